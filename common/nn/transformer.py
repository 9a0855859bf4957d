"""The transformer stacks every family is: a Block (attention and MLP as residual sub-layers,
their norms placed by config) and the Decoder and Encoder around a stack of blocks.

A family's `model.py` gives presets and a `config()`; the model is `Decoder` or `Encoder`, and
every choice that tells families apart is a config value:

- `norm_placement`: "pre" x + f(norm(x)) (Llama, GPT-2, ViT); "post" norm(x + f(x)) (BERT);
  "both" x + norm_out(f(norm_in(x))) (Gemma 2 and 3);
- `embed_scale`: token embeddings times sqrt(D) (Gemma); `final_softcap`: cap * tanh(logits /
  cap) on the output logits (Gemma 2), on every path that makes logits (`output_head`);
- `layer_pattern` and `layer_kinds`: a repeating pattern of layer kinds, each kind changing the
  attention (a sliding window) and/or the position encoding (its own RoPE theta) of its layers,
  e.g. Gemma 3's five local layers to one global; `model.scan` then runs one scanned body per
  repetition of the pattern;
- the sub-configs of attention, position, norm and MLP (`mlp.kind`: dense or MoE), each the
  shared layer's own config.
"""

import math

import jax
import jax.numpy as jnp
import ml_collections
from flax import nnx

from common.errors import UserError
from common.nn import attention, lora, memory, mlp, norms, position
from common.nn import moe  # noqa: F401  (registers mlp.kind "moe")
from common.nn.linear import Embedding, Linear, dtypes

NORM_PLACEMENTS = ("pre", "post", "both")
# What a layer kind may change: fields of the attention config (merged), the position encoding
# and the MLP (each replaced whole, so config modifiers that rewrite a kind of position reach it,
# and a dense layer can sit among MoE ones).
KIND_KEYS = ("attention", "position", "mlp")


def config(
  *,
  family: str,
  vocab_size: int,
  dim: int,
  num_layers: int,
  attention: ml_collections.ConfigDict,
  position: ml_collections.ConfigDict,
  norm: ml_collections.ConfigDict,
  mlp: ml_collections.ConfigDict,
  norm_placement: str = "pre",
  embed_scale: bool = False,
  layer_pattern: tuple[str, ...] = (),
  layer_kinds: dict | None = None,
  init_std: float = 0.02,
  **extra,
) -> ml_collections.ConfigDict:
  """A model config for `Decoder` or `Encoder`: the shared keys, then the stack's own `extra`
  ones (Decoder: tie_embeddings, final_softcap; Encoder: type_vocab_size, embed_norm,
  final_norm, pooler, num_labels)."""
  return ml_collections.ConfigDict(
    {
      "family": family,
      "vocab_size": vocab_size,
      "dim": dim,
      "num_layers": num_layers,
      "attention": attention,
      "position": position,
      "norm": norm,
      "mlp": mlp,
      "norm_placement": norm_placement,
      "embed_scale": embed_scale,
      "layer_pattern": tuple(layer_pattern),
      "layer_kinds": layer_kinds or {},
      **extra,
      "init_std": init_std,
      "remat": "none",  # or "full", "save_dots": recompute activations in the backward pass
      "scan": False,  # True: one compiled body (a repetition of the pattern) run by lax.scan
      "lora": lora.config(),  # rank > 0: low-rank adapters, base weights frozen
      "dtype": "float32",
      "param_dtype": "float32",
    }
  )


