"""The two ends of a stack of tokens, shared by the decoder and the encoder-decoder: the token
embedding (times sqrt(D) with `embed_scale`) and the output head (the tied embedding or an
lm_head, an optional scale before it, the final soft-cap after it)."""

import math

import jax.numpy as jnp

from nnx_zoo.common.nn import attention_ref
from nnx_zoo.common.nn.linear import Embedding, Linear


def embed_scale(cfg) -> float | None:
  """What token embeddings are multiplied by: sqrt(D) with `embed_scale` (Gemma), else None."""
  return math.sqrt(cfg.dim) if cfg.embed_scale else None


def embed(table: Embedding, tokens_BT, scale: float | None):
  """The tokens' embeddings [B, T, D], times `scale` unless it is None."""
  x_BTD = table(tokens_BT)
  if scale is not None:
    x_BTD = x_BTD * jnp.asarray(scale, x_BTD.dtype)
  return x_BTD


def make_lm_head(cfg, rngs, dt) -> Linear | None:
  """The output projection, or None when it is the tied embedding (`tie_embeddings`)."""
  if cfg.tie_embeddings:
    return None
  return Linear(cfg.dim, cfg.vocab_size, axes=("D", "V"), init_std=cfg.init_std, rngs=rngs, **dt)


def output_head(
  table: Embedding, lm_head: Linear | None, *, cap: float | None, scale: float | None = None
):
  """The module holding the output projection (`lm_head`, or the tied `table`) and
  `project(module, x) -> logits`: x times `scale`, projected, soft-capped at `cap` (each None:
  none).
  The one definition of the logits, used whole and chunk by chunk (train.loss_chunk)."""
  if lm_head is None:
    head, call = table, Embedding.attend
  else:
    head, call = lm_head, Linear.__call__

  def project(module, x_D):
    if scale is not None:
      x_D = x_D * jnp.asarray(scale, x_D.dtype)
    return attention_ref.soft_cap(call(module, x_D), cap)

  return head, project
