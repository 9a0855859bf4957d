"""The pure step functions at the centre of the trainer, and the train state they work on.

`train_step(state, batch) -> (state, metrics)`: the gradient of the loss of the run's task
(common/tasks/), under `jax.shard_map` when there is a mesh, the fused AdamW update, the
non-finite guard, the weights' moving average (`train.ema`). `eval_step` sums a held-out batch
as the task says. `make_train_step` is the one jitted step `zoo run` runs (and `zoo plan`
compiles).
"""

import contextlib
import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from nnx_zoo.common import config as config_lib
from nnx_zoo.common import models, parallel, tasks
from nnx_zoo.common.errors import UserError
from nnx_zoo.common.nn import accumulate, aux, lora, noise, pipeline
from nnx_zoo.common.train import faults


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class TrainState:
  step: jax.Array
  params: nnx.State
  opt_state: optax.OptState
  rng: jax.Array  # raw key data (uint32), so orbax saves it as a plain array
  # train.ema > 0: the exponential moving average of params (`ema_update`), the weights that are
  # evaluated and that `zoo eval`, `generate`, `export` and `init_from` read; None: no average.
  ema: nnx.State | None = None


def ema_decay(decay: float, step) -> jax.Array:
  """The decay of the average's update at `step` (1 for the first update): `decay`, capped by
  (1 + step) / (10 + step) (tf.train.ExponentialMovingAverage's num_updates), so the early
  average does not lean for thousands of steps on the initial weights."""
  step = jnp.asarray(step, jnp.float32)
  return jnp.minimum(decay, (1 + step) / (10 + step))


def ema_update(ema, params, *, decay: float, step):
  """ema + (1 - d) * (params - ema), d = `ema_decay(decay, step)`; written as an increment so
  that a parameter that does not change (a frozen one) stays bitwise equal to its average."""
  d = ema_decay(decay, step)
  return jax.tree.map(lambda e, p: e + ((1 - d) * (p - e)).astype(e.dtype), ema, params)


def sums_and_grads(
  params,
  batch: dict,
  *,
  graphdef,
  task,
  micro_batches: int = 1,
  frozen=None,
  loss_chunk: int = 0,
  noise_key=None,
  rows=None,
) -> tuple[dict, nnx.State]:
  """The batch's summed loss of `task` (`total`), the number of targets it sums over (`count`) and
  the mean of each auxiliary loss the layers added (`aux`, common/nn/aux.py), with the gradient
  of total + count * sum(weight * aux) with respect to `params` (`frozen`: parameters the model
  also uses, not differentiated). With micro_batches > 1 the batch is cut into that many slices
  run one after another (gradient accumulation: the activations of one slice are alive at a
  time); the sums are the same.

  `noise_key` (raw key data): the step's training noise (stochastic depth, common/nn/noise.py),
  drawn for the rows whose indices in the step's global batch are `rows` (those of `batch`)."""
  frozen = () if frozen is None else (frozen,)

  def objective(params, batch, rows):
    drawing = contextlib.nullcontext() if noise_key is None else noise.drawing(noise_key, rows)
    with aux.collect() as entries, drawing:
      total, count = task.loss_sums(
        nnx.merge(graphdef, params, *frozen), batch, loss_chunk=loss_chunk
      )
    # The auxiliary losses are means: weighted by the targets so that, summed over devices and
    # divided by all the targets, each adds its own weight * mean to the mean loss.
    objective = total + count * aux.weighted_sum(entries) if entries else total
    return objective, {"total": total, "count": count, "aux": aux.means(entries)}

  if micro_batches == 1:
    grads, sums = jax.grad(objective, has_aux=True)(params, batch, rows)
    return sums, grads
  # Each slice takes its rows of the batch and (drawing noise) those rows' global indices; a
  # frozen model's params (tasks.FROZEN) whole.
  held = {k: v for k, v in batch.items() if k == tasks.FROZEN}
  batch = {k: v for k, v in batch.items() if k != tasks.FROZEN}
  micro = jax.tree.map(lambda x: x.reshape(micro_batches, -1, *x.shape[1:]), (batch, rows))

  def add(acc, one_slice):
    one_slice = ({**one_slice[0], **held}, one_slice[1])
    fused = set()  # the leaves whose gradients the layers' backward loop added into `acc`

    def accumulating(params, batch, rows):
      with accumulate.accumulating(params, acc, *frozen) as added:
        out = objective(params, batch, rows)
      fused.update(added)
      return out

    grads, sums = jax.grad(accumulating, has_aux=True)(params, *one_slice)
    leaves, treedef = jax.tree.flatten(grads)
    acc = jax.tree.leaves(acc)
    leaves = [g if i in fused else a + g for i, (g, a) in enumerate(zip(leaves, acc, strict=True))]
    return jax.tree.unflatten(treedef, leaves), sums

  # Every slice runs in the loop, adding into gradients that start at zero (typed as the params
  # are, so the loop's carry keeps their sharding types), and each slice's sums leave it as its
  # output. Starting from the first slice's gradients instead, computed before the loop, planned
  # 0.64 GiB more temporaries for Qwen3-30B's 48 layers on v5e-64 (`bench/scan_growth.py`).
  # Scanned layers rematerialised in full add theirs in their own backward loop, in place
  # (`accumulate.accumulating`).
  grads, sums = jax.lax.scan(add, jax.tree.map(parallel.zeros_like, params), micro)
  sums = {
    "total": jnp.sum(sums["total"]),
    "count": jnp.sum(sums["count"]),
    "aux": {k: jnp.mean(v) for k, v in sums["aux"].items()},
  }
  return sums, grads


