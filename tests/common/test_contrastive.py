"""CLIP's contrastive loss: against numpy, and over a sharded batch against one device."""

import json
import os
import pathlib
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from nnx_zoo.common.tasks import contrastive_loss

ROOT = pathlib.Path(__file__).resolve().parents[2]


def numpy_clip_loss(image, text, scale, weights=None):
  """transformers' CLIPModel: normalise, logits_per_text = scale * t @ i.T, clip_loss = the mean
  of the two cross-entropies (rows with weight 0 dropped beforehand), in float64."""
  image, text = np.asarray(image, np.float64), np.asarray(text, np.float64)
  if weights is not None:
    keep = np.asarray(weights) > 0
    image, text = image[keep], text[keep]
  image = image / np.linalg.norm(image, axis=-1, keepdims=True)
  text = text / np.linalg.norm(text, axis=-1, keepdims=True)
  logits_per_text = scale * text @ image.T

  def ce(logits):  # mean cross-entropy with labels arange(n)
    logits = logits - logits.max(axis=1, keepdims=True)
    log_p = logits - np.log(np.exp(logits).sum(axis=1, keepdims=True))
    return -np.mean(np.diag(log_p))

  return (ce(logits_per_text) + ce(logits_per_text.T)) / 2


def embeddings(n=16, p=8, seed=0):
  k1, k2 = jax.random.split(jax.random.key(seed))
  image = jax.random.normal(k1, (n, p))
  text = image + 0.8 * jax.random.normal(k2, (n, p))  # related pairs: a loss well below log n
  return image, text


@pytest.mark.parametrize("scale", [1.0, 14.3, 100.0])
def test_plain_loss_equals_numpy(scale):
  image, text = embeddings()
  got = contrastive_loss.contrastive_loss(image, text, logit_scale=scale)
  np.testing.assert_allclose(got, numpy_clip_loss(image, text, scale), rtol=1e-5)
  total, count = contrastive_loss.contrastive_sums(image, text, logit_scale=scale)
  assert count == 16
  np.testing.assert_allclose(total / count, got, rtol=1e-6)


def test_padding_rows_count_for_nothing():
  image, text = embeddings()
  weights = jnp.asarray([1.0] * 12 + [0.0] * 4)
  # Padding rows of zeros (as a padded eval batch) or of anything: neither scored nor negatives.
  for pad in (jnp.zeros((4, 8)), jnp.ones((4, 8))):
    got = contrastive_loss.contrastive_loss(
      image.at[12:].set(pad), text.at[12:].set(pad), logit_scale=10.0, weights_B=weights
    )
    np.testing.assert_allclose(got, numpy_clip_loss(image[:12], text[:12], 10.0), rtol=1e-5)


def test_gradients_equal_numpy_finite_differences():
  """The gradient autodiff gives (what the sharded test compares) is the loss's own."""
  image, text = embeddings(n=6, p=4, seed=1)

  def loss(image, text):
    return contrastive_loss.contrastive_loss(image, text, logit_scale=5.0)

  g_image, g_text = jax.jit(jax.grad(loss, (0, 1)))(image, text)
  eps, x, t = 1e-6, np.asarray(image, np.float64), np.asarray(text, np.float64)
  for i, j in [(0, 0), (3, 2), (5, 3)]:
    d = np.zeros_like(x)
    d[i, j] = eps
    num_i = (numpy_clip_loss(x + d, t, 5.0) - numpy_clip_loss(x - d, t, 5.0)) / (2 * eps)
    num_t = (numpy_clip_loss(x, t + d, 5.0) - numpy_clip_loss(x, t - d, 5.0)) / (2 * eps)
    np.testing.assert_allclose(g_image[i, j], num_i, rtol=1e-3, atol=1e-6)
    np.testing.assert_allclose(g_text[i, j], num_t, rtol=1e-3, atol=1e-6)


