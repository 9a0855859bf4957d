"""Diffusion's forward process, drawn in the data pipeline: the `diffusion` config section, the
noise schedule, and each example noised from the iterator's own random stream (`noise_example`),
so a step is a pure function of its batch, a resumed run sees the batches it would have seen, and
a held-out batch has the same noise at every evaluation (`eval_batches`). The reverse process
(the objective, the sampler) is the denoiser task's (common/tasks/denoiser.py).

DDPM (Ho et al. 2020) on its linear beta schedule, or the cosine one: x_t = sqrt(abar_t) x_0 +
sqrt(1 - abar_t) eps with t uniform in 0..T-1, and classifier-free guidance's label drop. Batches
are {"noisy_images" [B, H, W, C], "timesteps" [B], "labels" [B] (num_classes: the null class),
"noise" [B, H, W, C], "weights" [B]}; images in [0, 1] are x_0 = 2 * image - 1.
"""

import functools

import ml_collections
import numpy as np

from nnx_zoo.common.errors import UserError


def config(**kw) -> ml_collections.ConfigDict:
  """The `diffusion` section of an experiment. steps: T of the schedule; schedule: "linear"
  (DDPM's betas from beta_start to beta_end, DiT's) or "cosine" (Nichol and Dhariwal's abar_t,
  which keeps small images' signal over more of the steps); label_drop: the share of training
  labels replaced by the null class (classifier-free guidance); sample_steps, guidance (1:
  none), eta: the sampler's defaults; eval_per_class and eval_seed: the samples `zoo eval`
  draws and measures."""
  cfg = {
    "steps": 1000,
    "beta_start": 1e-4,
    "beta_end": 0.02,
    "schedule": "linear",
    "label_drop": 0.1,
    "sample_steps": 50,
    "guidance": 1.0,
    "eta": 0.0,
    "eval_per_class": 100,
    "eval_seed": 0,
  }
  unknown = set(kw) - set(cfg)
  if unknown:
    raise UserError(f"Unknown diffusion keys {sorted(unknown)}; known: {sorted(cfg)}.")
  return ml_collections.ConfigDict({**cfg, **kw})


# The schedule and the forward process


SCHEDULES = ("linear", "cosine")


def alpha_bars(cfg) -> np.ndarray:
  """abar_t = prod_{s <= t} (1 - beta_s), t = 0..T-1 (float64)."""
  schedule = cfg.get("schedule", "linear")
  if schedule not in SCHEDULES:
    raise UserError(f"Unknown diffusion.schedule {schedule!r}: use one of {SCHEDULES}.")
  return _alpha_bars(schedule, cfg.steps, cfg.beta_start, cfg.beta_end)


@functools.cache  # read for every training example
def _alpha_bars(schedule: str, steps: int, beta_start: float, beta_end: float) -> np.ndarray:
  if schedule == "linear":
    betas = np.linspace(beta_start, beta_end, steps, dtype=np.float64)
  else:  # cosine: abar(u) = cos((u + s) / (1 + s) * pi / 2)^2, u = t / T, betas capped at 0.999
    s = 0.008
    f = np.cos((np.arange(steps + 1) / steps + s) / (1 + s) * np.pi / 2) ** 2
    betas = np.minimum(1 - f[1:] / f[:-1], 0.999)
  out = np.cumprod(1.0 - betas)
  out.flags.writeable = False
  return out


def noise_example(example: dict, rng: np.random.Generator, *, cfg, num_classes: int, drop=True):
  """An image example (or a batch of them) -> the training example of the denoiser: t drawn
  uniformly, eps ~ N(0, 1), x_t, and the label replaced by the null class with probability
  cfg.label_drop (if `drop`)."""
  images, labels = example["images"], np.asarray(example["labels"])
  lead = images.shape[:-3]
  t = rng.integers(0, cfg.steps, size=lead)
  eps = rng.standard_normal(images.shape)
  ab = alpha_bars(cfg)[t].reshape(lead + (1, 1, 1))
  x_t = np.sqrt(ab) * (2.0 * images - 1.0) + np.sqrt(1.0 - ab) * eps
  if drop and cfg.label_drop:
    labels = np.where(rng.uniform(size=lead) < cfg.label_drop, num_classes, labels)
  out = {
    "noisy_images": x_t.astype(np.float32),
    "timesteps": np.asarray(t, np.int32),
    "labels": np.asarray(labels, np.int32),
    "noise": eps.astype(np.float32),
  }
  if "weights" in example:
    out["weights"] = example["weights"]
  return out


def eval_batches(cfg, num_classes: int, batches):
  """`batches` (an image data kind's eval_batches) noised with a fixed stream per batch, labels
  kept: the held-out loss is comparable across evaluations."""

  def noised(source, *, batch_size: int, max_batches: int = 0, share=None):
    held_out = batches(source, batch_size=batch_size, max_batches=max_batches, share=share)
    for i, batch in enumerate(held_out):
      rng = np.random.default_rng([cfg.eval_seed, i])
      yield noise_example(batch, rng, cfg=cfg, num_classes=num_classes, drop=False)

  return noised
