"""Hugging Face <-> zoo for Gemma 2 (`gemma2`) and Gemma 3 text (`gemma3_text`) checkpoints.

A torch Linear weight is [out, in], our kernel [in, out]: transposed. HF's Gemma RMSNorm keeps
w of x * (1 + w), as ours does (norm.offset = 1): copied. HF's `layer_types` becomes the layer
pattern (its shortest period), with a "sliding" kind for "sliding_attention" layers.
"""

import ml_collections

from nnx_zoo.common import keymap
from nnx_zoo.common.errors import UserError
from nnx_zoo.common.keymap import copy
from nnx_zoo.zoo.gemma import model as gemma

MODEL_TYPES = ("gemma2", "gemma3_text")
PREFIX = "model."
# lm_head.weight when tied (a copy of the embedding).
IGNORED = (r"^lm_head\.weight$",)
KINDS = {"sliding_attention": "sliding", "full_attention": "full"}
ARCHITECTURES = {"gemma2": "Gemma2ForCausalLM", "gemma3_text": "Gemma3ForCausalLM"}


def _layer_types(hf: dict, version: int) -> list[str]:
  L = hf["num_hidden_layers"]
  if hf.get("layer_types"):
    return list(hf["layer_types"])
  period = 2 if version == 2 else hf.get("sliding_window_pattern", 6)
  return ["full_attention" if (i + 1) % period == 0 else "sliding_attention" for i in range(L)]


def config_from_hf(hf: dict, names=()) -> ml_collections.ConfigDict:
  """The zoo model config of a Gemma 2 or Gemma 3 text config.json."""
  model_type = hf["model_type"]
  version = 2 if model_type == "gemma2" else 3
  keymap.require(
    hf,
    ["vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size"],
    model_type,
  )
  problems = []
  act = hf.get("hidden_activation") or hf.get("hidden_act") or "gelu_pytorch_tanh"
  if act != "gelu_pytorch_tanh":
    problems.append(f"hidden_activation={act!r}")
  if hf.get("attention_bias"):
    problems.append("attention_bias=True")
  if hf.get("use_bidirectional_attention"):
    problems.append("use_bidirectional_attention=True")
  types = _layer_types(hf, version)
  if set(types) - set(KINDS):
    problems.append(f"layer_types {sorted(set(types) - set(KINDS))}")
  if problems:
    raise UserError(f"Gemma with {', '.join(problems)} is not supported.")
  rope = hf.get("rope_parameters") or {}
  if version == 3 and "full_attention" in rope:  # transformers 5: one RoPE per layer type
    theta, scaling = keymap.rope_from_hf(hf, rope["full_attention"])
    local_theta, local_scaling = keymap.rope_from_hf(hf, rope["sliding_attention"])
  else:
    theta, scaling = keymap.rope_from_hf(hf)
    local_theta = hf.get("rope_local_base_freq", 10_000.0) if version == 3 else None
    local_scaling = {"kind": "none"}
  if local_scaling["kind"] != "none":
    raise UserError(f"Gemma 3 sliding layers with RoPE scaling {local_scaling} are not supported.")
  head_dim = hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"]
  period = keymap.layer_period(types)
  cfg = gemma.config(
    "tiny",  # every field of the preset is given below
    version=version,
    vocab_size=hf["vocab_size"],
    dim=hf["hidden_size"],
    num_layers=hf["num_hidden_layers"],
    num_heads=hf["num_attention_heads"],
    num_kv_heads=hf.get("num_key_value_heads") or hf["num_attention_heads"],
    head_dim=head_dim,
    hidden_dim=hf["intermediate_size"],
    query_pre_attn_scalar=hf.get("query_pre_attn_scalar") or head_dim,
    window=hf.get("sliding_window") or 4096,
    # transformers' Gemma 3 attention does not apply attn_logit_softcapping (5.24 passes no
    # softcap to its attention functions): the field is read for Gemma 2 only.
    attn_softcap=(hf.get("attn_logit_softcapping") or 0.0) if version == 2 else 0.0,
    final_softcap=hf.get("final_logit_softcapping") or 0.0,
    rope_theta=theta,
    rope_scaling=scaling,
    local_rope_theta=local_theta,
    norm_eps=hf.get("rms_norm_eps") or 1e-6,
    layer_pattern=tuple(KINDS[t] for t in types[:period]),
  )
  if not hf.get("tie_word_embeddings", True):
    raise UserError("Gemma with untied embeddings (tie_word_embeddings=False) is not supported.")
  cfg.init_std = hf.get("initializer_range") or cfg.init_std
  return cfg


