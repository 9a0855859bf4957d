"""The T5 family and the shared encoder-decoder: published parameter counts, decoding with KV
caches (the encoder run once, cross-attention keys and values projected once) against the whole
model recomputed for every token, packing and padding of the source, remat and scan, and the
errors of the wrong generation path."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from nnx_zoo.common import engine, models
from nnx_zoo.common.errors import UserError
from nnx_zoo.common.nn import stacking, transformer
from nnx_zoo.zoo.llama import model as llama
from nnx_zoo.zoo.t5 import model as t5

# transformers 5.24 on the meta device (see zoo/t5/model.py); v1.1 and FLAN-T5 with their
# checkpoints' own lm_head.
PUBLISHED = {"t5-small": 60_506_624, "t5-v1.1-small": 76_961_152, "flan-t5-small": 76_961_152}


@pytest.mark.parametrize("preset", sorted(PUBLISHED))
def test_presets_have_published_parameter_counts(preset):
  assert models.num_params(t5.config(preset)) == PUBLISHED[preset]


def tiny(seed=0, **overrides):
  """The tiny T5 with weights large enough that attention is far from uniform and greedy
  decoding does not repeat one token."""
  model = models.build(t5.config("tiny", vocab_size=64, **overrides), seed=seed)
  rng = np.random.default_rng(seed)
  for _, p in nnx.iter_graph(model):
    if isinstance(p, nnx.Param) and p.get_value().ndim == 2:
      p.set_value(jnp.asarray(0.3 * rng.standard_normal(p.get_value().shape), jnp.float32))
  return model


@nnx.jit
def forward(model, tokens, dec, segments=None, dec_segments=None):
  """The model under jit: op by op, a T5 forward takes seconds on a busy CPU."""
  return model(tokens, dec, segment_ids_BS=segments, decoder_segment_ids_BT=dec_segments)


def source(seed=0, B=2, S=11):
  rng = np.random.default_rng(seed)
  segments = np.ones((B, S), np.int32)
  segments[1, -4:] = 0  # a padded row
  return jnp.asarray(rng.integers(0, 64, (B, S)), jnp.int32), jnp.asarray(segments)


@pytest.mark.slow
@pytest.mark.parametrize(
  "overrides",
  [dict(), dict(activation="relu", tie_embeddings=True, num_layers=1, num_decoder_layers=3)],
  ids=["v1.1", "original-deeper-decoder"],
)
def test_cached_greedy_decoding_equals_full_forward(overrides):
  model = tiny(**overrides)
  tokens, segments = source()
  got = engine.generate_seq2seq(
    model, tokens, segment_ids_BS=segments, max_new_tokens=8, rng=jax.random.key(0), temperature=0
  )
  want = engine.generate_seq2seq_stepwise(model, tokens, segment_ids_BS=segments, max_new_tokens=8)
  np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
  assert len(np.unique(np.asarray(want))) > 2, "a degenerate test: decoding repeats one token"


def test_decode_logits_equal_teacher_forced_logits():
  """Step by step through the cache, each step's logits are the full forward's at that
  position (not just their argmax)."""
  model = tiny()
  tokens, segments = source(1)
  decoder_tokens = jnp.asarray(np.random.default_rng(2).integers(0, 64, (2, 6)), jnp.int32)
  want = forward(model, tokens, decoder_tokens, segments)

  @nnx.jit
  def start(model, tokens, segments):
    source_BSD = model.encode(tokens, segment_ids_BS=segments)
    return model.init_cache(source_BSD, 6, segment_ids_BS=segments)

  step = nnx.jit(lambda model, token, cache: model.decode(token, cache=cache))
  cache, got = start(model, tokens, segments), []
  for t in range(6):
    logits, cache = step(model, decoder_tokens[:, t : t + 1], cache)
    got.append(logits[:, 0])
  np.testing.assert_allclose(np.stack(got, 1), want, atol=1e-4, rtol=1e-4)


@pytest.mark.slow
def test_padding_and_packing_of_the_source():
  """Padded source tokens change nothing; two pairs packed in a row (segments 1 and 2 of the
  source and of the decoder) give the logits each gives alone."""
  model = tiny()
  tokens, segments = source(3)
  dec = jnp.asarray(np.random.default_rng(4).integers(0, 64, (2, 5)), jnp.int32)
  base = forward(model, tokens, dec, segments)
  other = tokens.at[1, -4:].set(7)
  np.testing.assert_allclose(forward(model, other, dec, segments), base, atol=1e-6)

  a_src, b_src, a_dec, b_dec = tokens[0, :5], tokens[0, 5:], dec[0, :2], dec[0, 2:]
  packed = forward(
    model,
    jnp.concatenate([a_src, b_src])[None],
    jnp.concatenate([a_dec, b_dec])[None],
    jnp.asarray([[1] * 5 + [2] * 6]),
    jnp.asarray([[1] * 2 + [2] * 3]),
  )
  alone = [forward(model, s[None], d[None]) for s, d in ((a_src, a_dec), (b_src, b_dec))]
  np.testing.assert_allclose(packed, jnp.concatenate(alone, axis=1), atol=1e-4, rtol=1e-4)


def test_decoder_is_causal_by_gradients():
  model = tiny()
  tokens, _ = source(5)
  dec = jax.random.normal(jax.random.key(0), (2, 6, 64))

  def out_at_2(x_BTD):  # the decoder's output at position 2 as a function of its inputs
    pos = jnp.broadcast_to(jnp.arange(6), (2, 6))
    src = model.encode(tokens)
    h, _ = model.decoder(x_BTD, positions_BT=pos, segment_ids_BT=None, source_BSD=src)
    return h[:, 2].sum()

  g = np.abs(np.asarray(jax.jit(jax.grad(out_at_2))(dec))).sum(axis=(0, 2))
  assert (g[:3] > 0).all() and (g[3:] == 0).all(), g


@pytest.mark.slow
@pytest.mark.parametrize(
  "levers", [dict(remat="full"), dict(scan=True), dict(remat="save_dots", scan=True)]
)
def test_remat_and_scan_change_nothing(levers):
  """Loss and gradients (the encoder's too, reached through cross-attention) as without."""
  cfg = t5.config("tiny", vocab_size=64, num_layers=3, num_decoder_layers=2)
  tokens, segments = source(6)
  dec = jnp.asarray(np.random.default_rng(7).integers(0, 64, (2, 5)), jnp.int32)

  def loss_and_grads(cfg):
    graphdef, params = nnx.split(models.build(cfg, seed=1), nnx.Param)

    def loss(p):
      return jnp.mean(nnx.merge(graphdef, p)(tokens, dec, segment_ids_BS=segments) ** 2)

    return jax.jit(jax.value_and_grad(loss))(params)

  want_loss, want = loss_and_grads(cfg)
  cfg.update(levers)
  got_loss, got = loss_and_grads(cfg)  # same seed, the same weights (stacked if scanned)
  got = stacking.unstack_layers(got)
  np.testing.assert_allclose(got_loss, want_loss, rtol=1e-6)
  flat_got, flat_want = dict(nnx.to_flat_state(got)), dict(nnx.to_flat_state(want))
  assert flat_got.keys() == flat_want.keys()
  assert any(k[0] == "encoder" for k in flat_want)
  for k in flat_want:
    np.testing.assert_allclose(flat_got[k][...], flat_want[k][...], atol=1e-6, rtol=1e-5)


def test_wrong_generation_path_is_one_clear_error():
  with pytest.raises(
    UserError, match="encoder-decoder model: generate with engine.generate_seq2seq"
  ):
    engine.generate(tiny(), jnp.ones((1, 3), jnp.int32), max_new_tokens=2, rng=jax.random.key(0))
  decoder = models.build(llama.config("tiny"))
  with pytest.raises(UserError, match="Decoder is not an encoder-decoder"):
    engine.generate_seq2seq(
      decoder, jnp.ones((1, 3), jnp.int32), max_new_tokens=2, rng=jax.random.key(0)
    )


def test_cross_attention_block_without_source_is_a_user_error():
  model = tiny()
  x = jnp.zeros((1, 3, 64))
  pos = jnp.broadcast_to(jnp.arange(3), (1, 3))
  with pytest.raises(UserError, match="needs the source"):
    model.decoder(x, positions_BT=pos, segment_ids_BT=None)
  with pytest.raises(UserError, match="output_scale"):
    models.build(t5.config("tiny", output_scale="sqrt"))
  assert isinstance(model, transformer.EncoderDecoder)
