"""Multi-head attention (MHA, GQA, MQA by `num_kv_heads`), its masks, and the KV cache.

Causal or bidirectional, optional sliding window, segment ids so packed documents never attend
to each other, optional QK-norm, QKV bias and logit soft-cap. The position encoding is passed in
by the model (see common/position.py), so attention never branches on which one it is.
`cross` is the same layer as an encoder-decoder's cross-attention: queries from the decoder, keys
and values from the encoder's output (`source_kv`, projected once for a whole decoding).

`impl` picks how the softmax(q k^T) v core runs: "xla" (`attend` below, the reference), "flash"
(the Pallas kernel in kernels/flash_attention.py, Pallas interpret mode on CPU; on TPU jax's
splash attention, kernels/tpu_attention.py) or "cudnn"
(`jax.nn.dot_product_attention(implementation="cudnn")`, GPU only). Where the chosen one does not
apply, the layer runs "xla" and logs the reason once (see `choose_impl`).

"auto" (the default) is resolved when the layer is traced, for the platform the step compiles
for (the mesh's devices, as `moe.impl="auto"`; a TPU slice's under `zoo plan`), by `resolve_auto`:
GPU: "cudnn" where cuDNN's fused attention takes the call, else "flash" where the kernel passed
on an H200, else "xla"; TPU: "flash" (splash); CPU: "xla". The choice is logged once.

Under `mesh.context` (a row's tokens split over devices, common/parallel.py) a layer gathers the
keys and values of the whole row over `context` and masks by each token's index in the row, so
causal masks, windows, segments, GQA, soft-caps and biases are those of one device; the local
queries run against them a block at a time, each block rematerialised in the backward pass, so
no device holds more than a block's [N, block, T] scores (`attend_gathered`). With
`context_impl="ring"` the row's keys and values are not gathered: each device's block of them
travels round the ring of `context` devices (`jax.lax.ppermute`), one step per device, and each
step's scores are folded into a running softmax (`attend_ring`), so a device holds 1 / context of
the keys and values at a time and XLA may overlap a step's transfer with its compute. The
kernels are not used under `mesh.context` (logged once).
"""

import dataclasses
import logging
import re

import jax
import jax.numpy as jnp
import ml_collections
from flax import nnx

from nnx_zoo.common import parallel
from nnx_zoo.common.errors import UserError
from nnx_zoo.common.nn import norms
from nnx_zoo.common.nn.linear import Linear
from nnx_zoo.common.nn.position import Position
from nnx_zoo.kernels import flash_attention, tpu_attention

MASKS = ("causal", "bidirectional")
IMPLS = ("auto", "xla", "flash", "cudnn")
CONTEXT_IMPLS = ("gather", "ring")

# cuDNN's fused attention (jax's checks, jax._src.cudnn.fused_attention_stablehlo): bf16/fp16, a
# head dim that is a multiple of 8 and at most 128, or 256 from Hopper on (told by the device
# kind's name: "auto" may resolve for GPUs it cannot query), and even lengths when training with
# a bias (a segment mask reaches cuDNN as a bias too).
CUDNN_DTYPES = ("bfloat16", "float16")
HOPPER_OR_LATER = re.compile(r"(^|[-\s])g?(h[128]00|b[123]00)")
# The layer's flash-kernel block (flash_attention's default block_q and block_k).
FLASH_BLOCK = 128

logger = logging.getLogger(__name__)
_logged: set[tuple[str, str]] = set()


