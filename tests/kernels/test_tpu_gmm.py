"""The megablox grouped-matmul wrapper: values and gradients against `jax.lax.ragged_dot` in
Pallas TPU interpret mode on CPU (empty groups, rows past the last group, rows not a multiple of
the tile), and forward + backward compiled ahead of time for a TPU slice (v5e:2x2, libtpu
needed) under a check_vma `jax.shard_map`, costing each row's own group only (ragged_dot's weight
gradient costs every group on TPU)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from nnx_zoo.kernels import tpu_gmm


def randn(seed, shape):
  return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), jnp.float32)


@pytest.mark.parametrize(
  "rows, sizes",
  [(200, (30, 0, 70, 41, 50)), (256, (128, 0, 0, 100, 28))],
  ids=["ragged-tail", "whole-tiles"],
)
def test_equals_ragged_dot_values_and_grads(rows, sizes):
  D, F = 64, 96
  x, w, g = randn(0, (rows, D)), randn(1, (len(sizes), D, F)), randn(2, (rows, F))
  sizes = jnp.asarray(sizes, jnp.int32)

  def loss(dot):
    return lambda x, w: jnp.sum(dot(x, w, sizes) * g)

  y = jax.jit(tpu_gmm.gmm)(x, w, sizes)
  want = jax.lax.ragged_dot(x, w, sizes)
  np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-4)
  assert not np.any(y[int(sizes.sum()) :])  # rows past the groups: zeros
  got = jax.jit(jax.grad(loss(tpu_gmm.gmm), (0, 1)))(x, w)
  ref = jax.grad(loss(jax.lax.ragged_dot), (0, 1))(x, w)
  for a, b, name in zip(got, ref, ("dx", "dw"), strict=True):
    assert np.all(np.isfinite(a)) and np.any(a), name
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-4, err_msg=name)


def test_compiles_for_tpu_under_shard_map():
  """Rows split over `data`, experts' F over `tensor`, bf16, under check_vma as in the trainer's
  step: the Mosaic kernels (not interpret mode, not ragged-dot), at the cost of the matmuls."""
  pytest.importorskip("libtpu")
  from nnx_zoo.common import plan

  devices = plan.devices(plan.parse_topology("v5e:2x2"))
  mesh = jax.sharding.Mesh(np.asarray(devices).reshape(2, 2), ("data", "tensor"))
  R, D, F, E = 4096, 512, 1024, 8
  bf16 = jnp.bfloat16
  x = jax.ShapeDtypeStruct((2 * R, D), bf16)
  w = jax.ShapeDtypeStruct((E, D, 2 * F), bf16)
  sizes = jax.ShapeDtypeStruct((2 * E,), jnp.int32)

  def local(x, w, sizes):
    loss = lambda x, w: jnp.sum(tpu_gmm.gmm(x, w, sizes).astype(jnp.float32) ** 2)
    return jax.grad(loss, argnums=(0, 1))(x, w)

  step = jax.jit(
    jax.shard_map(
      local,
      mesh=mesh,
      in_specs=(P("data"), P(None, None, "tensor"), P("data")),
      out_specs=(P("data"), P(None, None, "tensor")),
      check_vma=True,
    )
  )
  lowered = step.lower(x, w, sizes)
  text = lowered.as_text()
  assert "tpu_custom_call" in text and "ragged_dot" not in text
  cost = lowered.compile().cost_analysis()
  cost = cost[0] if isinstance(cost, list) else cost
  ideal = 3 * 2 * R * D * F  # forward, dx and dw on this device's rows and F slice
  assert cost["flops"] < 2 * ideal  # not E x (what ragged_dot's dense weight gradient costs)
