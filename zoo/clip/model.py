"""CLIP: a text tower and a vision tower, both the shared Encoder, projected into one space.

tokens -> Embedding + learned positions -> [pre-norm causal blocks] x L -> LayerNorm
       -> the end-of-text token -> Linear (no bias) -> text features [B, P]
images -> (x - mean) / std -> patches (Conv2d, no bias) -> [class token, patches] + learned
       positions -> LayerNorm -> [pre-norm blocks] x L -> LayerNorm -> the class token
       -> Linear (no bias) -> image features [B, P]
logits = min(exp(logit_scale), 100) * cos(image, text)
"""

import math

import jax
import jax.numpy as jnp
import ml_collections
from flax import nnx

from nnx_zoo.common import config as config_lib
from nnx_zoo.common.errors import UserError
from nnx_zoo.common.nn import attention, lora, mlp, norms, position, transformer
from nnx_zoo.common.nn.linear import Linear, dtypes

# OpenAI's image statistics (HF's CLIPImageProcessor's image_mean and image_std).
OPENAI_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_STD = (0.26862954, 0.26130258, 0.27577711)

# Published dimensions (each model's config.json on the Hugging Face hub).
# fmt: off
PRESETS = {
    # openai/clip-vit-base-patch32.
    "clip-vit-b32": dict(
        projection_dim=512,
        text=dict(vocab_size=49408, dim=512, num_layers=12, num_heads=8, hidden_dim=2048,
                  max_len=77),
        vision=dict(dim=768, num_layers=12, num_heads=12, hidden_dim=3072, image_size=224,
                    patch=32),
    ),
    # Tiny shapes for tests: 32x32 RGB images, and the byte captions of common/data/images.py
    # (256 bytes and two markers: its TEXT_VOCAB, a test checks they agree).
    "tiny": dict(
        projection_dim=32,
        text=dict(vocab_size=258, dim=64, num_layers=2, num_heads=4,
                  hidden_dim=128, max_len=48),
        vision=dict(dim=64, num_layers=2, num_heads=4, hidden_dim=128, image_size=32, patch=8),
    ),
}
# fmt: on
TOWER_KEYS = ("dim", "num_layers", "num_heads", "hidden_dim")
TEXT_KEYS = (*TOWER_KEYS, "vocab_size", "max_len")
VISION_KEYS = (*TOWER_KEYS, "image_size", "patch", "channels", "pixel_mean", "pixel_std")
# What the towers share, held once at the top of the model config (the memory levers and
# dtypes the trainer sets as model.remat, model.scan, model.quant...).
SHARED = ("remat", "scan", "quant", "quant_backward", "lora", "dtype", "param_dtype")


