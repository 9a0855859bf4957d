"""The one trainer for every family, in the order it runs: workdir, data, model and optimizer,
checkpoint, step functions, loop.

At its centre is a pure `train_step(state, batch) -> (state, metrics)`; everything else is
start-up and bookkeeping around it.
"""

import dataclasses
import functools
import json
import os
import time

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
from flax import nnx

from common import config as config_lib
from common import mesh, models, parallel
from common.data import pipeline, tokenizers
from common.errors import UserError
from common.hub import checkpoint, paths
from common.nn import lora, memory
from common.train import faults, losses, optim

# State and step functions


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class TrainState:
  step: jax.Array
  params: nnx.State
  opt_state: optax.OptState
  rng: jax.Array  # raw key data (uint32), so orbax saves it as a plain array


def schedule(cfg, steps: int) -> optax.Schedule:
  """Linear warm-up, then cosine or linear decay to `min_lr_ratio * lr`, or constant."""
  warmup = min(cfg.warmup_steps, max(steps - 1, 0))
  end = cfg.lr * cfg.min_lr_ratio
  if cfg.schedule == "cosine":
    return optax.warmup_cosine_decay_schedule(0.0, cfg.lr, warmup, max(steps, warmup + 1), end)
  if cfg.schedule == "linear":
    return optax.join_schedules(
      [
        optax.linear_schedule(0.0, cfg.lr, warmup),
        optax.linear_schedule(cfg.lr, end, max(steps - warmup, 1)),
      ],
      [warmup],
    )
  if cfg.schedule == "constant":
    return optax.join_schedules(
      [optax.linear_schedule(0.0, cfg.lr, warmup), optax.constant_schedule(cfg.lr)], [warmup]
    )
  raise UserError(f"Unknown optim.schedule {cfg.schedule!r}: use cosine, linear or constant.")


def optimizer(cfg, steps: int, *, fused: bool = True) -> optax.GradientTransformation:
  """AdamW with global-norm clipping; no weight decay on vectors (norm scales, biases).
  `fused` False: the same as optax chains it (common/optim.py says why the trainer does not)."""
  return (optim.adamw if fused else optim.reference)(
    schedule(cfg, steps),
    b1=cfg.b1,
    b2=cfg.b2,
    eps=cfg.eps,
    weight_decay=cfg.weight_decay,
    clip_norm=cfg.clip_norm,
  )


def loss_sums(model, batch: dict) -> tuple[jax.Array, jax.Array]:
  """Summed next-token cross-entropy over a batch of packed rows, and the number of targets.

  A target counts only when it continues the segment of its input (no predicting across a
  document boundary) and is not padding.
  """
  tokens, segments = batch["tokens"], batch["segment_ids"]
  inputs_BT, targets_BT = tokens[:, :-1], tokens[:, 1:]
  in_seg_BT = segments[:, :-1]
  weights_BT = ((segments[:, 1:] == in_seg_BT) & (in_seg_BT != 0)).astype(jnp.float32)
  if losses.chunk_size():  # train.loss_chunk: the [B, T, V] logits never held whole
    total = losses.decoder_sums(
      model, inputs_BT, in_seg_BT, targets_BT, weights_BT, chunk=losses.chunk_size()
    )
    return total, jnp.sum(weights_BT)
  logits_BTV = model(inputs_BT, segment_ids_BT=in_seg_BT)
  ce_BT = parallel.cross_entropy(logits_BTV, targets_BT)
  return jnp.sum(ce_BT * weights_BT), jnp.sum(weights_BT)


def classify_rows(model, batch: dict) -> tuple[jax.Array, jax.Array, jax.Array]:
  """A classifier's logits [B, C], cross-entropy [B] against the rows' `labels`, and row weights
  [B] (a row of padding only, segment ids all 0, counts for nothing)."""
  logits_BC = model.classify(batch["tokens"], attention_mask=batch["segment_ids"])
  weights_B = (batch["segment_ids"] != 0).any(axis=1).astype(jnp.float32)
  ce_B = optax.softmax_cross_entropy_with_integer_labels(
    logits_BC.astype(jnp.float32), batch["labels"]
  )
  return logits_BC, ce_B, weights_B


