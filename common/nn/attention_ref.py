"""Attention's pure-jnp reference functions: the masks, softmax(q k^T) v, and two ways of running
it a block of query rows at a time (`attend_in_blocks` for a row against its own keys,
`attend_gathered` for queries at any indices of a row against the whole row's keys).

These are the "xla" implementation the layer runs where no kernel applies, and the reference the
kernels (kernels/flash_attention.py, kernels/tpu_attention.py) and the context-parallel paths
(common/nn/attention_ring.py) are tested against. They take arrays and static settings only: no
config, no mesh, no platform.
"""

import jax
import jax.numpy as jnp


def make_mask(
  q_idx_T: jax.Array,
  k_idx_S: jax.Array,
  q_seg_BT: jax.Array,
  k_seg_BS: jax.Array,
  *,
  causal: bool,
  window: int | None = None,
) -> jax.Array:
  """[B, T, S] booleans: True where query t may attend to key s (`window` None: any key). The
  queries' indices are [T], or [B, T] where each row has its own (a KV cache's rows)."""
  mask = q_seg_BT[:, :, None] == k_seg_BS[:, None, :]
  distance_TS = q_idx_T[..., :, None] - k_idx_S  # [T, S], or [B, T, S]
  if causal:
    mask &= distance_TS >= 0
  if window:
    # A window of W: the query and the W - 1 keys before it (and after it, if bidirectional).
    mask &= jnp.abs(distance_TS) < window
  return mask


def soft_cap(x: jax.Array, cap: float | None) -> jax.Array:
  """cap * tanh(x / cap): logits squashed into (-cap, cap) (Gemma 2); cap None (or a config's
  0) is no cap."""
  return cap * jnp.tanh(x / cap) if cap else x


