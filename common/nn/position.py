"""Position encodings, one choice per model: "rope" (with scaling), "alibi", "learned",
"sinusoidal" (fixed, added), "relative" (T5), "sincos_2d" (a fixed table over a grid of image
patches) or "none".

Each kind answers three questions the model and attention ask, and the answer is "nothing" for
the kinds it does not concern: `embed` adds to token embeddings (learned, sinusoidal), `rotate`
turns queries and keys (RoPE), `logit_bias` adds to attention logits (ALiBi). So a model calls
all three and never branches on the kind.
"""

import math

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from flax import nnx

from nnx_zoo.common import parallel
from nnx_zoo.common.errors import UserError
from nnx_zoo.common.nn.linear import normal

ROPE_SCALINGS = ("none", "linear", "llama3", "yarn")


def config(kind: str = "rope", **kw) -> ml_collections.ConfigDict:
  """A position sub-config. rope: theta, scaling; learned: max_len; sinusoidal: max_len (the
  longest sequence), theta (the longest wavelength's scale); relative (T5): num_buckets,
  max_distance, bidirectional (True in an encoder, False in a causal decoder); sincos_2d: grid
  (patches per side); alibi and none: nothing."""
  if kind == "rope":
    cfg = {"kind": "rope", "theta": kw.pop("theta", 10_000.0), "scaling": rope_scaling("none")}
    if "scaling" in kw:
      cfg["scaling"] = kw.pop("scaling")
  elif kind == "learned":
    cfg = {"kind": "learned", "max_len": kw.pop("max_len")}
  elif kind == "sinusoidal":
    cfg = {"kind": "sinusoidal", "max_len": kw.pop("max_len"), "theta": kw.pop("theta", 10_000.0)}
  elif kind in ("alibi", "none"):
    cfg = {"kind": kind}
  elif kind == "sincos_2d":
    cfg = {"kind": "sincos_2d", "grid": kw.pop("grid")}
  elif kind == "relative":
    cfg = {
      "kind": "relative",
      "num_buckets": kw.pop("num_buckets", 32),
      "max_distance": kw.pop("max_distance", 128),
      "bidirectional": kw.pop("bidirectional", True),
    }
  else:
    raise UserError(
      f"Unknown position kind {kind!r}: use rope, alibi, learned, sinusoidal, relative, sincos_2d "
      "or none."
    )
  if kw:
    raise UserError(f"Position kind {kind!r} takes no {sorted(kw)}.")
  return ml_collections.ConfigDict(cfg)


def rope_scaling(kind: str = "none", **kw) -> ml_collections.ConfigDict:
  """RoPE frequency scaling, as Hugging Face's `rope_scaling` (rope_type and its fields)."""
  defaults = {
    "none": {},
    "linear": {"factor": 1.0},
    "llama3": {
      "factor": 8.0,
      "low_freq_factor": 1.0,
      "high_freq_factor": 4.0,
      "original_max_len": 8192,
    },
    "yarn": {"factor": 4.0, "original_max_len": 4096, "beta_fast": 32.0, "beta_slow": 1.0},
  }
  if kind not in defaults:
    raise UserError(f"Unknown RoPE scaling {kind!r}: use one of {list(defaults)}.")
  unknown = set(kw) - set(defaults[kind])
  if unknown:
    raise UserError(f"RoPE scaling {kind!r} takes no {sorted(unknown)}.")
  return ml_collections.ConfigDict({"kind": kind, **defaults[kind], **kw})


