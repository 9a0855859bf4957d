"""Hugging Face <-> zoo for ViT (ViTForImageClassification; ViTModel's encoder when the model
has no head).

HF's cls_token [1, 1, D] and position_embeddings [1, T, D] drop their leading ones; the patch
Conv2d weight [D, C, p, p] becomes PatchEmbed's kernel [C * p * p, D]; Linear weights are
transposed. HF's ViTImageProcessor normalises with mean = std = 0.5, the zoo model's default
(model.pixel_mean, model.pixel_std): config.json does not carry them.
"""

import ml_collections

from nnx_zoo.common.errors import UserError
from nnx_zoo.common.keymap import (
  copy,
  linear,
  patch_conv,
  plain_transformer_activation,
  squeeze,
)
from nnx_zoo.zoo.vit import model as vit

MODEL_TYPES = ("vit",)
PREFIX = "vit."
# ViTModel's pooler (tanh(Linear) of the class token), which ViTForImageClassification does not
# have, and the masked-image-modeling token: dropped, and listed in `zoo convert`'s summary.
IGNORED = (r"^(vit\.)?pooler\.", r"(^|\.)embeddings\.mask_token$")
# HF hidden_act -> our MLP activation.
ACTIVATIONS = {
  "gelu": "gelu_exact",
  "gelu_new": "gelu",
  "gelu_pytorch_tanh": "gelu",
  "quick_gelu": "quick_gelu",
  "relu": "relu",
}


def _square(hf: dict, key: str) -> int:
  value = hf[key]
  if isinstance(value, (list, tuple)):
    if len(set(value)) != 1:
      raise UserError(f"ViT with {key}={list(value)} (not square) is not supported.")
    value = value[0]
  return int(value)


def config_from_hf(hf: dict, names=()) -> ml_collections.ConfigDict:
  """The zoo model config of a ViT config.json; the head is there if the weights have it."""
  required = ["hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size"]
  missing = [k for k in required + ["image_size", "patch_size"] if k not in hf]
  if missing:
    raise UserError(f"config.json (vit) lacks {missing}.")
  act = hf.get("hidden_act") or "gelu"
  if act not in ACTIVATIONS:
    raise UserError(f"ViT with hidden_act={act!r} is not supported.")
  image_size, patch = _square(hf, "image_size"), _square(hf, "patch_size")
  cfg = vit.config(
    "tiny",  # every field of the preset is given below
    dim=hf["hidden_size"],
    num_layers=hf["num_hidden_layers"],
    num_heads=hf["num_attention_heads"],
    hidden_dim=hf["intermediate_size"],
    image_size=image_size,
    patch=patch,
    channels=hf.get("num_channels") or 3,
    norm_eps=hf.get("layer_norm_eps") or 1e-12,
    activation=ACTIVATIONS[act],
    qkv_bias=hf.get("qkv_bias", True),
    num_labels=_num_labels(hf, names),
  )
  cfg.init_std = hf.get("initializer_range") or cfg.init_std
  return cfg


def _num_labels(hf: dict, names) -> int:
  if not any(n == "classifier.weight" for n in names):
    return 0
  return hf.get("num_labels") or len(hf.get("id2label") or {}) or 2


def config_to_hf(cfg, model_type: str | None = None) -> dict:
  """config.json; one architecture, so `model_type` is always "vit"."""
  act = plain_transformer_activation(cfg, ACTIVATIONS, "ViT")
  if not cfg.class_token:
    raise UserError("HF's ViT pools a class token: a ViT with pool='mean' cannot be exported.")
  att = cfg.attention
  num_labels = cfg.num_labels
  return {
    "architectures": ["ViTForImageClassification" if num_labels else "ViTModel"],
    **({"num_labels": num_labels} if num_labels else {}),
    "model_type": "vit",
    "hidden_size": cfg.dim,
    "num_hidden_layers": cfg.num_layers,
    "num_attention_heads": att.num_heads,
    "intermediate_size": cfg.mlp.hidden_dim,
    "hidden_act": act,
    "image_size": cfg.image_size,
    "patch_size": cfg.patch,
    "num_channels": cfg.channels,
    "qkv_bias": att.qkv_bias,
    "layer_norm_eps": cfg.norm.eps,
    "initializer_range": cfg.init_std,
    "torch_dtype": cfg.param_dtype,
  }


def rules(cfg) -> list:
  # A classifier's encoder weights are named as ViTForImageClassification's: under "vit.".
  p = PREFIX if cfg.num_labels else ""
  e = f"{p}embeddings"
  r = [
    squeeze(f"{e}.cls_token", "class_token", lead=2),
    squeeze(f"{e}.position_embeddings", "position.embedding", lead=1),
    patch_conv(
      f"{e}.patch_embeddings.projection.weight", "patch_embed.proj.kernel", patch=cfg.patch
    ),
    copy(f"{e}.patch_embeddings.projection.bias", "patch_embed.proj.bias"),
    copy(f"{p}layernorm.weight", "norm.scale"),
    copy(f"{p}layernorm.bias", "norm.bias"),
  ]
  if cfg.num_labels:
    r += linear("classifier", "head", bias=True)
  for i in range(cfg.num_layers):
    hf, zoo = f"{p}encoder.layer.{i}", f"blocks.{i}"
    for theirs, ours in (("query", "q"), ("key", "k"), ("value", "v")):
      r += linear(
        f"{hf}.attention.attention.{theirs}", f"{zoo}.attn.{ours}", bias=cfg.attention.qkv_bias
      )
    r += linear(f"{hf}.attention.output.dense", f"{zoo}.attn.o", bias=True)
    r += linear(f"{hf}.intermediate.dense", f"{zoo}.mlp.up", bias=True)
    r += linear(f"{hf}.output.dense", f"{zoo}.mlp.down", bias=True)
    for theirs, ours in (("layernorm_before", "attn_norm"), ("layernorm_after", "mlp_norm")):
      r += [
        copy(f"{hf}.{theirs}.weight", f"{zoo}.{ours}.scale"),
        copy(f"{hf}.{theirs}.bias", f"{zoo}.{ours}.bias"),
      ]
  return r