def attend(
  q_BTNH: jax.Array,
  k_BSKH: jax.Array,
  v_BSKH: jax.Array,
  *,
  mask_BTS: jax.Array,
  bias_BNTS: jax.Array | None = None,
  softcap: float | None = None,
  scale: float | None = None,
) -> jax.Array:
  """softmax(q k^T * scale + bias) v with grouped heads (scale None: 1 / sqrt(H)); the pure-jnp
  reference path."""
  B, T, N, H = q_BTNH.shape
  K = k_BSKH.shape[2]
  # Query heads grouped per key/value head: [B, T, K, G, H]. With G == 1 (MHA) the 4-D einsum
  # is used instead: XLA:CPU runs the 5-D form's batched dots ~1.4x slower.
  grouped = N != K
  q = q_BTNH.reshape(B, T, K, N // K, H) if grouped else q_BTNH
  spec_qk, spec_pv = (
    ("BTKGH,BSKH->BKGTS", "BKGTS,BSKH->BTKGH")
    if grouped
    else ("BTNH,BSNH->BNTS", "BNTS,BSNH->BTNH")
  )
  scale = H**-0.5 if scale is None else scale
  logits = soft_cap(
    jnp.einsum(spec_qk, q, k_BSKH, preferred_element_type=jnp.float32) * scale, softcap
  )
  if bias_BNTS is not None:
    logits = logits + bias_BNTS.reshape(logits.shape)
  mask = mask_BTS[:, None, None] if grouped else mask_BTS[:, None]
  logits = jnp.where(mask, logits, jnp.finfo(jnp.float32).min)
  probs = jax.nn.softmax(logits, axis=-1).astype(v_BSKH.dtype)
  return jnp.einsum(spec_pv, probs, v_BSKH).reshape(B, T, N, H)


# Query rows a block of `attend_in_blocks` (at least; at most MAX_QUERY_BLOCKS blocks a call).
QUERY_BLOCK = 128
MAX_QUERY_BLOCKS = 8


def key_range(t0: int, t1: int, S: int, *, causal: bool, window: int | None) -> tuple[int, int]:
  """[lo, hi): the keys that any of queries [t0, t1) may see under `make_mask`'s index rules
  (query t and key s at indices t and s, as when keys are the queries' own sequence)."""
  lo, hi = 0, S
  if causal:
    hi = min(S, t1)
  elif window:
    hi = min(S, t1 + window - 1)
  if window:
    lo = max(0, t0 - window + 1)
  return lo, hi


def attend_in_blocks(
  q_BTNH: jax.Array,
  k_BSKH: jax.Array,
  v_BSKH: jax.Array,
  *,
  mask_BTS: jax.Array,
  causal: bool,
  window: int | None,
  bias_BNTS: jax.Array | None = None,
  softcap: float | None = None,
  scale: float | None = None,
) -> jax.Array:
  """`attend` for self-attention (key s is query s's own token), a block of query rows at a
  time against only the keys the causal and window rules let that block see (`key_range`): a
  causal layer computes about half the [T, S] scores, a windowed one a band. The same values;
  on XLA:CPU a causal layer's forward + backward took 0.36x the time of `attend` at T = 1,024
  and about the same at T = 256 (bench/attention.py, B = 1), 0.7x at T = 256 with B = 8 and
  8 heads of 32. With neither rule it is `attend` itself."""
  T, S = q_BTNH.shape[1], k_BSKH.shape[1]
  blocks = min(MAX_QUERY_BLOCKS, T // QUERY_BLOCK)
  if not (causal or window) or blocks < 2:
    return attend(
      q_BTNH, k_BSKH, v_BSKH, mask_BTS=mask_BTS, bias_BNTS=bias_BNTS, softcap=softcap, scale=scale
    )
  edges = [T * j // blocks for j in range(blocks + 1)]
  outs = []
  for t0, t1 in zip(edges[:-1], edges[1:], strict=True):
    lo, hi = key_range(t0, t1, S, causal=causal, window=window)
    outs.append(
      attend(
        q_BTNH[:, t0:t1],
        k_BSKH[:, lo:hi],
        v_BSKH[:, lo:hi],
        mask_BTS=mask_BTS[:, t0:t1, lo:hi],
        bias_BNTS=None if bias_BNTS is None else bias_BNTS[:, :, t0:t1, lo:hi],
        softcap=softcap,
        scale=scale,
      )
    )
  return jnp.concatenate(outs, axis=1)


def attend_gathered(
  q_BTNH: jax.Array,
  k_BSKH: jax.Array,
  v_BSKH: jax.Array,
  *,
  q_idx_T: jax.Array,
  k_idx_S: jax.Array,
  q_seg_BT: jax.Array,
  k_seg_BS: jax.Array,
  causal: bool,
  window: int | None,
  bias_BNTS: jax.Array | None = None,
  softcap: float | None = None,
  scale: float | None = None,
) -> jax.Array:
  """`attend` for queries at any indices `q_idx_T` of their row against keys at `k_idx_S` (this
  device's tokens of a context-split row against the whole row): `make_mask` of the indices,
  QUERY_BLOCK query rows at a time in a loop whose body is rematerialised in the backward pass,
  so the [N, T, S] scores never exist whole, in the forward or the backward pass. Every key is
  scored (the indices are traced: no block of keys can be skipped statically)."""
  B, T, N, H = q_BTNH.shape
  kw = dict(softcap=softcap, scale=scale)

  def block(q_BtNH, q_idx_t, q_seg_Bt, bias_BNtS):
    mask_BtS = make_mask(q_idx_t, k_idx_S, q_seg_Bt, k_seg_BS, causal=causal, window=window)
    return attend(q_BtNH, k_BSKH, v_BSKH, mask_BTS=mask_BtS, bias_BNTS=bias_BNTS, **kw)

  blocks = T // QUERY_BLOCK
  if blocks < 2 or T % QUERY_BLOCK:
    return block(q_BTNH, q_idx_T, q_seg_BT, bias_BNTS)

  def split(x, axis):  # [..., T, ...] -> [blocks, ..., T / blocks, ...]
    x = x.reshape(*x.shape[:axis], blocks, QUERY_BLOCK, *x.shape[axis + 1 :])
    return jnp.moveaxis(x, axis, 0)

  xs = (split(q_BTNH, 1), split(q_idx_T, 0), split(q_seg_BT, 1))
  xs += (None if bias_BNTS is None else split(bias_BNTS, 2),)
  body = jax.checkpoint(lambda args: block(*args), prevent_cse=False)
  out_nBtNH = jax.lax.map(body, xs)
  return jnp.moveaxis(out_nBtNH, 0, 1).reshape(B, T, N, H)