def classify_sums(model, batch: dict) -> tuple[jax.Array, jax.Array]:
  """Summed cross-entropy of a classifier over its rows, and the number of rows."""
  _, ce_B, weights_B = classify_rows(model, batch)
  return jnp.sum(ce_B * weights_B), jnp.sum(weights_B)


def task_sums(model, batch: dict) -> tuple[jax.Array, jax.Array]:
  """The loss sums of what the batch holds: labelled rows train a classifier, token rows a
  language model."""
  return (classify_sums if "labels" in batch else loss_sums)(model, batch)


def sums_and_grads(params, batch: dict, *, graphdef, micro_batches: int = 1, frozen=None):
  """Summed loss, number of targets, and the gradient of the summed loss with respect to
  `params` (`frozen`: parameters the model also uses, not differentiated). With micro_batches
  > 1 the batch is cut into that many slices run one after another (gradient accumulation:
  the activations of one slice are alive at a time); the sums are the same."""
  frozen = () if frozen is None else (frozen,)

  def total_fn(params, batch):
    return task_sums(nnx.merge(graphdef, params, *frozen), batch)

  grad_fn = jax.value_and_grad(total_fn, has_aux=True)
  micro = jax.tree.map(lambda x: x.reshape(micro_batches, -1, *x.shape[1:]), batch)
  # The first slice starts the sums (so they carry the same sharding types as the rest).
  (total, count), grads = grad_fn(params, jax.tree.map(lambda x: x[0], micro))

  def add(sums, one_batch):
    (total, count), grads = grad_fn(params, one_batch)
    return jax.tree.map(jnp.add, sums, (total, count, grads)), None

  if micro_batches == 1:
    return total, count, grads
  return jax.lax.scan(add, (total, count, grads), jax.tree.map(lambda x: x[1:], micro))[0]


def sharded_sums_and_grads(
  params, batch: dict, *, graphdef, layout: parallel.Layout, micro_batches: int = 1, frozen=None
):
  """`sums_and_grads` under shard_map: each device runs its batch shard with its parameter
  shards; the shared layers gather and reduce (see common/parallel.py)."""
  specs = layout.param_specs(params)
  frozen = nnx.State({}) if frozen is None else frozen

  def local(params, frozen, batch):
    with parallel.active(layout):
      total, count, grads = sums_and_grads(
        params, batch, graphdef=graphdef, micro_batches=micro_batches, frozen=frozen
      )
    return jax.lax.psum(total, parallel.BATCH_AXES), jax.lax.psum(count, parallel.BATCH_AXES), grads

  return jax.shard_map(
    local,
    mesh=layout.mesh,
    in_specs=(specs, layout.param_specs(frozen), layout.batch_spec),
    out_specs=(parallel.P(), parallel.P(), specs),
    check_vma=True,
  )(params, frozen, batch)


