"""The denoiser task (DiT): DDPM's noise-prediction objective on the examples the data pipeline
noised (common/data/diffusion.py), a DDIM sampler with classifier-free guidance compiled as one
`lax.scan`, what a class-conditional image model's samples are measured by, and `zoo generate`
drawing images of the given classes.

The objective is DDPM's epsilon prediction (Ho et al. 2020): the model predicts eps (mean squared
error). Chosen over rectified flow because it is what DiT was trained with: weights imported from
diffusers (DiT-XL/2: epsilon on 1,000 linear-beta steps, t an integer) and weights trained here
are sampled by the same code, and `model.prediction` is read the same way (a learned sigma, DiT's
second half of the outputs, is neither trained nor read: no variational bound term, as diffusers'
DiT pipeline does not read it). Sampling is DDIM (Song et al. 2021) over `sample_steps` of the T
steps, eta = 0 deterministic, eta = 1 ancestral; x_0 is clipped to the data range at each step, as
DDPM's sampler does.
"""

import functools
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from nnx_zoo.common import tasks
from nnx_zoo.common.data import diffusion, images
from nnx_zoo.common.errors import UserError


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
  ab = diffusion.alpha_bars(cfg)
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
  train = images.load_split(cfg.data, "train")
  labels = np.repeat(np.arange(cfg.model.conditioning.num_classes), cfg.diffusion.eval_per_class)
  samples = sample((graphdef, params), labels, cfg=cfg.diffusion, seed=cfg.diffusion.eval_seed)
  result = sample_quality(samples, labels, train.images, train.labels)
  held_out = images.load_split(cfg.data, "eval")
  if held_out is not None:
    real = sample_quality(held_out.images, held_out.labels, train.images, train.labels)
    result.update(real_accuracy=real["sample_accuracy"], real_novel_fraction=real["novel_fraction"])
  return result


# The task


class Denoiser(tasks.Task):
  name = "denoiser"

  def loss_sums(self, model, batch, *, loss_chunk=0):
    return denoise_sums(model, batch)

  def score(self, graphdef, params, cfg):
    """Its samples' class accuracy and novelty (`evaluate_samples`)."""
    return evaluate_samples(graphdef, params, cfg)

  def generate(self, args, cfg):
    """Images of the given classes into an .npz file."""
    from nnx_zoo.common.hub import weights

    if args.prompt is not None:
      raise UserError(f"{cfg.model.family} generates images: give --labels or --num-per-label.")
    if args.out is None or (args.labels is None) == (args.num_per_label is None):
      raise UserError("Give --out FILE.npz and one of --labels 3,3,7 or --num-per-label N.")
    num_classes = cfg.model.conditioning.num_classes
    if args.labels is not None:
      try:
        labels = np.array([int(x) for x in args.labels.split(",") if x.strip()], np.int32)
      except ValueError:
        raise UserError(f"--labels {args.labels!r}: give comma-separated class ids.") from None
    else:
      if args.num_per_label < 1:
        raise UserError("--num-per-label must be at least 1.")
      labels = np.repeat(np.arange(num_classes, dtype=np.int32), args.num_per_label)
    if not len(labels) or labels.min() < 0 or labels.max() >= num_classes:
      raise UserError(f"--labels must be class ids in 0..{num_classes - 1}.")
    # A `zoo convert` output has no diffusion section: DiT's own schedule, the defaults.
    settings = diffusion.config(**(cfg.diffusion.to_dict() if cfg.get("diffusion") else {}))
    graphdef, params, _ = weights.restore_params(cfg, args.workdir)
    samples = sample(
      (graphdef, params),
      labels,
      cfg=settings,
      seed=args.seed,
      guidance=args.guidance,
      sample_steps=args.steps,
      eta=args.eta,
    )
    out = args.out if args.out.endswith(".npz") else args.out + ".npz"
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    np.savez(out, images=samples.astype(np.float32), labels=labels)
    print(json.dumps({"out": os.path.abspath(out), "images": list(samples.shape)}))


tasks.register(Denoiser())