def context_rows(batch: dict, layout: parallel.Layout, task=None) -> tuple[dict, dict]:
  """The batch as the sharded step splits it, and the PartitionSpec of each array. Under
  `mesh.context` > 1 the rows `task` splits (`Task.context_rows`: a language model's
  `next_token` rows, made from whole rows) are laid out in `parallel.context_order` and split
  over `context` as well as the batch axes: made on the host by `put_batch` (NumPy), or in the
  step when it is given whole rows. Every batch without the split is split over the batch axes
  only (a language model's rows whole: its loss makes their next-token rows on each device); a
  task with no rows to split refuses it."""
  context = layout.sizes.get("context", 1)
  if "next_token" in batch:  # made already (put_batch)
    return batch, {"next_token": {k: layout.token_spec for k in batch["next_token"]}}
  if context == 1:  # rows over the batch axes; a frozen model's params as params are
    specs = {k: jax.tree.map(lambda _: layout.batch_spec, v) for k, v in batch.items()}
    if tasks.FROZEN in batch:
      specs[tasks.FROZEN] = layout.param_specs(batch[tasks.FROZEN])
    return batch, specs
  rows = None if task is None else task.context_rows(batch)
  if rows is None:
    raise UserError(
      f"mesh.context={context} splits the token rows of a language model (a decoder trained "
      f"on next tokens); the {getattr(task, 'name', 'this')} task has none to split: set "
      "mesh.context=1."
    )
  order = parallel.context_order(rows["inputs"].shape[1], context)
  rows = {k: v[:, order] for k, v in rows.items()}
  return {"next_token": rows}, {"next_token": {k: layout.token_spec for k in rows}}