def train_step(
  state: TrainState,
  batch: dict,
  *,
  graphdef,
  tx,
  layout: parallel.Layout | None = None,
  micro_batches: int = 1,
  trainable=nnx.Param,
  loss_chunk: int = 0,
) -> tuple[TrainState, dict]:
  # Only the trained part is differentiated and updated (all of it, unless LoRA freezes some).
  trained, frozen = nnx.split_state(state.params, trainable, ...)
  kw = dict(graphdef=graphdef, micro_batches=micro_batches, frozen=frozen)
  with losses.chunked(loss_chunk):  # train.loss_chunk, read by loss_sums
    if layout is None:
      total, count, grads = sums_and_grads(trained, batch, **kw)
    else:
      total, count, grads = sharded_sums_and_grads(trained, batch, layout=layout, **kw)
  # The gradients are of the summed loss: the optimizer scales them by 1/count as it reads them
  # (common/optim.py), so the mean gradient is never stored.
  count = jnp.maximum(count, 1.0)
  loss, grad_norm = total / count, optax.tree.norm(grads) / count
  # A non-finite loss or gradient leaves params and optimizer state as they were (the step still
  # counts); train.nonfinite says, outside the step, whether the run goes on (faults.NonFinite).
  ok = faults.finite(loss, grad_norm)
  updates, opt_state = tx.update(
    grads, state.opt_state, trained, grad_scale=1 / count, grad_norm=grad_norm, apply=ok
  )
  params = nnx.merge_state(optax.apply_updates(trained, updates), frozen)
  skipped = jnp.logical_not(ok).astype(jnp.int32)
  metrics = {"loss": loss, "grad_norm": grad_norm, "targets": count, "skipped": skipped}
  return TrainState(state.step + 1, params, opt_state, state.rng), metrics


def eval_step(params, batch: dict, *, graphdef) -> dict:
  """Summed loss and count (and, for a classifier, correct predictions) of one batch."""
  model = nnx.merge(graphdef, params)
  if "labels" not in batch:
    total, count = loss_sums(model, batch)
    return {"total": total, "count": count}
  logits_BC, ce_B, weights_B = classify_rows(model, batch)
  right_B = (jnp.argmax(logits_BC, -1) == batch["labels"]).astype(jnp.float32)
  return {
    "total": jnp.sum(ce_B * weights_B),
    "count": jnp.sum(weights_B),
    "correct": jnp.sum(right_B * weights_B),
  }


# Start-up pieces (also used by `zoo eval` and `zoo generate`)


def init_state(cfg, tx) -> tuple[nnx.GraphDef, TrainState]:
  model = models.build(cfg.model, seed=cfg.seed)
  graphdef, params = nnx.split(model, nnx.Param)
  rng = jax.random.key_data(jax.random.key(cfg.seed + 1))
  trained = nnx.state(model, lora.trainable(cfg.model))  # the optimizer holds state for these
  return graphdef, TrainState(jnp.zeros((), jnp.int32), params, tx.init(trained), rng)


def abstract_state(cfg, tx) -> TrainState:
  return jax.eval_shape(lambda: init_state(cfg, tx)[1])


def placed_abstract_state(cfg, tx, layout: parallel.Layout | None):
  """The abstract train state with each leaf's sharding, and those shardings (one device:
  everything on the default device)."""
  abstract = abstract_state(cfg, tx)
  if layout is None:
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    shardings = jax.tree.map(lambda _: device, abstract)
  else:
    shardings = layout.shardings(layout.param_specs(abstract))
  placed = jax.tree.map(
    lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, shardings
  )
  return placed, shardings


def put_batch(batch: dict, layout: parallel.Layout | None) -> dict:
  """This process's rows of the global batch, as global arrays split over data x fsdp."""
  if layout is None:
    return batch
  sharding = parallel.NamedSharding(layout.mesh, layout.batch_spec)
  return {k: jax.make_array_from_process_local_data(sharding, v) for k, v in batch.items()}


def restore_params(cfg, workdir: str) -> tuple[nnx.GraphDef, nnx.State, int]:
  """The model of `cfg` with the params of the latest checkpoint in `workdir`."""
  abstract = nnx.eval_shape(lambda: models.build(cfg.model))
  graphdef = nnx.graphdef(abstract)
  ckpts, step = checkpoint.open_latest(workdir)
  try:
    # A checkpoint of another model fails deep in orbax: say which keys differ instead.
    saved = ml_collections.ConfigDict({"model": ckpts.meta(step)["model"]})
    changed = config_lib.differences(saved, {"model": cfg.model.to_dict()}, ignore=memory.LEVERS)
    if changed:
      raise UserError(
        f"{workdir} holds a checkpoint of a different model ({'; '.join(changed)}): give the "
        "experiment (and --config overrides) that trained it."
      )
    # Params and step only (whatever optimizer trained it, or none: `zoo convert`), from the
    # newest undamaged step.
    wanted = {"params": nnx.state(abstract, nnx.Param), "step": jax.ShapeDtypeStruct((), jnp.int32)}
    state = ckpts.restore_latest(wanted)
  finally:
    ckpts.close()
  return graphdef, state["params"], int(state["step"])


