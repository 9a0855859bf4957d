"""The attention layer: multi-head attention (MHA, GQA, MQA by `num_kv_heads`), its config, and
the KV cache.

Causal or bidirectional, optional sliding window, segment ids so packed documents never attend
to each other, optional QK-norm, QKV bias and logit soft-cap. The position encoding is passed in
by the model (see common/nn/position.py), so attention never branches on which one it is.
`cross` is the same layer as an encoder-decoder's cross-attention: queries from the decoder, keys
and values from the encoder's output (`source_kv`, projected once for a whole decoding).

The layer projects and positions the queries, keys and values and says where the keys come from
(`attention_dispatch.Keys`): its own tokens, a KV cache, the source sequence, or, under
`mesh.context` (a row's tokens split over devices, common/parallel.py), this device's tokens of
the row, masked by their indices in it (`parallel.token_index`). Which implementation then runs
(`impl`, `context_impl`: common/attention_impl.py, the table) and how it is called
(common/nn/attention_dispatch.py) are not its business; the reference functions are
common/nn/attention_ref.py, ring attention common/nn/attention_ring.py.
"""

import dataclasses

import jax
import jax.numpy as jnp
import ml_collections
from flax import nnx

from nnx_zoo.common import parallel
from nnx_zoo.common.attention_impl import CONTEXT_IMPLS, IMPLS
from nnx_zoo.common.errors import UserError
from nnx_zoo.common.nn import attention_dispatch, norms
from nnx_zoo.common.nn.attention_dispatch import Keys
from nnx_zoo.common.nn.linear import Linear
from nnx_zoo.common.nn.position import Position

MASKS = ("causal", "bidirectional")


def config(
  *,
  num_heads: int,
  num_kv_heads: int | None = None,
  head_dim: int,
  mask: str = "causal",
  window: int = 0,
  qkv_bias: bool = False,
  key_bias: bool = True,
  out_bias: bool = False,
  qk_norm: str = "none",
  softcap: float = 0.0,
  scale: float = 0.0,
  impl: str = "auto",
  context_impl: str = "gather",
) -> ml_collections.ConfigDict:
  """An attention sub-config. window=0: no sliding window; softcap=0: no soft-cap;
  qk_norm: "none", "rms" or "layer" (normalises each head's q and k, as Qwen3 and Gemma 3, with
  the model's norm settings); key_bias=False drops k's bias when qkv_bias (Whisper: a bias on
  the keys adds the same q.b to all of a query's logits, which softmax ignores); scale: the
  logits' factor, 0 meaning head_dim ** -0.5 (Gemma: query_pre_attn_scalar ** -0.5; T5: 1);
  impl: how the softmax(q k^T) v core runs ("auto": chosen for the platform compiled for) and
  context_impl: how a layer attends across `mesh.context` ("gather" or "ring"), both in
  common/attention_impl.py."""
  return ml_collections.ConfigDict(
    {
      "num_heads": num_heads,
      "num_kv_heads": num_kv_heads or num_heads,
      "head_dim": head_dim,
      "mask": mask,
      "window": window,
      "qkv_bias": qkv_bias,
      "key_bias": key_bias,
      "out_bias": out_bias,
      "qk_norm": qk_norm,
      "softcap": softcap,
      "scale": scale,
      "impl": impl,
      "context_impl": context_impl,
    }
  )


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class KVCache:
  """Keys and values of the tokens decoded so far, row by row: row b holds `index[b]` tokens, at
  positions 0 to index[b] - 1, so the rows of a batch advance independently (the engine's slots,
  common/engine.py). A call writes its T new tokens of row b at [index[b], index[b] + T)."""

  k_BSKH: jax.Array
  v_BSKH: jax.Array
  index: jax.Array  # int32 [B]

  @classmethod
  def init(cls, batch: int, max_len: int, num_kv_heads: int, head_dim: int, dtype=jnp.float32):
    shape = (batch, max_len, num_kv_heads, head_dim)
    return cls(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype), jnp.zeros((batch,), jnp.int32))

  def rewound(self, index: jax.Array) -> "KVCache":
    """The cache with the first `index` (a scalar for every row, or [B]) of each row counted as
    filled: what lies after them is never attended to, and the next tokens overwrite it (a
    prompt padded to a bucket length, its padding dropped after the prefill)."""
    index = jnp.broadcast_to(jnp.asarray(index, jnp.int32), self.index.shape)
    return dataclasses.replace(self, index=index)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class SourceKV:
  """A source sequence as one cross-attention layer sees it (an encoder's output through the
  layer's k and v): computed once, so decoding does not project the source again for every new
  token. Segment ids [B, S]: 0 is padding, never attended to."""

  k_BSKH: jax.Array
  v_BSKH: jax.Array
  segment_ids_BS: jax.Array


