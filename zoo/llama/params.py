"""Hugging Face <-> zoo for the Llama family: Llama, Mistral, Qwen2 and Qwen3 checkpoints.

A torch Linear weight is [out, in], our kernel [in, out]: transposed. q/k/v/o stay 2-D
([D, N*H]), so no reshape; our RoPE is HF's rotate_half layout, so q and k need no permutation.
"""

import ml_collections

from common.errors import UserError
from common.hub import keymap
from common.hub.keymap import copy, linear, transpose
from zoo.llama import model as llama

MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
PREFIX = "model."
# A buffer older checkpoints saved; lm_head.weight when tied (a copy of the embedding).
IGNORED = (r"rotary_emb\.inv_freq$", r"^lm_head\.weight$")

# The fields each config.json may omit, as the transformers config classes default them.
DEFAULTS = {
  "llama": dict(rms_norm_eps=1e-6, attention_bias=False, mlp_bias=False),
  "mistral": dict(rms_norm_eps=1e-6, sliding_window=4096),
  "qwen2": dict(rms_norm_eps=1e-6, use_sliding_window=False, max_window_layers=28),
  "qwen3": dict(rms_norm_eps=1e-6, head_dim=128, attention_bias=False, use_sliding_window=False),
}


def _window(hf: dict, model_type: str) -> int:
  """The sliding window of every layer (0: none); a window on some layers only is refused."""
  if model_type == "mistral":
    return hf.get("sliding_window") or 0
  if model_type not in ("qwen2", "qwen3") or not hf.get("use_sliding_window"):
    return 0
  L = hf["num_hidden_layers"]
  types = hf.get("layer_types") or [
    "sliding_attention" if i >= hf.get("max_window_layers", 28) else "full_attention"
    for i in range(L)
  ]
  if set(types) == {"full_attention"}:
    return 0
  if set(types) == {"sliding_attention"}:
    return hf["sliding_window"]
  raise UserError(
    "A sliding window on some layers only (max_window_layers / layer_types) is not supported."
  )


def config_from_hf(hf: dict, names=()) -> ml_collections.ConfigDict:
  """The zoo model config of a Llama/Mistral/Qwen2/Qwen3 config.json."""
  model_type = hf["model_type"]
  hf = {**DEFAULTS[model_type], **hf}  # an explicit null stays null (Mistral: no window)
  required = [
    "vocab_size",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "intermediate_size",
  ]
  missing = [k for k in required if k not in hf]
  if missing:
    raise UserError(f"config.json ({model_type}) lacks {missing}.")
  if hf.get("hidden_act") not in (None, "silu"):
    raise UserError(f"hidden_act {hf['hidden_act']!r} is not supported: the Llama MLP is SwiGLU.")
  theta, scaling = keymap.rope_from_hf(hf)
  # Bias: Llama and Qwen3 put attention_bias on q, k, v and o; Qwen2 always on q, k, v only.
  attention_bias = model_type in ("llama", "qwen3") and hf["attention_bias"]
  cfg = llama.config(
    "tiny",  # every field of the preset is given below
    vocab_size=hf["vocab_size"],
    dim=hf["hidden_size"],
    num_layers=hf["num_hidden_layers"],
    num_heads=hf["num_attention_heads"],
    num_kv_heads=hf.get("num_key_value_heads") or hf["num_attention_heads"],
    head_dim=hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"],
    hidden_dim=hf["intermediate_size"],
    norm_eps=hf["rms_norm_eps"],
    rope_theta=theta,
    rope_scaling=scaling,
    window=_window(hf, model_type),
    qkv_bias=attention_bias or model_type == "qwen2",
    out_bias=attention_bias,
    mlp_bias=model_type == "llama" and hf["mlp_bias"],
    qk_norm="rms" if model_type == "qwen3" else "none",
    tie_embeddings=bool(hf.get("tie_word_embeddings")),
  )
  cfg.init_std = hf.get("initializer_range") or cfg.init_std
  return cfg


def _misfits(model_type: str, cfg) -> list[str]:
  """The settings of `cfg` the transformers class of `model_type` does not have."""
  att, mlp_bias = cfg.attention, cfg.mlp.use_bias
  out = []
  if (att.qk_norm != "none") != (model_type == "qwen3") or att.qk_norm not in ("none", "rms"):
    out.append(f"qk_norm={att.qk_norm!r}")
  if model_type == "qwen2" and not (att.qkv_bias and not att.out_bias):
    out.append(f"qkv_bias={att.qkv_bias}, out_bias={att.out_bias} (it has q/k/v bias only)")
  if model_type == "mistral" and (att.qkv_bias or att.out_bias):
    out.append("attention biases")
  if model_type in ("llama", "qwen3") and att.qkv_bias != att.out_bias:
    out.append(f"qkv_bias={att.qkv_bias} with out_bias={att.out_bias}")
  if mlp_bias and model_type != "llama":
    out.append("an MLP bias")
  if att.window and model_type == "llama":
    out.append("a sliding window")
  if att.softcap or att.mask != "causal" or cfg.position.kind != "rope":
    out.append("softcap, a bidirectional mask or a position encoding other than RoPE")
  if (
    (cfg.mlp.kind, cfg.mlp.activation, cfg.norm.kind) != ("dense", "swiglu", "rms")
    or cfg.norm.offset
    or att.scale
    or (cfg.norm_placement, cfg.embed_scale, cfg.final_softcap) != ("pre", False, 0.0)
    or cfg.layer_pattern
  ):
    out.append("a stack other than Llama's (MLP, norms, scale, soft-cap or layer pattern)")
  return out


