"""Ring attention across `mesh.context`: a device's queries against the keys and values of the
whole row without gathering them.

Each device's block of keys and values travels round the ring of `context` devices
(`parallel.ring_shift`, a `jax.lax.ppermute`), one step per device, and each step's scores are
folded into a running softmax, so a device holds 1 / context of the row's keys and values at a
time and XLA may overlap a step's transfer with its compute (`attention.context_impl="ring"`).
The gathered alternative is `attention_ref.attend_gathered`; the dispatcher
(common/nn/attention_dispatch.py) picks between them.
"""

import jax
import jax.numpy as jnp

from nnx_zoo.common import parallel
from nnx_zoo.common.nn import attention_ref


def attend_ring(
  q_BTNH: jax.Array,
  k_BSKH: jax.Array,
  v_BSKH: jax.Array,
  *,
  q_idx_T: jax.Array,
  q_seg_BT: jax.Array,
  k_seg_BS: jax.Array,
  causal: bool,
  window: int | None,
  softcap: float | None = None,
  scale: float | None = None,
) -> jax.Array:
  """`attention_ref.attend_gathered` without gathering: this device's queries against each
  device's keys and values in turn, passed round the ring of `mesh.context` devices, each block's
  scores folded into a running softmax (its max, its sum and the weighted values, as flash
  attention does with blocks of one device's keys). Inside a sharded step only
  (`parallel.context_split()`). Each ring step runs the queries `attention_ref.QUERY_BLOCK` rows
  at a time, each block rematerialised in the backward pass: a device holds one block's
  [N, block, T / context] scores, and per ring step the running sums of its queries."""
  B, T, N, H = q_BTNH.shape
  K = k_BSKH.shape[2]
  G = N // K
  scale = H**-0.5 if scale is None else scale

  def fold(q_BtKGH, q_idx_t, q_seg_Bt, m_BtKG, l_BtKG, o_BtKGH, visiting):
    k_BSKH, v_BSKH, k_idx_S, k_seg_BS = visiting
    logits = jnp.einsum("BTKGH,BSKH->BTKGS", q_BtKGH, k_BSKH, preferred_element_type=jnp.float32)
    logits = attention_ref.soft_cap(logits * scale, softcap)
    mask = attention_ref.make_mask(
      q_idx_t, k_idx_S, q_seg_Bt, k_seg_BS, causal=causal, window=window
    )
    mask = mask[:, :, None, None]
    top = jnp.max(jnp.where(mask, logits, -jnp.inf), axis=-1)
    m_new = jax.lax.stop_gradient(jnp.maximum(m_BtKG, top))
    m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)[..., None]  # no key reached yet: 0
    p = jnp.where(mask, jnp.exp(jnp.where(mask, logits, m_safe) - m_safe), 0.0)
    rescale = jnp.where(jnp.isfinite(m_BtKG), jnp.exp(m_BtKG - m_safe[..., 0]), 0.0)
    pv = jnp.einsum("BTKGS,BSKH->BTKGH", p.astype(v_BSKH.dtype), v_BSKH)
    o_BtKGH = o_BtKGH * rescale[..., None] + pv.astype(jnp.float32)
    return m_new, l_BtKG * rescale + jnp.sum(p, axis=-1), o_BtKGH

  fold = jax.checkpoint(fold, prevent_cse=False)
  block = attention_ref.QUERY_BLOCK  # read when traced: one block size for every blocked path
  blocks = T // block if T % block == 0 else 1

  def split(x):  # [B, T, ...] -> [blocks, B, T / blocks, ...]
    return jnp.moveaxis(x.reshape(x.shape[0], blocks, -1, *x.shape[2:]), 1, 0)

  def merge(x):
    return jnp.moveaxis(x, 0, 1).reshape(x.shape[1], T, *x.shape[3:])

  q = q_BTNH.reshape(B, T, K, G, H)
  carry = (jnp.full((B, T, K, G), -jnp.inf), jnp.zeros((B, T, K, G)), jnp.zeros(q.shape))
  # The running sums vary over the mesh axes the queries and keys do (shard_map's typing).
  axes = parallel.varying(q_BTNH, k_BSKH, v_BSKH)
  carry = jax.tree.map(lambda x: parallel.to_varying(x, axes), carry)
  visiting = (k_BSKH, v_BSKH, parallel.token_index(T), k_seg_BS)
  for step in range(parallel.context_size()):
    if step:
      visiting = parallel.ring_shift(visiting)
    if blocks < 2:
      carry = fold(q, q_idx_T, q_seg_BT, *carry, visiting)
    else:
      xs = (split(q), q_idx_T.reshape(blocks, -1), split(q_seg_BT), *map(split, carry))
      carry = tuple(map(merge, jax.lax.map(lambda a, v=visiting: fold(*a, v), xs)))
  _, l_BTKG, o_BTKGH = carry
  out = o_BTKGH / jnp.where(l_BTKG > 0, l_BTKG, 1.0)[..., None]
  return out.reshape(B, T, N, H).astype(q_BTNH.dtype)