def sharded_sums_and_grads(
  params, batch: dict, *, graphdef, task, layout: parallel.Layout, frozen=None, **kw
) -> tuple[dict, nnx.State]:
  """`sums_and_grads` under shard_map: each device runs its batch shard (and, under
  `mesh.context`, its share of every row's tokens: `context_rows`) with its parameter shards;
  the shared layers gather and reduce (see common/parallel.py)."""
  # mesh.pipeline: the stacked layers in the stages' order (a no-op unless model.pipeline_repeats
  # > 1), their gradients back in the canonical order below.
  params = pipeline.to_stages(params, layout)
  specs = layout.param_specs(params)
  frozen = nnx.State({}) if frozen is None else pipeline.to_stages(frozen, layout)
  batch, batch_specs = context_rows(batch, layout, task)
  # Each device draws the noise of its own rows (their indices in the global batch).
  rows = kw.pop("rows", None)
  rows_spec = None if rows is None else layout.batch_spec

  def local(params, frozen, batch, rows):
    with parallel.active(layout):
      sums, grads = sums_and_grads(
        params, batch, graphdef=graphdef, task=task, frozen=frozen, rows=rows, **kw
      )
    sums = {
      "total": parallel.token_sum(sums["total"]),
      "count": parallel.token_sum(sums["count"]),
      "aux": jax.tree.map(parallel.token_mean, sums["aux"]),
    }
    return sums, grads

  sums, grads = jax.shard_map(
    local,
    mesh=layout.mesh,
    in_specs=(specs, layout.param_specs(frozen), batch_specs, rows_spec),
    out_specs=(parallel.P(), specs),
    check_vma=True,
  )(params, frozen, batch, rows)
  return sums, pipeline.from_stages(grads, layout)


def train_step(
  state: TrainState,
  batch: dict,
  *,
  graphdef,
  task,
  tx,
  layout: parallel.Layout | None = None,
  micro_batches: int = 1,
  trainable=nnx.Param,
  loss_chunk: int = 0,
  ema: float = 0.0,
  noisy: bool = False,
) -> tuple[TrainState, dict]:
  # Only the trained part is differentiated and updated (all of it, unless LoRA freezes some).
  trained, frozen = nnx.split_state(state.params, trainable, ...)
  kw = dict(
    graphdef=graphdef, task=task, micro_batches=micro_batches, frozen=frozen, loss_chunk=loss_chunk
  )
  if noisy:  # this step's key, and every row's index in the batch (common/nn/noise.py)
    key = jax.random.fold_in(jax.random.wrap_key_data(state.rng), state.step)
    kw.update(noise_key=jax.random.key_data(key), rows=jnp.arange(batch_rows(batch)))
  if layout is None:
    sums, grads = sums_and_grads(trained, batch, **kw)
  else:
    sums, grads = sharded_sums_and_grads(trained, batch, layout=layout, **kw)
  # The gradients are of the summed loss: the optimizer scales them by 1/count as it reads them
  # (common/train/optim.py), so the mean gradient is never stored.
  count = jnp.maximum(sums["count"], 1.0)
  loss, grad_norm = sums["total"] / count, optax.tree.norm(grads) / count
  # A non-finite loss or gradient leaves params and optimizer state as they were (the step still
  # counts); train.nonfinite says, outside the step, whether the run goes on (faults.NonFinite).
  ok = faults.finite(loss, grad_norm)
  updates, opt_state = tx.update(
    grads, state.opt_state, trained, grad_scale=1 / count, grad_norm=grad_norm, apply=ok
  )
  params = nnx.merge_state(optax.apply_updates(trained, updates), frozen)
  average = state.ema
  if average is not None:  # a skipped step leaves the average as it was, like the params
    new = ema_update(average, params, decay=ema, step=state.step + 1)
    average = jax.tree.map(lambda n, o: jnp.where(ok, n, o), new, average)
  skipped = jnp.logical_not(ok).astype(jnp.int32)
  metrics = {"loss": loss, "grad_norm": grad_norm, "targets": count, "skipped": skipped}
  metrics.update(sums["aux"])
  return TrainState(state.step + 1, params, opt_state, state.rng, average), metrics


def eval_step(params, batch: dict, *, graphdef, task, prompts=None) -> dict:
  """The held-out sums of one batch (`Task.eval_sums`: summed loss and count, and for a
  classifier its correct predictions; `prompts` [C, T]: a CLIP model's class prompts)."""
  return task.eval_sums(nnx.merge(graphdef, params), batch, prompts=prompts)


# The state: fresh, abstract (shapes only) and placed on the mesh