def config_to_hf(cfg, model_type: str | None = None) -> dict:
  """config.json for `model_type` (the source's, on a round trip) if its transformers class has
  exactly these settings, else the first that has: Qwen3 (QK-norm), Qwen2 (bias on q, k, v
  only), Llama, Mistral (a sliding window)."""
  order = ("qwen3", "qwen2", "llama", "mistral")
  candidates = ((model_type,) if model_type in MODEL_TYPES else ()) + order
  model_type = next((t for t in candidates if not _misfits(t, cfg)), None)
  if model_type is None:
    raise UserError(f"No HF Llama-family model has {'; '.join(_misfits('llama', cfg))}.")
  att, mlp_bias = cfg.attention, cfg.mlp.use_bias
  rope = keymap.rope_to_hf(cfg.position)
  kind = cfg.position.scaling.kind
  scaling = cfg.position.scaling.to_dict()
  hf = {
    "architectures": [
      {"llama": "Llama", "mistral": "Mistral", "qwen2": "Qwen2", "qwen3": "Qwen3"}[model_type]
      + "ForCausalLM"
    ],
    "model_type": model_type,
    "vocab_size": cfg.vocab_size,
    "hidden_size": cfg.dim,
    "num_hidden_layers": cfg.num_layers,
    "num_attention_heads": att.num_heads,
    "num_key_value_heads": att.num_kv_heads,
    "head_dim": att.head_dim,
    "intermediate_size": cfg.mlp.hidden_dim,
    "hidden_act": "silu",
    "rms_norm_eps": cfg.norm.eps,
    "tie_word_embeddings": cfg.tie_embeddings,
    "initializer_range": cfg.init_std,
    "torch_dtype": cfg.param_dtype,
    # Both spellings: transformers 5 reads rope_parameters, 4.x rope_theta and rope_scaling.
    "rope_theta": cfg.position.theta,
    "rope_parameters": rope,
    "rope_scaling": (
      None if kind == "none" else {k: v for k, v in rope.items() if k != "rope_theta"}
    ),
  }
  if kind == "yarn":  # HF checks the factor against max_position_embeddings / original
    hf["max_position_embeddings"] = int(scaling["original_max_len"] * scaling["factor"])
  if model_type in ("llama", "qwen3"):
    hf["attention_bias"] = att.qkv_bias
  if model_type == "llama":
    hf["mlp_bias"] = mlp_bias
  if model_type == "mistral":
    hf["sliding_window"] = att.window or None
  if model_type in ("qwen2", "qwen3"):
    hf.update(use_sliding_window=bool(att.window), sliding_window=att.window or None)
    hf["max_window_layers"] = 0  # the window, if any, on every layer
  return hf


def rules(cfg) -> list:
  att = cfg.attention
  r = [
    copy("model.embed_tokens.weight", "embed.embedding"),
    copy("model.norm.weight", "norm.scale"),
  ]
  if not cfg.tie_embeddings:
    r.append(transpose("lm_head.weight", "lm_head.kernel"))
  for i in range(cfg.num_layers):
    hf, zoo = f"model.layers.{i}", f"blocks.{i}"
    r += [
      copy(f"{hf}.input_layernorm.weight", f"{zoo}.attn_norm.scale"),
      copy(f"{hf}.post_attention_layernorm.weight", f"{zoo}.mlp_norm.scale"),
    ]
    for theirs, ours in (("q", "q"), ("k", "k"), ("v", "v")):
      r += linear(f"{hf}.self_attn.{theirs}_proj", f"{zoo}.attn.{ours}", bias=att.qkv_bias)
    r += linear(f"{hf}.self_attn.o_proj", f"{zoo}.attn.o", bias=att.out_bias)
    if att.qk_norm != "none":
      r += [
        copy(f"{hf}.self_attn.q_norm.weight", f"{zoo}.attn.q_norm.scale"),
        copy(f"{hf}.self_attn.k_norm.weight", f"{zoo}.attn.k_norm.scale"),
      ]
    for theirs, ours in (("gate_proj", "gate"), ("up_proj", "up"), ("down_proj", "down")):
      r += linear(f"{hf}.mlp.{theirs}", f"{zoo}.mlp.{ours}", bias=cfg.mlp.use_bias)
  return r
