"""Hugging Face <-> zoo for the Llama family: Llama, Mistral, Qwen2 and Qwen3 checkpoints, and
the mixtures of experts Mixtral and Qwen3-MoE.

A torch Linear weight is [out, in], our kernel [in, out]: transposed. q/k/v/o stay 2-D
([D, N*H]), so no reshape; our RoPE is HF's rotate_half layout, so q and k need no permutation.
An MoE layer's experts are read from per-expert tensors (what transformers writes:
`block_sparse_moe.experts.M.w1` for Mixtral, `mlp.experts.M.gate_proj` for Qwen3-MoE) or from the
fused ones (`mlp.experts.gate_up_proj` [E, 2F, D], `mlp.experts.down_proj` [E, D, F]), and
written per expert. Qwen3-MoE's dense layers (`mlp_only_layers`, `decoder_sparse_step`) become a
layer pattern with a "dense" kind.
"""

import ml_collections

from nnx_zoo.common import keymap
from nnx_zoo.common.errors import UserError
from nnx_zoo.common.keymap import copy, transpose
from nnx_zoo.zoo.llama import model as llama

MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "mixtral", "qwen3_moe")
MOE_TYPES = ("mixtral", "qwen3_moe")
PREFIX = "model."
# A buffer older checkpoints saved; lm_head.weight when tied (a copy of the embedding).
IGNORED = (r"rotary_emb\.inv_freq$", r"^lm_head\.weight$")

# The fields each config.json may omit, as the transformers config classes default them.
DEFAULTS = {
  "llama": dict(rms_norm_eps=1e-6, attention_bias=False, mlp_bias=False),
  "mistral": dict(rms_norm_eps=1e-6, sliding_window=4096),
  "qwen2": dict(rms_norm_eps=1e-6, use_sliding_window=False, max_window_layers=28),
  "qwen3": dict(rms_norm_eps=1e-6, head_dim=128, attention_bias=False, use_sliding_window=False),
  "mixtral": dict(
    rms_norm_eps=1e-5,
    sliding_window=None,
    num_local_experts=8,
    num_experts_per_tok=2,
    router_aux_loss_coef=0.001,
  ),
  "qwen3_moe": dict(
    rms_norm_eps=1e-6,
    attention_bias=False,
    use_sliding_window=False,
    num_experts=128,
    num_experts_per_tok=8,
    norm_topk_prob=False,
    decoder_sparse_step=1,
    mlp_only_layers=[],
    router_aux_loss_coef=0.001,
  ),
}


def _window(hf: dict, model_type: str) -> int:
  """The sliding window of every layer (0: none); a window on some layers only is refused."""
  if model_type in ("mistral", "mixtral"):
    return hf.get("sliding_window") or 0
  if model_type not in ("qwen2", "qwen3", "qwen3_moe") or not hf.get("use_sliding_window"):
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
  attention_bias = model_type in ("llama", "qwen3", "qwen3_moe") and hf["attention_bias"]
  moe_kw = _moe(hf, model_type) if model_type in MOE_TYPES else {}
  cfg = llama.config(
    "tiny",  # every field of the preset is given below
    vocab_size=hf["vocab_size"],
    dim=hf["hidden_size"],
    num_layers=hf["num_hidden_layers"],
    num_heads=hf["num_attention_heads"],
    num_kv_heads=hf.get("num_key_value_heads") or hf["num_attention_heads"],
    head_dim=hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"],
    hidden_dim=hf["moe_intermediate_size" if model_type == "qwen3_moe" else "intermediate_size"],
    norm_eps=hf["rms_norm_eps"],
    rope_theta=theta,
    rope_scaling=scaling,
    window=_window(hf, model_type),
    qkv_bias=attention_bias or model_type == "qwen2",
    out_bias=attention_bias,
    mlp_bias=model_type == "llama" and hf["mlp_bias"],
    qk_norm="rms" if model_type in ("qwen3", "qwen3_moe") else "none",
    tie_embeddings=bool(hf.get("tie_word_embeddings")),
    **moe_kw,
  )
  if model_type == "qwen3_moe":
    _dense_layers(cfg, hf)
  cfg.init_std = hf.get("initializer_range") or cfg.init_std
  return cfg


