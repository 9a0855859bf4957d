"""ViT: the shared Encoder over image patches, a class token and a classifier head on it.

images [B, S, S, C] in [0, 1] -> (x - 0.5) / 0.5 -> patches (Conv2d as one matmul) -> [class
       token, patches] + learned positions
       -> [x = x + Attention(LayerNorm(x)) -> x = x + GELU MLP(LayerNorm(x))] x L -> LayerNorm
       -> the class token -> Linear -> logits [B, num_labels]
"""

import ml_collections

from nnx_zoo.common import config as config_lib
from nnx_zoo.common.errors import UserError
from nnx_zoo.common.nn import attention, mlp, norms, position, transformer

# Published dimensions (each model's config.json on the Hugging Face hub).
# fmt: off
PRESETS = {
    # google/vit-base-patch16-224 (ImageNet-21k pre-trained, ImageNet-1k fine-tuned).
    "vit-b16": dict(
        dim=768, num_layers=12, num_heads=12, hidden_dim=3072, image_size=224, patch=16,
        num_labels=1000,
    ),
    # google/vit-large-patch16-224.
    "vit-l16": dict(
        dim=1024, num_layers=24, num_heads=16, hidden_dim=4096, image_size=224, patch=16,
        num_labels=1000,
    ),
    # Tiny shapes for tests.
    "tiny": dict(
        dim=64, num_layers=2, num_heads=4, hidden_dim=128, image_size=32, patch=8, num_labels=10,
    ),
}
# fmt: on


@config_lib.family_config(PRESETS, family="vit")
def config(p: dict) -> ml_collections.ConfigDict:
  """The model config of a preset, with flat overrides: the keys of PRESETS' entries, and
  channels (3), norm_eps (1e-12), activation ("gelu_exact", HF's "gelu"), qkv_bias (True),
  pixel_mean and pixel_std ((0.5,) * channels: HF's ViTImageProcessor's), pool ("token": the
  class token, as HF's; "mean": no class token, the mean of the patches' final states, big_vision's
  "gap", which HF's ViT does not have)."""
  channels, pool = p.get("channels", 3), p.get("pool", "token")
  if pool not in ("token", "mean"):
    raise UserError(f"Unknown vit pool {pool!r}: use 'token' or 'mean'.")
  images = transformer.patch_inputs(
    image_size=p["image_size"],
    patch=p["patch"],
    channels=channels,
    pixel_mean=p.get("pixel_mean", (0.5,) * channels),
    pixel_std=p.get("pixel_std", (0.5,) * channels),
    class_token=pool == "token",
  )
  return transformer.config(
    family="vit",
    vocab_size=0,  # no token table: the inputs are images
    dim=p["dim"],
    num_layers=p["num_layers"],
    attention=attention.config(
      num_heads=p["num_heads"],
      head_dim=p["dim"] // p["num_heads"],
      mask="bidirectional",
      qkv_bias=p.get("qkv_bias", True),
      out_bias=True,
    ),
    position=position.config("learned", max_len=transformer.num_patches(images)),
    norm=norms.config("layer", eps=p.get("norm_eps", 1e-12)),
    mlp=mlp.config(p.get("activation", "gelu_exact"), hidden_dim=p["hidden_dim"], use_bias=True),
    norm_placement="pre",
    stack=transformer.encoder_keys(
      images=images,
      final_norm=True,
      pool_at="first" if pool == "token" else "mean",
      num_labels=p["num_labels"],
    ),
  )


class Model(transformer.Encoder):
  """`model(images)` -> class logits [B, num_labels] (the Encoder's `classify`);
  `model.encode(images)` -> the final hidden states [B, 1 + patches, D]."""

  def __call__(self, images_BHWC):
    return self.classify(images_BHWC)
