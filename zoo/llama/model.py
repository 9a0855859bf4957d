"""Llama-style decoder: Llama 2/3, Mistral, Qwen2 and Qwen3 are this model with other settings.

tokens -> Embedding -> [RMSNorm -> Attention(RoPE, GQA) -> + -> RMSNorm -> SwiGLU -> +] x L
       -> RMSNorm -> lm_head (or the embedding, tied) -> logits
"""

import ml_collections

from common.errors import UserError, suggest
from common.nn import attention, mlp, norms, position, transformer

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
    # Tiny shapes for smoke runs and tests.
    "tiny": dict(
        vocab_size=256, dim=64, num_layers=2, num_heads=4, num_kv_heads=2,
        hidden_dim=128, norm_eps=1e-6, rope_theta=1e4,
    ),
}
# fmt: on


def config(preset: str = "tiny", **overrides) -> ml_collections.ConfigDict:
  """The model config of a preset, with flat overrides (the keys of PRESETS' entries, and
  out_bias, mlp_bias, head_dim)."""
  if preset not in PRESETS:
    raise UserError(f"Unknown llama preset {preset!r}.{suggest(preset, PRESETS)}")
  p = {**PRESETS[preset], **overrides}
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
    mlp=mlp.config("swiglu", hidden_dim=p["hidden_dim"], use_bias=p.get("mlp_bias", False)),
    tie_embeddings=p.get("tie_embeddings", False),
    final_softcap=0.0,
  )


Model = transformer.Decoder
