"""Pipeline parallelism: the scanned layers split into stages over `mesh.pipeline`, run on a
circular schedule inside the train step's one `jax.shard_map` (MaxText's and praxis' design).

The stacked layers (`model.scan`, common/nn/stacking.py) are C = S x R chunks of consecutive
layers (S stages, R = `model.pipeline_repeats`); stage s holds chunks s, S + s, 2S + s, ...
Each device's rows are cut into M = `train.pipeline_microbatches` micro-batches, and one
`lax.scan` runs M x R + S - 1 iterations. In iteration t, stage s works on item k = t - s (when
0 <= k < M x R: repeat r = k // M, micro-batch m = k % M) with its chunk r x S + s, then passes
the activations to stage s + 1 by `ppermute` (the last stage to the first, whose next repeat
takes them M - S iterations later: a delay line of M - S slots). The other iterations are the
bubbles, (S - 1) / (M x R + S - 1) of them: their inputs are zeroed, their weights' gradients,
auxiliary losses and outputs masked with `where` (not multiplied: a NaN in a bubble stays out).
A stage's chunk on a micro-batch is rematerialised, keeping only its input.

Storage. Checkpoints and every boundary keep the canonical stacked layout [repetitions, ...]:
the train state stores it with the layer dim split over `pipeline` in contiguous blocks, which is
stage s's chunks when R = 1. With R > 1 the step puts the layers in stage order ([R, S, n] ->
[S, R, n], `to_stages`) and the gradients back (`from_stages`): XLA moves (R - 1) / R of the
stacked weights and of their gradients between stages every step.

What is outside: the embedding and the head run before and after the stages on every pipeline
device (its rows are not split over `pipeline`); the last stage's outputs reach them by a `psum`
over `pipeline` of outputs masked to that stage. FSDP: a stage gathers its weights once per step,
before the loop (`parallel.gather`), not in every iteration.
"""

import contextlib
import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from nnx_zoo.common import parallel, step_context
from nnx_zoo.common.errors import UserError
from nnx_zoo.common.nn import aux, noise, stacking

AXIS = "pipeline"
# What fills the activations of the bubbles before anything is computed: zeros. A test fills
# them with NaN to check that nothing of a bubble reaches a loss or a gradient.
FILL = 0.0


