"""Patch embedding (ViT, CLIP, DiT): images [B, H, W, C] -> one vector per patch [B, T, D]; and
back (`unpatchify`: a denoiser's per-patch outputs as an image).

A convolution with stride = kernel = patch is a linear map of each flattened patch, so it runs as
the shared `Linear` (one 2-D matmul, see DESIGN.md for why not 3-D, let alone a convolution).

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
    self.proj = Linear(
      channels * patch * patch,
      dim,
      use_bias=use_bias,
      axes=(None, "D"),
      init_std=init_std,
      dtype=dtype,
      param_dtype=param_dtype,
      rngs=rngs,
    )

  def __call__(self, images_BHWC: jax.Array) -> jax.Array:
    if images_BHWC.ndim != 4 or images_BHWC.shape[-1] != self.channels:
      raise UserError(
        f"Expected images [B, H, W, {self.channels}] (channels last), got shape "
        f"{tuple(images_BHWC.shape)}."
      )
    return self.proj(patches(images_BHWC, self.patch))


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
