"""The encoder-decoder (T5, Whisper): an encoder stack, and a decoder stack whose blocks
cross-attend to the encoder's output."""

import jax
import jax.numpy as jnp
import ml_collections
from flax import nnx

from nnx_zoo.common.errors import UserError
from nnx_zoo.common.nn import head, norms, position
from nnx_zoo.common.nn.block import CrossCache
from nnx_zoo.common.nn.linear import Embedding, dtypes
from nnx_zoo.common.nn.patch import ConvStem, stem_length
from nnx_zoo.common.nn.stack import BlockStack, StackKeys

OUTPUT_SCALES = ("none", "rsqrt_dim")
INPUTS = ("tokens", "frames")


def encoder_decoder_keys(
  *,
  num_decoder_layers: int,
  decoder_position: ml_collections.ConfigDict,
  decoder_start_id: int,
  frames: dict | None = None,
  shared_embeddings: bool = True,
  tie_embeddings: bool = True,
  output_scale: str = "none",
  final_softcap: float = 0.0,
) -> StackKeys:
  """An `EncoderDecoder`'s keys: the decoder's `num_decoder_layers` and `decoder_position`
  (the encoder's are the shared num_layers and position), `decoder_start_id` (the decoder's
  first input: targets are shifted right after it); the encoder's inputs, tokens or (`frames`,
  `frame_inputs`' keys) feature frames; `shared_embeddings` (one token table for both sides),
  `tie_embeddings` (the output head is the decoder's table), `output_scale` ("none", or
  "rsqrt_dim": the decoder's output times D ** -0.5 before the head, transformers' T5
  `scale_decoder_outputs`) and `final_softcap` (as the Decoder's)."""
  return StackKeys.declared(locals(), inputs="frames")


def frame_inputs(
  *,
  channels: int,
  width: int = 3,
  strides: tuple[int, ...] = (1, 2),
  activation: str = "gelu_exact",
) -> dict:
  """The keys of an encoder whose inputs are feature frames [B, T, channels] (log-mel
  spectrograms: Whisper's 80 or 128 bins), to pass to `encoder_decoder_keys(frames=...)`: a
  `ConvStem` of one 1-D convolution of `width` taps per entry of `strides`, each followed by
  `activation` (an MLP activation's name), makes the encoder's T' = ~T / prod(strides)
  inputs."""
  return {
    "inputs": "frames",
    "channels": channels,
    "stem_width": width,
    "stem_strides": tuple(strides),
    "stem_activation": activation,
  }


def num_frames_out(cfg, frames: int) -> int:
  """The encoder's sequence length for `frames` input frames (a config with `frame_inputs`)."""
  return stem_length(frames, width=cfg["stem_width"], strides=cfg["stem_strides"])


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


def encoder_decoder_sides(cfg) -> tuple[ml_collections.ConfigDict, ml_collections.ConfigDict]:
  """The configs of an `EncoderDecoder`'s two stacks. The encoder's is `cfg` (its attention
  mask, `position`, `num_layers`); the decoder's has `num_decoder_layers`, `decoder_position`,
  causal self-attention (it generates one token after another); its blocks cross-attend
  (`Stack(..., cross_attention=True)`)."""
  encoder = ml_collections.ConfigDict(cfg.to_dict())
  decoder = ml_collections.ConfigDict(cfg.to_dict())
  decoder.num_layers = cfg.num_decoder_layers
  decoder.position = ml_collections.ConfigDict(cfg.decoder_position.to_dict())
  decoder.attention.mask = "causal"
  return encoder, decoder


class Stack(BlockStack):
  """One side of an `EncoderDecoder`: positions, blocks and the final norm (the embeddings are
  the model's, which the two sides may share); the decoder's blocks cross-attend to the source
  (`cross_attention`)."""

  def __init__(self, cfg, *, path: tuple, cross_attention: bool = False, rngs: nnx.Rngs):
    dt = dtypes(cfg)
    self._make_positions(cfg, rngs, dt)
    self._make_blocks(cfg, rngs, path=path, cross_attention=cross_attention)
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

  Its keys beyond the shared ones are `encoder_decoder_keys`' (T5's decoder_position is
  relative, not bidirectional; an encoder of feature frames, Whisper's, has a conv stem and no
  token table on that side: the model's `embed` is then the decoder's). `attention` is the
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
    self.inputs = cfg.inputs
    if self.inputs not in INPUTS:
      raise UserError(f"Unknown model.inputs {self.inputs!r}: use one of {INPUTS}.")
    if self.inputs == "frames" and not cfg.shared_embeddings:
      raise UserError("An encoder of frames has no token table: set shared_embeddings=True.")
    self.stem = make_stem(cfg, rngs, dt) if self.inputs == "frames" else None
    self.embed = Embedding(cfg.vocab_size, cfg.dim, init_std=cfg.init_std, rngs=rngs, **dt)
    self.decoder_embed = (
      None
      if cfg.shared_embeddings
      else Embedding(cfg.vocab_size, cfg.dim, init_std=cfg.init_std, rngs=rngs, **dt)
    )
    self.embed_scale = head.embed_scale(cfg)
    self.encoder = Stack(encoder_cfg, path=("encoder",), rngs=rngs)
    self.decoder = Stack(decoder_cfg, path=("decoder",), cross_attention=True, rngs=rngs)
    self.lm_head = head.make_lm_head(cfg, rngs, dt)
    self.output_scale = cfg.dim**-0.5 if cfg.output_scale == "rsqrt_dim" else None
    self.final_softcap = cfg.final_softcap or None  # the config's 0: no cap
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
    return head.embed(table, tokens_BT, self.embed_scale)

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
    return head.output_head(
      self._decoder_table(), self.lm_head, cap=self.final_softcap, scale=self.output_scale
    )

  def logits(self, x_BTD):
    module, project = self.output_head()
    return project(module, x_BTD)

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