def check_workdir(cfg, workdir: str):
  """Writes DIR/config.json, or checks that the one there describes the same model and data."""
  faults.check_writable(workdir, checkpoint.directory(workdir))  # now, not at the first save
  path = os.path.join(workdir, "config.json")
  # Only checkpoints can be mixed up: a config.json alone (of a run refused for bad data, say)
  # is replaced. data.long_records checks the data without changing it, and the memory levers
  # (model.remat, model.scan) how the model is computed, not what it is.
  if os.path.exists(path) and checkpoint.has_steps(workdir):
    with open(path) as f:
      old = config_lib.from_json(f.read())
    changed = config_lib.differences(
      old, cfg, within=("model.", "data."), ignore=("data.long_records", *memory.LEVERS)
    )
    if changed:
      raise UserError(
        f"{workdir} holds a run of a different model or data ({'; '.join(changed)}). Resuming "
        "it with this experiment would mix the two: use a new --workdir, or the settings of "
        "the first run."
      )
  if jax.process_index() == 0:
    with open(path, "w") as f:
      f.write(config_lib.to_json(cfg))


class MetricsLog:
  """metrics.jsonl and TensorBoard event files, written by process 0 only."""

  def __init__(self, workdir: str):
    self.active = jax.process_index() == 0
    if self.active:
      from tensorboardX import SummaryWriter

      self.file = open(os.path.join(workdir, "metrics.jsonl"), "a")  # noqa: SIM115 (kept open)
      self.tb = SummaryWriter(os.path.join(workdir, "tensorboard"))

  def write(self, step: int, metrics: dict, split: str = "train"):
    if not self.active:
      return
    record = {"step": step, **({"split": split} if split != "train" else {}), **metrics}
    self.file.write(json.dumps(record) + "\n")
    self.file.flush()
    for k, v in metrics.items():
      self.tb.add_scalar(f"{split}/{k}", v, step)

  def close(self):
    if self.active:
      self.file.close()
      self.tb.close()


def evaluate(params, eval_rows, *, graphdef, cfg, layout: parallel.Layout | None = None) -> dict:
  """Mean loss over the held-out rows (all of them unless train.eval_batches limits it).

  Runs as plain jit over the global (sharded) arrays: XLA partitions it, no shard_map needed."""
  step = jax.jit(functools.partial(eval_step, graphdef=graphdef))
  sums = {}
  for batch in pipeline.eval_batches(
    eval_rows, batch_size=cfg.train.batch_size, max_batches=cfg.train.eval_batches
  ):
    for k, v in step(params, put_batch(batch, layout)).items():
      sums[k] = sums.get(k, 0.0) + float(v)
  count = max(sums["count"], 1.0)
  loss = sums["total"] / count
  if "correct" in sums:  # a classifier
    return {"loss": loss, "accuracy": sums["correct"] / count, "examples": int(sums["count"])}
  return {"loss": loss, "perplexity": float(np.exp(min(loss, 50.0))), "targets": int(count)}


# The run