@config_lib.family_config(PRESETS, family="clip")
def config(p: dict) -> ml_collections.ConfigDict:
  """The model config of a preset, with overrides: projection_dim, `text` and `vision` (dicts of
  the presets' tower keys; vision also channels, pixel_mean, pixel_std (OpenAI's)), and
  end_token (None: the text tower pools at each row's largest id, as OpenAI's tokenizer makes
  its end token the largest, and HF's CLIP with eos_token_id 2; else the first `end_token`),
  activation ("quick_gelu"), norm_eps (1e-5), logit_scale_init (ln(1 / 0.07))."""
  text, vision = p["text"], p["vision"]
  for name, given, known in (("text", text, TEXT_KEYS), ("vision", vision, VISION_KEYS)):
    unknown = sorted(set(given) - set(known))
    if unknown:
      raise UserError(f"clip's {name} tower has no keys {unknown}; its keys: {list(known)}.")
  act, eps = p.get("activation", "quick_gelu"), p.get("norm_eps", 1e-5)
  end_token = p.get("end_token")
  if end_token is not None and end_token < 0:  # -1 meant "none" before None did
    raise UserError(f"clip end_token={end_token}: give a token id, or None to pool at the largest.")
  channels = vision.get("channels", 3)
  text_cfg = _tower(
    text,
    act,
    eps,
    mask="causal",
    max_len=text["max_len"],
    vocab_size=text["vocab_size"],
    stack=transformer.encoder_keys(
      final_norm=True,
      pool_at="argmax" if end_token is None else "end_token",
      end_token=end_token,
    ),
  )
  vision_cfg = _tower(
    vision,
    act,
    eps,
    mask="bidirectional",
    max_len=(vision["image_size"] // vision["patch"]) ** 2 + 1,
    vocab_size=0,  # no token table: the inputs are images
    stack=transformer.encoder_keys(
      images=transformer.patch_inputs(
        image_size=vision["image_size"],
        patch=vision["patch"],
        channels=channels,
        patch_bias=False,
        pixel_mean=vision.get("pixel_mean", OPENAI_MEAN[:channels]),
        pixel_std=vision.get("pixel_std", OPENAI_STD[:channels]),
      ),
      embed_norm=True,  # HF's pre_layrnorm
      final_norm=True,  # HF's post_layernorm, on every token: the pooled one is HF's
      pool_at="first",
    ),
  )
  shared = {k: text_cfg[k] for k in SHARED}
  for tower in (text_cfg, vision_cfg):
    for k in ("family", *SHARED):
      del tower[k]
  return ml_collections.ConfigDict(
    {
      "family": "clip",
      "text": text_cfg,
      "vision": vision_cfg,
      "projection_dim": p["projection_dim"],
      "logit_scale_init": p.get("logit_scale_init", math.log(1 / 0.07)),
      "max_logit_scale": 100.0,  # exp(logit_scale) is clipped here, as OpenAI's training does
      **shared,
    }
  )


def _tower(
  p: dict,
  act: str,
  eps: float,
  *,
  mask: str,
  max_len: int,
  vocab_size: int,
  stack: transformer.StackKeys,
) -> ml_collections.ConfigDict:
  return transformer.config(
    family="clip",
    vocab_size=vocab_size,
    dim=p["dim"],
    num_layers=p["num_layers"],
    attention=attention.config(
      num_heads=p["num_heads"],
      head_dim=p["dim"] // p["num_heads"],
      mask=mask,
      qkv_bias=True,
      out_bias=True,
    ),
    position=position.config("learned", max_len=max_len),
    norm=norms.config("layer", eps=eps),
    mlp=mlp.config(act, hidden_dim=p["hidden_dim"], use_bias=True),
    norm_placement="pre",
    stack=stack,
  )


def tower_config(cfg, name: str) -> ml_collections.ConfigDict:
  """The Encoder config of tower `name` ("text" or "vision"): its own keys and the shared ones."""
  tower = ml_collections.ConfigDict(cfg[name].to_dict())
  tower.family = cfg.family
  for k in SHARED:
    tower[k] = cfg[k]
  tower.lora = lora.config()  # adapters are added to the whole model (nnx_zoo.common.models.build)
  return tower


class Model(nnx.Module):
  """`encode_text(tokens)` and `encode_image(images)` -> projected features [B, P];
  `model(images, tokens)` -> logits [B_images, B_texts] (HF's logits_per_image)."""

  def __init__(self, cfg, *, rngs: nnx.Rngs):
    dt = dtypes(cfg)
    self.text = transformer.Encoder(tower_config(cfg, "text"), path=("text",), rngs=rngs)
    self.vision = transformer.Encoder(tower_config(cfg, "vision"), path=("vision",), rngs=rngs)
    P = cfg.projection_dim
    # HF's init: std D^-0.5 for the projections.
    self.text_projection = Linear(
      cfg.text.dim, P, axes=("D", None), init_std=cfg.text.dim**-0.5, rngs=rngs, **dt
    )
    self.visual_projection = Linear(
      cfg.vision.dim, P, axes=("D", None), init_std=cfg.vision.dim**-0.5, rngs=rngs, **dt
    )
    self.logit_scale = nnx.Param(jnp.asarray(cfg.logit_scale_init, dt["param_dtype"]), axes=())
    self.max_logit_scale = cfg.max_logit_scale
    self.max_len = cfg.text.position.max_len

  def encode_text(self, tokens_BT: jax.Array, *, attention_mask=None) -> jax.Array:
    """Text features [B, P]: the end-of-text token's final hidden state, projected."""
    T = tokens_BT.shape[-1]
    if self.max_len < T:
      raise UserError(
        f"A text of {T} tokens is longer than the text tower's {self.max_len} positions "
        "(model.text.position.max_len): truncate it."
      )
    hidden_BTD = self.text(tokens_BT, attention_mask=attention_mask)
    return self.text_projection(self.text.pool(hidden_BTD, tokens_BT))

  def encode_image(self, images_BHWC: jax.Array) -> jax.Array:
    """Image features [B, P]: the class token's final (normed) hidden state, projected."""
    return self.visual_projection(self.vision.pool(self.vision(images_BHWC)))

  def logit_scale_value(self) -> jax.Array:
    """exp(logit_scale), clipped at max_logit_scale: what cosine similarities are scaled by."""
    scale = jnp.exp(self.logit_scale[...].astype(jnp.float32))
    return jnp.minimum(scale, self.max_logit_scale)

  def __call__(self, images_BHWC: jax.Array, tokens_BT: jax.Array, *, attention_mask=None):
    def unit(x):
      return x / jnp.linalg.norm(x, axis=-1, keepdims=True)

    image_BP = unit(self.encode_image(images_BHWC).astype(jnp.float32))
    text_BP = unit(self.encode_text(tokens_BT, attention_mask=attention_mask).astype(jnp.float32))
    return self.logit_scale_value() * jnp.dot(image_BP, text_BP.T)