def rope_frequencies(head_dim: int, theta: float, scaling) -> tuple[np.ndarray, float]:
  """Inverse frequencies [H/2] and the factor cos/sin are multiplied by (YaRN's mscale)."""
  inv_freq = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
  kind = scaling.kind
  if kind == "none":
    return inv_freq, 1.0
  if kind == "linear":
    return inv_freq / scaling.factor, 1.0
  if kind == "llama3":
    old = scaling.original_max_len
    low_wavelen, high_wavelen = old / scaling.low_freq_factor, old / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    smooth = (old / wavelen - scaling.low_freq_factor) / (
      scaling.high_freq_factor - scaling.low_freq_factor
    )
    mid = (1 - smooth) * inv_freq / scaling.factor + smooth * inv_freq
    out = np.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
    is_mid = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return np.where(is_mid, mid, out), 1.0
  if kind == "yarn":

    def correction_dim(num_rotations):
      return (
        head_dim
        * math.log(scaling.original_max_len / (num_rotations * 2 * math.pi))
        / (2 * math.log(theta))
      )

    low = max(math.floor(correction_dim(scaling.beta_fast)), 0)
    high = min(math.ceil(correction_dim(scaling.beta_slow)), head_dim - 1)
    if low == high:
      high += 0.001  # avoid a zero-width ramp
    ramp = np.clip((np.arange(head_dim // 2) - low) / (high - low), 0, 1)
    extrapolation = 1 - ramp
    inv = inv_freq / scaling.factor * (1 - extrapolation) + inv_freq * extrapolation
    mscale = 0.1 * math.log(scaling.factor) + 1.0 if scaling.factor > 1 else 1.0
    return inv, mscale
  raise UserError(f"Unknown RoPE scaling {kind!r}: use one of {list(ROPE_SCALINGS)}.")


class Position(nnx.Module):
  """No position information (NoPE); the base of the other kinds."""

  # True: the stack computes `logit_bias` once and hands it to every layer (`StackBias`).
  per_stack = False

  def embed(self, x_BTD: jax.Array, positions_BT: jax.Array) -> jax.Array:
    return x_BTD

  def rotate(self, x_BTNH: jax.Array, positions_BT: jax.Array) -> jax.Array:
    return x_BTNH

  def logit_bias(self, q_pos_BT: jax.Array, k_pos_BS: jax.Array, num_heads: int):
    return None


class RoPE(Position):
  """Rotary embedding in the half-split layout of Hugging Face (rotate_half), so HF weights load
  without permuting q and k."""

  def __init__(self, head_dim: int, *, theta: float, scaling):
    inv_freq, self.mscale = rope_frequencies(head_dim, theta, scaling)
    self.inv_freq = tuple(inv_freq.tolist())  # a constant of the graph, not a parameter

  def rotate(self, x_BTNH: jax.Array, positions_BT: jax.Array) -> jax.Array:
    inv_freq = jnp.asarray(self.inv_freq, jnp.float32)
    angles_BTh = positions_BT[..., None].astype(jnp.float32) * inv_freq
    cos = (jnp.cos(angles_BTh) * self.mscale)[:, :, None, :]
    sin = (jnp.sin(angles_BTh) * self.mscale)[:, :, None, :]
    x1, x2 = jnp.split(x_BTNH.astype(jnp.float32), 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x_BTNH.dtype)


def alibi_slopes(num_heads: int) -> np.ndarray:
  """Press et al.: a geometric sequence per head, interleaved when N is not a power of two."""

  def power_of_two(n):
    start = 2 ** (-(2 ** -(math.log2(n) - 3)))
    return [start * start**i for i in range(n)]

  if math.log2(num_heads).is_integer():
    return np.array(power_of_two(num_heads), np.float32)
  closest = 2 ** math.floor(math.log2(num_heads))
  extra = power_of_two(2 * closest)[0::2][: num_heads - closest]
  return np.array(power_of_two(closest) + extra, np.float32)


class ALiBi(Position):
  def logit_bias(self, q_pos_BT, k_pos_BS, num_heads):
    slopes_N = jnp.asarray(alibi_slopes(num_heads))
    distance_BTS = (k_pos_BS[:, None, :] - q_pos_BT[:, :, None]).astype(jnp.float32)
    # -slope * |i - j|: symmetric, so it also serves bidirectional attention.
    return -slopes_N[None, :, None, None] * jnp.abs(distance_BTS)[:, None]


class Learned(Position):
  """A learned table of absolute positions added to the token embeddings (GPT-2, BERT)."""

  def __init__(self, max_len: int, dim: int, *, param_dtype=jnp.float32, rngs: nnx.Rngs):
    self.max_len = max_len
    self.embedding = nnx.Param(
      normal(0.02)(rngs.params(), (max_len, dim), param_dtype), axes=(None, "D")
    )

  def embed(self, x_BTD, positions_BT):
    table = parallel.gather(self.embedding[...], (None, "D"))
    return x_BTD + jnp.take(table, positions_BT, axis=0).astype(x_BTD.dtype)


def sinusoids(positions, dim: int, theta: float = 10_000.0) -> jax.Array:
  """[..., D] fixed encodings of integer positions: D / 2 sines then D / 2 cosines, of
  timescales 1 .. theta in geometric steps (tensor2tensor's timing signal, as Whisper's
  encoder `sinusoids`; not the interleaved form of "Attention is all you need")."""
  if dim % 2:
    raise UserError(f"Sinusoidal positions need an even width, not {dim}.")
  increment = math.log(theta) / (dim // 2 - 1)
  inv_timescales = jnp.exp(-increment * jnp.arange(dim // 2, dtype=jnp.float32))
  scaled = jnp.asarray(positions, jnp.float32)[..., None] * inv_timescales
  return jnp.concatenate([jnp.sin(scaled), jnp.cos(scaled)], axis=-1)


class Sinusoidal(Position):
  """Fixed sinusoids added to the embeddings (Whisper's encoder): computed, not learned, so no
  parameter (transformers stores Whisper's as a frozen [max_len, D] weight)."""

  def __init__(self, max_len: int, dim: int, *, theta: float = 10_000.0):
    self.max_len, self.dim, self.theta = max_len, dim, theta

  def table(self) -> jax.Array:
    """[max_len, D]: the encodings of positions 0 .. max_len - 1 (what transformers stores)."""
    return sinusoids(jnp.arange(self.max_len), self.dim, self.theta)

  def embed(self, x_BTD, positions_BT):
    if positions_BT.shape[-1] > self.max_len:
      raise UserError(
        f"A sequence of {positions_BT.shape[-1]} is longer than model.position.max_len="
        f"{self.max_len}."
      )
    return x_BTD + sinusoids(positions_BT, self.dim, self.theta).astype(x_BTD.dtype)


def sincos_2d_table(dim: int, grid: int) -> np.ndarray:
  """The fixed [grid * grid, dim] table of MAE and DiT (diffusers' `get_2d_sincos_pos_embed`):
  patch (row i, column j), row-major, gets sin/cos features of j in its first dim / 2 entries and
  of i in the rest; each half is sin(p * w_k) then cos(p * w_k), w_k = 10000^(-k / (dim / 4))."""
  if dim % 4:
    raise UserError(f"Position kind 'sincos_2d' needs a width divisible by 4, not {dim}.")
  omega = 1.0 / 10_000 ** (np.arange(dim // 4, dtype=np.float64) / (dim / 4))
  rows, cols = np.meshgrid(np.arange(grid), np.arange(grid), indexing="ij")

  def one(p):
    out = p.reshape(-1)[:, None] * omega[None, :]
    return np.concatenate([np.sin(out), np.cos(out)], axis=1)

  return np.concatenate([one(cols), one(rows)], axis=1).astype(np.float32)


class SinCos2D(Position):
  """A fixed 2-D sin-cos table over a grid x grid of patches, added to the embeddings: no
  parameters (ViT-style image stacks with fixed positions: MAE, DiT)."""

  def __init__(self, grid: int, dim: int):
    self.grid, self.dim = grid, dim
    sincos_2d_table(dim, grid)  # a width it cannot fill is refused when the model is built

  def embed(self, x_BTD, positions_BT):
    table_TD = jnp.asarray(sincos_2d_table(self.dim, self.grid))
    return x_BTD + jnp.take(table_TD, positions_BT, axis=0).astype(x_BTD.dtype)


def relative_position_bucket(
  relative_position, *, bidirectional: bool, num_buckets: int, max_distance: int
) -> jax.Array:
  """T5's bucket of each relative position (key - query), as transformers'
  `T5Attention._relative_position_bucket`: exact buckets for small distances, logarithmic ones
  up to `max_distance`, one bucket beyond; a bidirectional table gives half its buckets to keys
  after the query, a causal one sees only keys at or before it."""
  relative_position = jnp.asarray(relative_position, jnp.int32)
  buckets = jnp.zeros_like(relative_position)
  if bidirectional:
    num_buckets //= 2
    buckets = buckets + (relative_position > 0).astype(jnp.int32) * num_buckets
    distance = jnp.abs(relative_position)
  else:
    distance = -jnp.minimum(relative_position, 0)
  max_exact = num_buckets // 2
  is_small = distance < max_exact
  # float32 in the same order as torch, so a distance on a bucket boundary rounds the same way;
  # the maximum keeps log(0) (a small distance, not taken) finite.
  ratio = jnp.maximum(distance, 1).astype(jnp.float32) / max_exact
  log_ratio = jnp.log(ratio) / jnp.float32(math.log(max_distance / max_exact))
  large = max_exact + (log_ratio * (num_buckets - max_exact)).astype(jnp.int32)
  large = jnp.minimum(large, num_buckets - 1)
  return buckets + jnp.where(is_small, distance, large)


class RelativeBias(Position):
  """T5's learned relative position bias: a table [buckets, N] added to the attention logits
  by the bucket of key position - query position. The table has HF's layout
  (`relative_attention_bias.weight`, copied as is); one instance serves every layer, as in T5,
  where only the first layer owns it."""

  # Computed once per stack, as transformers' T5 does: the gradient of the table lookup, a
  # scatter of B x N x T x S values into the table, is then paid once and not per layer (it
  # took half of a small T5's training step on CPU).
  per_stack = True

  def __init__(
    self,
    num_heads: int,
    *,
    num_buckets: int = 32,
    max_distance: int = 128,
    bidirectional: bool = True,
    init_std: float = 0.02,
    param_dtype=jnp.float32,
    rngs: nnx.Rngs,
  ):
    self.num_heads, self.num_buckets = num_heads, num_buckets
    self.max_distance, self.bidirectional = max_distance, bidirectional
    self.table = nnx.Param(
      normal(init_std)(rngs.params(), (num_buckets, num_heads), param_dtype), axes=(None, "NH")
    )

  def logit_bias(self, q_pos_BT, k_pos_BS, num_heads):
    """The bias [B, N, T, S] for all heads (attention keeps its own heads' slice)."""
    table = self.table[...]  # [buckets, N]
    if parallel.tensor_split("NH"):
      # Stored split over tensor; all heads are gathered because attention slices the bias.
      table = jax.lax.all_gather(table, "tensor", axis=1, tiled=True)
    relative_BTS = k_pos_BS[:, None, :] - q_pos_BT[:, :, None]
    buckets_BTS = relative_position_bucket(
      relative_BTS,
      bidirectional=self.bidirectional,
      num_buckets=self.num_buckets,
      max_distance=self.max_distance,
    )
    bias_BTSN = jnp.take(table, buckets_BTS, axis=0).astype(jnp.float32)
    return jnp.transpose(bias_BTSN, (0, 3, 1, 2))


class StackBias(Position):
  """A logit bias computed once for a whole stack, handed to each layer's attention in place of
  the position encoding that made it (one whose `per_stack` is True)."""

  def __init__(self, bias_BNTS: jax.Array):
    self.bias_BNTS = nnx.data(bias_BNTS)

  def logit_bias(self, q_pos_BT, k_pos_BS, num_heads):
    return self.bias_BNTS


def make(
  cfg,
  *,
  head_dim: int,
  dim: int,
  num_heads: int | None = None,
  param_dtype=jnp.float32,
  rngs: nnx.Rngs,
) -> Position:
  if cfg.kind == "rope":
    return RoPE(head_dim, theta=cfg.theta, scaling=cfg.scaling)
  if cfg.kind == "alibi":
    return ALiBi()
  if cfg.kind == "learned":
    return Learned(cfg.max_len, dim, param_dtype=param_dtype, rngs=rngs)
  if cfg.kind == "sinusoidal":
    return Sinusoidal(cfg.max_len, dim, theta=cfg.theta)
  if cfg.kind == "relative":
    if num_heads is None:
      raise UserError(
        "Position kind 'relative' learns a bias per head: pass num_heads to position.make."
      )
    return RelativeBias(
      num_heads,
      num_buckets=cfg.num_buckets,
      max_distance=cfg.max_distance,
      bidirectional=cfg.bidirectional,
      init_std=dim**-0.5,
      param_dtype=param_dtype,
      rngs=rngs,
    )
  if cfg.kind == "sincos_2d":
    return SinCos2D(cfg.grid, dim)
  if cfg.kind == "none":
    return Position()
  raise UserError(
    f"Unknown position kind {cfg.kind!r}: use rope, alibi, learned, sinusoidal, relative, "
    "sincos_2d or none."
  )


def positions_from_segments(segment_ids_BT):
  """Each token's index within its own segment, so packed documents all start at position 0 (a
  NumPy array for NumPy ids: the host prepares the rows the context split feeds)."""
  B, T = segment_ids_BT.shape
  if isinstance(segment_ids_BT, np.ndarray):
    xp, cummax = np, np.maximum.accumulate
  else:
    xp, cummax = jnp, jax.lax.cummax
  idx_BT = xp.broadcast_to(xp.arange(T, dtype=xp.int32), (B, T))
  is_start = xp.concatenate(
    [xp.ones((B, 1), bool), segment_ids_BT[:, 1:] != segment_ids_BT[:, :-1]], axis=1
  )
  start_BT = cummax(xp.where(is_start, idx_BT, 0), axis=1)
  return idx_BT - start_BT


def default_positions(tokens_BT: jax.Array, segment_ids_BT=None, cache=None) -> jax.Array:
  """Positions when the caller gives none: per segment if packed, after the cache if decoding."""
  B, T = tokens_BT.shape
  if segment_ids_BT is not None:
    return positions_from_segments(segment_ids_BT)
  if cache is None:
    return jnp.broadcast_to(jnp.arange(T), (B, T))
  return cache[0].index[:, None] + jnp.arange(T)  # each row after its own cached tokens
