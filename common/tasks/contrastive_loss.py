"""CLIP's contrastive loss (symmetric InfoNCE) over the global batch, however it is sharded.

Each image is classified among all texts of the batch and each text among all images, the
matching pair being the right answer (Radford et al. 2021; transformers' `clip_loss`). The
negatives are the whole global batch: under `jax.shard_map` the embeddings are all-gathered over
the batch axes they are split over (`parallel.BATCH_AXES`), and each device scores its own rows
against everyone's. So the sums over devices equal one device's sums on the whole batch, and
autodiff's transpose of the all-gather (a reduce-scatter) sends each device the gradient of
every row's loss with respect to its embeddings. Which axes to gather is read from the arrays'
varying-axis types, so the step must run with `check_vma=True` (the trainer's does).

P is the projection dim; B this device's rows, G the rows of the global batch.
"""

import jax
import jax.numpy as jnp

from nnx_zoo.common import parallel


def _varying(x) -> frozenset:
  """The mesh axes `x` varies over inside shard_map (empty outside)."""
  aval = jax.typeof(x)
  return frozenset(getattr(aval, "vma", None) or aval.mat.varying)


def _normalize(x_BP: jax.Array) -> jax.Array:
  # A padding row of zeros stays zeros instead of 0 / 0.
  x = x_BP.astype(jnp.float32)
  return x * jax.lax.rsqrt(jnp.maximum(jnp.sum(x * x, axis=-1, keepdims=True), 1e-12))


def _gather(x: jax.Array, axes: tuple[str, ...]) -> jax.Array:
  if not axes:
    return x
  missing = tuple(a for a in axes if a not in _varying(x))
  if missing:  # e.g. weights made inside the step: the same on every device of those axes
    x = jax.lax.pcast(x, missing, to="varying")
  return jax.lax.all_gather(x, axes, axis=0, tiled=True)


def contrastive_sums(
  image_BP: jax.Array,
  text_BP: jax.Array,
  *,
  logit_scale: jax.Array | float,
  weights_B: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
  """(total, count): this device's rows' summed loss, (image -> text + text -> image) / 2 each,
  and the number of rows (weights 0: padding rows, neither scored nor a negative). Summed over
  the batch axes they give the global batch's; total / count is CLIP's loss.

  The embeddings are L2-normalised here (as CLIP does before its logits); `logit_scale` is the
  temperature already exponentiated and clipped (CLIP: exp(t) clipped at 100)."""
  B = image_BP.shape[0]
  weights_B = jnp.ones((B,), jnp.float32) if weights_B is None else weights_B.astype(jnp.float32)
  image_BP, text_BP = _normalize(image_BP), _normalize(text_BP)
  vary = _varying(image_BP) | _varying(text_BP) | _varying(weights_B)
  axes = tuple(a for a in parallel.BATCH_AXES if a in vary)
  all_image_GP, all_text_GP = _gather(image_BP, axes), _gather(text_BP, axes)
  all_weights_G = _gather(weights_B, axes)
  offset = jax.lax.axis_index(axes) * B if axes else 0
  target_B = offset + jnp.arange(B)
  negative_G = all_weights_G > 0

  def cross_entropy(query_BP, keys_GP):
    logits_BG = logit_scale * jnp.dot(query_BP, keys_GP.T)
    # A finite floor, not -inf, so an all-padding row stays finite (and is weighted 0).
    logits_BG = jnp.where(negative_G[None, :], logits_BG, -1e9)
    right_B = jnp.take_along_axis(logits_BG, target_B[:, None], axis=1)[:, 0]
    return jax.nn.logsumexp(logits_BG, axis=1) - right_B

  ce_B = (cross_entropy(image_BP, all_text_GP) + cross_entropy(text_BP, all_image_GP)) / 2
  return jnp.sum(weights_B * ce_B), jnp.sum(weights_B)


def contrastive_loss(
  image_BP: jax.Array,
  text_BP: jax.Array,
  *,
  logit_scale: jax.Array | float,
  weights_B: jax.Array | None = None,
) -> jax.Array:
  """CLIP's mean loss over the global batch: the same value on every device, and the same as
  one device computes on the whole batch (see `contrastive_sums`)."""
  total, count = contrastive_sums(image_BP, text_BP, logit_scale=logit_scale, weights_B=weights_B)
  axes = tuple(a for a in parallel.BATCH_AXES if a in _varying(total))
  if axes:
    total, count = jax.lax.psum(total, axes), jax.lax.psum(count, axes)
  return total / jnp.maximum(count, 1.0)
