"""Llama-style decoder: Llama 2/3, Mistral, Qwen2 and Qwen3 are this model with other settings.

tokens -> Embedding -> [RMSNorm -> Attention(RoPE, GQA) -> + -> RMSNorm -> SwiGLU -> +] x L
       -> RMSNorm -> lm_head (or the embedding, tied) -> logits
"""

import math

import ml_collections
from flax import nnx

from common.errors import UserError, suggest
from common.models import dtypes
from common.nn import attention, lora, memory, mlp, norms, position
from common.nn.linear import Embedding, Linear

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
  """The model config of a preset, with flat overrides (the keys of PRESETS' entries)."""
  if preset not in PRESETS:
    raise UserError(f"Unknown llama preset {preset!r}.{suggest(preset, PRESETS)}")
  p = {**PRESETS[preset], **overrides}
  head_dim = p.get("head_dim", p["dim"] // p["num_heads"])
  scaling = dict(p.get("rope_scaling", {"kind": "none"}))
  return ml_collections.ConfigDict(
    {
      "family": "llama",
      "vocab_size": p["vocab_size"],
      "dim": p["dim"],
      "num_layers": p["num_layers"],
      "attention": attention.config(
        num_heads=p["num_heads"],
        num_kv_heads=p["num_kv_heads"],
        head_dim=head_dim,
        window=p.get("window", 0),
        qkv_bias=p.get("qkv_bias", False),
        out_bias=p.get("out_bias", False),
        qk_norm=p.get("qk_norm", "none"),
      ),
      "position": position.config(
        "rope", theta=p["rope_theta"], scaling=position.rope_scaling(**scaling)
      ),
      "norm": norms.config("rms", eps=p["norm_eps"]),
      "mlp": mlp.config("swiglu", hidden_dim=p["hidden_dim"], use_bias=p.get("mlp_bias", False)),
      "tie_embeddings": p.get("tie_embeddings", False),
      "init_std": 0.02,
      "remat": "none",  # or "full", "save_dots": recompute activations in the backward pass
      "scan": False,  # True: one compiled block body run by jax.lax.scan over the layers
      "lora": lora.config(),  # rank > 0: low-rank adapters, base weights frozen
      "dtype": "float32",
      "param_dtype": "float32",
    }
  )


class Block(nnx.Module):
  """Pre-norm residual block: x + Attention(Norm(x)), then x + MLP(Norm(x))."""

  def __init__(self, cfg, *, rngs: nnx.Rngs):
    dt = dtypes(cfg)
    out_std = cfg.init_std / math.sqrt(2 * cfg.num_layers)
    self.attn_norm = norms.make(cfg.norm, cfg.dim, **dt)
    self.attn = attention.Attention(
      cfg.attention, cfg.dim, norm_eps=cfg.norm.eps, out_init_std=out_std, rngs=rngs, **dt
    )
    self.mlp_norm = norms.make(cfg.norm, cfg.dim, **dt)
    self.mlp = mlp.MLP(cfg.mlp, cfg.dim, out_init_std=out_std, rngs=rngs, **dt)

  def __call__(self, x_BTD, *, positions_BT, segment_ids_BT, position, cache):
    h_BTD, cache = self.attn(
      self.attn_norm(x_BTD),
      positions_BT=positions_BT,
      segment_ids_BT=segment_ids_BT,
      position=position,
      cache=cache,
    )
    x_BTD = x_BTD + h_BTD
    return x_BTD + self.mlp(self.mlp_norm(x_BTD)), cache


class Model(nnx.Module):
  def __init__(self, cfg, *, rngs: nnx.Rngs):
    dt = dtypes(cfg)
    self.embed = Embedding(cfg.vocab_size, cfg.dim, init_std=cfg.init_std, rngs=rngs, **dt)
    self.position = position.make(
      cfg.position,
      head_dim=cfg.attention.head_dim,
      dim=cfg.dim,
      rngs=rngs,
      param_dtype=dt["param_dtype"],
    )
    self.blocks = nnx.List([Block(cfg, rngs=rngs) for _ in range(cfg.num_layers)])
    self.norm = norms.make(cfg.norm, cfg.dim, **dt)
    self.remat = cfg.remat
    self.scan = cfg.get("scan", False)  # absent in configs saved before it existed
    self.lm_head = (
      None
      if cfg.tie_embeddings
      else Linear(cfg.dim, cfg.vocab_size, axes=("D", "V"), init_std=cfg.init_std, rngs=rngs, **dt)
    )

  def __call__(self, tokens_BT, *, positions_BT=None, segment_ids_BT=None, cache=None):
    """Logits [B, T, V]; with a KV cache (see `init_cache`), (logits, updated cache)."""
    x_BTD, new_cache = self.hidden(
      tokens_BT, positions_BT=positions_BT, segment_ids_BT=segment_ids_BT, cache=cache
    )
    logits_BTV = self.logits(x_BTD)
    return logits_BTV if cache is None else (logits_BTV, new_cache)

  def hidden(self, tokens_BT, *, positions_BT=None, segment_ids_BT=None, cache=None):
    """The final (normed) hidden states [B, T, D] and the updated cache."""
    if positions_BT is None:
      positions_BT = position.default_positions(tokens_BT, segment_ids_BT, cache)
    x_BTD = self.position.embed(self.embed(tokens_BT), positions_BT)
    x_BTD, new_cache = memory.run_blocks(
      self.blocks,
      x_BTD,
      cache=cache,
      remat=self.remat,
      scan=self.scan,
      positions_BT=positions_BT,
      segment_ids_BT=segment_ids_BT,
      position=self.position,
    )
    return self.norm(x_BTD), new_cache

  def logits(self, x_BTD):
    """The output projection: the tied embedding table, or lm_head."""
    return self.embed.attend(x_BTD) if self.lm_head is None else self.lm_head(x_BTD)

  def init_cache(self, batch: int, max_len: int) -> list[attention.KVCache]:
    return [block.attn.init_cache(batch, max_len) for block in self.blocks]
