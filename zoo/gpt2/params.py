"""Hugging Face <-> zoo for GPT-2.

GPT-2's projections are Conv1D, whose weight is already [in, out] like our kernel: copied as
they are. c_attn fuses q, k and v along its output dim: split in three (concatenated on export).
"""

import ml_collections

from nnx_zoo.common.errors import UserError
from nnx_zoo.common.keymap import copy, plain_transformer_activation, split, transpose
from nnx_zoo.zoo.gpt2 import model as gpt2

MODEL_TYPES = ("gpt2",)
PREFIX = "transformer."
# Causal-mask buffers older checkpoints saved; lm_head.weight when tied (a copy of wte).
IGNORED = (r"(^|\.)h\.\d+\.attn\.(masked_)?bias$", r"^lm_head\.weight$")
# HF activation_function -> our MLP kind.
ACTIVATIONS = {
  "gelu_new": "gelu",
  "gelu_pytorch_tanh": "gelu",
  "gelu": "gelu_exact",
  "relu": "relu",
}


def config_from_hf(hf: dict, names=()) -> ml_collections.ConfigDict:
  """The zoo model config of a GPT-2 config.json."""
  missing = [k for k in ("vocab_size", "n_embd", "n_layer", "n_head") if k not in hf]
  if missing:
    raise UserError(f"config.json (gpt2) lacks {missing}.")
  act = hf.get("activation_function") or "gelu_new"
  problems = []
  if act not in ACTIVATIONS:
    problems.append(f"activation_function={act!r}")
  for key, fine in (
    ("scale_attn_weights", True),
    ("scale_attn_by_inverse_layer_idx", False),
    ("add_cross_attention", False),
  ):
    if hf.get(key, fine) != fine:
      problems.append(f"{key}={hf[key]}")
  if problems:
    raise UserError(f"GPT-2 with {', '.join(problems)} is not supported.")
  cfg = gpt2.config(
    "tiny",  # every field of the preset is given below
    vocab_size=hf["vocab_size"],
    dim=hf["n_embd"],
    num_layers=hf["n_layer"],
    num_heads=hf["n_head"],
    max_len=hf.get("n_positions") or 1024,
    hidden_dim=hf.get("n_inner") or 4 * hf["n_embd"],
    norm_eps=hf.get("layer_norm_epsilon") or 1e-5,
    activation=ACTIVATIONS[act],
    tie_embeddings=hf.get("tie_word_embeddings", True),
  )
  cfg.init_std = hf.get("initializer_range") or cfg.init_std
  return cfg


def config_to_hf(cfg, model_type: str | None = None) -> dict:
  """config.json; one architecture, so `model_type` is always "gpt2"."""
  act = plain_transformer_activation(cfg, ACTIVATIONS, "GPT-2")
  att = cfg.attention
  return {
    "architectures": ["GPT2LMHeadModel"],
    "model_type": "gpt2",
    "vocab_size": cfg.vocab_size,
    "n_embd": cfg.dim,
    "n_layer": cfg.num_layers,
    "n_head": att.num_heads,
    "n_positions": cfg.position.max_len,
    "n_inner": cfg.mlp.hidden_dim,
    "layer_norm_epsilon": cfg.norm.eps,
    "activation_function": act,
    "tie_word_embeddings": cfg.tie_embeddings,
    "initializer_range": cfg.init_std,
    "torch_dtype": cfg.param_dtype,
  }


def rules(cfg) -> list:
  r = [
    copy("transformer.wte.weight", "embed.embedding"),
    copy("transformer.wpe.weight", "position.embedding"),
    copy("transformer.ln_f.weight", "norm.scale"),
    copy("transformer.ln_f.bias", "norm.bias"),
  ]
  if not cfg.tie_embeddings:
    r.append(transpose("lm_head.weight", "lm_head.kernel"))
  for i in range(cfg.num_layers):
    hf, zoo = f"transformer.h.{i}", f"blocks.{i}"
    qkv = tuple(f"{zoo}.attn.{x}" for x in "qkv")
    r += [
      copy(f"{hf}.ln_1.weight", f"{zoo}.attn_norm.scale"),
      copy(f"{hf}.ln_1.bias", f"{zoo}.attn_norm.bias"),
      split(f"{hf}.attn.c_attn.weight", tuple(f"{x}.kernel" for x in qkv)),
      split(f"{hf}.attn.c_attn.bias", tuple(f"{x}.bias" for x in qkv)),
      copy(f"{hf}.attn.c_proj.weight", f"{zoo}.attn.o.kernel"),
      copy(f"{hf}.attn.c_proj.bias", f"{zoo}.attn.o.bias"),
      copy(f"{hf}.ln_2.weight", f"{zoo}.mlp_norm.scale"),
      copy(f"{hf}.ln_2.bias", f"{zoo}.mlp_norm.bias"),
      copy(f"{hf}.mlp.c_fc.weight", f"{zoo}.mlp.up.kernel"),
      copy(f"{hf}.mlp.c_fc.bias", f"{zoo}.mlp.up.bias"),
      copy(f"{hf}.mlp.c_proj.weight", f"{zoo}.mlp.down.kernel"),
      copy(f"{hf}.mlp.c_proj.bias", f"{zoo}.mlp.down.bias"),
    ]
  return r
