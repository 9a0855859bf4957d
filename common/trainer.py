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

from common import checkpoint, data, mesh, models, tokenizers
from common import config as config_lib
from common.errors import UserError

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


def optimizer(cfg, steps: int) -> optax.GradientTransformation:
  """AdamW with global-norm clipping; no weight decay on vectors (norm scales, biases)."""
  return optax.chain(
    optax.clip_by_global_norm(cfg.clip_norm) if cfg.clip_norm else optax.identity(),
    optax.adamw(
      schedule(cfg, steps),
      b1=cfg.b1,
      b2=cfg.b2,
      eps=cfg.eps,
      weight_decay=cfg.weight_decay,
      mask=lambda params: jax.tree.map(lambda p: p.ndim >= 2, params),
    ),
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
  logits_BTV = model(inputs_BT, segment_ids_BT=in_seg_BT)
  ce_BT = optax.softmax_cross_entropy_with_integer_labels(
    logits_BTV.astype(jnp.float32), targets_BT
  )
  return jnp.sum(ce_BT * weights_BT), jnp.sum(weights_BT)


def train_step(state: TrainState, batch: dict, *, graphdef, tx) -> tuple[TrainState, dict]:
  def loss_fn(params):
    total, count = loss_sums(nnx.merge(graphdef, params), batch)
    return total / jnp.maximum(count, 1.0), count

  (loss, count), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
  updates, opt_state = tx.update(grads, state.opt_state, state.params)
  params = optax.apply_updates(state.params, updates)
  metrics = {"loss": loss, "grad_norm": optax.tree.norm(grads), "targets": count}
  return TrainState(state.step + 1, params, opt_state, state.rng), metrics


def eval_step(params, batch: dict, *, graphdef) -> tuple[jax.Array, jax.Array]:
  return loss_sums(nnx.merge(graphdef, params), batch)


# Start-up pieces (also used by `zoo eval` and `zoo generate`)


def init_state(cfg, tx) -> tuple[nnx.GraphDef, TrainState]:
  model = models.build(cfg.model, seed=cfg.seed)
  graphdef, params = nnx.split(model, nnx.Param)
  rng = jax.random.key_data(jax.random.key(cfg.seed + 1))
  return graphdef, TrainState(jnp.zeros((), jnp.int32), params, tx.init(params), rng)


def abstract_state(cfg, tx) -> TrainState:
  return jax.eval_shape(lambda: init_state(cfg, tx)[1])


def restore_params(cfg, workdir: str) -> tuple[nnx.GraphDef, nnx.State, int]:
  """The model of `cfg` with the params of the latest checkpoint in `workdir`."""
  tx = optimizer(cfg.optim, cfg.train.steps)
  graphdef = nnx.graphdef(nnx.eval_shape(lambda: models.build(cfg.model)))
  ckpts, step = checkpoint.open_latest(workdir)
  try:
    # A checkpoint of another model fails deep in orbax: say which keys differ instead.
    saved = ml_collections.ConfigDict({"model": ckpts.meta(step)["model"]})
    changed = config_lib.differences(saved, {"model": cfg.model.to_dict()})
    if changed:
      raise UserError(
        f"{workdir} holds a checkpoint of a different model ({'; '.join(changed)}): give the "
        "experiment (and --config overrides) that trained it."
      )
    state = ckpts.restore(step, abstract_state(cfg, tx))
  finally:
    ckpts.close()
  return graphdef, state.params, step


def check_workdir(cfg, workdir: str):
  """Writes DIR/config.json, or checks that the one there describes the same model and data."""
  os.makedirs(workdir, exist_ok=True)
  path = os.path.join(workdir, "config.json")
  if os.path.exists(path):
    with open(path) as f:
      old = config_lib.from_json(f.read())
    changed = config_lib.differences(old, cfg, within=("model.", "data."))
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


def evaluate(params, eval_rows, *, graphdef, cfg) -> dict:
  """Mean loss over the held-out rows (all of them unless train.eval_batches limits it)."""
  step = jax.jit(functools.partial(eval_step, graphdef=graphdef))
  total, count = 0.0, 0.0
  for batch in data.eval_batches(
    eval_rows, batch_size=cfg.train.batch_size, max_batches=cfg.train.eval_batches
  ):
    s, n = step(params, batch)
    total, count = total + float(s), count + float(n)
  loss = total / max(count, 1.0)
  return {"loss": loss, "perplexity": float(np.exp(min(loss, 50.0))), "targets": int(count)}


# The run


def train(cfg: ml_collections.ConfigDict, workdir: str, *, progress: bool = True) -> dict:
  """Trains `cfg` in `workdir`, resuming from its latest checkpoint; returns the last metrics."""
  from tqdm import tqdm

  # Workdir and data
  if cfg.init_from and not os.path.exists(cfg.init_from):
    raise UserError(
      f"init_from={cfg.init_from!r} does not exist: give the workdir of an earlier `zoo run` "
      "(or leave init_from empty to train from scratch)."
    )
  sizes = mesh.resolve(cfg.mesh, jax.device_count())
  if jax.device_count() > 1:
    raise UserError(
      f"mesh {sizes} spans {jax.device_count()} devices, and this trainer runs on one device "
      "so far (sharded training is the parallelism issue's work). Make one device visible, "
      "e.g. CUDA_VISIBLE_DEVICES=0 or without --xla_force_host_platform_device_count."
    )
  check_workdir(cfg, workdir)
  tokenizer = tokenizers.load(cfg.data.tokenizer)
  if tokenizer.vocab_size > cfg.model.vocab_size:
    raise UserError(
      f"The tokenizer has {tokenizer.vocab_size} ids but model.vocab_size is "
      f"{cfg.model.vocab_size}: set --config.model.vocab_size={tokenizer.vocab_size} or more."
    )
  train_rows = data.load_split(cfg.data, "train", tokenizer)
  eval_rows = data.load_split(cfg.data, "eval", tokenizer)
  data_iter = data.train_iterator(train_rows, batch_size=cfg.train.batch_size, seed=cfg.seed)

  # Model, optimizer, checkpoint
  tx = optimizer(cfg.optim, cfg.train.steps)
  ckpts = checkpoint.Checkpoints(workdir, keep=cfg.train.keep_checkpoints)
  meta = {"family": cfg.model.family, "model": cfg.model.to_dict(), "data": cfg.data.to_dict()}
  latest = ckpts.latest_step()
  if latest is not None:
    graphdef = nnx.graphdef(nnx.eval_shape(lambda: models.build(cfg.model)))
    state = ckpts.restore(latest, abstract_state(cfg, tx), data_iterator=data_iter)
  else:
    graphdef, state = init_state(cfg, tx)
    if cfg.init_from:
      state = dataclasses.replace(state, params=load_init_params(cfg, state.params))
  start = int(state.step)

  # Step functions
  step_fn = jax.jit(functools.partial(train_step, graphdef=graphdef, tx=tx), donate_argnums=0)
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
  try:
    for step in range(start + 1, cfg.train.steps + 1):
      state, metrics = step_fn(state, next(data_iter))
      if step % cfg.train.log_every == 0 or step == cfg.train.steps:
        metrics = {k: float(v) for k, v in metrics.items()}
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
        ev = evaluate(state.params, eval_rows, graphdef=graphdef, cfg=cfg)
        log.write(step, ev, split="eval")
        bar.write(f"step {step}: eval loss {ev['loss']:.4f}")
        last = {**last, "eval_loss": ev["loss"]}
        t0 = time.perf_counter()  # evaluation time is not training throughput
      if step % cfg.train.checkpoint_every == 0 or step == cfg.train.steps:
        ckpts.save(step, state, data_iterator=data_iter, meta=meta)
  finally:
    bar.close()
    ckpts.wait()
    ckpts.close()
    log.close()
  return last


def load_init_params(cfg, params: nnx.State) -> nnx.State:
  """Params from `init_from` (a zoo run's workdir) in place of the fresh ones; shapes must fit."""
  path = cfg.init_from
  if not os.path.exists(path):
    raise UserError(
      f"init_from={path!r} does not exist: give the workdir of an earlier `zoo run` "
      "(or leave init_from empty to train from scratch)."
    )
  ckpts, step = checkpoint.open_latest(path)
  try:
    meta = ckpts.meta(step)
    source = ml_collections.ConfigDict(meta["model"])
    src_cfg = ml_collections.ConfigDict(cfg.to_dict())
    src_cfg.model = source
    tx = optimizer(cfg.optim, cfg.train.steps)
    loaded = ckpts.restore(step, abstract_state(src_cfg, tx)).params
  finally:
    ckpts.close()
  want = dict(nnx.to_flat_state(params))
  got = dict(nnx.to_flat_state(loaded))
  problems = [
    f"{'.'.join(map(str, k))}: checkpoint {getattr(got.get(k), 'shape', 'missing')} vs "
    f"model {v.shape}"
    for k, v in want.items()
    if k not in got or got[k].shape != v.shape
  ]
  if problems:
    raise UserError(
      f"The checkpoint in {path} does not fit this experiment's model:\n  "
      + "\n  ".join(problems[:10])
      + "\nUse a checkpoint of the same model config, or change the experiment's model."
    )
  return loaded
