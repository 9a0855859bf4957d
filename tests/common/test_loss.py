"""train.loss_chunk: the chunked head + cross-entropy (common/tasks/losses.py) equals the plain
one in values and gradients, tied or untied, with a chunk that does not divide the tokens."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from nnx_zoo.common import models
from nnx_zoo.common.tasks import losses
from nnx_zoo.zoo.llama import model as llama


def batch(vocab: int, B: int = 3, T: int = 13):
  rng = np.random.default_rng(0)
  tokens = jnp.asarray(rng.integers(0, vocab, (B, T + 1)), jnp.int32)
  # Two documents in a row and some padding, so the loss weights are not all 1.
  segments = np.ones((B, T + 1), np.int32)
  segments[0, 6:] = 2
  segments[1, -3:] = 0
  return {"tokens": tokens, "segment_ids": jnp.asarray(segments)}


def sums_and_grads(cfg, batch, chunk):
  graphdef, params = nnx.split(models.build(cfg, seed=1), nnx.Param)

  def total(params):
    return losses.loss_sums(nnx.merge(graphdef, params), batch, loss_chunk=chunk)

  return jax.jit(jax.value_and_grad(total, has_aux=True))(params)


@pytest.mark.parametrize("tie", [False, True])
@pytest.mark.parametrize("chunk", [5, 64])
@pytest.mark.slow
def test_chunked_equals_plain(tie, chunk):
  cfg = llama.config("tiny", vocab_size=97, tie_embeddings=tie)
  b = batch(cfg.vocab_size)
  (total, count), grads = sums_and_grads(cfg, b, 0)
  (total_c, count_c), grads_c = sums_and_grads(cfg, b, chunk)
  assert count_c == count
  np.testing.assert_allclose(total_c, total, rtol=1e-6)
  for (path, g), (_, g_c) in zip(nnx.to_flat_state(grads), nnx.to_flat_state(grads_c), strict=True):
    # fp32 sums in another order: equal to a millionth of the largest entry.
    atol = 1e-6 * float(jnp.abs(g[...]).max())
    np.testing.assert_allclose(g_c[...], g[...], rtol=1e-5, atol=atol, err_msg=str(path))


def test_value_alone():
  """Without a gradient (evaluation) the chunked loss is the same number."""
  cfg = llama.config("tiny", vocab_size=97)
  b = batch(cfg.vocab_size)
  model = models.build(cfg, seed=1)
  value = nnx.jit(
    lambda model, chunk: losses.loss_sums(model, b, loss_chunk=chunk)[0], static_argnums=1
  )
  plain, chunked = value(model, 0), value(model, 8)  # compiled: op by op it took 10 s
  np.testing.assert_allclose(chunked, plain, rtol=1e-6)
  assert model.lm_head is not None  # the model is left as it was
