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
  e.g. Gemma 3's five local layers to one global; `model.scan` then stores the layers stacked
  per slot of the pattern and runs one scanned body per repetition of it;
- the sub-configs of attention, position, norm and MLP (`mlp.kind`: dense or MoE), each the
  shared layer's own config;
- `modulation`: "adaln_zero" modulates a pre-norm block by a conditioning vector c [B, D]
  (`cond_BD`): x + gate * f(norm(x) * (1 + scale) + shift) per sub-layer, shift, scale and gate
  from SiLU -> Linear(c) started at zero (DiT's adaLN-Zero, common/nn/conditioning.py); the
  `Denoiser` stack (common/nn/denoiser.py) gives c from a timestep and a class; `mlp_norm`, if
  given, is the MLP's norm config where it differs from the attention's (diffusers' DiT);
- the Encoder's `inputs`: token ids (BERT, CLIP's text tower), images cut into patches (ViT,
  CLIP's vision tower, see `patch_inputs`) or feature frames through a stem of 1-D convolutions
  (an audio front-end, see `frame_inputs`; so may an `EncoderDecoder`'s encoder), and
  `pool_at`, the token a classifier or a projection reads (the first, or CLIP's end-of-text
  token).

`EncoderDecoder` (T5) is two such stacks: an encoder, and a decoder whose blocks have a third
sub-layer, cross-attention to the encoder's output (`cross_attention`, between self-attention
and the MLP, its norm placed by the same rule); see `EncoderDecoder` for its own keys.
"""

import dataclasses
import math

import jax
import jax.numpy as jnp
import ml_collections
from flax import nnx

from nnx_zoo.common.errors import UserError
from nnx_zoo.common.nn import (
  attention,
  attention_ref,
  conditioning,
  lora,
  memory,
  mlp,
  moe,  # noqa: F401  (registers mlp.kind "moe")
  noise,
  norms,
  position,
  quant,
  stacking,
)
from nnx_zoo.common.nn.linear import Embedding, Linear, dtypes, normal
from nnx_zoo.common.nn.patch import ConvStem, PatchEmbed, stem_length

NORM_PLACEMENTS = ("pre", "post", "both")
# What a layer kind may change: fields of the attention config (merged), the position encoding
# and the MLP (each replaced whole, so config modifiers that rewrite a kind of position reach it,
# and a dense layer can sit among MoE ones).
KIND_KEYS = ("attention", "position", "mlp")
INPUTS = ("tokens", "patches", "frames")
# What `Encoder.pool` reads: the first token ([CLS], a class token), the largest id of each row
# (CLIP's end-of-text token, as HF's CLIP with eos_token_id 2), the first `end_token`, or the
# mean of every token (images, which have no padding: big_vision's ViT "gap").
POOL_AT = ("first", "argmax", "end_token", "mean")


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
  final_norm, pooler, num_labels, pool_at (and end_token), and for images the keys of
  `patch_inputs`)."""
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
      # Stochastic depth in training: the rate at the last layer, rising from 0 at the first.
      "drop_path": 0.0,
      **extra,
      "init_std": init_std,
      "remat": "none",  # or "full", "save_dots": recompute activations in the backward pass
      "scan": False,  # True: one compiled body (a repetition of the pattern) run by lax.scan
      # The projections of attention and the MLP multiplied in "int8" or "fp8" (common/nn/quant.py),
      # and with quant_backward their gradients' products too.
      "quant": "none",
      "quant_backward": True,
      "lora": lora.config(),  # rank > 0: low-rank adapters, base weights frozen
      "dtype": "float32",
      "param_dtype": "float32",
    }
  )


def patch_inputs(
  *,
  image_size: int,
  patch: int,
  channels: int = 3,
  patch_bias: bool = True,
  class_token: bool = True,
  pixel_mean: tuple[float, ...] = (0.5, 0.5, 0.5),
  pixel_std: tuple[float, ...] = (0.5, 0.5, 0.5),
) -> dict:
  """The `Encoder` keys of image inputs, to pass to `config(...)`: images [B, image_size,
  image_size, channels] in [0, 1], normalised as (x - pixel_mean) / pixel_std per channel (what
  a Hugging Face image processor does after scaling to [0, 1]), cut into patch x patch patches
  embedded by `PatchEmbed` (with a bias if `patch_bias`), after a learned class token if
  `class_token`. The learned positions need max_len = (image_size / patch)^2 + class_token."""
  return {
    "inputs": "patches",
    "image_size": image_size,
    "patch": patch,
    "channels": channels,
    "patch_bias": patch_bias,
    "class_token": class_token,
    "pixel_mean": tuple(pixel_mean),
    "pixel_std": tuple(pixel_std),
  }