def layer_config(cfg, i: int) -> ml_collections.ConfigDict:
  """The config layer `i` is built from: `cfg` with its layer kind's changes."""
  pattern = tuple(cfg.get("layer_pattern", ()))
  if not pattern:
    return cfg
  kinds = cfg.layer_kinds
  kind = pattern[i % len(pattern)]
  if kind not in kinds:
    raise UserError(
      f"model.layer_pattern names {kind!r}, which model.layer_kinds does not define "
      f"(it has {sorted(kinds)})."
    )
  changes = kinds[kind]
  unknown = [k for k in changes if k not in KIND_KEYS]
  if unknown:
    raise UserError(
      f"model.layer_kinds.{kind} sets {unknown}: a layer kind may set {', '.join(KIND_KEYS)}."
    )
  out = ml_collections.ConfigDict(cfg.to_dict())
  if "attention" in changes:
    bad = [k for k in changes.attention if k not in cfg.attention]
    if bad:
      raise UserError(f"model.layer_kinds.{kind}.attention has no keys {bad}.")
    out.attention.update(changes.attention.to_dict())
  if "position" in changes:
    if changes.position.get("kind") == "learned":
      raise UserError(
        f"model.layer_kinds.{kind}.position is learned: a layer kind's position may rotate or "
        "bias attention (rope, alibi, none), not add to the embeddings."
      )
    out.position = ml_collections.ConfigDict(changes.position.to_dict())
  if "mlp" in changes:
    out.mlp = ml_collections.ConfigDict(changes.mlp.to_dict())
  return out


def _period(cfg) -> int:
  return len(cfg.get("layer_pattern", ())) or 1


def _check(cfg):
  if cfg.get("norm_placement", "pre") not in NORM_PLACEMENTS:
    raise UserError(
      f"Unknown model.norm_placement {cfg.norm_placement!r}: use one of {NORM_PLACEMENTS}."
    )


class Block(nnx.Module):
  """One layer: attention, then the MLP, each a residual sub-layer with norms placed by
  `norm_placement` (see the module docstring)."""

  def __init__(self, cfg, *, rngs: nnx.Rngs):
    dt = dtypes(cfg)
    D = cfg.dim
    # The projections into the residual stream start smaller in deep models (GPT-2's 1/sqrt(2L)).
    out_std = cfg.init_std / math.sqrt(2 * cfg.num_layers)
    self.placement = cfg.get("norm_placement", "pre")
    both = self.placement == "both"
    self.attn_norm = norms.make(cfg.norm, D, **dt)
    self.attn = attention.Attention(
      cfg.attention, D, norm=cfg.norm, out_init_std=out_std, rngs=rngs, **dt
    )
    self.attn_out_norm = norms.make(cfg.norm, D, **dt) if both else None
    self.mlp_norm = norms.make(cfg.norm, D, **dt)
    self.mlp = mlp.make(cfg.mlp, D, out_init_std=out_std, rngs=rngs, **dt)
    self.mlp_out_norm = norms.make(cfg.norm, D, **dt) if both else None

  def __call__(self, x_BTD, *, positions_BT, segment_ids_BT, position, cache=None):
    post = self.placement == "post"
    h_BTD, cache = self.attn(
      x_BTD if post else self.attn_norm(x_BTD),
      positions_BT=positions_BT,
      segment_ids_BT=segment_ids_BT,
      position=position,
      cache=cache,
    )
    x_BTD = self._residual(x_BTD, h_BTD, self.attn_norm, self.attn_out_norm)
    # The padding mask (segment 0) keeps padding out of an MoE's load-balancing statistics.
    mask_BT = None if segment_ids_BT is None else segment_ids_BT != 0
    h_BTD = self.mlp(x_BTD if post else self.mlp_norm(x_BTD), mask_BT=mask_BT)
    return self._residual(x_BTD, h_BTD, self.mlp_norm, self.mlp_out_norm), cache

  def _residual(self, x_BTD, h_BTD, norm, out_norm):
    if self.placement == "post":
      return norm(x_BTD + h_BTD)
    return x_BTD + (h_BTD if out_norm is None else out_norm(h_BTD))


