"""The attention dispatcher: one call of a layer's queries against its keys (`Keys`), run by the
implementation the table picks (common/attention_impl.py).

The layer says where the keys and values come from; this module asks the table which
implementation runs the call and calls it: "xla" (common/nn/attention_ref.py), "blocked"
(common/nn/attention_blocked.py), "flash" (the Pallas kernel, or jax's splash kernel on TPU),
"cudnn", and under `mesh.context` "gather" or
"ring" (common/nn/attention_ring.py). Under tensor parallelism each sees only this device's
heads, so the kernels run per shard with no collective of their own.
"""

import dataclasses

import jax

from nnx_zoo.common import attention_impl, parallel
from nnx_zoo.common.nn import attention_blocked, attention_ref, pipeline
from nnx_zoo.common.nn.attention_ring import attend_ring
from nnx_zoo.kernels import flash_attention, tpu_attention


@dataclasses.dataclass(frozen=True)
class Keys:
  """The keys and values one call attends to, where they come from, and which of them each query
  may see: a key of the query's own segment (segment 0, padding, is nobody's), within `window`
  of the query's index in the row (None: any) and, if `causal`, not after it. Cross-attention's
  keys index another sequence: neither rule applies."""

  # "own": the queries' own tokens; "cache": a KV cache's slots, the new tokens written in;
  # "context": this device's tokens of a row split over mesh.context (the rest on the other
  # devices); "source": another sequence (cross-attention)
  kind: str
  k_BSKH: jax.Array
  v_BSKH: jax.Array
  q_idx_T: jax.Array  # the queries' and the keys' indices in their row (a cache's: [B, T])
  k_idx_S: jax.Array
  q_seg_BT: jax.Array
  k_seg_BS: jax.Array
  segments: bool  # segment ids were given (packed rows), so the kernels take them too
  causal: bool = False
  window: int | None = None
  bias_BNTS: jax.Array | None = None  # a logit bias of the positions (ALiBi)


def attend(
  q_BTNH: jax.Array,
  keys: Keys,
  *,
  impl: str,
  context_impl: str,
  softcap: float | None,
  scale: float,
) -> jax.Array:
  """[B, T, N, H]: softmax(q k^T * scale) v by the implementation that `attention.impl` (`impl`)
  and, under mesh.context, `attention.context_impl` give this call (`attention_impl.choose`)."""
  _, T, _, H = q_BTNH.shape
  call = attention_impl.Call(
    platform=tpu_attention.target_platform(),
    dtype=q_BTNH.dtype,
    head_dim=H,
    seq_len=T,
    keys=keys.kind,
    bias=keys.bias_BNTS is not None,
    segments=keys.segments,
    softcap=bool(softcap),
    bidirectional_window=bool(keys.window) and not keys.causal,
    device_kind=tpu_attention.target_device_kind(),
    pipelined=pipeline.active(),
  )
  impl = attention_impl.choose(impl, call)
  if keys.kind == "context":  # "xla" against the whole row: its keys gathered, or round a ring
    impl = attention_impl.choose(context_impl, call)
  # Every implementation takes the keys and values in the queries' dtype (a cache's may differ).
  k_BSKH, v_BSKH = keys.k_BSKH.astype(q_BTNH.dtype), keys.v_BSKH.astype(q_BTNH.dtype)
  keys = dataclasses.replace(keys, k_BSKH=k_BSKH, v_BSKH=v_BSKH)
  return IMPLEMENTATIONS[impl](q_BTNH, keys, softcap=softcap, scale=scale)


def _xla(q_BTNH: jax.Array, keys: Keys, **kw) -> jax.Array:
  k_BSKH, v_BSKH = keys.k_BSKH, keys.v_BSKH
  rules = dict(causal=keys.causal, window=keys.window)
  mask_BTS = attention_ref.make_mask(
    keys.q_idx_T, keys.k_idx_S, keys.q_seg_BT, keys.k_seg_BS, **rules
  )
  kw.update(mask_BTS=mask_BTS, bias_BNTS=keys.bias_BNTS)
  if keys.kind == "own":  # the keys are the queries' own tokens: skip those the rules mask
    return attention_ref.attend_in_blocks(q_BTNH, k_BSKH, v_BSKH, **rules, **kw)
  # A few queries at an offset into a longer cache, or another sequence's keys.
  return attention_ref.attend(q_BTNH, k_BSKH, v_BSKH, **kw)