def frame_inputs(
  *,
  channels: int,
  width: int = 3,
  strides: tuple[int, ...] = (1, 2),
  activation: str = "gelu_exact",
) -> dict:
  """The keys of an encoder whose inputs are feature frames [B, T, channels] (log-mel
  spectrograms: Whisper's 80 or 128 bins), to pass to `config(...)`: a `ConvStem` of one 1-D
  convolution of `width` taps per entry of `strides`, each followed by `activation` (an MLP
  activation's name), makes the encoder's T' = ~T / prod(strides) inputs."""
  return {
    "inputs": "frames",
    "channels": channels,
    "stem_width": width,
    "stem_strides": tuple(strides),
    "stem_activation": activation,
  }


def make_stem(cfg, rngs, dt) -> ConvStem:
  """The `ConvStem` of a config with `frame_inputs`' keys."""
  return ConvStem(
    cfg.dim,
    channels=cfg.channels,
    width=cfg.stem_width,
    strides=tuple(cfg.stem_strides),
    activation=cfg.stem_activation,
    init_std=cfg.init_std,
    rngs=rngs,
    **dt,
  )


def stem_segment_ids(stem: ConvStem, segment_ids_BT: jax.Array) -> jax.Array:
  """The segment ids of a stem's outputs: those of the frame at the centre of each window
  (output t of a stride-s convolution is centred on its input t * s)."""
  if stem.width % 2 == 0:
    raise UserError(f"Segment ids through a stem of even width {stem.width} are ambiguous.")
  for s in stem.strides:
    segment_ids_BT = segment_ids_BT[:, ::s]
  return segment_ids_BT


def num_frames_out(cfg, frames: int) -> int:
  """The encoder's sequence length for `frames` input frames (a config with `frame_inputs`)."""
  return stem_length(frames, width=cfg["stem_width"], strides=cfg["stem_strides"])