class _Stack(nnx.Module):
  """What the decoder and encoder share: positions, the blocks and how they are run."""

  def _make_positions(self, cfg, rngs, dt):
    kw = dict(
      head_dim=cfg.attention.head_dim,
      dim=cfg.dim,
      num_heads=cfg.attention.num_heads,
      rngs=rngs,
      param_dtype=dt["param_dtype"],
    )
    self.position = position.make(cfg.position, **kw)
    # A layer kind with its own position encoding (Gemma 3's local RoPE theta): one per slot of
    # the pattern, None where the slot uses the model's.
    period = _period(cfg)
    kinds = [layer_config(cfg, j) for j in range(period)]
    own = [k.position.to_dict() != cfg.position.to_dict() for k in kinds]
    self.layer_positions = (
      nnx.List(
        [position.make(k.position, **kw) if o else None for k, o in zip(kinds, own, strict=True)]
      )
      if any(own)
      else None
    )

  def _make_blocks(self, cfg, rngs):
    _check(cfg)
    self.blocks = nnx.List([Block(layer_config(cfg, i), rngs=rngs) for i in range(cfg.num_layers)])
    self.remat, self.scan = cfg.get("remat", "none"), cfg.get("scan", False)
    self.period = _period(cfg)

  def _run_blocks(self, x_BTD, *, positions_BT, segment_ids_BT, cache=None):
    per_slot = None
    if self.layer_positions is not None:
      per_slot = [{"position": self.position if p is None else p} for p in self.layer_positions]
    return memory.run_blocks(
      self.blocks,
      x_BTD,
      cache=cache,
      remat=self.remat,
      scan=self.scan,
      period=self.period,
      per_slot=per_slot,
      positions_BT=positions_BT,
      segment_ids_BT=segment_ids_BT,
      position=self.position,
    )


class Decoder(_Stack):
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
      return attention.soft_cap(call(module, x_D), cap)

    return head, project

  def logits(self, x_BTD):
    head, project = self.output_head()
    return project(head, x_BTD)

  def init_cache(self, batch: int, max_len: int) -> list[attention.KVCache]:
    return [block.attn.init_cache(batch, max_len) for block in self.blocks]


class Encoder(_Stack):
  """tokens (+ token types) (+ learned positions) -> norm (if embed_norm) -> blocks -> norm (if
  final_norm) -> hidden states [B, T, D]; `pool` and `classify` for a first-token pooler and a
  classification head (BERT)."""

  def __init__(self, cfg, *, rngs: nnx.Rngs):
    dt = dtypes(cfg)
    self.embed = Embedding(cfg.vocab_size, cfg.dim, init_std=cfg.init_std, rngs=rngs, **dt)
    self.token_type = (
      Embedding(cfg.type_vocab_size, cfg.dim, init_std=cfg.init_std, rngs=rngs, **dt)
      if cfg.get("type_vocab_size", 0)
      else None
    )
    self._make_positions(cfg, rngs, dt)
    self.embed_norm = norms.make(cfg.norm, cfg.dim, **dt) if cfg.get("embed_norm", False) else None
    self._make_blocks(cfg, rngs)
    self.norm = norms.make(cfg.norm, cfg.dim, **dt) if cfg.get("final_norm", True) else None
    self.pooler = (
      Linear(
        cfg.dim, cfg.dim, use_bias=True, axes=("D", None), init_std=cfg.init_std, rngs=rngs, **dt
      )
      if cfg.get("pooler", False)
      else None
    )
    num_labels = cfg.get("num_labels", 0)  # absent in configs saved before it existed
    if num_labels and self.pooler is None:
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
    x_BTD = self.embed(tokens_BT)
    if self.token_type is not None:
      if token_type_ids is None:
        token_type_ids = jnp.zeros(tokens_BT.shape, jnp.int32)
      x_BTD = x_BTD + self.token_type(token_type_ids)
    x_BTD = self.position.embed(x_BTD, positions_BT)
    if self.embed_norm is not None:
      x_BTD = self.embed_norm(x_BTD)
    x_BTD, _ = self._run_blocks(x_BTD, positions_BT=positions_BT, segment_ids_BT=segment_ids_BT)
    return x_BTD if self.norm is None else self.norm(x_BTD)

  def pool(self, hidden_BTD: jax.Array) -> jax.Array:
    """The pooled output [B, D]: tanh(Linear(the first token's hidden state)) (BERT's)."""
    if self.pooler is None:
      raise UserError("This encoder has no pooler (model.pooler=False): pool the hidden states.")
    return jnp.tanh(self.pooler(hidden_BTD[:, 0]))

  def classify(self, tokens_BT, *, attention_mask=None, token_type_ids=None) -> jax.Array:
    """Class logits [B, num_labels] of each row: the head on the pooled output."""
    if self.head is None:
      raise UserError("This encoder has no classifier head: set model.num_labels.")
    hidden_BTD = self(tokens_BT, attention_mask=attention_mask, token_type_ids=token_type_ids)
    return self.head(self.pool(hidden_BTD))
