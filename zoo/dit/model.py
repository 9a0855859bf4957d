"""DiT (Peebles and Xie 2023): the shared Denoiser stack of blocks modulated by adaLN-Zero.

noisy images [B, S, S, C] -> patches (Conv2d as one matmul) + fixed 2-D sin-cos positions
c = MLP(sinusoid(t)) + class table[label]   (label = num_classes: the null class)
-> [x = x + gate * Attention(modulate(LayerNorm(x))) -> x = x + gate * GELU MLP(modulate(...))] x L
-> modulate(LayerNorm(x)) -> Linear -> unpatchify -> [B, S, S, out_channels]
"""

import ml_collections

from nnx_zoo.common import config as config_lib
from nnx_zoo.common.nn import attention, conditioning, denoiser, mlp, norms, position, transformer

# Published dimensions (the paper's Table 1, facebookresearch/DiT's models.py): all on 256 x 256
# images as 32 x 32 x 4 VAE latents, patch 2, 1,000 ImageNet classes, learned sigma (8 outputs).
# fmt: off
_IMAGENET = dict(image_size=32, patch=2, channels=4, out_channels=8, num_classes=1000)
PRESETS = {
    "dit-s2": dict(dim=384, num_layers=12, num_heads=6, **_IMAGENET),
    "dit-b2": dict(dim=768, num_layers=12, num_heads=12, **_IMAGENET),
    "dit-l2": dict(dim=1024, num_layers=24, num_heads=16, **_IMAGENET),
    "dit-xl2": dict(dim=1152, num_layers=28, num_heads=16, **_IMAGENET),
    # Tiny shapes for tests.
    "tiny": dict(dim=32, num_layers=2, num_heads=4, image_size=8, patch=2, channels=1,
                 out_channels=1, num_classes=10),
}
# fmt: on


@config_lib.family_config(PRESETS, family="dit")
def config(p: dict) -> ml_collections.ConfigDict:
  """The model config of a preset, with flat overrides: the keys of PRESETS' entries, and
  hidden_dim (4 * dim), norm_eps (1e-6, both block norms and the final one), mlp_norm_eps (the
  MLP's norm where it differs: diffusers' `norm_eps`, 1e-5 by default), frequency_dim (256),
  freq_shift (1, diffusers' timestep frequencies, which its converted DiT checkpoints run with
  and which export needs; the paper's code has 0) and activation ("gelu": tanh GELU, DiT's)."""
  D, eps = p["dim"], p.get("norm_eps", 1e-6)
  mlp_eps = p.get("mlp_norm_eps", eps)
  mlp_norm = norms.config("layer", eps=mlp_eps, affine=False) if mlp_eps != eps else None
  return transformer.config(
    family="dit",
    vocab_size=0,  # no token table: the inputs are images
    dim=D,
    num_layers=p["num_layers"],
    attention=attention.config(
      num_heads=p["num_heads"],
      head_dim=D // p["num_heads"],
      mask="bidirectional",
      qkv_bias=True,
      out_bias=True,
    ),
    position=position.config("sincos_2d", grid=p["image_size"] // p["patch"]),
    norm=norms.config("layer", eps=eps, affine=False),
    mlp=mlp.config(
      p.get("activation", "gelu"), hidden_dim=p.get("hidden_dim", 4 * D), use_bias=True
    ),
    norm_placement="pre",
    modulation="adaln_zero",
    mlp_norm=mlp_norm,
    stack=denoiser.denoiser_keys(
      image_size=p["image_size"],
      patch=p["patch"],
      channels=p["channels"],
      out_channels=p["out_channels"],
      conditioning=conditioning.config(
        num_classes=p["num_classes"],
        frequency_dim=p.get("frequency_dim", 256),
        freq_shift=p.get("freq_shift", 1.0),
      ),
    ),
  )


Model = denoiser.Denoiser
