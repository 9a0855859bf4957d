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
from nnx_zoo.common.nn import attention_blocked, attention_ref


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
  scores folded into a running softmax (`attention_blocked.fold`, the one blocked attention
  folds one device's key blocks with). Inside a sharded step only
  (`parallel.context_split()`). Each ring step runs the queries `attention_ref.QUERY_BLOCK` rows
  at a time, each block rematerialised in the backward pass: a device holds one block's
  [N, block, T / context] scores, and per ring step the running sums of its queries."""
  B, T, N, H = q_BTNH.shape
  kw = dict(softcap=softcap, scale=H**-0.5 if scale is None else scale)

  def step(q_BtNH, q_idx_t, q_seg_Bt, m_BNt, l_BNt, o_BNtH, visiting):
    k_BSKH, v_BSKH, k_idx_S, k_seg_BS = visiting
    mask_BtS = attention_ref.make_mask(
      q_idx_t, k_idx_S, q_seg_Bt, k_seg_BS, causal=causal, window=window
    )
    carry = (m_BNt, l_BNt, o_BNtH)
    return attention_blocked.fold(carry, q_BtNH, k_BSKH, v_BSKH, mask_Bts=mask_BtS, **kw)

  step = jax.checkpoint(step, prevent_cse=False)
  block = attention_ref.QUERY_BLOCK  # read when traced: one block size for every gathered path
  blocks = T // block if T % block == 0 else 1

  def split(x, axis):  # [..., T, ...] -> [blocks, ..., T / blocks, ...]
    x = x.reshape(*x.shape[:axis], blocks, -1, *x.shape[axis + 1 :])
    return jnp.moveaxis(x, axis, 0)

  def merge(x, axis):
    x = jnp.moveaxis(x, 0, axis)
    return x.reshape(*x.shape[:axis], T, *x.shape[axis + 2 :])

  carry = attention_blocked.init(B, N, T, H, q_BTNH, k_BSKH, v_BSKH)
  visiting = (k_BSKH, v_BSKH, parallel.token_index(T), k_seg_BS)
  for step_i in range(parallel.context_size()):
    if step_i:
      visiting = parallel.ring_shift(visiting)
    if blocks < 2:
      carry = step(q_BTNH, q_idx_T, q_seg_BT, *carry, visiting)
    else:
      xs = (split(q_BTNH, 1), q_idx_T.reshape(blocks, -1), split(q_seg_BT, 1))
      xs += tuple(split(x, 2) for x in carry)  # the running sums' queries: axis 2
      out = jax.lax.map(lambda a, v=visiting: step(*a, v), xs)
      carry = tuple(merge(x, 2) for x in out)
  return attention_blocked.finish(carry, q_BTNH.dtype)
