"""Diffusion as a task of the one trainer: DDPM's noise-prediction objective, a DDIM sampler with
classifier-free guidance compiled as one `lax.scan`, and what a class-conditional image model's
samples are measured by.

The objective is DDPM's epsilon prediction (Ho et al. 2020) on its linear beta schedule: x_t =
sqrt(abar_t) x_0 + sqrt(1 - abar_t) eps with t uniform in 0..T-1, and the model predicts eps (mean
squared error). Chosen over rectified flow because it is what DiT was trained with: weights
imported from diffusers (DiT-XL/2: epsilon on 1,000 linear-beta steps, t an integer) and weights
trained here are sampled by the same code, and `model.prediction` is read the same way (a learned
sigma, DiT's second half of the outputs, is neither trained nor read: no variational bound term,
as diffusers' DiT pipeline does not read it). Sampling is DDIM (Song et al. 2021) over
`sample_steps` of the T steps, eta = 0 deterministic, eta = 1 ancestral; x_0 is clipped to the
data range at each step, as DDPM's sampler does.

The forward process (t, eps, the noisy image and classifier-free guidance's label drop) is drawn
in the data pipeline, per example, from the iterator's own random stream (`noise_example`): so a
step is a pure function of its batch, a resumed run sees the batches it would have seen, and a
held-out batch has the same noise at every evaluation (`eval_batches`). Batches are
{"noisy_images" [B, H, W, C], "timesteps" [B], "labels" [B] (num_classes: the null class),
"noise" [B, H, W, C], "weights" [B]}; images in [0, 1] are x_0 = 2 * image - 1.
"""

import functools

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from flax import nnx

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


def denoise_sums(model, batch: dict) -> tuple[jax.Array, jax.Array]:
  """Summed per-image mean squared error of the predicted noise, and the number of images."""
  pred = model.prediction(batch["noisy_images"], batch["timesteps"], batch["labels"])
  se_B = jnp.mean(jnp.square(pred.astype(jnp.float32) - batch["noise"]), axis=(1, 2, 3))
  weights_B = batch["weights"].astype(jnp.float32)
  return jnp.sum(se_B * weights_B), jnp.sum(weights_B)


# Sampling


def sample_timesteps(cfg, sample_steps: int) -> np.ndarray:
  """The `sample_steps` timesteps a sampler visits, from T - 1 down to 0, evenly spread."""
  return np.round(np.linspace(cfg.steps - 1, 0, sample_steps)).astype(np.int32)


def ddim_step(x, eps, ab_t, ab_prev, *, eta, z):
  """One DDIM update from x_t to x_prev (and the clipped x_0 it went through); `z` ~ N(0, 1)
  is used when eta > 0. ab_prev = 1 at the last step: x_prev is x_0."""
  x0 = jnp.clip((x - jnp.sqrt(1 - ab_t) * eps) / jnp.sqrt(ab_t), -1.0, 1.0)
  eps = (x - jnp.sqrt(ab_t) * x0) / jnp.sqrt(1 - ab_t)  # the noise the clipped x_0 implies
  sigma = eta * jnp.sqrt((1 - ab_prev) / (1 - ab_t) * (1 - ab_t / ab_prev))
  direction = jnp.sqrt(jnp.maximum(1 - ab_prev - sigma**2, 0.0)) * eps
  return jnp.sqrt(ab_prev) * x0 + direction + sigma * z, x0


def guided_prediction(model, x, t_B, labels_B, guidance: float):
  """eps_uncond + guidance * (eps_cond - eps_uncond), both in one batch; guidance 1: the
  conditional prediction alone."""
  if guidance == 1.0:
    return model.prediction(x, t_B, labels_B)
  null_B = jnp.full_like(labels_B, model.null_id)
  both = model.prediction(
    jnp.concatenate([x, x]), jnp.concatenate([t_B, t_B]), jnp.concatenate([labels_B, null_B])
  )
  cond, uncond = jnp.split(both, 2)
  return uncond + guidance * (cond - uncond)


@functools.partial(jax.jit, static_argnames=("graphdef", "shape", "guidance", "eta", "schedule"))
def _sample(params, labels_B, key, noise, *, graphdef, shape, guidance, eta, schedule):
  model = nnx.merge(graphdef, params)
  ts, ab_t, ab_prev = (np.asarray(a) for a in schedule)
  B = labels_B.shape[0]
  key, start = jax.random.split(key)
  x = jax.random.normal(start, (B, *shape), jnp.float32) if noise is None else noise

  def body(carry, step):
    x, key = carry
    t, abt, abp = step
    key, kz = jax.random.split(key)
    eps = guided_prediction(model, x, jnp.full((B,), t, jnp.int32), labels_B, guidance)
    z = jax.random.normal(kz, x.shape, jnp.float32) if eta else jnp.zeros_like(x)
    x, _ = ddim_step(x, eps.astype(jnp.float32), abt, abp, eta=eta, z=z)
    return (x, key), None

  steps = (jnp.asarray(ts), jnp.asarray(ab_t, jnp.float32), jnp.asarray(ab_prev, jnp.float32))
  (x, _), _ = jax.lax.scan(body, (x, key), steps)
  return jnp.clip((x + 1.0) / 2.0, 0.0, 1.0)


