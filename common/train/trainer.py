"""The one trainer for every family, in the order it runs: the layout, the data, the step
(compiled, its memory checked: common/train/fit.py), the weights (a train state restored, fresh,
or fresh with another checkpoint's weights), the workdir, the task's own start-up, then the loop.

The step itself (`common/train/step.py`) is a pure `train_step(state, batch) -> (state,
metrics)`; everything here is start-up and bookkeeping around it.
"""

import dataclasses
import functools
import os
import time

import jax
import jax.numpy as jnp
import ml_collections
from flax import nnx

from nnx_zoo.common import config as config_lib
from nnx_zoo.common import device_memory, files, mesh, models, parallel, tasks
from nnx_zoo.common.data import kinds, prepared
from nnx_zoo.common.errors import UserError
from nnx_zoo.common.hub import checkpoint, weights
from nnx_zoo.common.nn import qlora
from nnx_zoo.common.train import (
  events,
  faults,
  fit,
  goodput,
  inject,
  optim,
  settings,
  stragglers,
  wallclock,
  watchdog,
)
from nnx_zoo.common.train import step as steps
from nnx_zoo.common.train.metrics import MetricsLog


def train(cfg: ml_collections.ConfigDict, workdir: str, *, progress: bool = True) -> dict:
  """Trains `cfg` (resolved: experiments.get_config) in `workdir`, resuming from its latest
  checkpoint; returns the last metrics."""
  from tqdm import tqdm

  # Layout: a mesh that does not fit is refused before anything is read or written; so is a
  # workdir that holds a run of another model or data (resumed with the levers train.fit chose
  # for it), and data that does not fit the model (its tokenizer, its chat template). The run's
  # timeline (events/, for `zoo goodput`) is kept in memory until the workdir is written.
  ev = events.Events(workdir)
  layout = experiment_layout(cfg)
  ev.record("backend")
  cfg = fit.resumed(cfg, workdir)
  # A QLoRA base whose scales the mesh cannot split: one line, before the step compiles
  qlora.check_mesh(nnx.state(models.abstract(cfg.model), nnx.Param), layout)
  check_workdir(cfg, workdir)
  files.check_creatable(workdir, checkpoint.directory(workdir))  # before any data is read
  kinds.check(cfg)
  tasks.of(cfg)  # the task's own settings (its section of the config), checked before writing

  # Data: what cfg.data.kind's module of common/data/ loads (read only; a resumed run's
  # continues where its step left it, below)
  data = load_data(cfg, layout=layout, checked=True)

  # The step, compiled for the data's batches and its memory compared with the device's before
  # the weights are read or anything is written: one that does not fit is made to fit
  # (train.fit="auto") or refused in one line
  tx = optim.optimizer(cfg.optim, cfg.train.steps)
  cfg, step_fn = fit.fitted_step(cfg, tx=tx, layout=layout, example=fit.peek(data.iterator))

  # The hang watchdog (started with the loop) and $NNX_ZOO_INJECT's test faults, checked now
  process, processes = jax.process_index(), jax.process_count()
  guard = watchdog.Watchdog(
    cfg.train.watchdog_s,
    workdir=workdir,
    process=process,
    processes=processes,
    warmup_steps=cfg.train.log_every,
  )
  injected = inject.from_env(workdir, process=process)
  step_fn = injected.step_fn(step_fn)  # its stalls inside the step (none: the same step_fn)

  # Weights: resumed, fresh, or fresh with init_from's in their place (`start_state`)
  t0 = time.time()
  state, _ = start_state(cfg, tx, layout, workdir)
  ev.record("restore", step=int(state.step), seconds=time.time() - t0)

  # The workdir: config.json, the first file written, and the checkpoints
  write_config(cfg, workdir)
  ckpts = checkpoint.Checkpoints(workdir, keep=cfg.train.keep_checkpoints)
  ev.open()
  start = int(state.step)
  if start:
    ckpts.restore_data(start, data.iterator)

  # The task's own start-up (dpo and grpo: the reference model)
  task = tasks.of(cfg).prepare(data, cfg=cfg, layout=layout)

  # Loop
  data_iter = data.iterator
  meta = {"family": cfg.model.family, "model": cfg.model.to_dict(), "data": cfg.data.to_dict()}
  if cfg.train.ema:  # the readers of the checkpoint take the average (weights.params_key)
    meta["weights"] = "ema"
  graphdef = nnx.graphdef(models.abstract(cfg.model))
  tokens_per_step = cfg.train.batch_size * data.tokens_per_row
  lr_at = optim.schedule(cfg.optim, cfg.train.steps)
  log = MetricsLog(workdir)
  bar = tqdm(
    total=cfg.train.steps,
    initial=start,
    disable=not progress or jax.process_index(),
    unit="step",
    dynamic_ncols=True,
  )
  last, t0, since = {}, time.perf_counter(), start
  nonfinite = faults.NonFinite(cfg.train.nonfinite, ckpts)
  signals = faults.Signals().install()  # SIGTERM/SIGINT: finish the step, save, exit
  clock = wallclock.CheckpointClock(
    cfg.train.checkpoint_minutes, every=cfg.train.log_every, ckpts=ckpts
  )
  straggling = stragglers.Monitor(cfg.train, ev)
  how = "failed"
  guard.start()
  try:
    for step in range(start + 1, cfg.train.steps + 1):
      injected.at(step)
      ev.step_start()
      batch = steps.put_batch(next(data_iter), layout, task)
      ev.data_ready()
      batch = task.complete_train(batch, state.params)
      state, metrics = step_fn(state, fit.placed(batch, layout))
      ev.dispatched(step, metrics)  # recorded when done (its metrics ready), not now
      nonfinite.observe(step, metrics)
      if step % cfg.train.log_every == 0 or step == cfg.train.steps:
        metrics = {k: float(v) for k, v in metrics.items()}
        ev.wait_steps()  # the window's steps on disk before its line (and its straggler check)
        metrics["skipped"] = nonfinite.take()  # since the last line; "stop" raises here
        elapsed = time.perf_counter() - t0
        metrics["tokens_per_s"] = (step - since) * tokens_per_step / elapsed
        metrics["examples_per_s"] = (step - since) * cfg.train.batch_size / elapsed
        metrics["lr"] = float(lr_at(step - 1))
        metrics.update(task.step_metrics())  # what the task measured on the host (grpo)
        metrics.update(straggling.check(step))  # several processes: who is slow, if anyone
        t0, since = time.perf_counter(), step
        log.write(step, metrics)
        bar.set_postfix(loss=f"{metrics['loss']:.3f}", tok_s=f"{metrics['tokens_per_s']:.0f}")
        last = metrics
      bar.update(1)
      if (
        data.eval is not None
        and cfg.train.eval_every
        and (step % cfg.train.eval_every == 0 or step == cfg.train.steps)
      ):
        weights_now = state.params if state.ema is None else state.ema  # train.ema: the average
        ev.wait_steps()  # the queued steps' compute is theirs, not the evaluation's
        with guard.allowing(), ev.timed("eval", step=step):  # the first evaluation compiles
          held = evaluate(weights_now, data, graphdef=graphdef, cfg=cfg, layout=layout, task=task)
        log.write(step, held, split="eval")
        # The loss, and what else the task and data measure (accuracy, word error rate...).
        shown = ", ".join(f"{k} {v:.4f}" for k, v in held.items() if isinstance(v, float))
        bar.write(f"step {step}: eval {shown}")
        last = {**last, "eval_loss": held["loss"]}
        t0 = time.perf_counter()  # evaluation time is not training throughput
      # Read once per step; with several processes, every one of them stops at the same step.
      stop = signals.stop_after() if step < cfg.train.steps else None
      # Permanent saves by step number; between them a temporary one when train.checkpoint_minutes
      # have passed (kept until the next permanent one: common/hub/checkpoint.py).
      permanent = stop or step % cfg.train.checkpoint_every == 0 or step == cfg.train.steps
      if permanent or clock.due(step):
        nonfinite.check()  # under "stop", nothing after a non-finite step is saved
        kind = "permanent" if permanent else "temporary"
        ev.wait_steps()  # the same for the save
        with ev.timed("checkpoint", step=step, kind=kind):
          ckpts.save(
            step,
            state,
            data_iterator=data_iter,
            meta=meta,
            force=bool(stop),
            temporary=not permanent,
          )
      if stop:
        ckpts.wait()  # on disk before the process ends
        how = "preempted"
        raise signals.preempted(step, ckpts.path)
      guard.beat(step)
    how = "finished"
  finally:
    guard.stop()
    signals.restore()
    bar.close()
    ckpts.wait()
    ckpts.close()
    ev.close(how)
    if how != "failed" and log.active:  # the run's goodput so far, across its attempts
      log.scalars(cfg.train.steps, goodput.scalars(goodput.summary(workdir)), prefix="goodput")
    log.close()
  return last


