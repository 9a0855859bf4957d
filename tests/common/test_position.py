"""Position encodings against independent references: RoPE (HF rotate_half and its scalings),
ALiBi (the published slopes), learned tables and per-segment positions."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from nnx_zoo.common.errors import UserError
from nnx_zoo.common.nn import position

# ---------------------------------------------------------------------------------------------
# Independent references, written after Hugging Face transformers' modeling_rope_utils.py and
# modeling_llama.py (apply_rotary_pos_emb / rotate_half). Plain numpy, float64.


def hf_default_inv_freq(dim, base):
  return 1.0 / (base ** (np.arange(0, dim, 2, dtype=np.int64).astype(np.float64) / dim))


def hf_linear(dim, base, factor):
  """`_compute_linear_scaling_rope_parameters`."""
  return hf_default_inv_freq(dim, base) / factor, 1.0


def hf_llama3(dim, base, factor, low_freq_factor, high_freq_factor, old_context_len):
  """`_compute_llama3_parameters`."""
  inv_freq = hf_default_inv_freq(dim, base)
  low_freq_wavelen = old_context_len / low_freq_factor
  high_freq_wavelen = old_context_len / high_freq_factor
  wavelen = 2 * math.pi / inv_freq
  inv_freq_llama = np.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
  smooth_factor = (old_context_len / wavelen - low_freq_factor) / (
    high_freq_factor - low_freq_factor
  )
  smoothed = (1 - smooth_factor) * inv_freq_llama / factor + smooth_factor * inv_freq_llama
  is_medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
  return np.where(is_medium, smoothed, inv_freq_llama), 1.0


def hf_yarn(dim, base, factor, original_max, beta_fast=32, beta_slow=1):
  """`_compute_yarn_parameters` (no explicit attention_factor / mscale, truncate=True)."""

  def get_mscale(scale, mscale=1):
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0

  attention_factor = get_mscale(factor)

  def find_correction_dim(num_rotations):
    return (dim * math.log(original_max / (num_rotations * 2 * math.pi))) / (2 * math.log(base))

  low = max(math.floor(find_correction_dim(beta_fast)), 0)
  high = min(math.ceil(find_correction_dim(beta_slow)), dim - 1)
  if low == high:
    high += 0.001
  ramp = np.clip((np.arange(dim // 2, dtype=np.float64) - low) / (high - low), 0, 1)
  pos_freqs = base ** (np.arange(0, dim, 2, dtype=np.float64) / dim)
  inv_freq_extrapolation = 1.0 / pos_freqs
  inv_freq_interpolation = 1.0 / (factor * pos_freqs)
  extrapolation_factor = 1 - ramp
  inv_freq = (
    inv_freq_interpolation * (1 - extrapolation_factor)
    + inv_freq_extrapolation * extrapolation_factor
  )
  return inv_freq, attention_factor


def np_rope(x_BTNH, positions_BT, inv_freq, attention_factor=1.0):
  """HF: x * cos + rotate_half(x) * sin, cos/sin of concat(freqs, freqs), times the factor."""
  x = np.asarray(x_BTNH, np.float64)
  freqs = np.asarray(positions_BT, np.float64)[..., None] * inv_freq  # [B, T, H/2]
  emb = np.concatenate([freqs, freqs], axis=-1)[:, :, None, :]
  cos, sin = np.cos(emb) * attention_factor, np.sin(emb) * attention_factor
  half = x.shape[-1] // 2
  rotated = np.concatenate([-x[..., half:], x[..., :half]], axis=-1)
  return x * cos + rotated * sin


def rope(head_dim=16, theta=10_000.0, scaling=None):
  return position.RoPE(head_dim, theta=theta, scaling=scaling or position.rope_scaling("none"))


def randn(seed, shape):
  return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


# ---------------------------------------------------------------------------------------------
# RoPE


def test_rope_matches_hf_rotate_half():
  x = randn(0, (2, 6, 3, 16))
  positions = np.array([[0, 1, 2, 3, 4, 5], [7, 3, 0, 11, 2, 30]])
  got = rope(16).rotate(jnp.asarray(x), jnp.asarray(positions))
  want = np_rope(x, positions, hf_default_inv_freq(16, 10_000.0))
  np.testing.assert_allclose(np.asarray(got), want, atol=2e-5)


def test_rope_at_position_zero_is_identity_and_keeps_norm():
  x = randn(1, (1, 4, 2, 8))
  r = rope(8)
  np.testing.assert_allclose(r.rotate(x, jnp.zeros((1, 4), jnp.int32)), x, atol=1e-7)
  out = r.rotate(x, jnp.arange(4)[None] * 5)
  np.testing.assert_allclose(np.linalg.norm(out, axis=-1), np.linalg.norm(x, axis=-1), rtol=1e-5)


@pytest.mark.parametrize(
  "scaling",
  [
    position.rope_scaling("none"),
    position.rope_scaling("linear", factor=2.0),
    position.rope_scaling("llama3", factor=8.0, original_max_len=64),
    position.rope_scaling("yarn", factor=4.0, original_max_len=256),
  ],
  ids=lambda s: s.kind,
)
def test_rope_depends_only_on_relative_position(scaling):
  H = 16
  r = rope(H, scaling=scaling)
  q, k = randn(2, (1, 1, 2, H)), randn(3, (1, 1, 2, H))

  def score(m, n):
    qm = r.rotate(q, jnp.full((1, 1), m))
    kn = r.rotate(k, jnp.full((1, 1), n))
    return np.asarray(jnp.sum(qm * kn, axis=-1))  # one dot product per head

  for m, n in [(0, 0), (3, 1), (1, 3), (9, 2)]:
    base = score(m, n)
    for c in (1, 5, 17):
      np.testing.assert_allclose(score(m + c, n + c), base, atol=1e-4, rtol=1e-4)
  # ...and it does depend on the relative position.
  assert not np.allclose(score(3, 1), score(1, 3), atol=1e-3)


def test_linear_scaling_matches_hf():
  scaling = position.rope_scaling("linear", factor=4.0)
  inv, mscale = position.rope_frequencies(32, 10_000.0, scaling)
  want_inv, want_af = hf_linear(32, 10_000.0, 4.0)
  np.testing.assert_allclose(inv, want_inv, rtol=1e-12)
  assert mscale == want_af
  # Linear scaling == positions divided by the factor.
  x = randn(4, (1, 5, 1, 32))
  positions = np.arange(5)[None] * 4
  got = rope(32, scaling=scaling).rotate(x, jnp.asarray(positions))
  np.testing.assert_allclose(
    got, np_rope(x, positions / 4.0, hf_default_inv_freq(32, 1e4)), atol=2e-5
  )


@pytest.mark.parametrize("factor,original", [(8.0, 8192), (32.0, 8192), (4.0, 2048)])
def test_llama3_scaling_matches_hf(factor, original):
  H, theta = 64, 500_000.0
  scaling = position.rope_scaling(
    "llama3",
    factor=factor,
    low_freq_factor=1.0,
    high_freq_factor=4.0,
    original_max_len=original,
  )
  inv, mscale = position.rope_frequencies(H, theta, scaling)
  want, want_af = hf_llama3(H, theta, factor, 1.0, 4.0, original)
  np.testing.assert_allclose(inv, want, rtol=1e-12)
  assert mscale == want_af
  # All three regions (kept, smoothed, divided) are exercised by these shapes.
  base = hf_default_inv_freq(H, theta)
  assert np.any(np.isclose(inv, base)) and np.any(np.isclose(inv, base / factor))
  assert np.any(~np.isclose(inv, base) & ~np.isclose(inv, base / factor))
  x = randn(5, (1, 4, 2, H))
  positions = np.array([[0, 37, 900, 5000]])
  got = rope(H, theta, scaling).rotate(jnp.asarray(x), jnp.asarray(positions))
  # float32 angles at position 5000 are off by up to ~5000 * 2^-24 ~ 3e-4 rad.
  np.testing.assert_allclose(got, np_rope(x, positions, want), atol=2e-3)


@pytest.mark.parametrize(
  "H,theta,factor,original,beta_fast,beta_slow",
  [
    (64, 10_000.0, 4.0, 4096, 32.0, 1.0),
    (32, 1_000_000.0, 8.0, 32768, 32.0, 1.0),
    (16, 10_000.0, 2.0, 512, 16.0, 2.0),
    (64, 10_000.0, 1.0, 4096, 32.0, 1.0),  # factor 1: attention factor exactly 1
  ],
)
def test_yarn_scaling_matches_hf(H, theta, factor, original, beta_fast, beta_slow):
  scaling = position.rope_scaling(
    "yarn", factor=factor, original_max_len=original, beta_fast=beta_fast, beta_slow=beta_slow
  )
  inv, mscale = position.rope_frequencies(H, theta, scaling)
  want, want_af = hf_yarn(H, theta, factor, original, beta_fast, beta_slow)
  np.testing.assert_allclose(inv, want, rtol=1e-12)
  np.testing.assert_allclose(mscale, want_af, rtol=1e-12)
  # The attention factor multiplies cos and sin, as HF's `attention_scaling`.
  x = randn(6, (2, 3, 2, H))
  positions = np.array([[0, 1, 2], [5, 9, 31]])
  got = rope(H, theta, scaling).rotate(jnp.asarray(x), jnp.asarray(positions))
  np.testing.assert_allclose(got, np_rope(x, positions, want, want_af), atol=5e-5)


def test_yarn_ramp_is_exercised():
  """The default YaRN shapes mix interpolated and extrapolated frequencies (so the test above
  compares the ramp, not only one end of it)."""
  H, theta = 64, 10_000.0
  inv, _ = position.rope_frequencies(H, theta, position.rope_scaling("yarn"))
  base = hf_default_inv_freq(H, theta)
  assert np.isclose(inv[0], base[0]) and np.isclose(inv[-1], base[-1] / 4.0)
  assert np.any(~np.isclose(inv, base) & ~np.isclose(inv, base / 4.0))


def test_unknown_scaling_fields_are_rejected():
  with pytest.raises(UserError):
    position.rope_scaling("linear", beta_fast=1.0)
  with pytest.raises(UserError):
    position.rope_scaling("ntk")


# ---------------------------------------------------------------------------------------------
# ALiBi


def test_alibi_slopes_power_of_two():
  np.testing.assert_allclose(position.alibi_slopes(8), [2.0**-i for i in range(1, 9)], rtol=1e-7)
  np.testing.assert_allclose(position.alibi_slopes(4), [2.0**-i for i in (2, 4, 6, 8)], rtol=1e-7)


def test_alibi_slopes_interleaved_for_non_power_of_two():
  # Press et al. (ofirpress/attention_with_linear_biases): slopes of the closest power of two
  # (4: 2^-2, 2^-4, 2^-6, 2^-8), then every other slope of twice that (8: 2^-1, 2^-3, ...).
  want6 = [2.0**-2, 2.0**-4, 2.0**-6, 2.0**-8, 2.0**-1, 2.0**-3]
  np.testing.assert_allclose(position.alibi_slopes(6), want6, rtol=1e-7)
  # 12: the 8 slopes 2^-1..2^-8, then 16's slopes 2^-0.5, 2^-1.5, 2^-2.5, 2^-3.5.
  want12 = [2.0**-i for i in range(1, 9)] + [2.0**-0.5, 2.0**-1.5, 2.0**-2.5, 2.0**-3.5]
  np.testing.assert_allclose(position.alibi_slopes(12), want12, rtol=1e-6)


def test_alibi_bias_is_minus_slope_times_distance():
  N, T, S = 6, 4, 7
  q_pos = np.array([[3, 4, 5, 6], [0, 1, 2, 3]])
  k_pos = np.broadcast_to(np.arange(S), (2, S))
  bias = np.asarray(position.ALiBi().logit_bias(jnp.asarray(q_pos), jnp.asarray(k_pos), N))
  assert bias.shape == (2, N, T, S)
  slopes = [2.0**-2, 2.0**-4, 2.0**-6, 2.0**-8, 2.0**-1, 2.0**-3]
  for b in range(2):
    for n in range(N):
      for i in range(T):
        for j in range(S):
          want = -slopes[n] * abs(q_pos[b, i] - k_pos[b, j])
          assert bias[b, n, i, j] == pytest.approx(want, rel=1e-6, abs=1e-7)


def test_kinds_that_do_not_apply_are_identity():
  x = randn(7, (1, 3, 2, 8))
  pos = jnp.arange(3)[None]
  for p in (position.Position(), position.ALiBi()):
    np.testing.assert_array_equal(p.rotate(x, pos), x)
    np.testing.assert_array_equal(p.embed(x[:, :, 0], pos), x[:, :, 0])
  assert rope(8).logit_bias(pos, pos, 2) is None
  assert position.Position().logit_bias(pos, pos, 2) is None


# ---------------------------------------------------------------------------------------------
# Learned, make, positions


def test_learned_adds_the_row_of_each_position():
  p = position.Learned(16, 8, rngs=nnx.Rngs(0))
  table = np.asarray(p.embedding[...])
  x = randn(8, (2, 3, 8))
  pos = np.array([[0, 1, 2], [9, 4, 15]])
  np.testing.assert_allclose(p.embed(x, jnp.asarray(pos)), x + table[pos], rtol=1e-6)
  np.testing.assert_array_equal(p.rotate(x[:, :, None], pos), x[:, :, None])


def test_make_builds_each_kind():
  kw = dict(head_dim=8, dim=16, rngs=nnx.Rngs(0))
  assert type(position.make(position.config("rope"), **kw)) is position.RoPE
  assert type(position.make(position.config("alibi"), **kw)) is position.ALiBi
  assert type(position.make(position.config("none"), **kw)) is position.Position
  assert type(position.make(position.config("learned", max_len=8), **kw)) is position.Learned
  sinusoidal = position.make(position.config("sinusoidal", max_len=8), **kw)
  assert type(sinusoidal) is position.Sinusoidal
  with pytest.raises(UserError):
    position.config("fourier")


def np_positions_from_segments(seg_BT):
  out = np.zeros_like(seg_BT)
  for b, row in enumerate(seg_BT):
    for t in range(1, len(row)):
      out[b, t] = 0 if row[t] != row[t - 1] else out[b, t - 1] + 1
  return out


def test_positions_from_segments_restart_at_each_segment():
  seg = np.array([[1, 1, 1, 2, 2, 3, 3, 3], [5, 5, 5, 5, 5, 5, 0, 0], [1, 2, 1, 2, 2, 2, 7, 7]])
  got = np.asarray(position.positions_from_segments(jnp.asarray(seg)))
  np.testing.assert_array_equal(got[0], [0, 1, 2, 0, 1, 0, 1, 2])
  np.testing.assert_array_equal(got[1], [0, 1, 2, 3, 4, 5, 0, 1])
  np.testing.assert_array_equal(got, np_positions_from_segments(seg))
  # Under jit too.
  np.testing.assert_array_equal(jax.jit(position.positions_from_segments)(seg), got)


def test_default_positions():
  tokens = jnp.zeros((2, 4), jnp.int32)
  np.testing.assert_array_equal(position.default_positions(tokens), [[0, 1, 2, 3]] * 2)
  seg = jnp.array([[1, 1, 2, 2], [1, 1, 1, 1]])
  np.testing.assert_array_equal(
    position.default_positions(tokens, seg), [[0, 1, 0, 1], [0, 1, 2, 3]]
  )


def test_sinusoidal_matches_whisper_sinusoids():
  """transformers' Whisper encoder table (its `sinusoids`), added to the embeddings."""
  pytest.importorskip("torch")
  whisper = pytest.importorskip("transformers.models.whisper.modeling_whisper")
  want = whisper.sinusoids(50, 16).numpy()
  pos = position.make(position.config("sinusoidal", max_len=50), head_dim=4, dim=16, rngs=None)
  np.testing.assert_allclose(np.asarray(pos.table()), want, rtol=1e-5, atol=1e-5)
  x = np.ones((2, 7, 16), np.float32)
  positions = np.stack([np.arange(7), np.arange(10, 17)])
  got = pos.embed(x, positions)
  np.testing.assert_allclose(np.asarray(got), 1 + want[positions], rtol=1e-5, atol=1e-5)
  with pytest.raises(UserError, match="longer than"):
    pos.embed(np.ones((1, 51, 16), np.float32), np.arange(51)[None])