def train(cfg: ml_collections.ConfigDict, workdir: str, *, progress: bool = True) -> dict:
  """Trains `cfg` in `workdir`, resuming from its latest checkpoint; returns the last metrics."""
  from tqdm import tqdm

  # Workdir and data
  sizes = mesh.resolve(cfg.mesh, jax.device_count())
  parallel.check_fits(cfg.model, sizes, cfg.train.batch_size, cfg.train.micro_batches)
  layout = parallel.make_layout(sizes) if jax.device_count() > 1 else None
  init_params = None  # a new run from init_from: read and checked before anything is written
  if cfg.init_from and not checkpoint.has_steps(workdir):
    init_params = load_init_params(cfg, nnx.state(models.abstract(cfg.model), nnx.Param))
  check_workdir(cfg, workdir)
  tokenizer = tokenizers.load(cfg.data.tokenizer)
  if tokenizer.vocab_size > cfg.model.vocab_size:
    raise UserError(
      f"The tokenizer has {tokenizer.vocab_size} ids but model.vocab_size is "
      f"{cfg.model.vocab_size}: set --config.model.vocab_size={tokenizer.vocab_size} or more."
    )
  train_rows = pipeline.load_split(cfg.data, "train", tokenizer)
  eval_rows = pipeline.load_split(cfg.data, "eval", tokenizer)
  data_iter = pipeline.train_iterator(train_rows, batch_size=cfg.train.batch_size, seed=cfg.seed)

  # Model, optimizer, checkpoint
  tx = optimizer(cfg.optim, cfg.train.steps)
  ckpts = checkpoint.Checkpoints(workdir, keep=cfg.train.keep_checkpoints)
  meta = {"family": cfg.model.family, "model": cfg.model.to_dict(), "data": cfg.data.to_dict()}
  latest = ckpts.latest_step()
  graphdef = nnx.graphdef(nnx.eval_shape(lambda: models.build(cfg.model)))
  abstract, shardings = placed_abstract_state(cfg, tx, layout)
  if latest is not None:  # the newest step that restores; damaged newer ones are set aside
    state = ckpts.restore_latest(abstract, data_iterator=data_iter)
  else:
    state = jax.jit(lambda: init_state(cfg, tx)[1], out_shardings=shardings)()
    if init_params is not None:  # what it does not give (adapters, init_reinit) stays fresh
      params = jax.tree.map(
        lambda loaded, fresh: fresh if isinstance(loaded, jax.ShapeDtypeStruct) else loaded,
        init_params,
        state.params,
      )
      state = dataclasses.replace(state, params=jax.device_put(params, shardings.params))
  start = int(state.step)

  # Step functions
  step_fn = jax.jit(
    functools.partial(
      train_step,
      graphdef=graphdef,
      tx=tx,
      layout=layout,
      micro_batches=cfg.train.micro_batches,
      trainable=lora.trainable(cfg.model),
      loss_chunk=cfg.train.get("loss_chunk", 0),
    ),
    donate_argnums=0,
    out_shardings=(shardings, None),
  )
  tokens_per_step = cfg.train.batch_size * cfg.data.seq_len
  lr_at = schedule(cfg.optim, cfg.train.steps)

  # Loop
  log = MetricsLog(workdir)
  bar = tqdm(
    total=cfg.train.steps,
    initial=start,
    disable=not progress or jax.process_index(),
    unit="step",
    dynamic_ncols=True,
  )
  last, t0, since = {}, time.perf_counter(), start
  nonfinite = faults.NonFinite(cfg.train.get("nonfinite", "skip"), ckpts)
  signals = faults.Signals().install()  # SIGTERM/SIGINT: finish the step, save, exit
  try:
    for step in range(start + 1, cfg.train.steps + 1):
      state, metrics = step_fn(state, put_batch(next(data_iter), layout))
      nonfinite.observe(step, metrics)
      if step % cfg.train.log_every == 0 or step == cfg.train.steps:
        metrics = {k: float(v) for k, v in metrics.items()}
        metrics["skipped"] = nonfinite.take()  # since the last line; "stop" raises here
        elapsed = time.perf_counter() - t0
        metrics["tokens_per_s"] = (step - since) * tokens_per_step / elapsed
        metrics["lr"] = float(lr_at(step - 1))
        t0, since = time.perf_counter(), step
        log.write(step, metrics)
        bar.set_postfix(loss=f"{metrics['loss']:.3f}", tok_s=f"{metrics['tokens_per_s']:.0f}")
        last = metrics
      bar.update(1)
      if (
        eval_rows is not None
        and cfg.train.eval_every
        and (step % cfg.train.eval_every == 0 or step == cfg.train.steps)
      ):
        ev = evaluate(state.params, eval_rows, graphdef=graphdef, cfg=cfg, layout=layout)
        log.write(step, ev, split="eval")
        bar.write(f"step {step}: eval loss {ev['loss']:.4f}")
        last = {**last, "eval_loss": ev["loss"]}
        t0 = time.perf_counter()  # evaluation time is not training throughput
      # Read once per step; with several processes, every one of them stops at the same step.
      stop = signals.stop_after() if step < cfg.train.steps else None
      if stop or step % cfg.train.checkpoint_every == 0 or step == cfg.train.steps:
        nonfinite.check()  # under "stop", nothing after a non-finite step is saved
        ckpts.save(step, state, data_iterator=data_iter, meta=meta, force=bool(stop))
      if stop:
        ckpts.wait()  # on disk before the process ends
        raise signals.preempted(step, ckpts.path)
  finally:
    signals.restore()
    bar.close()
    ckpts.wait()
    ckpts.close()
    log.close()
  return last


