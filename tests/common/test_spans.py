"""T5 span corruption (common/data/spans.py): lengths, noise statistics, exact reconstruction."""

import numpy as np
import pytest

from nnx_zoo.common.data import spans
from nnx_zoo.common.errors import UserError

V = 1000  # vocab: ids 0..V-1, the top ones sentinels
FLOOR = 800  # rows use ids below it; no row here has 200 spans


def t5_random_spans_helper(inputs_length, noise_density, mean_noise_span_length):
  """Transcribed from T5's preprocessors.random_spans_helper (extra tokens per span 1 and 1)."""

  def _tokens_length_to_inputs_length_targets_length(tokens_length):
    num_noise_tokens = int(round(tokens_length * noise_density))
    num_nonnoise_tokens = tokens_length - num_noise_tokens
    num_noise_spans = int(round(num_noise_tokens / mean_noise_span_length))
    return (num_nonnoise_tokens + num_noise_spans + 1, num_noise_tokens + num_noise_spans + 1)

  tokens_length = inputs_length - 1
  while _tokens_length_to_inputs_length_targets_length(tokens_length + 1)[0] <= inputs_length:
    tokens_length += 1
  inputs_length, targets_length = _tokens_length_to_inputs_length_targets_length(tokens_length)
  if noise_density == 0.5 and targets_length > inputs_length:
    tokens_length -= 1
    targets_length -= 1
  return tokens_length, targets_length


def reconstruct(inputs, targets, vocab_size):
  """The original row from inputs and targets (EOS and padding already cut): each sentinel of
  the inputs replaced by what follows the same sentinel in the targets."""
  fill, current = {}, None
  for t in targets:
    if t >= FLOOR:
      current = t
      fill[current] = []
    else:
      fill[current].append(t)
  out = []
  for t in inputs:
    out += fill[t] if t >= FLOOR else [t]
  return out


def test_lengths_match_t5():
  # The published T5 pre-training shapes (inputs 512 -> rows of 568 tokens, targets 114).
  assert spans.lengths(512) == (568, 114)
  for inputs_length in range(20, 600, 7):
    for density, mean in [(0.15, 3.0), (0.3, 5.0), (0.5, 3.0), (0.1, 2.0)]:
      assert spans.lengths(
        inputs_length, noise_density=density, mean_span=mean
      ) == t5_random_spans_helper(inputs_length, density, mean), (inputs_length, density, mean)


def test_noise_fraction_and_mean_span_length():
  rng = np.random.default_rng(0)
  noise, runs, total = 0, [], 0
  for _ in range(500):
    mask = spans.noise_mask(200, rng, noise_density=0.15, mean_span=3.0)
    assert not mask[0] and mask[-1]  # starts kept, ends dropped, as T5
    noise += mask.sum()
    total += len(mask)
    edges = np.flatnonzero(np.diff(np.concatenate([[0], mask.astype(int), [0]])))
    runs += list(edges[1::2] - edges[::2])
  assert noise / total == pytest.approx(0.15, abs=0.005)
  assert np.mean(runs) == pytest.approx(3.0, abs=0.1)
  assert min(runs) >= 1


def test_inputs_and_targets_reconstruct_the_row_with_sentinels_in_order():
  inputs_length = 64
  tokens_length, targets_length = spans.lengths(inputs_length)
  rows = np.random.default_rng(1).integers(2, FLOOR, (50, tokens_length))
  out = spans.corrupt_rows(rows, seed=7, vocab_size=V, inputs_length=inputs_length, eos_id=1)
  assert out["inputs"].shape == (50, inputs_length) and out["targets"].shape == (50, targets_length)
  # A row of tokens_length tokens fills both exactly (no padding): the lengths are T5's.
  assert (out["input_segment_ids"] == 1).all() and (out["target_segment_ids"] == 1).all()
  for r, row in enumerate(rows):
    inputs, targets = out["inputs"][r], out["targets"][r]
    assert inputs[-1] == 1 and targets[-1] == 1  # EOS
    assert reconstruct(inputs[:-1], targets[:-1], V) == list(row)
    in_sentinels = [t for t in inputs if t >= FLOOR]
    out_sentinels = [t for t in targets if t >= FLOOR]
    # <extra_id_0> = V - 1, then descending, the same ones in both, the targets starting with one.
    assert in_sentinels == out_sentinels == list(range(V - 1, V - 1 - len(in_sentinels), -1))
    assert targets[0] == V - 1


def test_short_rows_are_padded_and_still_reconstruct():
  inputs_length = 40
  tokens_length, targets_length = spans.lengths(inputs_length)
  rng = np.random.default_rng(2)
  for n in [2, 3, 10, tokens_length - 1]:
    row = rng.integers(2, FLOOR, n)
    out = spans.corrupt_row(row, rng, vocab_size=V, inputs_length=inputs_length, pad_id=0)
    assert out["inputs"].shape == (inputs_length,) and out["targets"].shape == (targets_length,)
    k_in, k_out = out["input_segment_ids"].sum(), out["target_segment_ids"].sum()
    assert (out["inputs"][k_in:] == 0).all() and (out["targets"][k_out:] == 0).all()
    assert reconstruct(out["inputs"][:k_in], out["targets"][:k_out], V) == list(row)


def test_deterministic_per_seed_and_row():
  kw = dict(vocab_size=V, inputs_length=60)
  rows = np.random.default_rng(3).integers(2, FLOOR, (8, spans.lengths(60)[0]))
  a = spans.corrupt_rows(rows, seed=5, **kw)
  b = spans.corrupt_rows(rows, seed=5, **kw)
  c = spans.corrupt_rows(rows, seed=6, **kw)
  for k in a:
    np.testing.assert_array_equal(a[k], b[k])
  assert not np.array_equal(a["inputs"], c["inputs"])
  # A row's corruption depends on (seed, its index) only, not on the other rows.
  alone = spans.corrupt_rows(rows[:3], seed=5, **kw)
  np.testing.assert_array_equal(alone["inputs"], a["inputs"][:3])


def test_refuses_tokens_that_collide_with_sentinels_and_long_rows():
  row = np.array([5, 6, 7, 8, 9, 10, 11, 999])
  with pytest.raises(UserError, match="sentinel ids"):
    spans.corrupt(row, np.array([0, 0, 1, 0, 0, 0, 0, 1], bool), vocab_size=V)
  with pytest.raises(UserError, match="longer than"):
    spans.corrupt_row(np.arange(100), np.random.default_rng(0), vocab_size=V, inputs_length=20)
  with pytest.raises(UserError, match="noise_density"):
    spans.lengths(20, noise_density=1.5)
