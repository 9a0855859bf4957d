"""Patch embedding (ViT, CLIP, DiT): images [B, H, W, C] -> one vector per patch [B, T, D]; and
back (`unpatchify`: a denoiser's per-patch outputs as an image); and its 1-D relative, a stem of
1-D convolutions over feature frames [B, T, C] (Whisper's log-mel front-end), `ConvStem`.

A convolution with stride = kernel = patch is a linear map of each flattened patch, so it runs as
the shared `Linear` (one 2-D matmul, see docs/DESIGN.md for why not 3-D, let alone a convolution).

Kernel layout: [C * p * p, D], the rows in (channel, row, column) order of a patch. A torch /
Hugging Face conv weight [D, C, p, p] is therefore `w.reshape(D, -1).T` (`kernel_from_conv`), and
back `k.T.reshape(D, C, p, p)` (`conv_from_kernel`): a key map's `Rule` with these two.
Patches come out row by row (T = (H / p) * (W / p), index h * W / p + w), as HF's
`conv(x).flatten(2).transpose(1, 2)`.
"""

import jax
import jax.numpy as jnp
from flax import nnx

from nnx_zoo.common.errors import UserError
from nnx_zoo.common.nn import mlp
from nnx_zoo.common.nn.linear import Linear


def kernel_from_conv(w_DCpp: jax.Array) -> jax.Array:
  """A conv weight [D, C, p, p] (torch layout) -> our kernel [C * p * p, D]."""
  return w_DCpp.reshape(w_DCpp.shape[0], -1).T


def conv_from_kernel(kernel: jax.Array, *, patch: int) -> jax.Array:
  """Our kernel [C * p * p, D] -> a conv weight [D, C, p, p] (torch layout)."""
  return kernel.T.reshape(kernel.shape[1], -1, patch, patch)


def patches(images_BHWC: jax.Array, patch: int) -> jax.Array:
  """[B, H, W, C] -> [B, T, C * p * p]: each patch flattened in (channel, row, column) order."""
  B, H, W, C = images_BHWC.shape
  if H % patch or W % patch:
    raise UserError(
      f"Images of {H}x{W} pixels do not divide into {patch}x{patch} patches: resize or crop the "
      f"images to a multiple of {patch}, or pick a patch size that divides both."
    )
  h, w = H // patch, W // patch
  x = images_BHWC.reshape(B, h, patch, w, patch, C)
  return x.transpose(0, 1, 3, 5, 2, 4).reshape(B, h * w, C * patch * patch)


def conv_kernel(window: int, dim: int, *, use_bias: bool, **kw) -> Linear:
  """A convolution of `dim` filters as the shared Linear over flattened windows of `window`
  values (kernel [window, D]): `PatchEmbed`'s and each of `ConvStem`'s."""
  return Linear(window, dim, use_bias=use_bias, axes=(None, "D"), **kw)


class PatchEmbed(nnx.Module):
  """Conv2d(C, D, kernel=p, stride=p) as a Linear over flattened patches; `use_bias`: ViT has
  one, CLIP's vision tower does not."""

  def __init__(
    self,
    dim: int,
    *,
    patch: int,
    channels: int = 3,
    use_bias: bool = True,
    init_std: float = 0.02,
    dtype=jnp.float32,
    param_dtype=jnp.float32,
    rngs: nnx.Rngs,
  ):
    self.channels, self.patch = channels, patch
    kw = dict(init_std=init_std, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
    self.proj = conv_kernel(channels * patch * patch, dim, use_bias=use_bias, **kw)

  def __call__(self, images_BHWC: jax.Array) -> jax.Array:
    if images_BHWC.ndim != 4 or images_BHWC.shape[-1] != self.channels:
      raise UserError(
        f"Expected images [B, H, W, {self.channels}] (channels last), got shape "
        f"{tuple(images_BHWC.shape)}."
      )
    return self.proj(patches(images_BHWC, self.patch))


def conv1d_from_kernel(kernel: jax.Array, *, width: int) -> jax.Array:
  """Our kernel [C * w, D] -> a Conv1d weight [D, C, w] (torch layout); `kernel_from_conv`
  is the way back (it flattens any conv weight [D, C, ...])."""
  return kernel.T.reshape(kernel.shape[1], -1, width)


def windows(x_BTC: jax.Array, *, width: int, stride: int) -> jax.Array:
  """[B, T, C] -> [B, T', C * width]: the window under each output of a 1-D convolution padded
  by width // 2 on both sides (torch's `padding=width // 2`), flattened in (channel, tap) order.
  T' = (T + 2 * (width // 2) - width) // stride + 1."""
  B, T, C = x_BTC.shape
  pad = width // 2
  x = jnp.pad(x_BTC, ((0, 0), (pad, pad), (0, 0)))
  out = (T + 2 * pad - width) // stride + 1
  taps = [x[:, j : j + stride * (out - 1) + 1 : stride] for j in range(width)]  # w x [B, T', C]
  return jnp.stack(taps, axis=-1).reshape(B, out, C * width)


def stem_length(frames: int, *, width: int, strides) -> int:
  """The sequence length after a `ConvStem` of `frames` input frames."""
  for s in strides:
    frames = (frames + 2 * (width // 2) - width) // s + 1
  return frames


class ConvStem(nnx.Module):
  """1-D convolutions over frames [B, T, C] -> [B, T', D], each of `width` taps (padded by
  width // 2), with bias, followed by `activation`; one per entry of `strides` (Whisper: two of
  width 3, strides (1, 2), GELU). Like `PatchEmbed`, each runs as the shared `Linear` over the
  flattened windows (one 2-D matmul); a torch Conv1d weight [D, C, w] is `kernel_from_conv`."""

  def __init__(
    self,
    dim: int,
    *,
    channels: int,
    width: int = 3,
    strides: tuple[int, ...] = (1, 2),
    activation="gelu_exact",
    init_std: float = 0.02,
    dtype=jnp.float32,
    param_dtype=jnp.float32,
    rngs: nnx.Rngs,
  ):
    self.channels, self.width, self.strides = channels, width, tuple(strides)
    self.activation = mlp.activation(activation)  # the activations' one registry
    kw = dict(init_std=init_std, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
    self.convs = nnx.List(
      [
        conv_kernel((channels if i == 0 else dim) * width, dim, use_bias=True, **kw)
        for i in range(len(self.strides))
      ]
    )

  def __call__(self, x_BTC: jax.Array) -> jax.Array:
    if x_BTC.ndim != 3 or x_BTC.shape[-1] != self.channels:
      raise UserError(
        f"Expected frames [B, T, {self.channels}] (features last), got shape {tuple(x_BTC.shape)}."
      )
    x = x_BTC
    for conv, stride in zip(self.convs, self.strides, strict=True):
      x = self.activation(conv(windows(x, width=self.width, stride=stride)))
    return x


def unpatchify(x_BTK: jax.Array, *, patch: int, channels: int) -> jax.Array:
  """[B, T, p * p * C] -> [B, H, W, C]: each token's vector read in (row, column, channel) order
  of its patch (DiT's output layout, not the conv kernel's (channel, row, column) of `patches`),
  the tokens row by row over a square grid."""
  B, T, K = x_BTK.shape
  side = int(round(T**0.5))
  if side * side != T or patch * patch * channels != K:
    raise UserError(
      f"Cannot unpatchify [{B}, {T}, {K}] into a square image of {patch}x{patch} patches with "
      f"{channels} channels."
    )
  x = x_BTK.reshape(B, side, side, patch, patch, channels)
  return x.transpose(0, 1, 3, 2, 4, 5).reshape(B, side * patch, side * patch, channels)
