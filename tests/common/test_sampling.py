"""Sampling rules of common/sampling.py against independent references: greedy, top-k, top-p
(nucleus) and temperature."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from nnx_zoo.common import programs, sampling


def test_sample_logits_temperature_zero_and_top_k_one_are_argmax():
  logits = jnp.asarray(np.random.default_rng(12).standard_normal((64, 32)), jnp.float32)
  want = np.argmax(np.asarray(logits), -1)
  np.testing.assert_array_equal(
    sampling.sample_logits(logits, jax.random.key(0), temperature=0, top_k=0, top_p=1.0), want
  )
  for seed in range(3):
    got = sampling.sample_logits(logits, jax.random.key(seed), temperature=1.5, top_k=1, top_p=1.0)
    np.testing.assert_array_equal(got, want)


def draw(logits_V, n=512, seed=0, **kw):
  """The set of tokens drawn in n independent samples from one row of logits."""
  logits_BV = jnp.tile(jnp.asarray(logits_V, jnp.float32)[None], (n, 1))
  return set(np.asarray(sampling.sample_logits(logits_BV, jax.random.key(seed), **kw)).tolist())


@pytest.mark.parametrize(
  "top_p,want",
  [(0.3, {2}), (0.75, {2, 0}), (0.85, {2, 0, 3}), (0.99, {2, 0, 3, 1}), (1.0, {2, 0, 3, 1})],
)
def test_top_p_keeps_the_smallest_set_reaching_p(top_p, want):
  # Probabilities by construction: token 2: 0.5, 0: 0.3, 3: 0.15, 1: 0.05.
  logits = np.log([0.3, 0.05, 0.5, 0.15])
  assert draw(logits, temperature=1.0, top_k=0, top_p=top_p) == want


def np_nucleus(logits_V, temperature, top_p):
  """Independent reference: sort by probability, keep tokens until their mass reaches top_p."""
  z = np.asarray(logits_V, np.float64) / temperature
  p = np.exp(z - z.max())
  p /= p.sum()
  keep, mass = set(), 0.0
  for i in np.argsort(-p):
    keep.add(int(i))
    mass += p[i]
    if mass >= top_p:
      break
  return keep


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_top_p_samples_stay_in_the_nucleus(temperature):
  rng = np.random.default_rng(13)
  for seed in range(3):
    logits = rng.standard_normal(16) * 2
    got = draw(logits, n=256, seed=seed, temperature=temperature, top_k=0, top_p=0.6)
    assert got <= np_nucleus(logits, temperature, 0.6)


@pytest.mark.parametrize("top_k", [1, 3, 5])
def test_temperature_sampling_stays_in_top_k(top_k):
  rng = np.random.default_rng(14)
  for seed in range(3):
    logits = rng.standard_normal(32)
    top = set(np.argsort(-logits)[:top_k].tolist())
    got = draw(logits, n=256, seed=seed, temperature=2.0, top_k=top_k, top_p=1.0)
    assert got <= top
    if top_k > 1:
      assert len(got) > 1  # sampling, not argmax


def tiny_decoder():
  from nnx_zoo.common import models
  from nnx_zoo.zoo.llama import model as llama

  return models.build(llama.config("tiny", vocab_size=64), seed=3)


def test_stop_ids_end_each_row_where_it_stops_and_nothing_else_changes():
  """A row stops at its first stop token (filled with it after), the rows that do not stop are
  the tokens they would have been, and padding the prompt to its bucket changes nothing: the
  same tokens as the stepwise reference, which pads nothing."""
  model = tiny_decoder()
  prompt = np.random.default_rng(0).integers(0, 64, (3, 7))
  free = np.asarray(
    sampling.generate(model, prompt, max_new_tokens=12, rng=jax.random.key(0), temperature=0)
  )
  np.testing.assert_array_equal(free, sampling.generate_stepwise(model, prompt, max_new_tokens=12))
  stop = int(free[0, 7 + 4])  # row 0's fifth new token
  got = np.asarray(
    sampling.generate(
      model, prompt, max_new_tokens=12, rng=jax.random.key(0), temperature=0, stop_ids=(stop,)
    )
  )
  for row_free, row in zip(free[:, 7:], got[:, 7:], strict=True):
    hits = np.flatnonzero(row_free == stop)
    end = hits[0] + 1 if len(hits) else len(row_free)
    np.testing.assert_array_equal(row[:end], row_free[:end])
    assert (row[end:] == stop).all()


def test_prompts_of_one_bucket_share_a_program(monkeypatch):
  # Without a persistent cache programs.load compiles in this process and keeps each program
  # under its key (test_programs: the saved ones).
  monkeypatch.setattr(programs, "directory", lambda: None)
  monkeypatch.setattr(programs, "_loaded", {})
  model = tiny_decoder()
  for length in (3, 11, sampling.PROMPT_BUCKET):
    sampling.generate(
      model, np.ones((1, length), np.int32), max_new_tokens=4, rng=jax.random.key(0), temperature=0
    )
  assert len(programs._loaded) == 1


# The one loop (`begin`, `decode`): ragged prompts, stop ids, chunks


def ragged_prompts(seed=5):
  rng = np.random.default_rng(seed)
  lengths = np.array([3, 9, 6, 1], np.int32)
  P = 9
  prompt = rng.integers(1, 64, (4, P)) * (np.arange(P)[None] < lengths[:, None])
  return prompt.astype(np.int32), lengths


@pytest.mark.slow
def test_the_loop_on_ragged_prompts_with_stop_ids_equals_the_stepwise_reference():
  """At temperature 0, rows of prompts of 1 to 9 tokens in one batch (a one-token prefill, the
  rest forced) each get the tokens the stepwise reference gives that prompt alone, up to the
  row's first stop id, and the stop id after it."""
  from flax import nnx

  model = tiny_decoder()
  graphdef, params = nnx.split(model)
  prompt, lengths = ragged_prompts()
  N = 10
  free = [
    np.asarray(sampling.generate_stepwise(model, prompt[b : b + 1, :n], max_new_tokens=N))[0, n:]
    for b, n in enumerate(lengths)
  ]
  stop = int(free[0][3])  # row 0's fourth new token
  keys = jax.random.split(jax.random.key(0), 4)
  for prefill in (1, 3):
    state = sampling.begin(
      params, prompt, lengths, keys, graphdef=graphdef, prefill=prefill, max_new_tokens=N
    )
    state = sampling.decode(
      params, state, graphdef=graphdef, steps=9 + N, temperature=0.0, stop_ids=(stop,)
    )
    out = np.asarray(state.tokens_BL)
    assert np.asarray(state.done_B).all()
    for b, n in enumerate(lengths):
      np.testing.assert_array_equal(out[b, :n], prompt[b, :n])
      hits = np.flatnonzero(free[b] == stop)
      end = hits[0] + 1 if len(hits) else N
      np.testing.assert_array_equal(out[b, n : n + end], free[b][:end])
      assert (out[b, n + end : n + N] == stop).all()


