"""Blocked attention (`attention.impl="blocked"`): a row's queries a block at a time, each block's
keys a block at a time folded into a running softmax, and each query block recomputed in the
backward pass, so neither pass keeps the row's [N, T, S] scores: the XLA path's answer to what
flash attention does in a kernel.

`fold` is the running softmax's step (its max, its sum and the weighted values, as flash
attention keeps them): the one copy, used here and by ring attention (common/nn/attention_ring.py),
whose keys come round the ring a device's block at a time. `attend_blocked` is a row against its
own keys, skipping the key blocks the causal and window rules mask for a whole query block
(`attention_ref.key_range`, as `attend_in_blocks` does). Arrays and static settings only: no
config, no platform; of the mesh only the types of the running sums under shard_map.
"""

import functools

import jax
import jax.numpy as jnp

from nnx_zoo.common import parallel
from nnx_zoo.common.nn import attention_ref

# Query rows and keys a block. On XLA:CPU (bench/attention.py, B=1, 8 heads of 64, causal) a
# forward + backward at T = 4,096 kept 170, 112 and 107 MB of temporaries with blocks of 128,
# 256 and 512 (the "xla" path 895 MB), and 256 was the fastest of them at 1,024 and 4,096. A row
# of at most BLOCK tokens runs the dense path (`attention_ref.attend_in_blocks`, as "xla" does):
# one block would hold all its scores anyway.
BLOCK = 256


def init(B: int, N: int, T: int, H: int, *like) -> tuple[jax.Array, jax.Array, jax.Array]:
  """The running softmax of T queries before any key: (max [B, N, T], sum [B, N, T], weighted
  values [B, N, T, H]), all fp32, varying over the mesh axes any of `like` (what will be folded
  in) does inside a sharded step (shard_map's typing of a loop's carry)."""
  carry = jnp.full((B, N, T), -jnp.inf), jnp.zeros((B, N, T)), jnp.zeros((B, N, T, H))
  axes = parallel.varying(*like)
  return tuple(parallel.to_varying(x, axes) for x in carry)


