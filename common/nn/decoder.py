"""The decoder stack: tokens in, next-token logits out (Llama, GPT-2, Gemma, ...)."""

import math

import jax.numpy as jnp
from flax import nnx

from nnx_zoo.common.nn import attention, attention_ref, norms, position
from nnx_zoo.common.nn.linear import Embedding, Linear, dtypes
from nnx_zoo.common.nn.stack import BlockStack


class Decoder(BlockStack):
  """tokens -> Embedding (x sqrt(D) if embed_scale) (+ learned positions) -> blocks -> norm ->
  output head (the tied embedding or lm_head; soft-capped if final_softcap) -> logits."""

  def __init__(self, cfg, *, rngs: nnx.Rngs):
    dt = dtypes(cfg)
    self.embed = Embedding(cfg.vocab_size, cfg.dim, init_std=cfg.init_std, rngs=rngs, **dt)
    self.embed_scale = math.sqrt(cfg.dim) if cfg.get("embed_scale", False) else 0.0
    self._make_positions(cfg, rngs, dt)
    self._make_blocks(cfg, rngs)
    self.norm = norms.make(cfg.norm, cfg.dim, **dt)
    self.lm_head = (
      None
      if cfg.tie_embeddings
      else Linear(cfg.dim, cfg.vocab_size, axes=("D", "V"), init_std=cfg.init_std, rngs=rngs, **dt)
    )
    self.final_softcap = cfg.get("final_softcap", 0.0)

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
    x_BTD = self.embed(tokens_BT)
    if self.embed_scale:
      x_BTD = x_BTD * jnp.asarray(self.embed_scale, x_BTD.dtype)
    x_BTD = self.position.embed(x_BTD, positions_BT)
    x_BTD, new_cache = self._run_blocks(
      x_BTD, positions_BT=positions_BT, segment_ids_BT=segment_ids_BT, cache=cache
    )
    return self.norm(x_BTD), new_cache

  def output_head(self):
    """The module holding the output projection and `project(module, x) -> logits`: the one
    definition of the logits, used whole (`logits`) and chunk by chunk (train.loss_chunk)."""
    cap = self.final_softcap
    if self.lm_head is None:
      head, call = self.embed, Embedding.attend
    else:
      head, call = self.lm_head, Linear.__call__

    def project(module, x_D):
      return attention_ref.soft_cap(call(module, x_D), cap)

    return head, project

  def logits(self, x_BTD):
    head, project = self.output_head()
    return project(head, x_BTD)

  def init_cache(self, batch: int, max_len: int) -> list[attention.KVCache]:
    return [self.layer(i).attn.init_cache(batch, max_len) for i in range(self.num_layers)]