def _moe(hf: dict, model_type: str) -> dict:
  # transformers 5 writes num_local_experts for both (num_experts is an alias of it).
  experts = hf.get("num_local_experts") or hf["num_experts"]
  return dict(
    num_experts=experts,
    top_k=hf["num_experts_per_tok"],
    # Mixtral always renormalises the top-k weights; Qwen3-MoE as norm_topk_prob says.
    norm_topk_prob=model_type == "mixtral" or bool(hf["norm_topk_prob"]),
    router_aux_coef=float(hf.get("router_aux_loss_coef") or 0.0),
  )


def _dense_layers(cfg, hf: dict):
  """Qwen3-MoE's dense layers (mlp_only_layers, or off the decoder_sparse_step) as a "dense"
  layer kind in a pattern over all the layers."""
  L, step = hf["num_hidden_layers"], hf["decoder_sparse_step"] or 1
  dense = set(hf["mlp_only_layers"] or [])
  kinds = ["dense" if i in dense or (i + 1) % step else "moe" for i in range(L)]
  if "dense" not in kinds:
    return
  period = keymap.layer_period(kinds)
  cfg.layer_pattern = tuple(kinds[:period])
  cfg.layer_kinds = {
    "dense": {"mlp": llama.config("tiny", hidden_dim=hf["intermediate_size"]).mlp.to_dict()},
    "moe": {},
  }


def _misfits(model_type: str, cfg) -> list[str]:
  """The settings of `cfg` the transformers class of `model_type` does not have."""
  att, mlp_bias = cfg.attention, cfg.mlp.use_bias
  out = []
  moe_type = model_type in MOE_TYPES
  if (cfg.mlp.kind == "moe") != moe_type:
    out.append("a mixture of experts" if cfg.mlp.kind == "moe" else "a dense MLP")
  elif moe_type and (cfg.mlp.shared_hidden_dim or cfg.mlp.capacity_factor or cfg.mlp.z_coef):
    out.append("shared experts, a capacity factor or a router z-loss")
  elif model_type == "mixtral" and not cfg.mlp.norm_topk_prob:
    out.append("top-k weights not renormalised")
  qk_norm_types = ("qwen3", "qwen3_moe")
  if (att.qk_norm != "none") != (model_type in qk_norm_types) or att.qk_norm not in ("none", "rms"):
    out.append(f"qk_norm={att.qk_norm!r}")
  if model_type == "qwen2" and not (att.qkv_bias and not att.out_bias):
    out.append(f"qkv_bias={att.qkv_bias}, out_bias={att.out_bias} (it has q/k/v bias only)")
  if model_type == "mistral" and (att.qkv_bias or att.out_bias):
    out.append("attention biases")
  if model_type in ("llama", "qwen3", "qwen3_moe") and att.qkv_bias != att.out_bias:
    out.append(f"qkv_bias={att.qkv_bias} with out_bias={att.out_bias}")
  if model_type == "mixtral" and (att.qkv_bias or att.out_bias):
    out.append("attention biases")
  if mlp_bias and model_type != "llama":
    out.append("an MLP bias")
  if att.window and model_type == "llama":
    out.append("a sliding window")
  if att.softcap or att.mask != "causal" or cfg.position.kind != "rope":
    out.append("softcap, a bidirectional mask or a position encoding other than RoPE")
  if (
    (cfg.mlp.activation, cfg.norm.kind) != ("swiglu", "rms")
    or cfg.norm.offset
    or att.scale
    or (cfg.norm_placement, cfg.embed_scale, cfg.final_softcap) != ("pre", False, 0.0)
    or (cfg.layer_pattern and _dense_layers_of(cfg) is None)
    or (_dense_layers_of(cfg) and model_type != "qwen3_moe")
  ):
    out.append("a stack other than Llama's (MLP, norms, scale, soft-cap or layer pattern)")
  return out


def _dense_layers_of(cfg) -> list[int] | None:
  """The dense layers of an MoE model's layer pattern ("dense" and "moe" kinds, the dense one
  a SwiGLU MLP); [] without a pattern; None for any other pattern."""
  if not cfg.layer_pattern:
    return []
  kinds = cfg.layer_kinds.to_dict()
  if set(cfg.layer_pattern) != {"dense", "moe"} or kinds.get("moe") or cfg.mlp.kind != "moe":
    return None
  dense = kinds.get("dense", {})
  if set(dense) != {"mlp"} or dense["mlp"]["kind"] != "dense":
    return None
  P = len(cfg.layer_pattern)
  return [i for i in range(cfg.num_layers) if cfg.layer_pattern[i % P] == "dense"]