def config(
  *,
  num_heads: int,
  num_kv_heads: int | None = None,
  head_dim: int,
  mask: str = "causal",
  window: int = 0,
  qkv_bias: bool = False,
  key_bias: bool = True,
  out_bias: bool = False,
  qk_norm: str = "none",
  softcap: float = 0.0,
  scale: float = 0.0,
  impl: str = "auto",
  context_impl: str = "gather",
) -> ml_collections.ConfigDict:
  """An attention sub-config. window=0: no sliding window; softcap=0: no soft-cap;
  qk_norm: "none", "rms" or "layer" (normalises each head's q and k, as Qwen3 and Gemma 3, with
  the model's norm settings); key_bias=False drops k's bias when qkv_bias (Whisper: a bias on
  the keys adds the same q.b to all of a query's logits, which softmax ignores); scale: the
  logits' factor, 0 meaning head_dim ** -0.5 (Gemma: query_pre_attn_scalar ** -0.5; T5: 1);
  impl: see the module docstring ("auto": chosen for the platform compiled for); context_impl:
  how a layer attends across `mesh.context` ("gather" or "ring", see the module docstring)."""
  return ml_collections.ConfigDict(
    {
      "num_heads": num_heads,
      "num_kv_heads": num_kv_heads or num_heads,
      "head_dim": head_dim,
      "mask": mask,
      "window": window,
      "qkv_bias": qkv_bias,
      "key_bias": key_bias,
      "out_bias": out_bias,
      "qk_norm": qk_norm,
      "softcap": softcap,
      "scale": scale,
      "impl": impl,
      "context_impl": context_impl,
    }
  )


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class KVCache:
  """Keys and values of the tokens decoded so far; `index` of them are filled."""

  k_BSKH: jax.Array
  v_BSKH: jax.Array
  index: jax.Array  # int32 scalar

  @classmethod
  def init(cls, batch: int, max_len: int, num_kv_heads: int, head_dim: int, dtype=jnp.float32):
    shape = (batch, max_len, num_kv_heads, head_dim)
    return cls(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype), jnp.zeros((), jnp.int32))


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class SourceKV:
  """A source sequence as one cross-attention layer sees it (an encoder's output through the
  layer's k and v): computed once, so decoding does not project the source again for every new
  token. Segment ids [B, S]: 0 is padding, never attended to."""

  k_BSKH: jax.Array
  v_BSKH: jax.Array
  segment_ids_BS: jax.Array


def make_mask(
  q_idx_T: jax.Array,
  k_idx_S: jax.Array,
  q_seg_BT: jax.Array,
  k_seg_BS: jax.Array,
  *,
  causal: bool,
  window: int = 0,
) -> jax.Array:
  """[B, T, S] booleans: True where query t may attend to key s."""
  mask = q_seg_BT[:, :, None] == k_seg_BS[:, None, :]
  distance_TS = q_idx_T[:, None] - k_idx_S[None, :]
  if causal:
    mask &= (distance_TS >= 0)[None]
  if window:
    # A window of W: the query and the W - 1 keys before it (and after it, if bidirectional).
    mask &= (jnp.abs(distance_TS) < window)[None]
  return mask


def soft_cap(x: jax.Array, cap: float) -> jax.Array:
  """cap * tanh(x / cap): logits squashed into (-cap, cap) (Gemma 2); cap 0 is no cap."""
  return cap * jnp.tanh(x / cap) if cap else x


def logit_scale(cfg) -> float:
  """The factor of q.k: `cfg.scale`, or head_dim ** -0.5 when it is 0 (absent in configs saved
  before it existed)."""
  return cfg.get("scale", 0.0) or cfg.head_dim**-0.5