@pytest.mark.slow
def test_chunked_equals_unchunked_and_padding_changes_nothing():
  """Sampled (temperature, top-k, top-p), the loop run 3 steps a call, its state passed back,
  writes the tokens one call writes; and each row's tokens do not depend on how far its prompt
  is padded (its keys are folded with the absolute position)."""
  from flax import nnx

  graphdef, params = nnx.split(tiny_decoder())
  prompt, lengths = ragged_prompts(6)
  N = 8
  options = dict(graphdef=graphdef, temperature=1.3, top_k=20, top_p=0.9, stop_ids=(5, 7))

  def start(prompt_BP):
    keys = jax.random.split(jax.random.key(4), 4)
    return sampling.begin(
      params, prompt_BP, lengths, keys, graphdef=graphdef, prefill=1, max_new_tokens=N
    )

  whole = sampling.decode(params, start(prompt), steps=100, **options)
  want = np.asarray(whole.tokens_BL)
  state, calls = start(prompt), 0
  while not np.asarray(state.done_B).all():
    state = sampling.decode(params, state, steps=3, **options)
    calls += 1
  assert calls > 2
  np.testing.assert_array_equal(np.asarray(state.tokens_BL), want)
  assert int(state.t) == int(whole.t)
  wider = sampling.decode(params, start(np.pad(prompt, ((0, 0), (0, 7)))), steps=100, **options)
  np.testing.assert_array_equal(np.asarray(wider.tokens_BL)[:, : 9 + N], want)