# Start-up pieces (also used by `zoo eval` and `zoo data`)


def experiment_layout(cfg) -> parallel.Layout | None:
  """The layout of the mesh `cfg.mesh` on this job's devices (None on one device), the model,
  batch and pipeline checked against it."""
  sizes = mesh.resolve(cfg.mesh, jax.device_count())
  parallel.check_experiment(cfg, sizes)
  return parallel.experiment_layout(cfg, sizes) if jax.device_count() > 1 else None


def start_state(cfg, tx, layout, workdir: str):
  """The train state the loop starts from, and its shardings: the newest step in `workdir` that
  restores (damaged newer ones are set aside; its data iterator is restored once the data is
  loaded, `Checkpoints.restore_data`); else a fresh state, with the weights of `cfg.init_from`
  in place of its fresh params (what init_from does not give, adapters and init_reinit, stays
  fresh). A new run writes nothing here: a checkpoint that does not fit leaves no workdir."""
  abstract, shardings = steps.placed_abstract_state(cfg, tx, layout)
  if checkpoint.has_steps(workdir):
    ckpts = checkpoint.Checkpoints(workdir, keep=cfg.train.keep_checkpoints)
    try:
      state = ckpts.restore_latest(abstract, with_data=True)
    finally:
      ckpts.close()
    if state is not None:
      return state, shardings
  if not cfg.init_from and cfg.model.lora.get("base_quant") and jax.process_count() == 1:
    # A fresh QLoRA model built op by op, then placed: the stack quantizes each layer as it is
    # built, so one layer's fp32 kernels are held at a time. Jitted, XLA schedules every
    # layer's random kernels before their quantization (a Qwen2.5-1.5B-shaped nf4 init:
    # 13.12 GiB of temporaries; tests/common/test_qlora_memory.py).
    return jax.device_put(steps.init_state(cfg, tx)[1], shardings), shardings
  if not cfg.init_from:
    return jax.jit(lambda: steps.init_state(cfg, tx)[1], out_shardings=shardings)(), shardings
  # init_from's weights, each read once (a QLoRA base quantized as it is read); of the fresh
  # state only what they do not give is computed (adapters, init_reinit, the optimizer state,
  # the rng): no fresh copy of the base is made, nor a QLoRA base's random fp32 kernels.
  loaded = weights.init_params(cfg, nnx.state(models.abstract(cfg.model), nnx.Param))
  params = weights.start_params(
    loaded, lambda: steps.init_state(cfg, tx)[1].params, abstract.params, shardings.params
  )
  del loaded
  without = dict(params={}, ema=None)  # the params are init_from's, the average starts at them
  state = jax.jit(
    lambda: dataclasses.replace(steps.init_state(cfg, tx)[1], **without),
    out_shardings=dataclasses.replace(shardings, **without),
  )()
  state = dataclasses.replace(state, params=params)
  if shardings.ema is not None:  # the average starts at the loaded weights (its own buffers)
    state = dataclasses.replace(state, ema=jax.tree.map(jnp.copy, params))
  return state, shardings


