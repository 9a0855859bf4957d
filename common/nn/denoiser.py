"""The diffusion transformer stack: noisy images, a timestep and a class in, a prediction the size
of the image out (DiT; any transformer denoiser built from the shared Block).

images [B, S, S, C] -> patches (PatchEmbed) + positions (fixed 2-D sin-cos: `sincos_2d`)
       c [B, D] = Conditioning(timestep, class)            (common/nn/conditioning.py)
       -> [Block modulated by c (`modulation="adaln_zero"`)] x L
       -> norm -> modulate(shift, scale from c) -> Linear(D, p * p * out_channels)
       -> unpatchify -> [B, S, S, out_channels]

Keys beyond the shared ones of `transformer.config`: those of `denoiser_keys` (image_size,
patch, channels, out_channels, patch_bias, conditioning). With
out_channels = 2 * channels (DiT's learned sigma) the first `channels` are the prediction a
sampler reads (`prediction`), the rest the variance, as diffusers' DiT pipeline splits them.
"""

import jax
import jax.numpy as jnp
import ml_collections
from flax import nnx

from nnx_zoo.common.errors import UserError
from nnx_zoo.common.nn import conditioning, norms
from nnx_zoo.common.nn.linear import Linear, dtypes
from nnx_zoo.common.nn.patch import PatchEmbed, unpatchify
from nnx_zoo.common.nn.stack import BlockStack, StackKeys


def denoiser_keys(
  *,
  image_size: int,
  patch: int,
  channels: int,
  conditioning: ml_collections.ConfigDict,
  out_channels: int | None = None,
  patch_bias: bool = True,
) -> StackKeys:
  """A `Denoiser`'s keys, to pass to `transformer.config(stack=...)`: its images [B, image_size,
  image_size, channels] cut into patch x patch patches (with a bias if `patch_bias`), its
  `conditioning` (a `conditioning.config`) and its output's channels (None: as many as
  `channels`)."""
  if out_channels is None:
    out_channels = channels
  return StackKeys.declared(locals())


class Denoiser(BlockStack):
  """`model(images, timesteps, labels)` -> [B, S, S, out_channels]: see the module docstring.
  Labels are class ids, `num_classes` (`null_id`) for none (classifier-free guidance)."""

  def __init__(self, cfg, *, rngs: nnx.Rngs):
    dt = dtypes(cfg)
    S, p, D = cfg.image_size, cfg.patch, cfg.dim
    if S % p:
      raise UserError(f"model.patch={p} does not divide model.image_size={S}.")
    if cfg.modulation == "none":
      raise UserError("A Denoiser's blocks read the conditioning: set model.modulation.")
    self.image_size, self.channels, self.out_channels = S, cfg.channels, cfg.out_channels
    self.patch = p
    self.patch_embed = PatchEmbed(
      D, patch=p, channels=cfg.channels, use_bias=cfg.patch_bias, init_std=cfg.init_std,
      rngs=rngs, **dt,
    )  # fmt: skip
    self.conditioning = conditioning.Conditioning(
      cfg.conditioning, D, init_std=cfg.init_std, rngs=rngs, **dt
    )
    self._make_positions(cfg, rngs, dt)
    self._make_blocks(cfg, rngs)
    self.norm = norms.make(cfg.norm, D, **dt)
    self.final_modulation = conditioning.Modulation(D, 2, rngs=rngs, **dt)  # shift, scale
    # Zero at initialisation, as DiT's: the first predictions are 0.
    self.head = Linear(
      D, p * p * cfg.out_channels, use_bias=True, axes=("D", None), init_std=0.0, rngs=rngs, **dt
    )

  @property
  def null_id(self) -> int:
    return self.conditioning.label.null_id

  @property
  def num_classes(self) -> int:
    return self.conditioning.label.num_classes

  def __call__(self, images_BHWC, timesteps_B, labels_B) -> jax.Array:
    S, C = self.image_size, self.channels
    if images_BHWC.ndim != 4 or tuple(images_BHWC.shape[1:]) != (S, S, C):
      raise UserError(
        f"Expected images [B, {S}, {S}, {C}] (channels last), got {tuple(images_BHWC.shape)}."
      )
    x_BTD = self.patch_embed(images_BHWC.astype(jnp.float32))
    B, T, _ = x_BTD.shape
    positions_BT = jnp.broadcast_to(jnp.arange(T), (B, T))
    x_BTD = self.position.embed(x_BTD, positions_BT)
    c_BD = self.conditioning(timesteps_B, labels_B)
    x_BTD, _ = self._run_blocks(
      x_BTD, positions_BT=positions_BT, segment_ids_BT=jnp.ones((B, T), jnp.int32), cond_BD=c_BD
    )
    shift_BD, scale_BD = self.final_modulation(c_BD)
    out_BTK = self.head(conditioning.modulate(self.norm(x_BTD), shift_BD, scale_BD))
    return unpatchify(out_BTK, patch=self.patch, channels=self.out_channels)

  def prediction(self, images_BHWC, timesteps_B, labels_B) -> jax.Array:
    """What a sampler reads: the first `channels` outputs (without a learned variance)."""
    return self(images_BHWC, timesteps_B, labels_B)[..., : self.channels]
