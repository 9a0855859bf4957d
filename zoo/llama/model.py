"""Llama-style decoder: Llama 2/3, Mistral, Qwen2 and Qwen3 are this model with other settings.

tokens -> Embedding -> [RMSNorm -> Attention(RoPE, GQA) -> + -> RMSNorm -> SwiGLU -> +] x L
       -> RMSNorm -> lm_head (or the embedding, tied) -> logits
"""

import ml_collections

from nnx_zoo.common import config as config_lib
from nnx_zoo.common.nn import attention, mlp, moe, norms, position, transformer

# Published dimensions (each model's config.json on the Hugging Face hub).
# fmt: off
PRESETS = {
    "llama2-7b": dict(
        vocab_size=32000, dim=4096, num_layers=32, num_heads=32, num_kv_heads=32,
        hidden_dim=11008, norm_eps=1e-5, rope_theta=1e4,
    ),
    "llama3-8b": dict(
        vocab_size=128256, dim=4096, num_layers=32, num_heads=32, num_kv_heads=8,
        hidden_dim=14336, norm_eps=1e-5, rope_theta=5e5,
    ),
    "llama3.2-1b": dict(
        vocab_size=128256, dim=2048, num_layers=16, num_heads=32, num_kv_heads=8,
        hidden_dim=8192, norm_eps=1e-5, rope_theta=5e5, tie_embeddings=True,
        rope_scaling=dict(kind="llama3", factor=32.0, low_freq_factor=1.0,
                          high_freq_factor=4.0, original_max_len=8192),
    ),
    "mistral-7b": dict(
        vocab_size=32000, dim=4096, num_layers=32, num_heads=32, num_kv_heads=8,
        hidden_dim=14336, norm_eps=1e-5, rope_theta=1e4, window=4096,
    ),
    "qwen2.5-0.5b": dict(
        vocab_size=151936, dim=896, num_layers=24, num_heads=14, num_kv_heads=2,
        hidden_dim=4864, norm_eps=1e-6, rope_theta=1e6, qkv_bias=True, tie_embeddings=True,
    ),
    "qwen3-0.6b": dict(
        vocab_size=151936, dim=1024, num_layers=28, num_heads=16, num_kv_heads=8, head_dim=128,
        hidden_dim=3072, norm_eps=1e-6, rope_theta=1e6, qk_norm="rms", tie_embeddings=True,
    ),
    # Mixture of experts: hidden_dim is each expert's.
    "mixtral-8x7b": dict(
        vocab_size=32000, dim=4096, num_layers=32, num_heads=32, num_kv_heads=8,
        hidden_dim=14336, norm_eps=1e-5, rope_theta=1e6, num_experts=8, top_k=2,
        router_aux_coef=0.02,
    ),
    "qwen3-30b-a3b": dict(
        vocab_size=151936, dim=2048, num_layers=48, num_heads=32, num_kv_heads=4, head_dim=128,
        hidden_dim=768, norm_eps=1e-6, rope_theta=1e6, qk_norm="rms", num_experts=128,
        top_k=8, router_aux_coef=0.001,
    ),
    # Tiny shapes for smoke runs and tests.
    "tiny": dict(
        vocab_size=256, dim=64, num_layers=2, num_heads=4, num_kv_heads=2,
        hidden_dim=128, norm_eps=1e-6, rope_theta=1e4,
    ),
}
# fmt: on


@config_lib.family_config(PRESETS, family="llama")
def config(p: dict) -> ml_collections.ConfigDict:
  """The model config of a preset, with flat overrides (the keys of PRESETS' entries, and
  out_bias, mlp_bias, head_dim; with num_experts > 0 the MLP is a mixture of experts: top_k,
  norm_topk_prob (True), router_aux_coef, router_z_coef, shared_hidden_dim, shared_gate,
  capacity_factor (0: dropless), moe_impl)."""
  scaling = dict(p.get("rope_scaling", {"kind": "none"}))
  return transformer.config(
    family="llama",
    vocab_size=p["vocab_size"],
    dim=p["dim"],
    num_layers=p["num_layers"],
    attention=attention.config(
      num_heads=p["num_heads"],
      num_kv_heads=p["num_kv_heads"],
      head_dim=p.get("head_dim", p["dim"] // p["num_heads"]),
      window=p.get("window", 0),
      qkv_bias=p.get("qkv_bias", False),
      out_bias=p.get("out_bias", False),
      qk_norm=p.get("qk_norm", "none"),
    ),
    position=position.config(
      "rope", theta=p["rope_theta"], scaling=position.rope_scaling(**scaling)
    ),
    norm=norms.config("rms", eps=p["norm_eps"]),
    mlp=_mlp(p),
    stack=transformer.decoder_keys(tie_embeddings=p.get("tie_embeddings", False)),
  )


def _mlp(p: dict) -> ml_collections.ConfigDict:
  if not p.get("num_experts"):
    return mlp.config("swiglu", hidden_dim=p["hidden_dim"], use_bias=p.get("mlp_bias", False))
  return moe.config(
    num_experts=p["num_experts"],
    top_k=p["top_k"],
    hidden_dim=p["hidden_dim"],
    norm_topk_prob=p.get("norm_topk_prob", True),
    shared_hidden_dim=p.get("shared_hidden_dim", 0),
    shared_gate=p.get("shared_gate", False),
    capacity_factor=p.get("capacity_factor", 0.0),
    aux_coef=p.get("router_aux_coef", 0.0),
    z_coef=p.get("router_z_coef", 0.0),
    use_bias=p.get("mlp_bias", False),
    impl=p.get("moe_impl", "auto"),
  )


Model = transformer.Decoder