def load_data(
  cfg, *, train: bool = True, layout: parallel.Layout | None = None, checked: bool = False
) -> kinds.Data:
  """The data of `cfg.data.kind`, as its module of common/data/ registers it (common/data/
  kinds.py), checked against the model config. `train=False`: the held-out split only (`zoo
  eval`). Each process reads the rows of every batch that its devices of `layout` hold
  (`parallel.process_rows`)."""
  batch_size = cfg.train.batch_size
  share = parallel.process_rows(layout, batch_size)
  data = kinds.load(cfg, train=train, batch_size=batch_size, share=share, checked=checked)
  held_out = data.eval_batches

  def eval_batches(split, *, batch_size: int, **kw):  # this process's rows of each batch
    return held_out(
      split, batch_size=batch_size, share=parallel.process_rows(layout, batch_size), **kw
    )

  return dataclasses.replace(data, eval_batches=eval_batches)


def check_workdir(cfg, workdir: str):
  """That the config.json of a run in `workdir` describes the same model and data as `cfg`
  (`write_config` writes it). Reads only."""
  path = os.path.join(workdir, "config.json")
  # Only checkpoints can be mixed up: a config.json alone (of a run refused for bad data, say)
  # is replaced. data.long_records checks the data without changing it, data.workers only reads
  # it ahead, and the memory levers (model.remat, model.scan) and stochastic depth say how the
  # model is computed, not what it is. A mixture's weights may change (prepared.reweighted).
  if os.path.exists(path) and checkpoint.has_steps(workdir):
    with open(path) as f:
      old = config_lib.from_json(f.read())
    if "model" in old:
      old.model = models.upgrade(old.model.to_dict())
    ignore = ("data.long_records", "data.workers", *models.HOW_TRAINED)
    if prepared.reweighted(old.get("data", {}).get("mixture", ""), cfg.data.get("mixture", "")):
      ignore += ("data.mixture",)
    changed = config_lib.differences(old, cfg, within=("model.", "data."), ignore=ignore)
    if changed:
      raise UserError(
        f"{workdir} holds a run of a different model or data ({'; '.join(changed)}). Resuming "
        "it with this experiment would mix the two: use a new --workdir, or the settings of "
        "the first run."
      )