SHARDED = textwrap.dedent(
  """
  import json, sys
  import jax, jax.numpy as jnp, numpy as np
  from nnx_zoo.common import parallel
  from nnx_zoo.common.tasks import contrastive_loss

  P = parallel.P
  k1, k2 = jax.random.split(jax.random.key(0))
  image = jax.random.normal(k1, (16, 8))
  text = image + 0.8 * jax.random.normal(k2, (16, 8))
  weights = jnp.asarray([1.0] * 13 + [0.0] * 3)  # a padded last batch
  scale = jnp.float32(12.0)

  def loss(image, text, scale, weights):
    return contrastive_loss.contrastive_loss(image, text, logit_scale=scale, weights_B=weights)

  def total(image, text, scale, weights):  # what the trainer differentiates: the local sum
    return contrastive_loss.contrastive_sums(image, text, logit_scale=scale, weights_B=weights)[0]

  def results(fn_loss, fn_total):
    out = {}
    for name, w in (("all", None), ("padded", weights)):
      value, grads = fn_loss(image, text, scale, w)
      t_grads = fn_total(image, text, scale, w)
      out[name] = {
        "loss": float(value),
        "grads": [np.asarray(g).tolist() for g in grads],
        "total_grads": [np.asarray(g).tolist() for g in t_grads],
      }
    return out

  one = jax.jit(jax.value_and_grad(loss, (0, 1, 2)))
  one_total = jax.jit(jax.grad(total, (0, 1, 2)))
  out = {"single": results(one, one_total)}

  for mesh in [(2, 1, 4), (4, 2, 1), (8, 1, 1), (1, 8, 1)]:
    layout = parallel.make_layout(dict(zip(("data", "fsdp", "tensor"), mesh)))
    batch = layout.batch_spec

    def sharded(fn, layout=layout, batch=batch):
      def local(image, text, scale, weights):
        with parallel.active(layout):
          return fn(image, text, scale, weights)
      return local

    def run(fn, out_specs, layout=layout, batch=batch):
      def call(image, text, scale, w):
        w = jnp.ones((16,)) if w is None else w
        f = jax.shard_map(
          sharded(fn), mesh=layout.mesh, in_specs=(batch, batch, P(), batch),
          out_specs=out_specs, check_vma=True,
        )
        return jax.jit(f)(image, text, scale, w)
      return call

    # scale is replicated: shard_map's autodiff sums its gradient over the devices (the
    # transpose of its implicit broadcast), as it does a replicated parameter's in the trainer.
    def loss_and_grads(image, text, scale, weights):
      return jax.value_and_grad(loss, (0, 1, 2))(image, text, scale, weights)

    def total_grads(image, text, scale, weights):
      return jax.grad(total, (0, 1, 2))(image, text, scale, weights)

    out[str(mesh)] = results(
      run(loss_and_grads, (P(), (batch, batch, P()))), run(total_grads, (batch, batch, P()))
    )
  print(json.dumps(out))
  """
)


@pytest.fixture(scope="module")
def sharded_results():
  env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8"}
  proc = subprocess.run(
    [sys.executable, "-P", "-c", SHARDED], cwd=ROOT, env=env, capture_output=True, text=True
  )
  assert proc.returncode == 0, proc.stderr[-3000:]
  return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.slow
@pytest.mark.multidevice
@pytest.mark.parametrize("mesh", ["(2, 1, 4)", "(4, 2, 1)", "(8, 1, 1)", "(1, 8, 1)"])
@pytest.mark.parametrize("rows", ["all", "padded"])
def test_sharded_loss_and_gradients_equal_one_device(sharded_results, mesh, rows):
  """Over (data, fsdp, tensor) meshes of 8 devices: the loss every device returns, and the
  gradient with respect to the embeddings (and the scale) of the mean loss and of the summed
  loss the trainer differentiates, equal one device's on the whole batch."""
  ref, got = sharded_results["single"][rows], sharded_results[mesh][rows]
  image, text = embeddings()
  weights = None if rows == "all" else [1.0] * 13 + [0.0] * 3
  assert ref["loss"] == pytest.approx(numpy_clip_loss(image, text, 12.0, weights), rel=1e-5)
  assert got["loss"] == pytest.approx(ref["loss"], rel=1e-6)
  for key in ("grads", "total_grads"):
    for want, have in zip(ref[key], got[key], strict=True):  # image, text, scale
      want, have = np.asarray(want), np.asarray(have)
      assert np.abs(want).max() > 0
      np.testing.assert_allclose(have, want, rtol=1e-5, atol=1e-6 * np.abs(want).max())