def logit_scale(cfg) -> float:
  """The factor of q.k: `cfg.scale`, or head_dim ** -0.5 when it is 0."""
  return cfg.scale or cfg.head_dim**-0.5


class Attention(nnx.Module):
  def __init__(
    self,
    cfg,
    dim: int,
    *,
    norm=None,
    out_init_std: float = 0.02,
    dtype=jnp.float32,
    param_dtype=jnp.float32,
    rngs: nnx.Rngs,
  ):
    if cfg.mask not in MASKS:
      raise UserError(f"Unknown attention mask {cfg.mask!r}: use one of {MASKS}.")
    if cfg.impl not in IMPLS:  # "auto" is resolved when traced: the platform may differ
      raise UserError(f"Unknown attention impl {cfg.impl!r}: use one of {IMPLS}.")
    self.context_impl = cfg.context_impl
    if self.context_impl not in CONTEXT_IMPLS:
      raise UserError(
        f"Unknown attention context_impl {self.context_impl!r}: use one of {CONTEXT_IMPLS}."
      )
    if cfg.num_heads % cfg.num_kv_heads:
      raise UserError(
        f"num_heads={cfg.num_heads} is not a multiple of num_kv_heads={cfg.num_kv_heads}: "
        "each key/value head serves a whole group of query heads."
      )
    N, K, H = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    self.num_heads, self.num_kv_heads, self.head_dim = N, K, H
    # None for off (the config's 0): no sliding window, no logit soft-cap.
    self.causal = cfg.mask == "causal"
    self.window, self.softcap = cfg.window or None, cfg.softcap or None
    self.scale = logit_scale(cfg)
    self.impl = cfg.impl
    self.dtype = dtype
    kw = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
    self.q = Linear(dim, N * H, use_bias=cfg.qkv_bias, axes=("D", "NH"), **kw)
    key_bias = cfg.qkv_bias and cfg.key_bias
    self.k = Linear(dim, K * H, use_bias=key_bias, axes=("D", "KH"), **kw)
    self.v = Linear(dim, K * H, use_bias=cfg.qkv_bias, axes=("D", "KH"), **kw)
    self.o = Linear(
      N * H, dim, use_bias=cfg.out_bias, axes=("NH", "D"), init_std=out_init_std, **kw
    )
    if cfg.qk_norm == "none":
      self.q_norm = self.k_norm = None
    else:
      # The model's norm settings (eps, Gemma's 1 + w form) with the kind qk_norm names.
      norm_cfg = norms.config(cfg.qk_norm, **norms.settings(norm))
      self.q_norm = norms.make(norm_cfg, H, dtype=dtype, param_dtype=param_dtype)
      self.k_norm = norms.make(norm_cfg, H, dtype=dtype, param_dtype=param_dtype)

  def init_cache(self, batch: int, max_len: int) -> KVCache:
    return KVCache.init(batch, max_len, self.num_kv_heads, self.head_dim, self.dtype)

  def _heads(self, proj: Linear, x_BTD: jax.Array, norm=None) -> jax.Array:
    """[B, T, heads, H] through `proj` (and the QK-norm `norm`). -1 heads: under tensor
    parallelism this device holds N / tensor query and K / tensor key/value heads."""
    B, T, _ = x_BTD.shape
    y_BTnH = proj(x_BTD).reshape(B, T, -1, self.head_dim)
    return y_BTnH if norm is None else norm(y_BTnH)

  def source_kv(self, x_BSD: jax.Array, segment_ids_BS: jax.Array | None = None) -> SourceKV:
    """The keys and values `cross` attends to: the source through this layer's k and v."""
    k_BSKH, v_BSKH = self._heads(self.k, x_BSD, self.k_norm), self._heads(self.v, x_BSD)
    if segment_ids_BS is None:
      segment_ids_BS = jnp.ones(x_BSD.shape[:2], jnp.int32)
    return SourceKV(k_BSKH, v_BSKH, segment_ids_BS)

  def cross(
    self, x_BTD: jax.Array, source: SourceKV, *, segment_ids_BT: jax.Array | None = None
  ) -> jax.Array:
    """Cross-attention (an encoder-decoder's): queries from `x_BTD`, keys and values from
    `source` (`source_kv`). A query sees every source token of its own segment, so packed pairs
    stay apart and source padding is never attended to; no causal mask, window or position
    encoding applies, as the queries and keys index two different sequences."""
    B, T, _ = x_BTD.shape
    q_BTNH = self._heads(self.q, x_BTD, self.q_norm)
    if segment_ids_BT is None:
      segment_ids_BT = jnp.ones((B, T), jnp.int32)
    idx_T, idx_S = jnp.arange(T), jnp.arange(source.k_BSKH.shape[1])
    seg_BT, seg_BS = segment_ids_BT, source.segment_ids_BS
    keys = Keys("source", source.k_BSKH, source.v_BSKH, idx_T, idx_S, seg_BT, seg_BS, segments=True)
    return self.o(self._attend(q_BTNH, keys).reshape(B, T, -1))

  def __call__(
    self,
    x_BTD: jax.Array,
    *,
    positions_BT: jax.Array,
    segment_ids_BT: jax.Array | None = None,
    position: Position,
    cache: KVCache | None = None,
  ) -> tuple[jax.Array, KVCache | None]:
    B, T, _ = x_BTD.shape
    q_BTNH = position.rotate(self._heads(self.q, x_BTD, self.q_norm), positions_BT)
    k_BTKH = position.rotate(self._heads(self.k, x_BTD, self.k_norm), positions_BT)
    v_BTKH = self._heads(self.v, x_BTD)
    keys, cache = self._keys(k_BTKH, v_BTKH, positions_BT, segment_ids_BT, position, cache)
    return self.o(self._attend(q_BTNH, keys).reshape(B, T, -1)), cache

  def _keys(
    self, k_BTKH, v_BTKH, positions_BT, segment_ids_BT, position: Position, cache: KVCache | None
  ) -> tuple[Keys, KVCache | None]:
    """Where this call's keys and values come from, with the logit bias of their positions: its
    own tokens; the cache they are written into (returned updated); or, under mesh.context, this
    device's tokens of a row whose rest the other devices hold."""
    B, T = k_BTKH.shape[:2]
    segments = segment_ids_BT is not None
    if segment_ids_BT is None:
      segment_ids_BT = jnp.ones((B, T), jnp.int32)
    kind, k_BSKH, v_BSKH = "own", k_BTKH, v_BTKH
    q_idx_T = k_idx_S = jnp.arange(T)
    k_seg_BS, k_pos_BS = segment_ids_BT, positions_BT
    if cache is not None:
      # Row b's new keys go to [index[b], index[b] + T) (past the cache's end: dropped); slots
      # not written yet get segment 0, which no query has, so they are never attended to.
      idx_BT = cache.index[:, None] + jnp.arange(T)
      rows_B1 = jnp.arange(B)[:, None]

      def write(c_BSKH, new_BTKH):
        return c_BSKH.at[rows_B1, idx_BT].set(new_BTKH.astype(c_BSKH.dtype), mode="drop")

      k_BSKH, v_BSKH = write(cache.k_BSKH, k_BTKH), write(cache.v_BSKH, v_BTKH)
      S = k_BSKH.shape[1]
      kind, q_idx_T, k_idx_S = "cache", idx_BT, jnp.arange(S)
      k_seg_BS = jnp.where(k_idx_S < (cache.index + T)[:, None], segment_ids_BT[:, :1], 0)
      k_pos_BS = jnp.broadcast_to(k_idx_S, (B, S))
      cache = KVCache(k_BSKH, v_BSKH, cache.index + T)
    elif parallel.context_split():
      # Masked by their indices in the row; a logit bias needs the positions of the whole row.
      kind, q_idx_T = "context", parallel.token_index(T)
      k_idx_S, k_pos_BS = q_idx_T, parallel.gather_context(positions_BT)
    bias_BNTS = position.logit_bias(positions_BT, k_pos_BS, self.num_heads)
    if bias_BNTS is not None:
      bias_BNTS = parallel.local_heads(bias_BNTS, axis=1)
    rules = dict(causal=self.causal, window=self.window, bias_BNTS=bias_BNTS)
    keys = Keys(kind, k_BSKH, v_BSKH, q_idx_T, k_idx_S, segment_ids_BT, k_seg_BS, segments, **rules)
    return keys, cache

  def _attend(self, q_BTNH: jax.Array, keys: Keys) -> jax.Array:
    kw = dict(impl=self.impl, context_impl=self.context_impl, softcap=self.softcap)
    return attention_dispatch.attend(q_BTNH, keys, scale=self.scale, **kw)
