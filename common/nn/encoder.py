"""The encoder stack: tokens or images as patches in, hidden states out, with its pooler and
classifier head (BERT, ViT, CLIP's towers). Feature frames are an encoder-decoder's input
(common/nn/encoder_decoder.py)."""

import jax
import jax.numpy as jnp
from flax import nnx

from nnx_zoo.common.errors import UserError
from nnx_zoo.common.nn import norms, position
from nnx_zoo.common.nn.linear import Embedding, Linear, dtypes, normal
from nnx_zoo.common.nn.patch import PatchEmbed
from nnx_zoo.common.nn.stack import BlockStack, StackKeys

INPUTS = ("tokens", "patches")

# What `Encoder.pool` reads: the first token ([CLS], a class token), the largest id of each row
# (CLIP's end-of-text token, as HF's CLIP with eos_token_id 2), the first `end_token`, or the
# mean of every token (images, which have no padding: big_vision's ViT "gap").
POOL_AT = ("first", "argmax", "end_token", "mean")


def encoder_keys(
  *,
  images: dict | None = None,
  type_vocab_size: int = 0,
  embed_norm: bool = False,
  final_norm: bool = True,
  pooler: bool = False,
  num_labels: int = 0,
  pool_at: str = "",
  end_token: int | None = None,
) -> StackKeys:
  """An `Encoder`'s keys: its inputs, tokens or (`images`, `patch_inputs`' keys) images;
  `type_vocab_size` (BERT's token types; 0: none), a norm after the embeddings (`embed_norm`)
  and after the blocks (`final_norm`), BERT's tanh `pooler`, a classifier head of `num_labels`
  classes (0: none), and `pool_at`, the token a classifier or projection reads (encoder.POOL_AT;
  "": the pooler's, the first), `end_token` the id it reads at with pool_at="end_token"."""
  return StackKeys.declared(locals(), inputs="images")


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
  """The `Encoder` keys of image inputs, to pass to `encoder_keys(images=...)`: images
  [B, image_size, image_size, channels] in [0, 1], normalised as (x - pixel_mean) / pixel_std
  per channel (what a Hugging Face image processor does after scaling to [0, 1]), cut into
  patch x patch patches embedded by `PatchEmbed` (with a bias if `patch_bias`), after a learned
  class token if `class_token`. The learned positions need
  max_len = (image_size / patch)^2 + class_token."""
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


def num_patches(cfg) -> int:
  """The encoder's sequence length for images (a config, or `patch_inputs`' keys): the patches
  and the class token."""
  return (cfg["image_size"] // cfg["patch"]) ** 2 + int(cfg["class_token"])


def check_patches(cfg):
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


class Encoder(BlockStack):
  """tokens (+ token types), or images as patches after a class token (`inputs`, see
  `patch_inputs`) -> (+ learned positions) -> norm (if embed_norm) -> blocks -> norm (if
  final_norm) -> hidden states [B, T, D]; `pool` and `classify` for the pooled token (BERT's
  tanh pooler on it if `pooler`) and a classification head (BERT, ViT)."""

  def __init__(self, cfg, *, path: tuple = (), rngs: nnx.Rngs):
    """`path`: the encoder's attribute in the model that holds it (CLIP's towers), () if it is
    the model."""
    dt = dtypes(cfg)
    self.inputs = cfg.inputs
    if self.inputs not in INPUTS:
      raise UserError(f"Unknown model.inputs {self.inputs!r}: use one of {INPUTS}.")
    if self.inputs == "tokens":
      self.embed = Embedding(cfg.vocab_size, cfg.dim, init_std=cfg.init_std, rngs=rngs, **dt)
      self.patch_embed = self.class_token = None
    else:
      self.embed = None
      self._make_patches(cfg, rngs, dt)
    self.token_type = (
      Embedding(cfg.type_vocab_size, cfg.dim, init_std=cfg.init_std, rngs=rngs, **dt)
      if cfg.type_vocab_size
      else None
    )
    self._make_positions(cfg, rngs, dt)
    self.embed_norm = norms.make(cfg.norm, cfg.dim, **dt) if cfg.embed_norm else None
    self._make_blocks(cfg, rngs, path=path)
    self.norm = norms.make(cfg.norm, cfg.dim, **dt) if cfg.final_norm else None
    self.pooler = (
      Linear(
        cfg.dim, cfg.dim, use_bias=True, axes=("D", None), init_std=cfg.init_std, rngs=rngs, **dt
      )
      if cfg.pooler
      else None
    )
    # "": BERT's, which pools only through its pooler (HF's BertModel has no other pooled output).
    self.pool_at = cfg.pool_at
    if self.pool_at and self.pool_at not in POOL_AT:
      raise UserError(f"Unknown model.pool_at {self.pool_at!r}: use one of {POOL_AT}.")
    self.end_token = cfg.end_token if self.pool_at == "end_token" else None
    num_labels = cfg.num_labels
    if num_labels and self.pooler is None and not self.pool_at:
      raise UserError("model.num_labels > 0 needs model.pooler=True: the head reads the pooler.")
    self.head = (
      Linear(cfg.dim, num_labels, use_bias=True, init_std=cfg.init_std, rngs=rngs, **dt)
      if num_labels
      else None
    )

  def _make_patches(self, cfg, rngs, dt):
    check_patches(cfg)
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
    """Final hidden states [B, T, D] of tokens [B, T] or images [B, H, W, C].

    `attention_mask` [B, T] (1 = token, 0 = padding), as Hugging Face's: no token attends to
    padding. It is folded into the segment ids, so padding positions attend only to each
    other and their outputs mean nothing (HF's do not either). Positions count from the start of
    the row, padding included, as HF's absolute position ids; `segment_ids_BT` (packed rows)
    restarts them per segment.
    """
    if self.inputs == "patches":
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