def load_init_params(cfg, params: nnx.State) -> nnx.State:
  """`params` (arrays, or abstract ShapeDtypeStructs) with the weights of `init_from` (a zoo
  run's workdir, a `zoo convert` output or a Hugging Face directory) in their place.

  Every parameter of the model must come from the checkpoint with its shape, except LoRA
  adapters and what `init_reinit` names (a new head, a resized vocab), which keep their fresh
  initialisation; every parameter of the checkpoint must be used. All that does not fit is
  reported in one error.
  """
  from common import hub

  path = hub.fetch(paths.resolve(cfg.init_from))  # a hub id is downloaded
  if not os.path.exists(path):
    raise UserError(
      f"init_from={path!r} does not exist: give the workdir of an earlier `zoo run`, a "
      "`zoo convert` output, a Hugging Face directory or hub id (or leave init_from empty)."
    )
  _, loaded = hub.read(path)  # params only: the optimizer starts fresh
  reinit = lora.patterns(cfg.get("init_reinit", ""))
  want = dict(nnx.to_flat_state(params))
  got = dict(nnx.to_flat_state(loaded))

  def fresh(key) -> bool:
    return isinstance(want.get(key), lora.LoRAParam) or lora.matches(_dotted(key), reinit)

  problems = [
    f"{_dotted(k)}: checkpoint {got[k].shape if k in got else 'missing'} vs model {v.shape}"
    for k, v in want.items()
    if not fresh(k) and (k not in got or got[k].shape != v.shape)
  ]
  problems += [
    f"{_dotted(k)}: in the checkpoint, not in the model {got[k].shape}"
    for k in got
    if k not in want and not lora.matches(_dotted(k), reinit)
  ]
  if problems:
    raise UserError(
      f"The checkpoint in {path} does not fit this experiment's model ({len(problems)} "
      "parameters):\n  "
      + "\n  ".join(problems[:20])
      + ("\n  ..." if len(problems) > 20 else "")
      + "\nUse a checkpoint of the same model config, change the experiment's model, or name "
      "the parameters to start fresh in init_reinit (e.g. --config.init_reinit='head.*')."
    )
  return nnx.from_flat_state(
    [
      (k, v if fresh(k) else v.replace(jnp.asarray(got[k][...], v.get_value().dtype)))
      for k, v in want.items()
    ]
  )


def _dotted(key: tuple) -> str:
  return ".".join(map(str, key))
