"""The Whisper family: transformers' parameter counts of the published presets, cached greedy
decoding against the whole model recomputed for every token, and padded audio frames."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from nnx_zoo.common import engine, models
from nnx_zoo.zoo.whisper import model as whisper

BIG = ("whisper-medium", "whisper-large-v2", "whisper-large-v3", "whisper-large-v3-turbo")


@pytest.mark.parametrize(
  "preset",
  [pytest.param(p, marks=pytest.mark.slow) if p in BIG else p for p in sorted(whisper.HF_PARAMS)],
)
def test_presets_have_transformers_parameter_counts(preset):
  """HF_PARAMS is what transformers 5.25 counts on the meta device; it holds the encoder's
  sinusoids as a frozen [max_source_positions, D] weight, which the zoo computes."""
  cfg = whisper.config(preset)
  assert cfg.position.max_len == 1500
  assert models.num_fixed(cfg) == 1500 * cfg.dim
  assert models.num_params(cfg) + models.num_fixed(cfg) == whisper.HF_PARAMS[preset]


def tiny(seed=0, **overrides):
  """The tiny Whisper with weights large enough that attention is far from uniform."""
  model = models.build(whisper.config("tiny", **overrides), seed=seed)
  rng = np.random.default_rng(seed)
  for _, p in nnx.iter_graph(model):
    if isinstance(p, nnx.Param) and p.get_value().ndim == 2:
      p.set_value(jnp.asarray(0.3 * rng.standard_normal(p.get_value().shape), jnp.float32))
  return model


@pytest.mark.slow
def test_cached_greedy_decoding_equals_full_forward():
  model = tiny(num_layers=1, num_decoder_layers=2)
  frames = jnp.asarray(np.random.default_rng(0).standard_normal((2, 100, 80)), jnp.float32)
  want = engine.generate_seq2seq_stepwise(model, frames, max_new_tokens=6)
  got = engine.generate_seq2seq(
    model, frames, max_new_tokens=6, rng=jax.random.key(0), temperature=0.0
  )
  assert got.dtype == jnp.int32
  np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
  assert len(set(np.asarray(got).ravel().tolist())) > 1  # not one token repeated
  # After a forced prompt (Whisper's start, language, task), with tokens suppressed: always the
  # first greedy token, at the first step the second one.
  prompt, suppress, begin = [1, 7, 9], [int(want[0, 0])], [int(want[1, 0]), 40]
  kw = dict(decoder_prompt=prompt, suppress_ids=suppress, begin_suppress_ids=begin)
  want = engine.generate_seq2seq_stepwise(model, frames, max_new_tokens=4, **kw)
  got = engine.generate_seq2seq(
    model, frames, max_new_tokens=4, rng=jax.random.key(0), temperature=0.0, **kw
  )
  np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
  assert suppress[0] not in np.asarray(got) and begin[0] not in np.asarray(got)[:, 0]


@pytest.mark.slow
def test_padded_frames_are_unseen():
  """Frames marked 0 (padding) change nothing: a row cut short equals its padded form."""
  model = tiny(num_layers=1, num_decoder_layers=1)
  rng = np.random.default_rng(1)
  frames = rng.standard_normal((1, 100, 80)).astype(np.float32)
  segments = np.ones((1, 100), np.int32)
  segments[:, 60:] = 0
  noisy = frames.copy()
  noisy[:, 61:] = 5 * rng.standard_normal((1, 39, 80))  # frame 60 sits under window 30's edge
  dec = jnp.asarray([[1, 5, 7]], jnp.int32)
  a = model(jnp.asarray(frames), dec, segment_ids_BS=jnp.asarray(segments))
  b = model(jnp.asarray(noisy), dec, segment_ids_BS=jnp.asarray(segments))
  np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5)


def test_zoo_show_prints_transformers_count(capsys):
  """`zoo show` adds the fixed sinusoids to the count, as transformers counts them."""
  from nnx_zoo.common import cli, experiments

  assert cli.main(["show", "speech/spoken-digits"]) == 0
  out = capsys.readouterr().out
  cfg = experiments.get_config("speech/spoken-digits").model
  fixed = models.num_fixed(cfg)
  assert fixed == cfg.position.max_len * cfg.dim
  assert f"# parameters: {models.num_params(cfg):,}" in out
  assert f"(transformers' count): {models.num_params(cfg) + fixed:,}" in out