def sample(
  model_or_split,
  labels,
  *,
  cfg,
  seed: int = 0,
  guidance=None,
  sample_steps=None,
  eta=None,
  noise=None,
) -> np.ndarray:
  """Images [N, H, W, C] in [0, 1] of classes `labels` [N] from a Denoiser (a module, or its
  (graphdef, params)): DDIM with classifier-free guidance, one compiled scan over the steps.
  guidance, sample_steps and eta default to cfg's; `noise` [N, H, W, C]: x_T to start from
  (drawn from `seed` if None)."""
  if isinstance(model_or_split, tuple):
    graphdef, params = model_or_split
  else:
    graphdef, params = nnx.split(model_or_split, nnx.Param)
  model = nnx.merge(graphdef, params)
  guidance = float(cfg.guidance if guidance is None else guidance)
  eta = float(cfg.eta if eta is None else eta)
  ts = sample_timesteps(cfg, int(cfg.sample_steps if sample_steps is None else sample_steps))
  ab = alpha_bars(cfg)
  schedule = (
    tuple(ts.tolist()),
    tuple(ab[ts].tolist()),
    tuple(np.append(ab[ts[1:]], 1.0).tolist()),
  )
  shape = (model.image_size, model.image_size, model.channels)
  out = _sample(
    params,
    jnp.asarray(labels, jnp.int32),
    jax.random.key(seed),
    None if noise is None else jnp.asarray(noise, jnp.float32),
    graphdef=graphdef,
    shape=shape,
    guidance=guidance,
    eta=eta,
    schedule=schedule,
  )
  return np.asarray(out)


# Measuring samples


def nearest_distances(a_PX: np.ndarray, b_QX: np.ndarray, *, exclude_self=False) -> np.ndarray:
  """Each row of a's Euclidean distance to its nearest row of b (itself excluded if a is b):
  a [P, X] and b [Q, X], P and Q rows of X features (flattened images)."""
  d2 = (a_PX**2).sum(1)[:, None] + (b_QX**2).sum(1)[None, :] - 2 * a_PX @ b_QX.T
  if exclude_self:
    np.fill_diagonal(d2, np.inf)
  return np.sqrt(np.maximum(d2.min(1), 0.0))


def sample_quality(samples, labels, train_images, train_labels) -> dict:
  """Class accuracy of `samples` by an RBF SVM trained on the training images (scikit-learn),
  and novelty: the share of samples whose nearest training image is farther than the median
  nearest-neighbour distance among the training images themselves (a copy is at 0)."""
  from sklearn.svm import SVC

  flat = np.asarray(samples, np.float64).reshape(len(samples), -1)
  train = np.asarray(train_images, np.float64).reshape(len(train_images), -1)
  classifier = SVC(gamma="scale").fit(train, train_labels)
  threshold = float(np.median(nearest_distances(train, train, exclude_self=True)))
  to_train = nearest_distances(flat, train)
  return {
    "sample_accuracy": float(np.mean(classifier.predict(flat) == np.asarray(labels))),
    "novel_fraction": float(np.mean(to_train > threshold)),
    "sample_nn_median": float(np.median(to_train)),
    "train_nn_median": threshold,
    "samples": len(flat),
  }


def evaluate_samples(graphdef, params, cfg) -> dict:
  """`sample_quality` of cfg.diffusion.eval_per_class samples of every class (default guidance,
  sampler and seed of cfg.diffusion) against the experiment's training images; with the same
  measures of its held-out real images for comparison (`real_*`), if it has any."""
  from nnx_zoo.common.data import images

  train = images.load_split(cfg.data, "train")
  labels = np.repeat(np.arange(cfg.model.conditioning.num_classes), cfg.diffusion.eval_per_class)
  samples = sample((graphdef, params), labels, cfg=cfg.diffusion, seed=cfg.diffusion.eval_seed)
  result = sample_quality(samples, labels, train.images, train.labels)
  held_out = images.load_split(cfg.data, "eval")
  if held_out is not None:
    real = sample_quality(held_out.images, held_out.labels, train.images, train.labels)
    result.update(real_accuracy=real["sample_accuracy"], real_novel_fraction=real["novel_fraction"])
  return result