def config_to_hf(cfg, model_type: str | None = None) -> dict:
  """config.json for `model_type` (the source's, on a round trip) if its transformers class has
  exactly these settings, else the first that has: Qwen3 (QK-norm), Qwen2 (bias on q, k, v
  only), Llama, Mistral (a sliding window), and for experts Qwen3-MoE (QK-norm) or Mixtral."""
  order = ("qwen3", "qwen2", "llama", "mistral", "qwen3_moe", "mixtral")
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
      {
        "llama": "Llama",
        "mistral": "Mistral",
        "qwen2": "Qwen2",
        "qwen3": "Qwen3",
        "mixtral": "Mixtral",
        "qwen3_moe": "Qwen3Moe",
      }[model_type]
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
  if model_type in ("llama", "qwen3", "qwen3_moe"):
    hf["attention_bias"] = att.qkv_bias
  if model_type == "llama":
    hf["mlp_bias"] = mlp_bias
  if model_type in ("mistral", "mixtral"):
    hf["sliding_window"] = att.window or None
  if model_type in ("qwen2", "qwen3", "qwen3_moe"):
    hf.update(use_sliding_window=bool(att.window), sliding_window=att.window or None)
    hf["max_window_layers"] = 0  # the window, if any, on every layer
  if model_type in MOE_TYPES:
    m = cfg.mlp
    hf.update(num_experts_per_tok=m.top_k, router_aux_loss_coef=m.aux_coef)
    hf["num_local_experts"] = m.num_experts
  if model_type == "qwen3_moe":
    dense = _dense_layers_of(cfg)
    hf.update(
      moe_intermediate_size=cfg.mlp.hidden_dim,
      norm_topk_prob=cfg.mlp.norm_topk_prob,
      decoder_sparse_step=1,
      mlp_only_layers=dense,
      intermediate_size=cfg.layer_kinds.dense.mlp.hidden_dim if dense else cfg.mlp.hidden_dim,
    )
  return hf


def rules(cfg, names=()) -> list:
  """The key map; `names` (a checkpoint's tensor names) picks the fused expert layout when the
  checkpoint has it."""
  att = cfg.attention
  fused = any(n.endswith("experts.gate_up_proj") for n in names)
  dense_layers = _dense_layers_of(cfg) or []
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
    r += keymap.attention(f"{hf}.self_attn", f"{zoo}.attn", att)
    if cfg.mlp.kind == "moe" and i not in dense_layers:
      r += _expert_rules(cfg, hf, f"{zoo}.mlp", fused=fused)
      continue
    r += keymap.gated_mlp(f"{hf}.mlp", f"{zoo}.mlp", bias=cfg.mlp.use_bias)
  return r


def _expert_rules(cfg, hf: str, zoo: str, *, fused: bool) -> list:
  """An MoE layer: the router and the experts, per expert (as transformers writes them: Mixtral's
  block_sparse_moe.experts.M.w1/w3/w2, Qwen3-MoE's mlp.experts.M.gate/up/down_proj) or fused."""
  E = cfg.mlp.num_experts
  mixtral = cfg.attention.qk_norm == "none"  # Qwen3-MoE has QK-norm, Mixtral not
  moe = f"{hf}.block_sparse_moe" if mixtral and not fused else f"{hf}.mlp"
  r = [transpose(f"{moe}.gate.weight", f"{zoo}.router")]
  if fused:
    return r + [
      keymap.experts_gate_up(f"{moe}.experts.gate_up_proj", (f"{zoo}.gate", f"{zoo}.up")),
      keymap.experts_transposed(f"{moe}.experts.down_proj", f"{zoo}.down"),
    ]
  names = (
    (("w1", "gate"), ("w3", "up"), ("w2", "down"))
    if mixtral
    else (
      ("gate_proj", "gate"),
      ("up_proj", "up"),
      ("down_proj", "down"),
    )
  )
  for theirs, ours in names:
    per_expert = tuple(f"{moe}.experts.{e}.{theirs}.weight" for e in range(E))
    r.append(keymap.stack_transposed(per_expert, f"{zoo}.{ours}"))
  return r