def _blocked(q_BTNH: jax.Array, keys: Keys, **kw) -> jax.Array:
  # The table gives "blocked" only a row's own keys (keys.kind "own").
  q_seg_BT, k_seg_BS = keys.q_seg_BT, keys.k_seg_BS
  rules = dict(causal=keys.causal, window=keys.window, bias_BNTS=keys.bias_BNTS)
  return attention_blocked.attend_blocked(
    q_BTNH, keys.k_BSKH, keys.v_BSKH, q_seg_BT=q_seg_BT, k_seg_BS=k_seg_BS, **rules, **kw
  )


def _flash(q_BTNH: jax.Array, keys: Keys, *, softcap: float | None, scale: float) -> jax.Array:
  # The kernels' own convention: 0 for no window and no soft-cap.
  kw = dict(causal=keys.causal, window=keys.window or 0, softcap=softcap or 0.0, scale=scale)
  q_seg_BT, k_seg_BS = (keys.q_seg_BT, keys.k_seg_BS) if keys.segments else (None, None)
  if tpu_attention.target_platform() == "tpu":
    return tpu_attention.attention(q_BTNH, keys.k_BSKH, keys.v_BSKH, segment_ids_BT=q_seg_BT, **kw)
  return flash_attention.flash_attention(
    q_BTNH, keys.k_BSKH, keys.v_BSKH, q_segment_ids_BT=q_seg_BT, kv_segment_ids_BS=k_seg_BS, **kw
  )


def _cudnn(q_BTNH: jax.Array, keys: Keys, *, softcap: float | None, scale: float) -> jax.Array:
  del softcap  # the table gives a soft-capped call "xla"
  seg_mask = None
  if keys.segments:
    seg_mask = (keys.q_seg_BT[:, :, None] == keys.k_seg_BS[:, None, :])[:, None]
  return jax.nn.dot_product_attention(
    q_BTNH,
    keys.k_BSKH,
    keys.v_BSKH,
    bias=keys.bias_BNTS,
    mask=seg_mask,
    is_causal=keys.causal,
    local_window_size=(keys.window - 1, 0) if keys.window else None,
    scale=scale,
    implementation="cudnn",
  )


def _gather(q_BTNH: jax.Array, keys: Keys, **kw) -> jax.Array:
  """This device's queries against the keys and values of the whole row, gathered over
  mesh.context and masked by each token's index in the row."""
  gather = parallel.gather_context
  k_BSKH, v_BSKH, k_seg_BS = gather(keys.k_BSKH), gather(keys.v_BSKH), gather(keys.k_seg_BS)
  kw.update(k_idx_S=parallel.row_index(q_BTNH.shape[1]), k_seg_BS=k_seg_BS, **_queries(keys))
  return attention_ref.attend_gathered(q_BTNH, k_BSKH, v_BSKH, bias_BNTS=keys.bias_BNTS, **kw)


def _ring(q_BTNH: jax.Array, keys: Keys, **kw) -> jax.Array:
  kw.update(k_seg_BS=keys.k_seg_BS, **_queries(keys))
  return attend_ring(q_BTNH, keys.k_BSKH, keys.v_BSKH, **kw)


def _queries(keys: Keys) -> dict:
  """What the context paths mask by on the queries' side: their indices in the row, their
  segments, and the layer's rules."""
  return dict(q_idx_T=keys.q_idx_T, q_seg_BT=keys.q_seg_BT, causal=keys.causal, window=keys.window)


# What each implementation the table can pick calls.
IMPLEMENTATIONS = {
  "xla": _xla,
  "blocked": _blocked,
  "flash": _flash,
  "cudnn": _cudnn,
  "gather": _gather,
  "ring": _ring,
}
