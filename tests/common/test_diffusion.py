"""Diffusion (the forward process, common/data/diffusion.py; the denoiser task's objective and
sampler, common/tasks/denoiser.py) against numpy references written from the
papers' formulas: DDPM's schedule and forward process, the DDIM update, the whole guided sampling
loop on a stand-in denoiser, the loss sums, and the sample measures."""

import math

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from nnx_zoo.common.data import diffusion
from nnx_zoo.common.tasks import denoiser

CFG = diffusion.config(steps=100, beta_start=1e-4, beta_end=0.05, label_drop=0.25)


def np_alpha_bars(T, b0, b1):
  out, prod = [], 1.0
  for t in range(T):
    prod *= 1.0 - (b0 + (b1 - b0) * t / (T - 1))
    out.append(prod)
  return np.array(out)


def test_schedule_is_ddpm_linear_betas():
  np.testing.assert_allclose(diffusion.alpha_bars(CFG), np_alpha_bars(100, 1e-4, 0.05), rtol=1e-12)
  ts = denoiser.sample_timesteps(CFG, 5)
  assert ts.tolist() == [99, 74, 50, 25, 0]


def test_cosine_schedule_is_improved_ddpms():
  """Nichol and Dhariwal (2021), eq. 17: abar_t = f(t) / f(0), f(t) = cos((t/T + s) / (1 + s) *
  pi / 2)^2, with betas clipped at 0.999."""
  cfg = diffusion.config(steps=50, schedule="cosine")
  T, s = 50, 0.008

  def f(t):
    return math.cos((t / T + s) / (1 + s) * math.pi / 2) ** 2

  prod, want = 1.0, []
  for t in range(1, T + 1):
    prod *= 1 - min(1 - f(t) / f(t - 1), 0.999)
    want.append(prod)
  np.testing.assert_allclose(diffusion.alpha_bars(cfg), want, rtol=1e-12)


def test_forward_process_and_label_drop():
  rng = np.random.default_rng(0)
  images = rng.random((2000, 4, 4, 1))
  labels = rng.integers(0, 10, 2000)
  out = diffusion.noise_example(
    {"images": images, "labels": labels}, np.random.default_rng(1), cfg=CFG, num_classes=10
  )
  ab = np_alpha_bars(100, 1e-4, 0.05)[out["timesteps"]][:, None, None, None]
  want = np.sqrt(ab) * (2 * images - 1) + np.sqrt(1 - ab) * out["noise"]
  np.testing.assert_allclose(out["noisy_images"], want, atol=1e-5)
  dropped = out["labels"] == 10
  assert abs(dropped.mean() - 0.25) < 0.04
  np.testing.assert_array_equal(out["labels"][~dropped], labels[~dropped])
  assert out["timesteps"].min() >= 0 and out["timesteps"].max() == 99
  # One example (what the training iterator draws): the same shapes, without the batch.
  one = diffusion.noise_example(
    {"images": images[0], "labels": labels[0]}, np.random.default_rng(2), cfg=CFG, num_classes=10
  )
  assert one["noisy_images"].shape == (4, 4, 1) and one["timesteps"].shape == ()


def np_ddim_step(x, eps, ab_t, ab_prev, eta, z):
  x0 = np.clip((x - math.sqrt(1 - ab_t) * eps) / math.sqrt(ab_t), -1, 1)
  eps = (x - math.sqrt(ab_t) * x0) / math.sqrt(1 - ab_t)
  sigma = eta * math.sqrt((1 - ab_prev) / (1 - ab_t)) * math.sqrt(1 - ab_t / ab_prev)
  return math.sqrt(ab_prev) * x0 + math.sqrt(max(1 - ab_prev - sigma**2, 0)) * eps + sigma * z


@pytest.mark.parametrize("eta", [0.0, 1.0])
def test_ddim_step_matches_the_formula(eta):
  rng = np.random.default_rng(0)
  x, eps, z = (rng.standard_normal((3, 4, 4, 1)) for _ in range(3))
  got, _ = denoiser.ddim_step(jnp.asarray(x), jnp.asarray(eps), 0.3, 0.6, eta=eta, z=jnp.asarray(z))
  np.testing.assert_allclose(got, np_ddim_step(x, eps, 0.3, 0.6, eta, z), atol=1e-5)


class Stand(nnx.Module):
  """A stand-in denoiser: eps = w * x + 0.05 * label + t / 1000, so guidance shows."""

  image_size, channels, null_id = 4, 1, 10

  def __init__(self):
    self.w = nnx.Param(jnp.asarray(0.3))

  def prediction(self, x, t_B, labels_B):
    return self.w[...] * x + 0.05 * labels_B[:, None, None, None] + t_B[:, None, None, None] / 1000


@pytest.mark.parametrize("guidance", [1.0, 3.0])
def test_guided_sampling_loop_matches_a_numpy_loop(guidance):
  labels = np.array([1, 7])
  x = np.random.default_rng(0).standard_normal((2, 4, 4, 1))
  got = denoiser.sample(
    Stand(), labels, cfg=CFG, guidance=guidance, sample_steps=6, eta=0.0, noise=x
  )
  ab = np_alpha_bars(100, 1e-4, 0.05)
  ts = np.round(np.linspace(99, 0, 6)).astype(int)
  null = np.full(2, 10)
  for i, t in enumerate(ts):
    cond = 0.3 * x + 0.05 * labels[:, None, None, None] + t / 1000
    uncond = 0.3 * x + 0.05 * null[:, None, None, None] + t / 1000
    eps = uncond + guidance * (cond - uncond)
    ab_prev = ab[ts[i + 1]] if i + 1 < len(ts) else 1.0
    x = np_ddim_step(x, eps, ab[t], ab_prev, 0.0, 0.0)
  np.testing.assert_allclose(got, np.clip((x + 1) / 2, 0, 1), atol=1e-5)


def test_denoise_sums_are_weighted_squared_errors():
  class Zero:
    def prediction(self, x, t, y):
      return jnp.zeros_like(x)

  rng = np.random.default_rng(0)
  noise = rng.standard_normal((3, 2, 2, 1)).astype(np.float32)
  batch = {
    "noisy_images": jnp.zeros((3, 2, 2, 1)),
    "timesteps": jnp.zeros(3, jnp.int32),
    "labels": jnp.zeros(3, jnp.int32),
    "noise": jnp.asarray(noise),
    "weights": jnp.asarray([1.0, 1.0, 0.0]),
  }
  total, count = denoiser.denoise_sums(Zero(), batch)
  np.testing.assert_allclose(total, (noise[:2] ** 2).mean(axis=(1, 2, 3)).sum(), rtol=1e-6)
  assert float(count) == 2


def test_sample_measures():
  rng = np.random.default_rng(0)
  train = rng.random((60, 4, 4, 1))
  labels = np.repeat(np.arange(3), 20)
  train[labels == 1, :2] += 1.0  # separable classes
  train[labels == 2, 2:] += 1.0
  a, b = rng.random((7, 16)), rng.random((5, 16))
  brute = np.sqrt(((a[:, None] - b[None]) ** 2).sum(-1)).min(1)
  np.testing.assert_allclose(denoiser.nearest_distances(a, b), brute, rtol=1e-6)
  copies = denoiser.sample_quality(train, labels, train, labels)
  assert copies["novel_fraction"] == 0.0 and copies["sample_accuracy"] == 1.0
  far = denoiser.sample_quality(train + 5.0, labels, train, labels)
  assert far["novel_fraction"] == 1.0