def num_patches(cfg) -> int:
  """The encoder's sequence length for images (a config, or `patch_inputs`' keys): the patches
  and the class token."""
  return (cfg["image_size"] // cfg["patch"]) ** 2 + int(cfg["class_token"])


def _check_patches(cfg):
  S, p, C = cfg.image_size, cfg.patch, cfg.channels
  if S % p:
    raise UserError(
      f"model.patch={p} does not divide model.image_size={S}: pick a patch size that divides "
      "the image size."
    )
  if len(cfg.pixel_mean) != C or len(cfg.pixel_std) != C:
    raise UserError(
      f"model.pixel_mean and model.pixel_std need one value per channel (channels={C}); got "
      f"{tuple(cfg.pixel_mean)} and {tuple(cfg.pixel_std)}."
    )
  T = num_patches(cfg)
  if cfg.position.kind == "learned" and cfg.position.max_len < T:
    raise UserError(
      f"model.position.max_len={cfg.position.max_len} is less than the {T} tokens of an image "
      f"({S // p}x{S // p} patches{' and the class token' if cfg.class_token else ''})."
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


def _check_modulation(cfg) -> str:
  modulation = cfg.get("modulation", "none")
  if modulation not in conditioning.MODULATIONS:
    raise UserError(
      f"Unknown model.modulation {modulation!r}: use one of {conditioning.MODULATIONS}."
    )
  if modulation != "none" and (
    cfg.get("norm_placement", "pre") != "pre" or cfg.get("cross_attention", False)
  ):
    raise UserError(
      f"model.modulation={modulation!r} modulates pre-norm blocks without cross-attention: set "
      "model.norm_placement='pre'."
    )
  return modulation


def _check(cfg):
  if cfg.get("norm_placement", "pre") not in NORM_PLACEMENTS:
    raise UserError(
      f"Unknown model.norm_placement {cfg.norm_placement!r}: use one of {NORM_PLACEMENTS}."
    )


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class CrossCache:
  """A decoding state of a block with cross-attention: its self-attention KV cache and the
  source's keys and values, projected once for the whole decoding."""

  self_attn: attention.KVCache
  source: attention.SourceKV

  @property
  def index(self) -> jax.Array:  # as KVCache's: the tokens decoded so far
    return self.self_attn.index


class Block(nnx.Module):
  """One layer: attention, (cross-attention, if `cross_attention`,) then the MLP, each a
  residual sub-layer with norms placed by `norm_placement` (see the module docstring)."""

  def __init__(self, cfg, *, rngs: nnx.Rngs):
    dt = dtypes(cfg)
    D = cfg.dim
    # The projections into the residual stream start smaller in deep models (GPT-2's 1/sqrt(2L)).
    out_std = cfg.init_std / math.sqrt(2 * cfg.num_layers)
    self.placement = cfg.get("norm_placement", "pre")
    # Stochastic depth: each residual branch dropped per row in training (common/nn/noise.py).
    self.drop_path = cfg.get("drop_path", 0.0)
    both = self.placement == "both"
    self.attn_norm = norms.make(cfg.norm, D, **dt)
    self.attn = attention.Attention(
      cfg.attention, D, norm=cfg.norm, out_init_std=out_std, rngs=rngs, **dt
    )
    self.attn_out_norm = norms.make(cfg.norm, D, **dt) if both else None
    self.mlp_norm = norms.make(cfg.get("mlp_norm") or cfg.norm, D, **dt)
    self.mlp = mlp.make(cfg.mlp, D, out_init_std=out_std, rngs=rngs, **dt)
    # adaLN-Zero: shift, scale and gate of the attention, then of the MLP.
    self.modulation = (
      conditioning.Modulation(D, 6, rngs=rngs, **dt)
      if _check_modulation(cfg) == "adaln_zero"
      else None
    )
    self.mlp_out_norm = norms.make(cfg.norm, D, **dt) if both else None
    cross = cfg.get("cross_attention", False)
    # Every source token is visible to every target token: no causal mask, no window.
    cross_cfg = ml_collections.ConfigDict({**cfg.attention.to_dict(), "mask": "bidirectional"})
    cross_cfg.window = 0
    self.cross_norm = norms.make(cfg.norm, D, **dt) if cross else None
    self.cross_attn = (
      attention.Attention(cross_cfg, D, norm=cfg.norm, out_init_std=out_std, rngs=rngs, **dt)
      if cross
      else None
    )
    self.cross_out_norm = norms.make(cfg.norm, D, **dt) if cross and both else None
    # model.quant: the sub-layers' projections multiply in int8 or fp8; the modulation's and
    # every other Linear of the model stay in the compute dtype (common/nn/quant.py).
    if (how := quant.settings(cfg)) is not None:
      for sub in [s for s in (self.attn, self.cross_attn, self.mlp) if s is not None]:
        for _, m in nnx.iter_graph(sub):
          if isinstance(m, Linear):
            m.quant = how

  def __call__(
    self,
    x_BTD,
    *,
    positions_BT,
    segment_ids_BT,
    position,
    cache=None,
    source_BSD=None,
    source_segment_ids_BS=None,
    cond_BD=None,
  ):
    """`source_BSD` (and its segment ids): what cross-attention attends to, an encoder's output;
    when decoding, `cache` is a `CrossCache` holding it projected instead. `cond_BD`: the
    conditioning a modulated block reads (`modulation`)."""
    if self.modulation is not None:
      return self._modulated(
        x_BTD,
        cond_BD,
        positions_BT=positions_BT,
        segment_ids_BT=segment_ids_BT,
        position=position,
        cache=cache,
      )
    post = self.placement == "post"
    crossed = isinstance(cache, CrossCache)
    h_BTD, self_cache = self.attn(
      x_BTD if post else self.attn_norm(x_BTD),
      positions_BT=positions_BT,
      segment_ids_BT=segment_ids_BT,
      position=position,
      cache=cache.self_attn if crossed else cache,
    )
    x_BTD = self._residual(x_BTD, h_BTD, self.attn_norm, self.attn_out_norm)
    if self.cross_attn is not None:
      if crossed:
        source = cache.source
      elif source_BSD is None:
        raise UserError(
          "A block with cross-attention needs the source it attends to (an encoder's output)."
        )
      else:
        source = self.cross_attn.source_kv(source_BSD, source_segment_ids_BS)
      h_BTD = self.cross_attn.cross(
        x_BTD if post else self.cross_norm(x_BTD), source, segment_ids_BT=segment_ids_BT
      )
      x_BTD = self._residual(x_BTD, h_BTD, self.cross_norm, self.cross_out_norm)
      if cache is not None:
        self_cache = CrossCache(self_cache, source)
    # The padding mask (segment 0) keeps padding out of an MoE's load-balancing statistics.
    mask_BT = None if segment_ids_BT is None else segment_ids_BT != 0
    h_BTD = self.mlp(x_BTD if post else self.mlp_norm(x_BTD), mask_BT=mask_BT)
    return self._residual(x_BTD, h_BTD, self.mlp_norm, self.mlp_out_norm), self_cache

  def _modulated(self, x_BTD, cond_BD, *, segment_ids_BT, cache, **attn_kw):
    """adaLN-Zero: x + gate * f(modulate(norm(x), shift, scale)), for attention then MLP."""
    if cond_BD is None:
      raise UserError("A block with model.modulation='adaln_zero' needs the conditioning cond_BD.")
    shift1, scale1, gate1, shift2, scale2, gate2 = self.modulation(cond_BD)
    h_BTD, new_cache = self.attn(
      conditioning.modulate(self.attn_norm(x_BTD), shift1, scale1),
      segment_ids_BT=segment_ids_BT,
      cache=cache,
      **attn_kw,
    )
    x_BTD = x_BTD + noise.drop_path(gate1[:, None, :] * h_BTD, self.drop_path)
    mask_BT = None if segment_ids_BT is None else segment_ids_BT != 0
    h_BTD = self.mlp(conditioning.modulate(self.mlp_norm(x_BTD), shift2, scale2), mask_BT=mask_BT)
    return x_BTD + noise.drop_path(gate2[:, None, :] * h_BTD, self.drop_path), new_cache

  def _residual(self, x_BTD, h_BTD, norm, out_norm):
    """The sub-layer's output h added to the stream x (the branch dropped as a whole for the
    rows stochastic depth drops: after its own norm, before the stream's)."""
    if self.placement == "post":
      return norm(x_BTD + noise.drop_path(h_BTD, self.drop_path))
    h_BTD = h_BTD if out_norm is None else out_norm(h_BTD)
    return x_BTD + noise.drop_path(h_BTD, self.drop_path)


class _Stack(nnx.Module):
  """What the decoder and encoder share: positions, the blocks and how they are run. The
  blocks are `blocks` (one per layer) or, with `model.scan`, stored stacked: `stacked` (one
  module per slot of the layer pattern, each parameter [repetitions, ...]) and `rest` (the
  layers past the last whole repetition); `layer(i)` is layer i either way."""

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
    blocks = [Block(layer_config(cfg, i), rngs=rngs) for i in range(cfg.num_layers)]
    self.remat, self.scan = cfg.get("remat", "none"), cfg.get("scan", False)
    self.period = _period(cfg)
    # Scanned, the layers are stored stacked (common/nn/stacking.py: `stacked`, one module per
    # slot of the pattern, then the `rest`); built one by one first, so the values are those of
    # the unscanned model of the same seed.
    reps = stacking.stacks(cfg.num_layers, self.period) if self.scan else 0
    if reps:
      self.stacked = nnx.List(stacking.stack_blocks(blocks, self.period))
      self.rest = nnx.List(blocks[reps * self.period :])
      self.blocks = None
    else:
      self.stacked = self.rest = None
      self.blocks = nnx.List(blocks)

  def layer(self, i: int) -> Block:
    """Layer i as one block (of a stacked stack, a view on its slice of the stacks)."""
    if self.stacked is None:
      return self.blocks[i]
    return stacking.layer(self.stacked, self.rest, i)

  @property
  def num_layers(self) -> int:
    if self.stacked is None:
      return len(self.blocks)
    return stacking.num_stacked(self.stacked) * len(self.stacked) + len(self.rest)

  def _run_blocks(self, x_BTD, *, positions_BT, segment_ids_BT, cache=None, **source):
    per_slot = None
    if self.layer_positions is not None:
      per_slot = [{"position": self.position if p is None else p} for p in self.layer_positions]
    layer_position = self.position
    if self.position.per_stack and per_slot is None and cache is None:
      # One bias for every layer (T5's): the keys are the queries' own tokens.
      bias = self.position.logit_bias(positions_BT, positions_BT, self.position.num_heads)
      layer_position = position.StackBias(bias)
    return memory.run_blocks(
      self.blocks if self.stacked is None else self.rest,
      x_BTD,
      stacked=self.stacked,
      cache=cache,
      remat=self.remat,
      period=self.period,
      per_slot=per_slot,
      positions_BT=positions_BT,
      segment_ids_BT=segment_ids_BT,
      position=layer_position,
      **source,
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
      return attention_ref.soft_cap(call(module, x_D), cap)

    return head, project

  def logits(self, x_BTD):
    head, project = self.output_head()
    return project(head, x_BTD)

  def init_cache(self, batch: int, max_len: int) -> list[attention.KVCache]:
    return [self.layer(i).attn.init_cache(batch, max_len) for i in range(self.num_layers)]


class Encoder(_Stack):
  """tokens (+ token types), or images as patches after a class token (`inputs`, see
  `patch_inputs`) -> (+ learned positions) -> norm (if embed_norm) -> blocks -> norm (if
  final_norm) -> hidden states [B, T, D]; `pool` and `classify` for the pooled token (BERT's
  tanh pooler on it if `pooler`) and a classification head (BERT, ViT)."""

  def __init__(self, cfg, *, rngs: nnx.Rngs):
    dt = dtypes(cfg)
    self.inputs = cfg.get("inputs", "tokens")  # absent in configs saved before images
    if self.inputs not in INPUTS:
      raise UserError(f"Unknown model.inputs {self.inputs!r}: use one of {INPUTS}.")
    self.stem = make_stem(cfg, rngs, dt) if self.inputs == "frames" else None
    if self.inputs == "tokens":
      self.embed = Embedding(cfg.vocab_size, cfg.dim, init_std=cfg.init_std, rngs=rngs, **dt)
      self.patch_embed = self.class_token = None
    else:
      self.embed = None
      if self.inputs == "patches":
        self._make_patches(cfg, rngs, dt)
      else:
        self.patch_embed = self.class_token = None
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
    # "": BERT's, which pools only through its pooler (HF's BertModel has no other pooled output).
    self.pool_at = cfg.get("pool_at", "")
    if self.pool_at and self.pool_at not in POOL_AT:
      raise UserError(f"Unknown model.pool_at {self.pool_at!r}: use one of {POOL_AT}.")
    self.end_token = cfg.end_token if self.pool_at == "end_token" else -1
    num_labels = cfg.get("num_labels", 0)  # absent in configs saved before it existed
    if num_labels and self.pooler is None and not self.pool_at:
      raise UserError("model.num_labels > 0 needs model.pooler=True: the head reads the pooler.")
    self.head = (
      Linear(cfg.dim, num_labels, use_bias=True, init_std=cfg.init_std, rngs=rngs, **dt)
      if num_labels
      else None
    )

  def _make_patches(self, cfg, rngs, dt):
    _check_patches(cfg)
    self.image_size, self.channels = cfg.image_size, cfg.channels
    self.pixel_mean, self.pixel_std = tuple(cfg.pixel_mean), tuple(cfg.pixel_std)
    self.patch_embed = PatchEmbed(
      cfg.dim,
      patch=cfg.patch,
      channels=cfg.channels,
      use_bias=cfg.patch_bias,
      init_std=cfg.init_std,
      rngs=rngs,
      **dt,
    )
    self.class_token = (
      nnx.Param(normal(cfg.init_std)(rngs.params(), (cfg.dim,), dt["param_dtype"]), axes=("D",))
      if cfg.class_token
      else None
    )

  def __call__(self, inputs, **kw):
    """Final hidden states [B, T, D]: `encode`."""
    return self.encode(inputs, **kw)

  def encode(
    self,
    inputs,
    *,
    attention_mask=None,
    token_type_ids=None,
    positions_BT=None,
    segment_ids_BT=None,
  ):
    """Final hidden states [B, T, D] of tokens [B, T], images [B, H, W, C] or frames
    [B, T_frames, C] (segment ids, if given, are the frames').

    `attention_mask` [B, T] (1 = token, 0 = padding), as Hugging Face's: no token attends to
    padding. It is folded into the segment ids, so padding positions attend only to each
    other and their outputs mean nothing (HF's do not either). Positions count from the start of
    the row, padding included, as HF's absolute position ids; `segment_ids_BT` (packed rows)
    restarts them per segment.
    """
    if self.inputs == "frames":
      if attention_mask is not None or token_type_ids is not None:
        raise UserError("A frame encoder takes no attention_mask or token_type_ids.")
      x_BTD = self.stem(inputs)
      B, T, _ = x_BTD.shape
      positions_BT = jnp.broadcast_to(jnp.arange(T), (B, T))
      segment_ids_BT = (
        jnp.ones((B, T), jnp.int32)
        if segment_ids_BT is None
        else stem_segment_ids(self.stem, segment_ids_BT)
      )
    elif self.inputs == "patches":
      if attention_mask is not None or token_type_ids is not None:
        raise UserError("An image encoder takes no attention_mask or token_type_ids.")
      x_BTD = self._embed_images(inputs)
      B, T, _ = x_BTD.shape
      if positions_BT is None:
        positions_BT = jnp.broadcast_to(jnp.arange(T), (B, T))
      if segment_ids_BT is None:
        segment_ids_BT = jnp.ones((B, T), jnp.int32)
    else:
      x_BTD, positions_BT, segment_ids_BT = self._embed_tokens(
        inputs, attention_mask, token_type_ids, positions_BT, segment_ids_BT
      )
    x_BTD = self.position.embed(x_BTD, positions_BT)
    if self.embed_norm is not None:
      x_BTD = self.embed_norm(x_BTD)
    x_BTD, _ = self._run_blocks(x_BTD, positions_BT=positions_BT, segment_ids_BT=segment_ids_BT)
    return x_BTD if self.norm is None else self.norm(x_BTD)

  def _embed_tokens(self, tokens_BT, attention_mask, token_type_ids, positions_BT, segment_ids_BT):
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
    return x_BTD, positions_BT, segment_ids_BT

  def _embed_images(self, images_BHWC):
    """[B, S, S, C] in [0, 1] -> normalised -> patches (after the class token) [B, T, D]."""
    S, C = self.image_size, self.channels
    if images_BHWC.ndim != 4 or tuple(images_BHWC.shape[1:]) != (S, S, C):
      raise UserError(
        f"Expected images [B, {S}, {S}, {C}] (channels last, values in [0, 1]), got shape "
        f"{tuple(images_BHWC.shape)}."
      )
    x = images_BHWC.astype(jnp.float32)
    x = (x - jnp.asarray(self.pixel_mean, jnp.float32)) / jnp.asarray(self.pixel_std, jnp.float32)
    x_BTD = self.patch_embed(x)
    if self.class_token is not None:
      B, _, D = x_BTD.shape
      first_B1D = jnp.broadcast_to(self.class_token[...].astype(x_BTD.dtype), (B, 1, D))
      x_BTD = jnp.concatenate([first_B1D, x_BTD], axis=1)
    return x_BTD

  def pool(self, hidden_BTD: jax.Array, tokens_BT: jax.Array | None = None) -> jax.Array:
    """The pooled output [B, D]: the hidden state at `pool_at` (the first token, the mean of all;
    or, given the tokens, the end token), through BERT's tanh(Linear) pooler when the model has
    one."""
    if self.pooler is None and not self.pool_at:
      raise UserError("This encoder has no pooler (model.pooler=False): pool the hidden states.")
    if self.pool_at in ("", "first"):
      x_BD = hidden_BTD[:, 0]
    elif self.pool_at == "mean":
      x_BD = jnp.mean(hidden_BTD, axis=1)
    else:
      if tokens_BT is None:
        raise UserError(f"model.pool_at={self.pool_at!r} needs the tokens: pool(hidden, tokens).")
      # argmax finds the first maximum: the first end token of each row.
      at_B = jnp.argmax(tokens_BT if self.pool_at == "argmax" else tokens_BT == self.end_token, 1)
      x_BD = jnp.take_along_axis(hidden_BTD, at_B[:, None, None], axis=1)[:, 0]
    return x_BD if self.pooler is None else jnp.tanh(self.pooler(x_BD))

  def classify(self, inputs, *, attention_mask=None, token_type_ids=None) -> jax.Array:
    """Class logits [B, num_labels] of each row (tokens) or image: the head on the pooled
    output."""
    if self.head is None:
      raise UserError("This encoder has no classifier head: set model.num_labels.")
    hidden_BTD = self.encode(inputs, attention_mask=attention_mask, token_type_ids=token_type_ids)
    return self.head(self.pool(hidden_BTD, inputs if self.inputs == "tokens" else None))


# Encoder-decoder (T5)

OUTPUT_SCALES = ("none", "rsqrt_dim")


def encoder_decoder_sides(cfg) -> tuple[ml_collections.ConfigDict, ml_collections.ConfigDict]:
  """The configs of an `EncoderDecoder`'s two stacks. The encoder's is `cfg` (its attention
  mask, `position`, `num_layers`); the decoder's has `num_decoder_layers`, `decoder_position`,
  causal self-attention (it generates one token after another) and cross-attention."""
  encoder = ml_collections.ConfigDict(cfg.to_dict())
  decoder = ml_collections.ConfigDict(cfg.to_dict())
  decoder.num_layers = cfg.num_decoder_layers
  decoder.position = ml_collections.ConfigDict(cfg.decoder_position.to_dict())
  decoder.attention.mask = "causal"
  decoder.cross_attention = True
  return encoder, decoder


class Stack(_Stack):
  """One side of an `EncoderDecoder`: positions, blocks and the final norm (the embeddings are
  the model's, which the two sides may share)."""

  def __init__(self, cfg, *, rngs: nnx.Rngs):
    dt = dtypes(cfg)
    self._make_positions(cfg, rngs, dt)
    self._make_blocks(cfg, rngs)
    self.norm = norms.make(cfg.norm, cfg.dim, **dt)

  def __call__(self, x_BTD, *, positions_BT, segment_ids_BT, cache=None, **source):
    """The final (normed) hidden states [B, T, D] and the updated cache; `source`: the
    decoder's `source_BSD` and `source_segment_ids_BS` (see `Block`)."""
    x_BTD = self.position.embed(x_BTD, positions_BT)
    x_BTD, cache = self._run_blocks(
      x_BTD, positions_BT=positions_BT, segment_ids_BT=segment_ids_BT, cache=cache, **source
    )
    return self.norm(x_BTD), cache


class EncoderDecoder(nnx.Module):
  """tokens -> Embedding -> encoder blocks -> norm -> the source [B, S, D];
  decoder tokens -> Embedding (the same one if shared_embeddings) -> decoder blocks (causal
  self-attention, cross-attention to the source, MLP) -> norm (x D ** -0.5 if output_scale) ->
  output head (the decoder's embedding, tied, or lm_head) -> logits [B, T, V].

  Its keys beyond the shared ones (`config(..., **extra)`): `num_decoder_layers`,
  `decoder_position` (T5: relative, not bidirectional), `shared_embeddings`, `tie_embeddings`,
  `output_scale` ("none", or "rsqrt_dim": the decoder's output times D ** -0.5 before the head,
  transformers' T5 `scale_decoder_outputs`), `decoder_start_id` (the decoder's first input:
  targets are shifted right after it), `final_softcap` if given, and `frame_inputs`' keys for
  an encoder of feature frames (Whisper: a conv stem, no token table on that side; the
  model's `embed` is then the decoder's). `attention` is the
  encoder's self-attention (its mask as configured); the decoder's is causal, and its
  cross-attention sees the whole source.
  """

  def __init__(self, cfg, *, rngs: nnx.Rngs):
    dt = dtypes(cfg)
    if cfg.output_scale not in OUTPUT_SCALES:
      raise UserError(
        f"Unknown model.output_scale {cfg.output_scale!r}: use one of {OUTPUT_SCALES}."
      )
    encoder_cfg, decoder_cfg = encoder_decoder_sides(cfg)
    self.inputs = cfg.get("inputs", "tokens")
    if self.inputs not in ("tokens", "frames"):
      raise UserError(f"Unknown model.inputs {self.inputs!r}: use 'tokens' or 'frames'.")
    if self.inputs == "frames" and not cfg.shared_embeddings:
      raise UserError("An encoder of frames has no token table: set shared_embeddings=True.")
    self.stem = make_stem(cfg, rngs, dt) if self.inputs == "frames" else None
    self.embed = Embedding(cfg.vocab_size, cfg.dim, init_std=cfg.init_std, rngs=rngs, **dt)
    self.decoder_embed = (
      None
      if cfg.shared_embeddings
      else Embedding(cfg.vocab_size, cfg.dim, init_std=cfg.init_std, rngs=rngs, **dt)
    )
    self.embed_scale = math.sqrt(cfg.dim) if cfg.get("embed_scale", False) else 0.0
    self.encoder = Stack(encoder_cfg, rngs=rngs)
    self.decoder = Stack(decoder_cfg, rngs=rngs)
    self.lm_head = (
      None
      if cfg.tie_embeddings
      else Linear(cfg.dim, cfg.vocab_size, axes=("D", "V"), init_std=cfg.init_std, rngs=rngs, **dt)
    )
    self.output_scale = cfg.dim**-0.5 if cfg.output_scale == "rsqrt_dim" else 0.0
    self.final_softcap = cfg.get("final_softcap", 0.0)
    self.decoder_start_id = cfg.decoder_start_id

  def __call__(
    self, tokens_BS, decoder_tokens_BT, *, segment_ids_BS=None, decoder_segment_ids_BT=None
  ):
    """Logits [B, T, V] of the decoder tokens given the source tokens (teacher forcing)."""
    return self.logits(
      self.hidden(
        tokens_BS,
        decoder_tokens_BT,
        segment_ids_BS=segment_ids_BS,
        decoder_segment_ids_BT=decoder_segment_ids_BT,
      )
    )

  def _embed(self, table: Embedding, tokens_BT):
    x_BTD = table(tokens_BT)
    if self.embed_scale:
      x_BTD = x_BTD * jnp.asarray(self.embed_scale, x_BTD.dtype)
    return x_BTD

  def _decoder_table(self) -> Embedding:
    return self.embed if self.decoder_embed is None else self.decoder_embed

  def source_segment_ids(self, inputs, segment_ids_BS=None) -> jax.Array:
    """The segment ids of the source the encoder makes of `inputs` (tokens [B, S] or frames
    [B, T, C], whose ids the stem downsamples); all 1 if not given."""
    if segment_ids_BS is None:
      B, S = inputs.shape[:2]
      if self.stem is not None:
        S = stem_length(S, width=self.stem.width, strides=self.stem.strides)
      return jnp.ones((B, S), jnp.int32)
    return segment_ids_BS if self.stem is None else stem_segment_ids(self.stem, segment_ids_BS)

  def encode(self, inputs, *, segment_ids_BS=None) -> jax.Array:
    """The source [B, S, D]: the encoder's final hidden states, of tokens [B, S] or (with
    `frame_inputs`) frames [B, T, C]. Segment ids (0 = padding) keep packed rows' sources apart
    and padding unseen."""
    if self.stem is None:
      positions_BS = position.default_positions(inputs, segment_ids_BS)
      x_BSD = self._embed(self.embed, inputs)
    else:  # frames: positions from 0 over the whole window, as Whisper's
      x_BSD = self.stem(inputs.astype(self.stem.convs[0].kernel[...].dtype))
      B, S, _ = x_BSD.shape
      positions_BS = jnp.broadcast_to(jnp.arange(S), (B, S))
    segment_ids_BS = self.source_segment_ids(inputs, segment_ids_BS)
    x_BSD, _ = self.encoder(x_BSD, positions_BT=positions_BS, segment_ids_BT=segment_ids_BS)
    return x_BSD

  def hidden(
    self, tokens_BS, decoder_tokens_BT, *, segment_ids_BS=None, decoder_segment_ids_BT=None
  ) -> jax.Array:
    """The decoder's final (normed) hidden states [B, T, D], before output_scale and the head.
    Decoder segment s attends to source segment s."""
    source_BSD = self.encode(tokens_BS, segment_ids_BS=segment_ids_BS)
    segment_ids_BS = self.source_segment_ids(tokens_BS, segment_ids_BS)
    positions_BT = position.default_positions(decoder_tokens_BT, decoder_segment_ids_BT)
    x_BTD, _ = self.decoder(
      self._embed(self._decoder_table(), decoder_tokens_BT),
      positions_BT=positions_BT,
      segment_ids_BT=decoder_segment_ids_BT,
      source_BSD=source_BSD,
      source_segment_ids_BS=segment_ids_BS,
    )
    return x_BTD

  def output_head(self):
    """The module holding the output projection and `project(module, x) -> logits`, output
    scale and soft-cap included (as `Decoder.output_head`: whole, or chunk by chunk)."""
    scale, cap = self.output_scale, self.final_softcap
    if self.lm_head is None:
      head, call = self._decoder_table(), Embedding.attend
    else:
      head, call = self.lm_head, Linear.__call__

    def project(module, x_D):
      if scale:
        x_D = x_D * jnp.asarray(scale, x_D.dtype)
      return attention_ref.soft_cap(call(module, x_D), cap)

    return head, project

  def logits(self, x_BTD):
    head, project = self.output_head()
    return project(head, x_BTD)

  def init_cache(self, source_BSD, max_len: int, *, segment_ids_BS=None) -> list[CrossCache]:
    """The decoding state for `max_len` decoder tokens: empty self-attention caches, and the
    source's keys and values, projected once per layer (the encoder ran once, before)."""
    B = source_BSD.shape[0]
    blocks = [self.decoder.layer(i) for i in range(self.decoder.num_layers)]
    return [
      CrossCache(
        block.attn.init_cache(B, max_len), block.cross_attn.source_kv(source_BSD, segment_ids_BS)
      )
      for block in blocks
    ]

  def decode(self, decoder_tokens_BT, *, cache: list[CrossCache]):
    """Logits [B, T, V] of decoder tokens following those in `cache` (see `init_cache`), and
    the updated cache."""
    positions_BT = position.default_positions(decoder_tokens_BT, None, cache)
    x_BTD, cache = self.decoder(
      self._embed(self._decoder_table(), decoder_tokens_BT),
      positions_BT=positions_BT,
      segment_ids_BT=None,
      cache=cache,
    )
    return self.logits(x_BTD), cache
