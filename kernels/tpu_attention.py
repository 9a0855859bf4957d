"""Flash attention on TPU: jax's own Pallas TPU splash-attention kernel in the layer's layout.

`attention(q_BTNH, k_BSKH, v_BSKH, ...)` computes what `nnx_zoo.common.nn.attention_ref.attend`
computes for the masks of `nnx_zoo.common.nn.attention_ref.make_mask` (causal or not, a window W:
the query and the W - 1 keys before it, and after it if not causal; segment ids; GQA; logit
soft-cap after the scale) with `jax.experimental.pallas.ops.tpu.splash_attention`, which never
stores a [T, S] array and skips key blocks its mask rules out, forward and backward.

Why splash alone, not also `pallas.ops.tpu.flash_attention`: that kernel needs as many key/value
heads as query heads (GQA would repeat K and V), has no window and no soft-cap, and everything
it does splash does too; one kernel, one set of tests.

The kernel's blocks are 128 positions at least; a length that is not a multiple of 128 is padded
and the padding given its own segment, so any T works. On a CPU the kernel runs in Pallas' TPU
interpret mode (`interpret=True`): slow, but it is the same kernel, so the numerics are tested
there (tests/kernels/test_tpu_attention.py).

Under `jax.shard_map` each device calls it on its own heads and rows (it has no collective),
inside the trainer's check_vma shard_map too: jax's kernel does not type its outputs' varying
mesh axes, which `nnx_zoo.kernels.vma.per_device` supplies.
"""

import functools

import jax
import jax.numpy as jnp
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as splash
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as masks

from nnx_zoo.kernels import vma

LANES = 128  # the kernel's blocks are multiples of this


def target_platform() -> str:
  """The platform the code being traced compiles for: the mesh's devices (under `jax.shard_map`
  or `jax.set_mesh`; a TPU slice when `zoo plan` compiles for one from a CPU), else the default
  backend."""
  device = getattr(jax.sharding.get_abstract_mesh(), "abstract_device", None)
  return device.platform if device is not None else jax.default_backend()


def target_device_kind() -> str:
  """The device kind ("NVIDIA H200", "TPU v5") of the platform `target_platform` names."""
  device = getattr(jax.sharding.get_abstract_mesh(), "abstract_device", None)
  return device.device_kind if device is not None else jax.devices()[0].device_kind


def unsupported_reason(
  q_BTNH,
  k_BSKH,
  *,
  bias: bool = False,
  cache: bool = False,
  platform: str | None = None,
) -> str | None:
  """Why `attention` cannot run this call (the layer then runs "xla" and logs it once), or
  None. `q_BTNH` and `k_BSKH` are arrays or anything with a `.shape`."""
  platform = platform or target_platform()
  _, T, N, _ = q_BTNH.shape
  _, S, K, _ = k_BSKH.shape
  if platform not in ("tpu", "cpu"):
    return f"the splash kernel is compiled for TPU (interpret mode on CPU), this is {platform}"
  if bias:
    return "the splash kernel adds no logit bias (ALiBi)"
  if cache:
    return "decoding with a KV cache"
  if T != S:
    return f"queries and keys of different lengths ({T} and {S})"
  if N % K:
    return f"{N} query heads are not a multiple of {K} key/value heads"
  return None


def _block(length: int) -> int:
  """The largest of 512, 256, 128 that divides `length` (a multiple of 128)."""
  return next(b for b in (512, 256, 128) if length % b == 0)


@functools.lru_cache(maxsize=64)
def _kernel(
  num_heads: int, T: int, *, causal: bool, window: int, softcap: float, interpret: bool
) -> splash.SplashAttentionKernel:
  """The splash kernel for one example's [N, T, H] queries (built once per shape: the mask's
  block map is computed here, in numpy)."""
  if window:
    # make_mask's window: |t - s| < W, i.e. W - 1 keys back (and forward unless causal).
    mask = masks.LocalMask((T, T), window_size=(window - 1, 0 if causal else window - 1), offset=0)
  elif causal:
    mask = masks.CausalMask((T, T))
  else:
    mask = masks.FullMask((T, T))
  b = _block(T)
  blocks = splash.BlockSizes(
    block_q=b,
    block_kv=b,
    block_kv_compute=b,
    block_q_dkv=b,
    block_kv_dkv=b,
    block_kv_dkv_compute=b,
    block_q_dq=b,
    block_kv_dq=b,
  )
  return splash.make_splash_mha(
    masks.MultiHeadMask([mask] * num_heads),
    block_sizes=blocks,
    head_shards=1,
    q_seq_shards=1,
    attn_logits_soft_cap=softcap or None,
    interpret=interpret,
  )


def attention(
  q_BTNH: jax.Array,
  k_BSKH: jax.Array,
  v_BSKH: jax.Array,
  *,
  causal: bool,
  window: int = 0,
  segment_ids_BT: jax.Array | None = None,
  softcap: float = 0.0,
  scale: float | None = None,
  interpret: bool | None = None,
) -> jax.Array:
  """softmax(cap(q k^T * scale)) v under the mask, [B, T, N, H]; scale None: 1 / sqrt(H);
  interpret None: Pallas interpret mode when compiling for a CPU."""
  B, T, N, H = q_BTNH.shape
  if interpret is None:
    interpret = target_platform() != "tpu"
  scale = H**-0.5 if scale is None else scale
  padded = -T % LANES
  if padded or segment_ids_BT is not None:
    seg_BT = jnp.zeros((B, T), jnp.int32) if segment_ids_BT is None else segment_ids_BT
    # Padding is a segment of its own: no real query sees it, and each padded query sees at
    # least itself (a row with no key at all would give NaN to the backward pass).
    pad_id = jnp.min(seg_BT) - 1
    seg_BT = jnp.pad(seg_BT.astype(jnp.int32), ((0, 0), (0, padded)), constant_values=0)
    if padded:
      seg_BT = seg_BT.at[:, T:].set(pad_id)
  else:
    seg_BT = None

  def heads_first(x_BTNH):  # [B, T, N, H] -> [B, N, T + padded, H], as the kernel takes them
    return jnp.pad(x_BTNH, ((0, 0), (0, padded), (0, 0), (0, 0))).transpose(0, 2, 1, 3)

  # The kernel takes no scale: it goes on q, before the soft-cap as in `attend`.
  q_BNTH = heads_first(q_BTNH * jnp.asarray(scale, q_BTNH.dtype))
  k_BKSH, v_BKSH = heads_first(k_BSKH), heads_first(v_BSKH)
  kernel = _kernel(
    N, T + padded, causal=causal, window=window, softcap=float(softcap), interpret=interpret
  )
  if seg_BT is None:
    out_BNTH = vma.per_device(jax.vmap(kernel))(q_BNTH, k_BKSH, v_BKSH)
  else:

    def run(q_BNTH, k_BKSH, v_BKSH, seg_BT):
      segments = splash.SegmentIds(q=seg_BT, kv=seg_BT)
      return jax.vmap(lambda q, k, v, s: kernel(q, k, v, segment_ids=s))(
        q_BNTH, k_BKSH, v_BKSH, segments
      )

    out_BNTH = vma.per_device(run)(q_BNTH, k_BKSH, v_BKSH, seg_BT)
  return out_BNTH.transpose(0, 2, 1, 3)[:, :T]
