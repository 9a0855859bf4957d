"""GPT-2: a pre-norm decoder with learned absolute positions, LayerNorm, a GELU MLP, biases
everywhere and the output projection tied to the token embedding.

tokens -> Embedding + learned positions -> [LayerNorm -> Attention -> + -> LayerNorm -> GELU MLP
       -> +] x L -> LayerNorm -> embedding^T (tied) -> logits
"""

import math

import ml_collections
from flax import nnx

from common.errors import UserError, suggest
from common.models import dtypes
from common.nn import attention, lora, memory, mlp, norms, position
from common.nn.linear import Embedding, Linear

# Published dimensions (openai-community/gpt2* config.json on the Hugging Face hub).
# fmt: off
PRESETS = {
    "gpt2": dict(vocab_size=50257, dim=768, num_layers=12, num_heads=12, max_len=1024),
    "gpt2-medium": dict(vocab_size=50257, dim=1024, num_layers=24, num_heads=16, max_len=1024),
    "gpt2-large": dict(vocab_size=50257, dim=1280, num_layers=36, num_heads=20, max_len=1024),
    "gpt2-xl": dict(vocab_size=50257, dim=1600, num_layers=48, num_heads=25, max_len=1024),
    # Tiny shapes for smoke runs and tests.
    "tiny": dict(vocab_size=256, dim=64, num_layers=2, num_heads=4, max_len=128),
}
# fmt: on


def config(preset: str = "tiny", **overrides) -> ml_collections.ConfigDict:
  """The model config of a preset, with flat overrides: the keys of PRESETS' entries, and
  hidden_dim (4 * dim), norm_eps (1e-5), activation ("gelu", GPT-2's gelu_new), tie_embeddings
  (True)."""
  if preset not in PRESETS:
    raise UserError(f"Unknown gpt2 preset {preset!r}.{suggest(preset, PRESETS)}")
  p = {**PRESETS[preset], **overrides}
  return ml_collections.ConfigDict(
    {
      "family": "gpt2",
      "vocab_size": p["vocab_size"],
      "dim": p["dim"],
      "num_layers": p["num_layers"],
      "attention": attention.config(
        num_heads=p["num_heads"],
        head_dim=p["dim"] // p["num_heads"],
        qkv_bias=True,
        out_bias=True,
      ),
      "position": position.config("learned", max_len=p["max_len"]),
      "norm": norms.config("layer", eps=p.get("norm_eps", 1e-5)),
      "mlp": mlp.config(
        p.get("activation", "gelu"), hidden_dim=p.get("hidden_dim", 4 * p["dim"]), use_bias=True
      ),
      "tie_embeddings": p.get("tie_embeddings", True),
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
    # GPT-2 scales the init of the projections into the residual stream by 1/sqrt(2L).
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