def config_to_hf(cfg, model_type: str | None = None) -> dict:
  """config.json of Gemma 2 (attention soft-cap, no QK-norm, one RoPE) or Gemma 3 text."""
  att = cfg.attention
  version = 3 if att.qk_norm == "rms" else 2
  model_type = "gemma2" if version == 2 else "gemma3_text"
  kinds = cfg.layer_kinds.to_dict()
  windows = {kinds[k].get("attention", {}).get("window", att.window) for k in kinds}
  if (
    (cfg.norm_placement, cfg.embed_scale, cfg.tie_embeddings) != ("both", True, True)
    or (cfg.mlp.kind, cfg.mlp.activation, cfg.mlp.use_bias) != ("dense", "geglu", False)
    or (cfg.norm.kind, cfg.norm.offset) != ("rms", 1.0)
    or att.qk_norm not in ("none", "rms")
    or att.qkv_bias
    or att.out_bias
    or att.window
    or set(cfg.layer_pattern) - {"sliding", "full"}
    or kinds.get("full")
    or len(windows - {0}) != 1
    or cfg.position.kind != "rope"
    or (version == 3 and att.softcap)  # HF's Gemma 3 ignores attn_logit_softcapping
  ):
    raise UserError("This model has settings HF's Gemma 2/3 do not have: export it as its family.")
  sliding = kinds["sliding"]
  types = [
    "sliding_attention"
    if cfg.layer_pattern[i % len(cfg.layer_pattern)] == "sliding"
    else "full_attention"
    for i in range(cfg.num_layers)
  ]
  hf = {
    "architectures": [ARCHITECTURES[model_type]],
    "model_type": model_type,
    "vocab_size": cfg.vocab_size,
    "hidden_size": cfg.dim,
    "num_hidden_layers": cfg.num_layers,
    "num_attention_heads": att.num_heads,
    "num_key_value_heads": att.num_kv_heads,
    "head_dim": att.head_dim,
    "intermediate_size": cfg.mlp.hidden_dim,
    "hidden_activation": "gelu_pytorch_tanh",
    "rms_norm_eps": cfg.norm.eps,
    "query_pre_attn_scalar": round(att.scale**-2),  # an int in HF's config class
    "sliding_window": sliding["attention"]["window"],
    "layer_types": types,
    "attn_logit_softcapping": att.softcap or None,
    "final_logit_softcapping": cfg.final_softcap or None,
    "tie_word_embeddings": True,
    "initializer_range": cfg.init_std,
    "torch_dtype": cfg.param_dtype,
  }
  full = keymap.rope_to_hf(cfg.position)
  if version == 2:
    hf["rope_parameters"] = full
    hf["rope_theta"] = cfg.position.theta
  else:
    local = ml_collections.ConfigDict(sliding.get("position") or cfg.position.to_dict())
    hf["rope_parameters"] = {"full_attention": full, "sliding_attention": keymap.rope_to_hf(local)}
    hf["rope_theta"], hf["rope_local_base_freq"] = cfg.position.theta, local.theta
  return hf


def rules(cfg) -> list:
  r = [
    copy("model.embed_tokens.weight", "embed.embedding"),
    copy("model.norm.weight", "norm.scale"),
  ]
  for i in range(cfg.num_layers):
    hf, zoo = f"model.layers.{i}", f"blocks.{i}"
    for theirs, ours in (
      ("input_layernorm", "attn_norm"),
      ("post_attention_layernorm", "attn_out_norm"),
      ("pre_feedforward_layernorm", "mlp_norm"),
      ("post_feedforward_layernorm", "mlp_out_norm"),
    ):
      r.append(copy(f"{hf}.{theirs}.weight", f"{zoo}.{ours}.scale"))
    r += keymap.attention(f"{hf}.self_attn", f"{zoo}.attn", cfg.attention)
    r += keymap.gated_mlp(f"{hf}.mlp", f"{zoo}.mlp", bias=False)
  return r
