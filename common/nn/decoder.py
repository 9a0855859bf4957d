"""The decoder stack: tokens in, next-token logits out (Llama, GPT-2, Gemma, ...)."""

from flax import nnx

from nnx_zoo.common.nn import attention, head, norms, position
from nnx_zoo.common.nn.linear import Embedding, dtypes
from nnx_zoo.common.nn.stack import BlockStack, StackKeys


def decoder_keys(*, tie_embeddings: bool = False, final_softcap: float = 0.0) -> StackKeys:
  """A `Decoder`'s keys: `tie_embeddings` (the output head is the token table) and
  `final_softcap` (cap * tanh(logits / cap) on the logits; 0: none)."""
  return StackKeys.declared(locals())


class Decoder(BlockStack):
  """tokens -> Embedding (x sqrt(D) if embed_scale) (+ learned positions) -> blocks -> norm ->
  output head (the tied embedding or lm_head; soft-capped if final_softcap) -> logits."""

  def __init__(self, cfg, *, rngs: nnx.Rngs):
    dt = dtypes(cfg)
    self.embed = Embedding(cfg.vocab_size, cfg.dim, init_std=cfg.init_std, rngs=rngs, **dt)
    self.embed_scale = head.embed_scale(cfg)
    self._make_positions(cfg, rngs, dt)
    self._make_blocks(cfg, rngs)
    self.norm = norms.make(cfg.norm, cfg.dim, **dt)
    self.lm_head = head.make_lm_head(cfg, rngs, dt)
    self.final_softcap = cfg.final_softcap or None  # the config's 0: no cap

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
    x_BTD = head.embed(self.embed, tokens_BT, self.embed_scale)
    x_BTD = self.position.embed(x_BTD, positions_BT)
    x_BTD, new_cache = self._run_blocks(
      x_BTD, positions_BT=positions_BT, segment_ids_BT=segment_ids_BT, cache=cache
    )
    return self.norm(x_BTD), new_cache

  def output_head(self):
    """The module holding the output projection and `project(module, x) -> logits`: the one
    definition of the logits, used whole (`logits`) and chunk by chunk (train.loss_chunk)."""
    return head.output_head(self.embed, self.lm_head, cap=self.final_softcap)

  def logits(self, x_BTD):
    module, project = self.output_head()
    return project(module, x_BTD)

  def init_cache(self, batch: int, max_len: int) -> list[attention.KVCache]:
    return [self.layer(i).attn.init_cache(batch, max_len) for i in range(self.num_layers)]