def fold(
  carry: tuple[jax.Array, jax.Array, jax.Array],
  q_BtNH: jax.Array,
  k_BsKH: jax.Array,
  v_BsKH: jax.Array,
  *,
  mask_Bts: jax.Array,
  bias_BNts: jax.Array | None = None,
  softcap: float | None,
  scale: float,
) -> tuple[jax.Array, jax.Array, jax.Array]:
  """The running softmax (`init`) of queries `q_BtNH` with one more block of keys and values
  folded in: their logits as `attention_ref.attend` makes them (scaled, soft-capped, biased,
  grouped heads), the keys `mask_Bts` hides left out. The max is a constant to autodiff (it
  cancels in `finish`), so the gradients are softmax's."""
  m_BNt, l_BNt, o_BNtH = carry
  B, t, N, H = q_BtNH.shape
  s, K = k_BsKH.shape[1:3]
  # Query heads grouped per key/value head, as `attend` groups them (4-D dots where N == K:
  # XLA:CPU runs the 5-D form's batched dots slower).
  if N != K:
    q_BtKGH = q_BtNH.reshape(B, t, K, N // K, H)
    logits = jnp.einsum("BTKGH,BSKH->BKGTS", q_BtKGH, k_BsKH, preferred_element_type=jnp.float32)
  else:
    logits = jnp.einsum("BTNH,BSNH->BNTS", q_BtNH, k_BsKH, preferred_element_type=jnp.float32)
  logits = attention_ref.soft_cap(logits.reshape(B, N, t, s) * scale, softcap)
  if bias_BNts is not None:
    logits = logits + bias_BNts
  mask = mask_Bts[:, None]
  top = jnp.max(jnp.where(mask, logits, -jnp.inf), axis=-1)
  m_new = jax.lax.stop_gradient(jnp.maximum(m_BNt, top))
  m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)[..., None]  # no key reached yet: 0
  p_BNts = jnp.where(mask, jnp.exp(jnp.where(mask, logits, m_safe) - m_safe), 0.0)
  rescale = jnp.where(jnp.isfinite(m_BNt), jnp.exp(m_BNt - m_safe[..., 0]), 0.0)
  p = p_BNts.astype(v_BsKH.dtype)
  if N != K:
    pv = jnp.einsum("BKGTS,BSKH->BKGTH", p.reshape(B, K, N // K, t, s), v_BsKH)
  else:
    pv = jnp.einsum("BNTS,BSNH->BNTH", p, v_BsKH)
  o_BNtH = o_BNtH * rescale[..., None] + pv.reshape(B, N, t, H).astype(jnp.float32)
  return m_new, l_BNt * rescale + jnp.sum(p_BNts, axis=-1), o_BNtH


def finish(carry, dtype) -> jax.Array:
  """[B, t, N, H]: the weighted values over their sum (0 for a query that saw no key)."""
  _, l_BNt, o_BNtH = carry
  out = o_BNtH / jnp.where(l_BNt > 0, l_BNt, 1.0)[..., None]
  return jnp.swapaxes(out, 1, 2).astype(dtype)


def attend_blocked(
  q_BTNH: jax.Array,
  k_BSKH: jax.Array,
  v_BSKH: jax.Array,
  *,
  q_seg_BT: jax.Array,
  k_seg_BS: jax.Array,
  causal: bool,
  window: int | None,
  bias_BNTS: jax.Array | None = None,
  softcap: float | None = None,
  scale: float | None = None,
  block: int | None = None,
) -> jax.Array:
  """`attention_ref.attend` for self-attention (key s is query s's own token; the mask is
  `make_mask`'s of the indices and segments), `block` (default BLOCK) query rows at a time,
  each against its visible keys (`key_range`) `block` at a time through `fold`. Each query
  block is rematerialised in the backward pass, and each key block's step within it, so the
  step holds one block's [N, block, block] scores and its queries' running sums per key block,
  never [N, T, S]; a logit bias is sliced per block. A row of at most `block` tokens runs
  `attend_in_blocks` (the dense path: one block would hold all its scores anyway)."""
  B, T, N, H = q_BTNH.shape
  S = k_BSKH.shape[1]
  block = block or BLOCK
  rules = dict(causal=causal, window=window)
  scale = H**-0.5 if scale is None else scale
  if block >= T:  # one block: the dense path
    mask_BTS = attention_ref.make_mask(jnp.arange(T), jnp.arange(S), q_seg_BT, k_seg_BS, **rules)
    return attention_ref.attend_in_blocks(
      q_BTNH, k_BSKH, v_BSKH, mask_BTS=mask_BTS, bias_BNTS=bias_BNTS, softcap=softcap,
      scale=scale, **rules,
    )  # fmt: skip
  blocks = -(-T // block)
  edges = [T * j // blocks for j in range(blocks + 1)]
  outs = []
  for t0, t1 in zip(edges[:-1], edges[1:], strict=True):
    lo, hi = attention_ref.key_range(t0, t1, S, causal=causal, window=window)
    body = functools.partial(
      _query_block, t0=t0, t1=t1, lo=lo, hi=hi, block=block, rules=rules, softcap=softcap,
      scale=scale,
    )  # fmt: skip
    outs.append(jax.checkpoint(body)(q_BTNH, k_BSKH, v_BSKH, q_seg_BT, k_seg_BS, bias_BNTS))
  return jnp.concatenate(outs, axis=1)


def _query_block(q_BTNH, k_BSKH, v_BSKH, q_seg_BT, k_seg_BS, bias_BNTS, **static) -> jax.Array:
  """[B, t1 - t0, N, H]: queries [t0, t1) against keys [lo, hi), `block` keys a step (a
  `lax.scan` over the whole blocks, then the rest)."""
  t0, t1, lo, hi, block = (static[k] for k in ("t0", "t1", "lo", "hi", "block"))
  B, _, N, H = q_BTNH.shape
  q_BtNH, q_seg_Bt, q_idx_t = q_BTNH[:, t0:t1], q_seg_BT[:, t0:t1], jnp.arange(t0, t1)
  kw = dict(softcap=static["softcap"], scale=static["scale"])

  def step(carry, keys):
    k_BsKH, v_BsKH, k_idx_s, k_seg_Bs, bias_BNts = keys
    mask_Bts = attention_ref.make_mask(q_idx_t, k_idx_s, q_seg_Bt, k_seg_Bs, **static["rules"])
    return fold(carry, q_BtNH, k_BsKH, v_BsKH, mask_Bts=mask_Bts, bias_BNts=bias_BNts, **kw), None

  step = jax.checkpoint(step, prevent_cse=False)

  def keys(s0, s1):  # keys [s0, s1) with what masks and biases them
    bias = None if bias_BNTS is None else bias_BNTS[:, :, t0:t1, s0:s1]
    k_idx = jnp.arange(s0, s1)
    return k_BSKH[:, s0:s1], v_BSKH[:, s0:s1], k_idx, k_seg_BS[:, s0:s1], bias

  like = (q_BTNH, k_BSKH, v_BSKH, q_seg_BT, k_seg_BS, bias_BNTS)
  carry = init(B, N, t1 - t0, H, *(x for x in like if x is not None))
  whole = (hi - lo) // block
  if whole > 1:

    def split(x, axis):  # [..., whole * block, ...] -> [whole, ..., block, ...]
      x = x.reshape(*x.shape[:axis], whole, block, *x.shape[axis + 1 :])
      return jnp.moveaxis(x, axis, 0)

    k, v, k_idx, k_seg, bias = keys(lo, lo + whole * block)
    xs = (split(k, 1), split(v, 1), split(k_idx, 0), split(k_seg, 1))
    xs += (None if bias is None else split(bias, 3),)
    carry, _ = jax.lax.scan(step, carry, xs)
  elif whole == 1:
    carry, _ = step(carry, keys(lo, lo + block))
  if lo + whole * block < hi:
    carry, _ = step(carry, keys(lo + whole * block, hi))
  return finish(carry, q_BTNH.dtype)