@dataclasses.dataclass(frozen=True)
class Schedule:
  """S stages, R repeats (circular), M micro-batches."""

  stages: int
  repeats: int
  microbatches: int

  @property
  def iterations(self) -> int:
    return self.microbatches * self.repeats + self.stages - 1

  @property
  def bubble(self) -> float:
    """The fraction of a stage's iterations that are bubbles."""
    return (self.stages - 1) / self.iterations

  @property
  def delay(self) -> int:
    """The iterations the first stage holds an item between two repeats (M - S)."""
    return self.microbatches - self.stages

  def table(self) -> list[tuple[int, int, int, int]]:
    """(iteration, stage, repeat, micro-batch) of every item the stages work on, in time order:
    what `circulate` computes, written out (tests and `zoo plan`)."""
    out = []
    for t in range(self.iterations):
      for s in range(self.stages):
        k = t - s
        if 0 <= k < self.microbatches * self.repeats:
          out.append((t, s, k // self.microbatches, k % self.microbatches))
    return out


def schedule_of(layout: parallel.Layout | None) -> Schedule | None:
  """The schedule of the sharded step being traced (None: no pipeline)."""
  if layout is None or layout.sizes.get(AXIS, 1) == 1:
    return None
  stages = layout.sizes[AXIS]
  return Schedule(stages, layout.pipeline_repeats, layout.pipeline_microbatches or 2 * stages)


def active() -> bool:
  """Whether the step being traced runs its stacked layers in stages."""
  return schedule_of(parallel.current_layout()) is not None


# The stacked weights in stage order, and back (R > 1; the identity for R = 1).


def _permute(tree, layout: parallel.Layout | None, *, inverse: bool):
  schedule = schedule_of(layout)
  if schedule is None or schedule.repeats == 1:
    return tree
  S, R = schedule.stages, schedule.repeats

  def one(v):
    if getattr(v, "axes", None) is None or tuple(v.axes)[:1] != (stacking.LAYERS,):
      return v
    a = v.get_value()
    n = a.shape[0] // (S * R)
    split = (S, R) if inverse else (R, S)
    a = a.reshape(*split, n, *a.shape[1:]).swapaxes(0, 1).reshape(a.shape)
    return v.replace(a)

  return jax.tree.map(one, tree, is_leaf=stacking.is_variable)


def to_stages(params, layout):
  """The stacked leaves of `params` (global arrays) with stage s's chunks in block s."""
  return _permute(params, layout, inverse=False)


def from_stages(grads, layout):
  """`to_stages` undone: the canonical layer order."""
  return _permute(grads, layout, inverse=True)


# The schedule.


@jax.custom_vjp
def _bubble_masked(w, valid):
  """`w`, whose gradient is zero where `valid` is false (where, not times: a bubble's NaN)."""
  return w


def _bubble_masked_fwd(w, valid):
  return w, valid


def _bubble_masked_bwd(valid, g):
  return jnp.where(valid, g, jnp.zeros_like(g)), None


_bubble_masked.defvjp(_bubble_masked_fwd, _bubble_masked_bwd)


def circulate(fn, x_M, *, schedule: Schedule, policy=None, fill: float | None = None):
  """The circular schedule on this stage (inside shard_map over `pipeline`): micro-batches
  `x_M` [M, ...] (the same on every stage) through `fn(x, r, m, valid) -> (y, extra)`, this
  stage's chunk of repeat r on micro-batch m, in every iteration. Returns the last stage's
  outputs [M, ...] on every stage, and each leaf of `extra` summed over the valid iterations of
  every stage. `policy`: the remat policy of `fn` (its input is kept)."""
  S, R, M = schedule.stages, schedule.repeats, schedule.microbatches
  fill = FILL if fill is None else fill
  s = jax.lax.axis_index(AXIS)
  ring = [(i, (i + 1) % S) for i in range(S)]

  def work(t):
    k = t - s
    valid = (k >= 0) & (k < M * R)
    k = jnp.clip(k, 0, M * R - 1)
    return k // M, k % M, valid

  # The carry's type: an output varies over the inputs' axes and the stage's (its weights vary
  # over `pipeline`); one that varied over more would fail the scan's type check, not pass.
  axes = parallel.varying(x_M) | {AXIS}
  # The rematerialised unit: a stage's chunk on one micro-batch, keeping its input; the rest of
  # an iteration (selects, the delay line, the send) keeps nothing a micro-batch large.
  fn = jax.checkpoint(fn, policy=policy, prevent_cse=False)
  blank = parallel.to_varying(jnp.full(x_M.shape[1:], fill, x_M.dtype), axes)
  fifo = (
    jnp.broadcast_to(blank, (schedule.delay, *blank.shape)) if R > 1 and schedule.delay else None
  )

  def step(carry, t):
    incoming, fifo = carry  # incoming: what the previous stage sent in the last iteration
    r, m, valid = work(t)
    delayed = incoming
    if fifo is not None:  # the last stage's output of M - S iterations ago
      slot = t % schedule.delay
      delayed = jax.lax.dynamic_index_in_dim(fifo, slot, keepdims=False)
      fifo = jax.lax.dynamic_update_index_in_dim(fifo, incoming, slot, 0)
    fresh = jax.lax.dynamic_index_in_dim(x_M, jnp.minimum(t, M - 1), keepdims=False)
    x = jnp.where(s == 0, jnp.where(t < M, fresh, delayed), incoming)
    x = jnp.where(valid, x, jnp.zeros_like(x))
    y, extra = fn(x, r, m, valid)
    y = parallel.to_varying(y, axes)
    extra = jax.tree.map(lambda e: jnp.where(valid, e, jnp.zeros_like(e)), extra)
    return (jax.lax.ppermute(y, AXIS, ring), fifo), (y, extra)

  _, (ys, extras) = jax.lax.scan(step, (blank, fifo), jnp.arange(schedule.iterations))
  # Item (R - 1, m) leaves the last stage in iteration (R - 1) x M + m + S - 1.
  first = (R - 1) * M + S - 1
  out = ys[first : first + M]
  out = jax.lax.psum(jnp.where(s == S - 1, out, jnp.zeros_like(out)), AXIS)
  return out, jax.tree.map(lambda e: jax.lax.psum(jnp.sum(e, axis=0), AXIS), extras)


# The stacked layers of a stack, in stages (what memory.run_blocks calls when pipelining).


def _gathered(states, layout):
  """Each stacked leaf with its fsdp-split dims whole: the stage's weights, gathered once."""

  def one(v):
    axes = getattr(v, "axes", None)
    # A layer's 1-D weights (norm scales, biases) are stored whole (Layout.param_spec).
    if axes is None or v.get_value().ndim <= 2:
      return v
    return v.replace(parallel.gather(v.get_value(), (None, *tuple(axes)[1:])))

  return jax.tree.map(one, states, is_leaf=stacking.is_variable)


@contextlib.contextmanager
def _gathered_layout(layout):
  """The layers inside a stage find their weights gathered already (`_gathered`)."""
  with parallel.active(dataclasses.replace(layout, gathered=True)):
    yield


def run(stacked, x_BTD, *, rest, policy, period, per_slot, stream, kwargs):
  """The stacked layers of one stack on `x_BTD` (this device's rows) in stages; the same
  result as `memory.run_blocks` without a pipeline. `kwargs` (and `per_slot[j]`, slot j's): what
  every layer takes; its arrays with one entry per row (positions, segment ids, a
  conditioning) are cut into the micro-batches with the rows."""
  layout = parallel.current_layout()
  schedule = schedule_of(layout)
  S, R, M = schedule.stages, schedule.repeats, schedule.microbatches
  if len(rest):
    raise UserError(
      f"mesh.pipeline={S} needs every layer in the stacked repetitions of the pattern "
      f"({len(rest)} left over): choose model.num_layers a multiple of the pattern."
    )
  B = x_BTD.shape[0]
  if B % M:
    raise UserError(f"This device's {B} rows do not split into {M} pipeline micro-batches.")

  def split(a):
    return a.reshape(M, B // M, *a.shape[1:])

  def per_row(a):
    return isinstance(a, jax.Array) and a.ndim >= 1 and a.shape[0] == B

  rows = {k: split(v) for k, v in kwargs.items() if per_row(v)}
  draws = step_context.current().draws
  rows_M = split(draws.rows_B) if draws is not None else None

  splits = [nnx.split(slot) for slot in stacked]
  graphdefs = [g for g, _ in splits]
  states = _gathered(tuple(s for _, s in splits), layout)
  local = stacking.num_stacked(stacked)  # this stage's repetitions of the pattern: R x n
  n = local // R
  num_layers = local * S * period  # the stack's (the noise's depth is over all of them)

  def chunk(r, valid):
    def one(a):
      a = jax.lax.dynamic_index_in_dim(a.reshape(R, n, *a.shape[1:]), r, keepdims=False)
      return _bubble_masked(a, valid)

    return jax.tree.map(one, states)

  s = jax.lax.axis_index(AXIS)

  def fn(x, r, m, valid):
    layer_kw = {**kwargs, **{k: v[m] for k, v in rows.items()}}
    base = (r * S + s) * n  # the stack's repetition this chunk starts at

    def body(x, xs):
      # What the layers add to the aux channel leaves the body as its output (no leaked tracer).
      i, reps = xs
      with aux.collect() as entries:
        for j, state in enumerate(reps):
          block = nnx.merge(graphdefs[j], stacking.layer_state(state))
          kw = layer_kw if per_slot is None else {**layer_kw, **per_slot[j]}
          with noise.layer(stream, (base + i) * period + j, num_layers):
            x, _ = block(x, cache=None, **kw)
      weights.update(aux.weights(entries))
      return x, aux.as_arrays(entries)

    drawing = noise.rows(rows_M[m]) if rows_M is not None else contextlib.nullcontext()
    x = parallel.to_varying(x, frozenset({AXIS}))  # as the stage's layers make it
    with drawing, _gathered_layout(layout):
      x, added = jax.lax.scan(body, x, (jnp.arange(n), chunk(r, valid)))
    return x, jax.tree.map(lambda a: jnp.sum(a, axis=0), added)

  weights = {}
  out_M, added = circulate(fn, split(x_BTD), schedule=schedule, policy=policy)
  aux.add_collected(added, weights)
  return out_M.reshape(x_BTD.shape)
