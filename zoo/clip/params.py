"""Hugging Face <-> zoo for CLIP (CLIPModel: both towers, their projections and the logit scale).

The vision tower's class_embedding [D] is our class token as is; its patch Conv2d weight
[D, C, p, p] becomes PatchEmbed's kernel [C * p * p, D]; Linear weights are transposed.
HF's CLIPImageProcessor normalises with OpenAI's mean and std, the zoo model's default
(model.vision.pixel_mean, pixel_std): config.json does not carry them. The text tower pools at
the argmax of the ids when eos_token_id is 2 (OpenAI's checkpoints, as HF does) and at the
first eos_token_id otherwise (model.end_token).
"""

import math

import ml_collections

from nnx_zoo.common.errors import UserError
from nnx_zoo.common.keymap import (
  copy,
  linear,
  patch_conv,
  plain_transformer_activation,
  require,
)
from nnx_zoo.zoo.clip import model as clip

MODEL_TYPES = ("clip",)
PREFIX = ""
IGNORED = (r"(^|\.)position_ids$",)
# HF hidden_act -> our MLP activation.
ACTIVATIONS = {
  "quick_gelu": "quick_gelu",
  "gelu": "gelu_exact",
  "gelu_new": "gelu",
  "gelu_pytorch_tanh": "gelu",
  "relu": "relu",
}
# HF's eos_token_id of the checkpoints made before it named the real end token: pool at argmax.
ARGMAX_EOS = 2
TOWER = ["hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size"]


def _tower(hf: dict, kind: str) -> dict:
  require(hf, TOWER, f"clip {kind}_config")
  return {
    "dim": hf["hidden_size"],
    "num_layers": hf["num_hidden_layers"],
    "num_heads": hf["num_attention_heads"],
    "hidden_dim": hf["intermediate_size"],
  }


def _activation(text: dict, vision: dict) -> tuple[str, float]:
  acts = {t.get("hidden_act") or "quick_gelu" for t in (text, vision)}
  eps = {t.get("layer_norm_eps") or 1e-5 for t in (text, vision)}
  if len(acts) > 1 or len(eps) > 1 or not acts <= set(ACTIVATIONS):
    raise UserError(
      f"CLIP with hidden_act {sorted(acts)} and layer_norm_eps {sorted(eps)} is not supported: "
      f"both towers need one of {list(ACTIVATIONS)} and the same eps."
    )
  return ACTIVATIONS[acts.pop()], eps.pop()


def config_from_hf(hf: dict, names=()) -> ml_collections.ConfigDict:
  """The zoo model config of a CLIPModel config.json."""
  text, vision = hf.get("text_config") or {}, hf.get("vision_config") or {}
  require(vision, ["image_size", "patch_size"], "clip vision_config")
  act, eps = _activation(text, vision)
  eos = text.get("eos_token_id", ARGMAX_EOS)
  cfg = clip.config(
    "tiny",  # every field of the preset is given below
    projection_dim=hf.get("projection_dim") or 512,
    text={
      **_tower(text, "text"),
      "vocab_size": text.get("vocab_size") or 49408,
      "max_len": text.get("max_position_embeddings") or 77,
    },
    vision={
      **_tower(vision, "vision"),
      "image_size": vision["image_size"],
      "patch": vision["patch_size"],
      "channels": vision.get("num_channels") or 3,
    },
    end_token=None if eos == ARGMAX_EOS else eos,
    activation=act,
    norm_eps=eps,
    logit_scale_init=hf.get("logit_scale_init_value", math.log(1 / 0.07)),
  )
  for tower, sub in ((cfg.text, text), (cfg.vision, vision)):
    tower.init_std = sub.get("initializer_range") or tower.init_std
  return cfg


def config_to_hf(cfg, model_type: str | None = None) -> dict:
  """config.json; one architecture, so `model_type` is always "clip"."""
  towers = {}
  for name in ("text", "vision"):
    tower = cfg[name]
    act = plain_transformer_activation(tower, ACTIVATIONS, "CLIP")
    towers[name] = {
      "hidden_size": tower.dim,
      "num_hidden_layers": tower.num_layers,
      "num_attention_heads": tower.attention.num_heads,
      "intermediate_size": tower.mlp.hidden_dim,
      "hidden_act": act,
      "layer_norm_eps": tower.norm.eps,
      "initializer_range": tower.init_std,
      "projection_dim": cfg.projection_dim,
    }
  text, vision = cfg.text, cfg.vision
  towers["text"].update(
    vocab_size=text.vocab_size,
    max_position_embeddings=text.position.max_len,
    eos_token_id=ARGMAX_EOS if text.pool_at == "argmax" else text.end_token,
  )
  towers["vision"].update(
    image_size=vision.image_size, patch_size=vision.patch, num_channels=vision.channels
  )
  return {
    "architectures": ["CLIPModel"],
    "model_type": "clip",
    "projection_dim": cfg.projection_dim,
    "logit_scale_init_value": cfg.logit_scale_init,
    "text_config": towers["text"],
    "vision_config": towers["vision"],
    "torch_dtype": cfg.param_dtype,
  }


def _blocks(hf: str, zoo: str, num_layers: int) -> list:
  r = []
  for i in range(num_layers):
    h, z = f"{hf}.encoder.layers.{i}", f"{zoo}.blocks.{i}"
    for theirs, ours in (("q_proj", "q"), ("k_proj", "k"), ("v_proj", "v"), ("out_proj", "o")):
      r += linear(f"{h}.self_attn.{theirs}", f"{z}.attn.{ours}", bias=True)
    r += linear(f"{h}.mlp.fc1", f"{z}.mlp.up", bias=True)
    r += linear(f"{h}.mlp.fc2", f"{z}.mlp.down", bias=True)
    r += _norm(f"{h}.layer_norm1", f"{z}.attn_norm") + _norm(f"{h}.layer_norm2", f"{z}.mlp_norm")
  return r


def _norm(hf: str, zoo: str) -> list:
  return [copy(f"{hf}.weight", f"{zoo}.scale"), copy(f"{hf}.bias", f"{zoo}.bias")]


def rules(cfg) -> list:
  t, v = "text_model", "vision_model"
  return [
    copy("logit_scale", "logit_scale"),
    *linear("text_projection", "text_projection", bias=False),
    *linear("visual_projection", "visual_projection", bias=False),
    copy(f"{t}.embeddings.token_embedding.weight", "text.embed.embedding"),
    copy(f"{t}.embeddings.position_embedding.weight", "text.position.embedding"),
    *_blocks(t, "text", cfg.text.num_layers),
    *_norm(f"{t}.final_layer_norm", "text.norm"),
    copy(f"{v}.embeddings.class_embedding", "vision.class_token"),
    patch_conv(f"{v}.embeddings.patch_embedding.weight", "vision.patch_embed.proj.kernel",
               patch=cfg.vision.patch),
    copy(f"{v}.embeddings.position_embedding.weight", "vision.position.embedding"),
    *_norm(f"{v}.pre_layrnorm", "vision.embed_norm"),
    *_blocks(v, "vision", cfg.vision.num_layers),
    *_norm(f"{v}.post_layernorm", "vision.norm"),
  ]  # fmt: skip