def sharded_eval_step(params, batch: dict, *, graphdef, task, layout: parallel.Layout) -> dict:
  """`eval_step` of a language model's rows split over `mesh.context` (`context_rows`), under
  shard_map as the train step runs: plain jit cannot split a row, whose attention gathers
  across the split. Each device sums its tokens; the sums are over all devices."""
  batch, batch_specs = context_rows(batch, layout, task)

  def local(params, batch):
    with parallel.active(layout):
      return parallel.token_sum(eval_step(params, batch, graphdef=graphdef, task=task))

  return jax.shard_map(
    local,
    mesh=layout.mesh,
    in_specs=(layout.param_specs(params), batch_specs),
    out_specs=parallel.P(),
    check_vma=True,
  )(params, batch)


def init_state(cfg, tx) -> tuple[nnx.GraphDef, TrainState]:
  model = models.build(cfg.model, seed=cfg.seed)
  graphdef, params = nnx.split(model, nnx.Param)
  rng = jax.random.key_data(jax.random.key(cfg.seed + 1))
  trained = nnx.state(model, lora.trainable(cfg.model))  # the optimizer holds state for these
  average = jax.tree.map(jnp.copy, params) if cfg.train.ema else None  # starts at the params
  return graphdef, TrainState(jnp.zeros((), jnp.int32), params, tx.init(trained), rng, average)


def abstract_state(cfg, tx) -> TrainState:
  return jax.eval_shape(lambda: init_state(cfg, tx)[1])


def placed_abstract_state(cfg, tx, layout: parallel.Layout | None):
  """The abstract train state with each leaf's sharding, and those shardings (one device:
  everything on the default device)."""
  abstract = abstract_state(cfg, tx)
  shardings = parallel.placement(abstract, layout)
  placed = jax.tree.map(
    lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, shardings
  )
  return placed, shardings


def put_batch(batch: dict, layout: parallel.Layout | None, task=None) -> dict:
  """The global batch from this process's rows of it (`parallel.process_rows`), each device
  given its part only: rows split over the batch axes and, under `mesh.context` > 1, a language
  model's rows as their next-token rows (`context_rows`, made here on the host from the whole
  rows) with each device's share of every row's tokens, so no device receives whole rows."""
  if layout is None:
    return batch
  batch, specs = context_rows(batch, layout, task)
  # The global rows: this process holds `held` of the batch axes' `shards` blocks of rows.
  shards = math.prod(layout.sizes[a] for a in parallel.BATCH_AXES)
  held = parallel.process_block(layout, layout.batch_spec, (shards,))[0]
  rows = batch_rows(batch) * shards // (held.stop - held.start)

  def put(spec, x):
    shape = (rows, *x.shape[1:])
    block = parallel.process_block(layout, spec, shape)  # its rows are those of x
    sharding = parallel.NamedSharding(layout.mesh, spec)
    return jax.make_array_from_process_local_data(sharding, x[(slice(None), *block[1:])], shape)

  return jax.tree.map(put, specs, batch, is_leaf=lambda s: isinstance(s, parallel.P))


def make_train_step(cfg, *, tx, layout: parallel.Layout | None, shardings):
  """The jitted train step of `cfg` (the state donated, placed as `shardings`): what `zoo run`
  runs and `zoo plan` compiles for other hardware."""
  graphdef = nnx.graphdef(models.abstract(cfg.model))
  step = functools.partial(
    train_step,
    graphdef=graphdef,
    task=tasks.of(cfg),
    tx=tx,
    layout=layout,
    micro_batches=cfg.train.micro_batches,
    trainable=lora.trainable(cfg.model),
    loss_chunk=cfg.train.loss_chunk,
    ema=cfg.train.ema,
    noisy=noisy(cfg.model),
  )
  return jax.jit(step, donate_argnums=0, out_shardings=(shardings, None))


def noisy(model_cfg) -> bool:
  """Whether a model (or a model inside it: CLIP's towers, an encoder-decoder's sides) draws
  training noise (`drop_path`)."""
  return any(
    k.split(".")[-1] == "drop_path" and bool(v)
    for k, v in config_lib.flatten(model_cfg.to_dict()).items()
  )


def batch_rows(batch: dict) -> int:
  """The number of rows (examples) a batch holds: the leading dim of its arrays."""
  return jax.tree.leaves({k: v for k, v in batch.items() if k != tasks.FROZEN})[0].shape[0]
