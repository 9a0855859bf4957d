"""What every stack of blocks shares (the decoder, the encoder, each side of an encoder-decoder,
the denoiser): the config of each layer, its positions, its blocks and how they are run."""

import ml_collections
from flax import nnx

from nnx_zoo.common.errors import UserError
from nnx_zoo.common.nn import block, memory, position, qlora, stacking

# What a layer kind may change: fields of the attention config (merged), the position encoding
# and the MLP (each replaced whole, so config modifiers that rewrite a kind of position reach it,
# and a dense layer can sit among MoE ones).
KIND_KEYS = ("attention", "position", "mlp")


class StackKeys(dict):
  """The keys of one kind of stack, made by its builder (`decoder_keys`, `encoder_keys`,
  `encoder_decoder_keys`, `denoiser.denoiser_keys`): what `config(stack=...)` adds to the
  shared keys."""

  @classmethod
  def declared(cls, arguments: dict, *, inputs: str | None = None) -> "StackKeys":
    """A builder's keys: its keyword arguments (`locals()` on entry), so that each key is
    named once, in the builder's signature with its default. `inputs`: the argument holding
    the keys of an input kind (`patch_inputs`, `frame_inputs`), merged in; without them the
    stack's inputs are tokens."""
    keys = dict(arguments)
    if inputs is None:
      return cls(keys)
    return cls({"inputs": "tokens", **(keys.pop(inputs) or {}), **keys})


def layer_config(cfg, i: int) -> ml_collections.ConfigDict:
  """The config layer `i` is built from: `cfg` with its layer kind's changes."""
  pattern = tuple(cfg.layer_pattern)
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
    if changes.position.kind == "learned":
      raise UserError(
        f"model.layer_kinds.{kind}.position is learned: a layer kind's position may rotate or "
        "bias attention (rope, alibi, none), not add to the embeddings."
      )
    out.position = ml_collections.ConfigDict(changes.position.to_dict())
  if "mlp" in changes:
    out.mlp = ml_collections.ConfigDict(changes.mlp.to_dict())
  return out


def pattern_period(cfg) -> int:
  return len(cfg.layer_pattern) or 1


class BlockStack(nnx.Module):
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
    period = pattern_period(cfg)
    kinds = [layer_config(cfg, j) for j in range(period)]
    own = [k.position.to_dict() != cfg.position.to_dict() for k in kinds]
    self.layer_positions = (
      nnx.List(
        [position.make(k.position, **kw) if o else None for k, o in zip(kinds, own, strict=True)]
      )
      if any(own)
      else None
    )

  def _make_blocks(self, cfg, rngs, *, path: tuple = (), cross_attention: bool = False):
    """The blocks; `path`: where this stack sits in its model (its attribute there, () for the
    model itself), which names its parameters' running gradient sums (common/nn/accumulate.py)."""
    block.check_placement(cfg)
    self.path = tuple(path)
    # Under QLoRA each layer's kernels are stored quantized as soon as it is built (the values
    # those of quantizing the whole model afterwards), so a fresh init holds one layer in fp32.
    base_quant = cfg.lora.base_quant if "lora" in cfg else ""
    blocks = [
      qlora.store(
        block.Block(layer_config(cfg, i), cross_attention=cross_attention, rngs=rngs),
        base_quant,
        layer=".".join(map(str, (*path, stacking.BLOCKS, i))),
      )
      for i in range(cfg.num_layers)
    ]
    self.remat, self.scan = cfg.remat, cfg.scan
    self.period = pattern_period(cfg)
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

  def layer(self, i: int) -> block.Block:
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
      path=self.path,
      per_slot=per_slot,
      positions_BT=positions_BT,
      segment_ids_BT=segment_ids_BT,
      position=layer_position,
      **source,
    )
