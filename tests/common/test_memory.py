"""Memory levers change memory, not results: remat == no remat, accumulation == one batch."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from common import models, trainer
from common.errors import UserError
from zoo.llama import model as llama


def batch(B=8, T=17, vocab=256, seed=0):
  rng = np.random.default_rng(seed)
  segments = np.where(np.arange(T) < T // 2, 1, 2)[None].repeat(B, 0).astype(np.int32)
  return {"tokens": rng.integers(0, vocab, (B, T)).astype(np.int32), "segment_ids": segments}


def sums(cfg, micro_batches=1):
  graphdef, params = nnx.split(models.build(cfg), nnx.Param)
  fn = jax.jit(
    lambda p, b: trainer.sums_and_grads(p, b, graphdef=graphdef, micro_batches=micro_batches)
  )
  return fn(params, batch()), (graphdef, params)


def assert_same(a, b, rtol=1e-5):
  (ta, ca, ga), (tb, cb, gb) = a, b
  assert float(ca) == float(cb)
  assert float(ta) == pytest.approx(float(tb), rel=rtol)
  for x, y in zip(jax.tree.leaves(ga), jax.tree.leaves(gb), strict=True):
    scale = float(jnp.max(jnp.abs(y))) + 1e-12
    assert float(jnp.max(jnp.abs(x - y))) / scale < rtol


@pytest.mark.parametrize("policy", ["full", "save_dots"])
def test_remat_equals_no_remat_and_is_applied(policy):
  base = llama.config("tiny")
  cfg = llama.config("tiny")
  cfg.remat = policy
  (got, (graphdef, params)), (want, _) = sums(cfg), sums(base)
  assert_same(got, want)
  jaxpr = str(
    jax.make_jaxpr(lambda p: trainer.sums_and_grads(p, batch(), graphdef=graphdef))(params)
  )
  assert "remat" in jaxpr or "checkpoint" in jaxpr


def test_unknown_remat_policy_is_a_user_error():
  cfg = llama.config("tiny")
  cfg.remat = "sometimes"
  with pytest.raises(UserError, match="model.remat"):
    sums(cfg)


def test_accumulating_four_micro_batches_equals_one_batch():
  cfg = llama.config("tiny")
  assert_same(sums(cfg, micro_batches=4)[0], sums(cfg, micro_batches=1)[0])


def test_bf16_compute_keeps_fp32_master_weights():
  cfg = llama.config("tiny")
  cfg.dtype = "bfloat16"
  (total, _, grads), (graphdef, params) = sums(cfg)
  assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(params))
  assert all(g.dtype == jnp.float32 for g in jax.tree.leaves(grads))
  logits = nnx.merge(graphdef, params)(jnp.asarray(batch()["tokens"][:, :-1]))
  assert logits.dtype == jnp.bfloat16
  fp32 = sums(llama.config("tiny"))[0][0]
  assert float(total) == pytest.approx(float(fp32), rel=2e-2)  # same model, coarser arithmetic
