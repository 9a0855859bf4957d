"""The two ends of a stack of tokens, shared by the decoder and the encoder-decoder: the token
embedding (times sqrt(D) with `embed_scale`) and the output head (the tied embedding or an
lm_head, an optional scale before it, the final soft-cap after it)."""

import math

import jax.numpy as jnp

from nnx_zoo.common.nn import attention_ref
from nnx_zoo.common.nn.linear import Embedding, Linear


def embed_scale(cfg) -> float:
  """What token embeddings are multiplied by: sqrt(D) with `embed_scale` (Gemma), else 0 (none)."""
  return math.sqrt(cfg.dim) if cfg.get("embed_scale", False) else 0.0


def embed(table: Embedding, tokens_BT, scale: float):
  """The tokens' embeddings [B, T, D], times `scale` if it is not 0."""
  x_BTD = table(tokens_BT)
  if scale:
    x_BTD = x_BTD * jnp.asarray(scale, x_BTD.dtype)
  return x_BTD


def make_lm_head(cfg, rngs, dt) -> Linear | None:
  """The output projection, or None when it is the tied embedding (`tie_embeddings`)."""
  if cfg.tie_embeddings:
    return None
  return Linear(cfg.dim, cfg.vocab_size, axes=("D", "V"), init_std=cfg.init_std, rngs=rngs, **dt)


def output_head(table: Embedding, lm_head: Linear | None, *, cap: float, scale: float = 0.0):
  """The module holding the output projection (`lm_head`, or the tied `table`) and
  `project(module, x) -> logits`: x times `scale` (if not 0), projected, soft-capped at `cap`.
  The one definition of the logits, used whole and chunk by chunk (train.loss_chunk)."""
  if lm_head is None:
    head, call = table, Embedding.attend
  else:
    head, call = lm_head, Linear.__call__

  def project(module, x_D):
    if scale:
      x_D = x_D * jnp.asarray(scale, x_D.dtype)
    return attention_ref.soft_cap(call(module, x_D), cap)

  return head, project