def write_config(cfg, workdir: str):
  """Writes workdir/config.json (process 0; replaced whole, as the others may be reading it),
  once the workdir and its checkpoint directory are found writable (now, not at the first
  save)."""
  files.check_writable(workdir, checkpoint.directory(workdir))
  if jax.process_index() == 0:
    with files.replacing(os.path.join(workdir, "config.json")) as tmp, open(tmp, "w") as f:
      f.write(config_lib.to_json(cfg))


def evaluate(
  params,
  data: kinds.Data,
  *,
  graphdef,
  cfg,
  layout: parallel.Layout | None = None,
  task=None,
  check_memory: bool = False,
) -> dict:
  """The task's held-out metrics (`Task.summary`: the mean loss, and its own, such as a
  classifier's accuracy) over the held-out rows (all of them unless train.eval_batches limits
  it), with the data kind's score where it has one (speech: the word error rate).

  Runs as plain jit over the global (sharded) arrays: XLA partitions it, no shard_map needed;
  but a mesh that splits rows over `context` runs it as the train step runs (shard_map), each
  device given its share of every row. `task`: the run's, prepared (`Task.prepare`).
  `check_memory` (`zoo eval`): the step, compiled for the first batch, is refused in one line
  before it runs if its memory does not fit the device (common/device_memory.py)."""
  task = task or tasks.of(cfg).prepare(data, cfg=cfg, layout=layout)
  if layout is not None and layout.sizes.get("context", 1) > 1:
    step = functools.partial(steps.sharded_eval_step, graphdef=graphdef, task=task, layout=layout)
  else:
    step = functools.partial(steps.eval_step, graphdef=graphdef, task=task, prompts=data.prompts)
  step = jax.jit(step)
  # A mixture's held-out splits are {component: split}: each one's loss is reported beside the
  # total (`loss/<name>`), which is the mean over all of their targets.
  parts = data.eval if isinstance(data.eval, dict) else {"": data.eval}
  sums, part_loss = {}, {}
  for name, held_out in parts.items():
    part = {}
    for batch in data.eval_batches(
      held_out, batch_size=settings.eval_batch_size(cfg), max_batches=cfg.train.eval_batches
    ):
      batch = task.complete(steps.put_batch(batch, layout, task), params)
      if check_memory:  # jit keeps the program compiled here for the calls below
        check_eval_step(step, params, batch, cfg=cfg)
        check_memory = False
      for k, v in step(params, batch).items():
        part[k] = part.get(k, 0.0) + float(v)
    for k, v in part.items():
      sums[k] = sums.get(k, 0.0) + v
    if name:
      part_loss[f"loss/{name}"] = part["total"] / max(part["count"], 1.0)
  result = {**task.summary(sums), **part_loss}
  if data.score is not None:
    result.update(data.score(graphdef, params))
  return result


def check_eval_step(step, params, batch, *, cfg):
  """A UserError of one line if the jitted eval `step`, compiled for `batch`, needs more memory
  than the device has (the weights, already held, count as had)."""
  fit = device_memory.measure(
    step.lower(params, batch).compile(), held=device_memory.held_bytes(params)
  )
  if not fit.fits():
    raise device_memory.refusal(
      f"{cfg.get('experiment', '') or 'The experiment'}'s eval step",
      fit,
      "Lower --config.train.eval_batch_size (the held-out rows a step), or use a device with more "
      "memory.",
    )
