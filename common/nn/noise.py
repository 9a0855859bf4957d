"""Training noise: stochastic depth (`model.drop_path`), drawn only inside a training step.

Stochastic depth (Huang et al. 2016; DeiT's and timm's `drop_path`) drops a residual branch for
a whole row: a block computes x + keep_B / (1 - p) * f(x), keep_B ~ Bernoulli(1 - p) per row,
with p rising linearly over the stack, from 0 at its first layer to `model.drop_path` at its last
(timm's `linspace(0, drop_path_rate, depth)`).

The trainer draws around the loss it differentiates (`drawing(key, rows_B)`, the step context's
`draws`); evaluation,
decoding and export call the model outside it and see no noise. Each draw is a function of the
step's key, the stack (an encoder-decoder has two), the layer, the draw's place in the layer
and the row's index in the step's global batch, and of nothing about where the row is computed:
a step draws the same masks on one device or a mesh, with micro-batches or without, with the
layers scanned or not (tests/parallel checks the losses equal one device's).

The shared stack (`memory.run_blocks`) takes a stream per stack (`stack`) and runs each layer
inside `layer(stack, i, num_layers)`; `i` may be traced (a scan's repetition). A block calls
`drop_path(h_BTD, rate)` on each residual branch.
"""

import contextlib
import dataclasses

import jax
import jax.numpy as jnp

from nnx_zoo.common import step_context


@dataclasses.dataclass
class _Draws:
  key: jax.Array  # the step's key, raw uint32 data
  rows_B: jax.Array  # int32: each local row's index in the step's global batch
  stacks: int = 0  # stacks entered so far, in trace order
  layer_key: jax.Array | None = None  # while a layer runs: its key ...
  depth: jax.Array | float = 0.0  # ... its place in the stack, 0 (first) to 1 (last) ...
  count: int = 0  # ... and the draws made in it so far


@contextlib.contextmanager
def drawing(key_data: jax.Array, rows_B: jax.Array):
  """Within it, the layers draw their noise from `key_data` (raw key data, this step's) for the
  rows whose global indices are `rows_B`."""
  with step_context.entered(draws=_Draws(jnp.asarray(key_data), jnp.asarray(rows_B, jnp.int32))):
    yield


def stack() -> int | None:
  """A new stream of draws for one stack of layers (None when nobody draws)."""
  draws = step_context.current().draws
  if draws is None:
    return None
  draws.stacks += 1
  return draws.stacks - 1


@contextlib.contextmanager
def rows(rows_B: jax.Array):
  """Within it, the draws are those of the rows `rows_B` (their global indices): a pipeline's
  micro-batch, run by a stage while the step draws for all of the device's rows."""
  draws = step_context.current().draws
  if draws is None:
    yield
    return
  saved, draws.rows_B = draws.rows_B, rows_B
  try:
    yield
  finally:
    draws.rows_B = saved


@contextlib.contextmanager
def layer(stack_id: int | None, i, num_layers: int):
  """Runs layer `i` (an int, or traced in a scan) of `num_layers` of stream `stack_id`."""
  draws = step_context.current().draws
  if draws is None or stack_id is None:
    yield
    return
  saved = draws.layer_key, draws.depth, draws.count
  key = jax.random.fold_in(jax.random.fold_in(_key(draws.key), stack_id), i)
  draws.layer_key, draws.depth, draws.count = key, i / max(num_layers - 1, 1), 0
  try:
    yield
  finally:
    draws.layer_key, draws.depth, draws.count = saved


def _key(data: jax.Array) -> jax.Array:
  return jax.random.wrap_key_data(data) if data.dtype == jnp.uint32 else data


def drop_path(h_BTD: jax.Array, rate: float) -> jax.Array:
  """h_BTD with each row kept with probability 1 - p (and scaled by 1 / (1 - p)) or zeroed,
  p = rate * the layer's depth; h_BTD itself outside a training step or at rate 0."""
  draws = step_context.current().draws
  if not rate or draws is None or draws.layer_key is None:
    return h_BTD
  if not 0.0 <= rate < 1.0:
    raise ValueError(f"model.drop_path={rate} is not in [0, 1).")
  key = jax.random.fold_in(draws.layer_key, draws.count)
  draws.count += 1
  keep = 1.0 - rate * jnp.asarray(draws.depth, jnp.float32)
  kept_B = jax.vmap(lambda row: jax.random.bernoulli(jax.random.fold_in(key, row), keep))(
    draws.rows_B
  )
  scale_B = jnp.where(kept_B, 1.0 / keep, 0.0).astype(h_BTD.dtype)
  return h_BTD * scale_B.reshape(-1, *(1,) * (h_BTD.ndim - 1))