def attend(
  q_BTNH: jax.Array,
  k_BSKH: jax.Array,
  v_BSKH: jax.Array,
  *,
  mask_BTS: jax.Array,
  bias_BNTS: jax.Array | None = None,
  softcap: float = 0.0,
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


def key_range(t0: int, t1: int, S: int, *, causal: bool, window: int) -> tuple[int, int]:
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
  window: int,
  bias_BNTS: jax.Array | None = None,
  softcap: float = 0.0,
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
  window: int,
  bias_BNTS: jax.Array | None = None,
  softcap: float = 0.0,
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


def attend_ring(
  q_BTNH: jax.Array,
  k_BSKH: jax.Array,
  v_BSKH: jax.Array,
  *,
  q_idx_T: jax.Array,
  q_seg_BT: jax.Array,
  k_seg_BS: jax.Array,
  causal: bool,
  window: int,
  softcap: float = 0.0,
  scale: float | None = None,
) -> jax.Array:
  """`attend_gathered` without gathering: this device's queries against each device's keys and
  values in turn, passed round the ring of `mesh.context` devices, each block's scores folded
  into a running softmax (its max, its sum and the weighted values, as flash attention does
  with blocks of one device's keys). Inside a sharded step only (`parallel.context_split()`).
  Each ring step runs the queries QUERY_BLOCK rows at a time, each block rematerialised in the
  backward pass: a device holds one block's [N, block, T / context] scores, and per ring step
  the running sums of its queries."""
  B, T, N, H = q_BTNH.shape
  K = k_BSKH.shape[2]
  G = N // K
  scale = H**-0.5 if scale is None else scale

  def fold(q_BtKGH, q_idx_t, q_seg_Bt, m_BtKG, l_BtKG, o_BtKGH, visiting):
    k_BSKH, v_BSKH, k_idx_S, k_seg_BS = visiting
    logits = jnp.einsum("BTKGH,BSKH->BTKGS", q_BtKGH, k_BSKH, preferred_element_type=jnp.float32)
    logits = soft_cap(logits * scale, softcap)
    mask = make_mask(q_idx_t, k_idx_S, q_seg_Bt, k_seg_BS, causal=causal, window=window)
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
  blocks = T // QUERY_BLOCK if T % QUERY_BLOCK == 0 else 1

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


def _log_once(impl: str, message: str, level: int = logging.WARNING):
  if (impl, message) not in _logged:
    _logged.add((impl, message))
    logger.log(level, "attention impl=%r: %s", impl, message)


def resolve_auto(
  *,
  platform: str,
  dtype,
  head_dim: int,
  seq_len: int,
  bias: bool = False,
  segments: bool = False,
  cache: bool = False,
  softcap: bool = False,
  bidirectional_window: bool = False,
  device_kind: str = "",
) -> tuple[str, str]:
  """(impl, why): what `impl="auto"` runs on `platform` ("cpu", "gpu", "tpu") for a self-attention
  call of `seq_len` queries (and keys) in `dtype`, on devices of `device_kind` ("NVIDIA H200",
  or a hardware name; "" if unknown). A pure function of its arguments.

  GPU: "cudnn" where cuDNN's fused attention takes the call; else "flash" (the Pallas Triton
  kernel) only in float32 with lengths of whole blocks, the cases that passed on an H200 (issue
  23: its bf16 GQA case and its padded-length cases failed there, not understood yet); else "xla".
  TPU: "flash" (jax's splash kernel) unless a logit bias or a KV cache rules it out. CPU: "xla",
  the fastest there (bench/attention.py)."""
  name = jnp.dtype(dtype).name
  if platform == "gpu":
    max_head_dim = 256 if HOPPER_OR_LATER.search(device_kind.lower()) else 128
    why_not = None
    if name not in CUDNN_DTYPES:
      why_not = f"cuDNN takes bf16/fp16, not {name}"
    elif softcap:
      why_not = "cuDNN has no logit soft-cap"
    elif cache:
      why_not = "decoding with a KV cache"
    elif bidirectional_window:
      why_not = "cuDNN has no bidirectional sliding window"
    elif head_dim % 8 or head_dim > max_head_dim:
      why_not = f"cuDNN takes head dims that are multiples of 8 up to {max_head_dim} here"
      why_not += f", not {head_dim}"
    elif (bias or segments) and seq_len % 2:
      why_not = f"cuDNN's biased (or segment-masked) backward needs an even length, not {seq_len}"
    if why_not is None:
      return "cudnn", f"gpu, {name}: cuDNN fused attention"
    if bias or cache:
      return "xla", f"gpu: {why_not}; the flash kernel adds no bias and does not decode"
    if name != "float32":
      return "xla", f"gpu: {why_not}; the flash kernel failed in {name} on an H200 (issue 23)"
    if seq_len % FLASH_BLOCK:
      return "xla", (
        f"gpu: {why_not}; the flash kernel failed on padded lengths on an H200 (issue 23), and "
        f"{seq_len} is not a multiple of {FLASH_BLOCK}"
      )
    return "flash", f"gpu: {why_not}; the flash kernel (Pallas Triton)"
  if platform == "tpu":
    if bias:
      return "xla", "tpu: the splash kernel adds no logit bias (ALiBi)"
    if cache:
      return "xla", "tpu: decoding with a KV cache"
    return "flash", "tpu: jax's splash attention kernel"
  return "xla", f"{platform}: the XLA path (with query blocks)"


def describe_auto(
  model_cfg, *, platform: str, seq_len: int, segments: bool = True, device_kind: str = ""
) -> str:
  """What "auto" resolves to for a model config's layers on `platform` at `seq_len` (training,
  no cache): one "impl (why)" per distinct choice, for `zoo show`. Only layers whose
  attention.impl is "auto" are described ("" if none)."""
  from nnx_zoo.common.nn import transformer  # the stack imports this module

  if "attention" not in model_cfg or "num_layers" not in model_cfg:
    return ""
  seen = {}
  for i in range(model_cfg.num_layers):
    layer = transformer.layer_config(model_cfg, i)
    att = layer.attention
    if att.get("impl", "xla") != "auto":
      continue
    impl, why = resolve_auto(
      platform=platform,
      dtype=model_cfg.get("dtype", "float32"),
      head_dim=att.head_dim,
      seq_len=seq_len,
      bias=layer.position.kind in ("alibi", "relative"),
      segments=segments,
      softcap=bool(att.softcap),
      bidirectional_window=bool(att.window) and att.mask != "causal",
      device_kind=device_kind,
    )
    seen.setdefault(impl, why)
  return "; ".join(f"{impl} ({why})" for impl, why in seen.items())


def choose_impl(
  impl: str,
  *,
  bias: bool,
  cache: bool,
  softcap: bool,
  bidirectional_window: bool,
  dtype,
  backend: str | None = None,
) -> str:
  """The implementation that runs: `impl`, or "xla" where it does not apply (reason logged once
  per process, not per call: this runs at trace time)."""
  # The platform being compiled for: a TPU slice's when `zoo plan` compiles for one from a CPU.
  backend = backend or tpu_attention.target_platform()
  reason = None
  if impl == "flash":
    if bias:
      reason = "the flash kernel adds no logit bias (ALiBi)"
    elif cache:
      # A decoding step is a few query rows against the whole cache: a padded block of queries
      # would be mostly waste, and the cache's fill mask is no causal/window/segment rule.
      reason = "decoding with a KV cache"
    elif backend == "cpu":
      # Not a fallback: the same kernel, emulated by XLA loops; on CPU it holds no [T, S]
      # array, though "xla"'s query blocks run faster there (bench/attention.py), and it keeps
      # "flash" testable.
      _log_once(impl, "runs in Pallas interpret mode on CPU", logging.INFO)
  elif impl == "cudnn":
    if backend != "gpu":
      reason = f"cuDNN attention needs a GPU, this is {backend}"
    elif jnp.dtype(dtype) not in (jnp.bfloat16, jnp.float16):
      reason = f"cuDNN attention takes bf16/fp16, not {jnp.dtype(dtype).name}"
    elif softcap:
      reason = "cuDNN attention has no logit soft-cap"
    elif cache:
      reason = "decoding with a KV cache"
    elif bidirectional_window:
      reason = "cuDNN attention has no bidirectional sliding window"
  if reason is None:
    return impl
  _log_once(impl, f"falls back to 'xla': {reason}")
  return "xla"


class Attention(nnx.Module):
  def __init__(
    self,
    cfg,
    dim: int,
    *,
    norm=None,
    out_init_std: float = 0.02,
    dtype=jnp.float32,
    param_dtype=jnp.float32,
    rngs: nnx.Rngs,
  ):
    if cfg.mask not in MASKS:
      raise UserError(f"Unknown attention mask {cfg.mask!r}: use one of {MASKS}.")
    if cfg.impl not in IMPLS:  # "auto" is resolved when traced: the platform may differ
      raise UserError(f"Unknown attention impl {cfg.impl!r}: use one of {IMPLS}.")
    self.context_impl = cfg.get("context_impl", "gather")  # absent in configs saved before it
    if self.context_impl not in CONTEXT_IMPLS:
      raise UserError(
        f"Unknown attention context_impl {self.context_impl!r}: use one of {CONTEXT_IMPLS}."
      )
    if cfg.num_heads % cfg.num_kv_heads:
      raise UserError(
        f"num_heads={cfg.num_heads} is not a multiple of num_kv_heads={cfg.num_kv_heads}: "
        "each key/value head serves a whole group of query heads."
      )
    N, K, H = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    self.num_heads, self.num_kv_heads, self.head_dim = N, K, H
    self.causal, self.window, self.softcap = cfg.mask == "causal", cfg.window, cfg.softcap
    self.scale = logit_scale(cfg)
    self.impl = cfg.impl
    self.dtype = dtype
    kw = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
    self.q = Linear(dim, N * H, use_bias=cfg.qkv_bias, axes=("D", "NH"), **kw)
    key_bias = cfg.qkv_bias and cfg.get("key_bias", True)  # absent in configs saved before it
    self.k = Linear(dim, K * H, use_bias=key_bias, axes=("D", "KH"), **kw)
    self.v = Linear(dim, K * H, use_bias=cfg.qkv_bias, axes=("D", "KH"), **kw)
    self.o = Linear(
      N * H, dim, use_bias=cfg.out_bias, axes=("NH", "D"), init_std=out_init_std, **kw
    )
    if cfg.qk_norm == "none":
      self.q_norm = self.k_norm = None
    else:
      # The model's norm settings (eps, Gemma's 1 + w form) with the kind qk_norm names.
      norm_cfg = norms.config(cfg.qk_norm, **norms.settings(norm))
      self.q_norm = norms.make(norm_cfg, H, dtype=dtype, param_dtype=param_dtype)
      self.k_norm = norms.make(norm_cfg, H, dtype=dtype, param_dtype=param_dtype)

  def init_cache(self, batch: int, max_len: int) -> KVCache:
    return KVCache.init(batch, max_len, self.num_kv_heads, self.head_dim, self.dtype)

  def source_kv(self, x_BSD: jax.Array, segment_ids_BS: jax.Array | None = None) -> SourceKV:
    """The keys and values `cross` attends to: the source through this layer's k and v."""
    B, S, _ = x_BSD.shape
    k_BSKH = self.k(x_BSD).reshape(B, S, -1, self.head_dim)
    v_BSKH = self.v(x_BSD).reshape(B, S, -1, self.head_dim)
    if self.k_norm is not None:
      k_BSKH = self.k_norm(k_BSKH)
    if segment_ids_BS is None:
      segment_ids_BS = jnp.ones((B, S), jnp.int32)
    return SourceKV(k_BSKH, v_BSKH, segment_ids_BS)

  def cross(
    self, x_BTD: jax.Array, source: SourceKV, *, segment_ids_BT: jax.Array | None = None
  ) -> jax.Array:
    """Cross-attention (an encoder-decoder's): queries from `x_BTD`, keys and values from
    `source` (`source_kv`). A query sees every source token of its own segment, so packed pairs
    stay apart and source padding is never attended to; no causal mask, window or position
    encoding applies, as the queries and keys index two different sequences."""
    B, T, _ = x_BTD.shape
    q_BTNH = self.q(x_BTD).reshape(B, T, -1, self.head_dim)
    if self.q_norm is not None:
      q_BTNH = self.q_norm(q_BTNH)
    if segment_ids_BT is None:
      segment_ids_BT = jnp.ones((B, T), jnp.int32)
    S = source.k_BSKH.shape[1]
    mask_BTS = make_mask(
      jnp.arange(T), jnp.arange(S), segment_ids_BT, source.segment_ids_BS, causal=False
    )
    if self.impl not in ("xla", "auto"):
      _log_once(self.impl, "falls back to 'xla' in cross-attention")
    out_BTNH = attend(
      q_BTNH,
      source.k_BSKH.astype(q_BTNH.dtype),
      source.v_BSKH.astype(q_BTNH.dtype),
      mask_BTS=mask_BTS,
      softcap=self.softcap,
      scale=self.scale,
    )
    return self.o(out_BTNH.reshape(B, T, -1))

  def __call__(
    self,
    x_BTD: jax.Array,
    *,
    positions_BT: jax.Array,
    segment_ids_BT: jax.Array | None = None,
    position: Position,
    cache: KVCache | None = None,
  ) -> tuple[jax.Array, KVCache | None]:
    B, T, _ = x_BTD.shape
    H = self.head_dim
    # -1: under tensor parallelism this device holds N / tensor query and K / tensor kv heads.
    q_BTNH = self.q(x_BTD).reshape(B, T, -1, H)
    k_BTKH = self.k(x_BTD).reshape(B, T, -1, H)
    v_BTKH = self.v(x_BTD).reshape(B, T, -1, H)
    if self.q_norm is not None:
      q_BTNH, k_BTKH = self.q_norm(q_BTNH), self.k_norm(k_BTKH)
    q_BTNH = position.rotate(q_BTNH, positions_BT)
    k_BTKH = position.rotate(k_BTKH, positions_BT)

    segments_given = segment_ids_BT is not None
    if segment_ids_BT is None:
      segment_ids_BT = jnp.ones((B, T), jnp.int32)
    context = cache is None and parallel.context_split()
    if context:  # this device's tokens of the row; the keys and values of the whole row
      k_BSKH, v_BSKH = parallel.gather_context(k_BTKH), parallel.gather_context(v_BTKH)
      q_idx_T = parallel.token_index(T)
      k_idx_S = parallel.row_index(T)
      k_seg_BS = parallel.gather_context(segment_ids_BT)
      k_pos_BS = parallel.gather_context(positions_BT)
    elif cache is None:
      k_BSKH, v_BSKH = k_BTKH, v_BTKH
      q_idx_T = k_idx_S = jnp.arange(T)
      k_seg_BS, k_pos_BS = segment_ids_BT, positions_BT
    else:
      # Write the new keys at [index, index + T); slots not written yet get segment 0, which
      # no query has, so they are never attended to.
      start = (0, cache.index, 0, 0)
      k_BSKH = jax.lax.dynamic_update_slice(cache.k_BSKH, k_BTKH.astype(cache.k_BSKH.dtype), start)
      v_BSKH = jax.lax.dynamic_update_slice(cache.v_BSKH, v_BTKH.astype(cache.v_BSKH.dtype), start)
      S = k_BSKH.shape[1]
      q_idx_T, k_idx_S = cache.index + jnp.arange(T), jnp.arange(S)
      filled_S = k_idx_S < cache.index + T
      k_seg_BS = jnp.where(filled_S[None], segment_ids_BT[:, :1], 0)
      k_pos_BS = jnp.broadcast_to(k_idx_S, (B, S))
      cache = KVCache(k_BSKH, v_BSKH, cache.index + T)
    k_BSKH, v_BSKH = k_BSKH.astype(q_BTNH.dtype), v_BSKH.astype(q_BTNH.dtype)

    bias = position.logit_bias(positions_BT, k_pos_BS, self.num_heads)
    if bias is not None:
      bias = parallel.local_heads(bias, axis=1)
    impl = self.impl
    if context:
      if impl not in ("xla", "auto"):
        _log_once(impl, "falls back to 'xla' under mesh.context (keys gathered over devices)")
      impl = "context"
    elif impl == "auto":
      impl, why = resolve_auto(
        platform=tpu_attention.target_platform(),
        dtype=q_BTNH.dtype,
        head_dim=H,
        seq_len=T,
        bias=bias is not None,
        segments=segments_given,
        cache=cache is not None,
        softcap=bool(self.softcap),
        bidirectional_window=bool(self.window) and not self.causal,
        device_kind=tpu_attention.target_device_kind(),
      )
      _log_once("auto", f"resolved to {impl!r}: {why}", logging.INFO)
    impl = choose_impl(  # "context" passes through
      impl,
      bias=bias is not None,
      cache=cache is not None,
      softcap=bool(self.softcap),
      bidirectional_window=bool(self.window) and not self.causal,
      dtype=q_BTNH.dtype,
    )
    # Under tensor parallelism each branch sees only this device's heads, so the kernels run
    # per shard with no collective of their own.
    if impl == "flash" and tpu_attention.target_platform() == "tpu":
      reason = tpu_attention.unsupported_reason(q_BTNH, k_BSKH, bias=False, cache=False)
      if reason is not None:
        _log_once(impl, f"falls back to 'xla': {reason}")
        impl = "xla"
    if impl == "context" and self.context_impl == "ring" and bias is None:
      out_BTNH = attend_ring(
        q_BTNH,
        k_BTKH.astype(q_BTNH.dtype),
        v_BTKH.astype(q_BTNH.dtype),
        q_idx_T=q_idx_T,
        q_seg_BT=segment_ids_BT,
        k_seg_BS=segment_ids_BT,
        causal=self.causal,
        window=self.window,
        softcap=self.softcap,
        scale=self.scale,
      )
    elif impl == "context":
      if self.context_impl == "ring":
        _log_once("ring", "gathers the keys instead: a logit bias (ALiBi) is not passed round")
      out_BTNH = attend_gathered(
        q_BTNH,
        k_BSKH,
        v_BSKH,
        q_idx_T=q_idx_T,
        k_idx_S=k_idx_S,
        q_seg_BT=segment_ids_BT,
        k_seg_BS=k_seg_BS,
        causal=self.causal,
        window=self.window,
        bias_BNTS=bias,
        softcap=self.softcap,
        scale=self.scale,
      )
    elif impl == "flash" and tpu_attention.target_platform() == "tpu":
      out_BTNH = tpu_attention.attention(
        q_BTNH,
        k_BSKH,
        v_BSKH,
        causal=self.causal,
        window=self.window,
        segment_ids_BT=segment_ids_BT if segments_given else None,
        softcap=self.softcap,
        scale=self.scale,
      )
    elif impl == "flash":
      seg = segment_ids_BT if segments_given else None
      out_BTNH = flash_attention.flash_attention(
        q_BTNH,
        k_BSKH,
        v_BSKH,
        causal=self.causal,
        window=self.window,
        q_segment_ids_BT=seg,
        kv_segment_ids_BS=seg,
        softcap=self.softcap,
        scale=self.scale,
      )
    elif impl == "cudnn":
      seg_mask = None
      if segments_given:
        seg_mask = (segment_ids_BT[:, :, None] == segment_ids_BT[:, None, :])[:, None]
      out_BTNH = jax.nn.dot_product_attention(
        q_BTNH,
        k_BSKH,
        v_BSKH,
        bias=bias,
        mask=seg_mask,
        is_causal=self.causal,
        local_window_size=(self.window - 1, 0) if self.window else None,
        scale=self.scale,
        implementation="cudnn",
      )
    else:
      mask_BTS = make_mask(
        q_idx_T, k_idx_S, segment_ids_BT, k_seg_BS, causal=self.causal, window=self.window
      )
      kw = dict(mask_BTS=mask_BTS, bias_BNTS=bias, softcap=self.softcap, scale=self.scale)
      if cache is None:  # the keys are the queries' own tokens: skip those the rules mask
        out_BTNH = attend_in_blocks(
          q_BTNH, k_BSKH, v_BSKH, causal=self.causal, window=self.window, **kw
        )
      else:  # a few queries at an offset into a longer cache
        out_BTNH = attend(q_BTNH, k_BSKH, v_BSKH, **kw)
    return self.o(out_BTNH.reshape(B, T, -1)), cache
