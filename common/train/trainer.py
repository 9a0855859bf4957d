"""The one trainer for every family, in the order it runs: mesh and workdir, data, a train
state (fresh, restored, or initialised from another checkpoint), then the loop.

The step itself (`common/train/step.py`) is a pure `train_step(state, batch) -> (state,
metrics)`; everything here is start-up and bookkeeping around it.
"""

import dataclasses
import functools
import os
import time
from collections.abc import Callable, Iterator

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from flax import nnx

from nnx_zoo.common import config as config_lib
from nnx_zoo.common import mesh, models, parallel
from nnx_zoo.common.data import images, pipeline, spans, speech, tokenizers
from nnx_zoo.common.errors import UserError
from nnx_zoo.common.hub import checkpoint, weights
from nnx_zoo.common.nn import memory
from nnx_zoo.common.train import diffusion, faults, optim
from nnx_zoo.common.train import step as steps
from nnx_zoo.common.train.metrics import MetricsLog


def train(cfg: ml_collections.ConfigDict, workdir: str, *, progress: bool = True) -> dict:
  """Trains `cfg` in `workdir`, resuming from its latest checkpoint; returns the last metrics."""
  from tqdm import tqdm

  # Mesh and workdir: every misfit is refused before anything is written.
  sizes = mesh.resolve(cfg.mesh, jax.device_count())
  parallel.check_experiment(cfg, sizes)
  layout = parallel.make_layout(sizes) if jax.device_count() > 1 else None
  resuming = checkpoint.has_steps(workdir)
  init_from = None  # a new run from init_from: read and checked before anything is written
  if cfg.init_from and not resuming:
    init_from = weights.init_params(cfg, nnx.state(models.abstract(cfg.model), nnx.Param))
  check_workdir(cfg, workdir)

  # Data: the pipeline of cfg.data.kind (text rows or images, see `load_data`)
  data = load_data(cfg, layout=layout)
  data_iter = data.iterator

  # State: restored (the newest step that restores; damaged newer ones are set aside), or fresh,
  # with init_from's weights in place of the fresh ones it gives.
  tx = optim.optimizer(cfg.optim, cfg.train.steps)
  ckpts = checkpoint.Checkpoints(workdir, keep=cfg.train.keep_checkpoints)
  meta = {"family": cfg.model.family, "model": cfg.model.to_dict(), "data": cfg.data.to_dict()}
  if cfg.train.ema:  # the readers of the checkpoint take the average (weights.params_key)
    meta["weights"] = "ema"
  abstract, shardings = steps.placed_abstract_state(cfg, tx, layout)
  if ckpts.latest_step() is not None:
    state = ckpts.restore_latest(abstract, data_iterator=data_iter)
  else:
    state = jax.jit(lambda: steps.init_state(cfg, tx)[1], out_shardings=shardings)()
    if init_from is not None:  # what it does not give (adapters, init_reinit) stays fresh
      params = jax.tree.map(  # one tree per layer (init_params), stacked back if scanned
        lambda loaded, fresh: fresh if isinstance(loaded, jax.ShapeDtypeStruct) else loaded,
        init_from,
        memory.unstack_layers(state.params),
      )
      params = memory.match_layers(params, state.params)
      params = jax.device_put(params, shardings.params)
      state = dataclasses.replace(state, params=params)
      if state.ema is not None:  # the average starts at the loaded weights (its own buffers)
        state = dataclasses.replace(state, ema=jax.tree.map(jnp.copy, params))
  start = int(state.step)
  step_fn = steps.make_train_step(cfg, tx=tx, layout=layout, shardings=shardings)
  graphdef = nnx.graphdef(models.abstract(cfg.model))
  tokens_per_step = cfg.train.batch_size * data.tokens_per_row
  lr_at = optim.schedule(cfg.optim, cfg.train.steps)

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
  nonfinite = faults.NonFinite(cfg.train.nonfinite, ckpts)
  signals = faults.Signals().install()  # SIGTERM/SIGINT: finish the step, save, exit
  try:
    for step in range(start + 1, cfg.train.steps + 1):
      state, metrics = step_fn(state, steps.put_batch(next(data_iter), layout))
      nonfinite.observe(step, metrics)
      if step % cfg.train.log_every == 0 or step == cfg.train.steps:
        metrics = {k: float(v) for k, v in metrics.items()}
        metrics["skipped"] = nonfinite.take()  # since the last line; "stop" raises here
        elapsed = time.perf_counter() - t0
        metrics["tokens_per_s"] = (step - since) * tokens_per_step / elapsed
        metrics["examples_per_s"] = (step - since) * cfg.train.batch_size / elapsed
        metrics["lr"] = float(lr_at(step - 1))
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
        ev = evaluate(weights_now, data, graphdef=graphdef, cfg=cfg, layout=layout)
        log.write(step, ev, split="eval")
        extra = "".join(f", {k} {ev[k]:.4f}" for k in ("wer",) if k in ev)
        bar.write(f"step {step}: eval loss {ev['loss']:.4f}{extra}")
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


# Start-up pieces (also used by `zoo eval`)


@dataclasses.dataclass
class Data:
  """A data kind's splits as the trainer uses them."""

  iterator: Iterator | None  # endless training batches (a grain iterator: its state is saved)
  eval: object | None  # the held-out split; None when the data has none
  eval_batches: Callable[..., Iterator]  # (split, *, batch_size, max_batches) -> batches
  tokens_per_row: int  # a batch row's tokens for tokens_per_s (an image counts as one)
  prompts: np.ndarray | None = None  # CLIP: the class prompts' tokens, for zero-shot accuracy
  # A held-out metric computed from the params beyond the loss, (graphdef, params) -> dict
  # (speech: the word error rate of greedy transcripts).
  score: Callable[..., dict] | None = None


def load_data(cfg, *, train: bool = True, layout: parallel.Layout | None = None) -> Data:
  """The data of `cfg.data.kind`: the one place that picks a pipeline by data kind (text rows,
  common/data/pipeline.py; images, common/data/images.py, noised for a denoiser when the
  experiment has a `diffusion` section; span-corrupted source and target rows,
  common/data/spans.py; spoken audio and its words, common/data/speech.py). `train=False`: the
  held-out split only (`zoo eval`). Each process reads the rows of every batch that its devices
  of `layout` hold (`parallel.process_rows`)."""
  batch_size = cfg.train.batch_size
  share = parallel.process_rows(layout, batch_size)
  data = _load_data(cfg, train, batch_size, share)
  return dataclasses.replace(data, eval_batches=functools.partial(data.eval_batches, share=share))


def _load_data(cfg, train: bool, batch_size: int, share: slice | None) -> Data:
  if cfg.data.kind in speech.KINDS:
    if cfg.model.vocab_size < speech.VOCAB_SIZE:
      raise UserError(
        f"The spoken words use {speech.VOCAB_SIZE} ids but model.vocab_size is "
        f"{cfg.model.vocab_size}: set --config.model.vocab_size={speech.VOCAB_SIZE} or more."
      )
    held_out = speech.load_split(cfg.data, "eval")
    iterator = None
    if train:
      iterator = speech.train_iterator(
        speech.load_split(cfg.data, "train"),
        cfg.data,
        batch_size=batch_size,
        seed=cfg.seed,
        share=share,
      )

    def score(graphdef, params):
      return speech.word_error_rate((graphdef, params), held_out, cfg.data)

    rows = speech.target_len(cfg.data)
    return Data(iterator, held_out, speech.eval_batches, rows, score=score)
  if cfg.data.kind in images.KINDS:
    held_out = images.load_split(cfg.data, "eval")
    length = cfg.data.caption_len  # > 0: image-caption pairs (CLIP)
    iterator, then, batches = None, None, images.eval_batches
    if cfg.get("diffusion") is not None:  # a denoiser: the forward process drawn with the data
      num_classes = cfg.model.conditioning.num_classes
      then = functools.partial(diffusion.noise_example, cfg=cfg.diffusion, num_classes=num_classes)
      batches = diffusion.eval_batches(cfg.diffusion, num_classes, images.eval_batches)
    if train:
      if cfg.data.mix != "none" and (then is not None or length):
        raise UserError(
          f"data.mix={cfg.data.mix!r} mixes a classifier's labels; this task (a denoiser or "
          "image-caption pairs) has none to mix: set data.mix='none'."
        )
      iterator = images.train_iterator(
        images.load_split(cfg.data, "train"),
        batch_size=batch_size,
        seed=cfg.seed,
        augment=cfg.data.augment,
        max_shift=cfg.data.max_shift,
        max_rotate=cfg.data.max_rotate,
        max_scale=cfg.data.max_scale,
        augment_prob=cfg.data.augment_prob,
        mix=cfg.data.mix,
        mix_alpha=cfg.data.mix_alpha,
        mix_prob=cfg.data.mix_prob,
        caption_tokens=images.caption_tokens(length) if length else None,
        then=then,
        share=share,
      )
    prompts = images.encode_texts(images.class_prompts(), length) if length else None
    return Data(iterator, held_out, batches, 1, prompts)
  if cfg.data.kind in spans.KINDS:
    tokenizer = tokenizers.load(cfg.data.tokenizer)
    ids = spans.vocab_size(cfg.data, tokenizer)
    if ids > cfg.model.vocab_size:
      raise UserError(
        f"The data uses {ids} ids (the tokenizer's {tokenizer.vocab_size} and "
        f"data.extra_ids={cfg.data.extra_ids} sentinels) but model.vocab_size is "
        f"{cfg.model.vocab_size}: set --config.model.vocab_size={ids} or more."
      )
    iterator = None
    if train:
      iterator = spans.train_iterator(
        spans.load_split(cfg.data, "train", tokenizer),
        batch_size=batch_size,
        seed=cfg.seed,
        corrupt=spans.corrupter(cfg.data, tokenizer),
        share=share,
      )
    held_out = spans.load_split(cfg.data, "eval", tokenizer)
    return Data(iterator, held_out, pipeline.eval_batches, cfg.data.seq_len)
  tokenizer = tokenizers.load(cfg.data.tokenizer)
  if tokenizer.vocab_size > cfg.model.vocab_size:
    raise UserError(
      f"The tokenizer has {tokenizer.vocab_size} ids but model.vocab_size is "
      f"{cfg.model.vocab_size}: set --config.model.vocab_size={tokenizer.vocab_size} or more."
    )
  iterator = None
  if train:
    rows = pipeline.load_split(cfg.data, "train", tokenizer)
    iterator = pipeline.train_iterator(rows, batch_size=batch_size, seed=cfg.seed, share=share)
  held_out = pipeline.load_split(cfg.data, "eval", tokenizer)
  return Data(iterator, held_out, pipeline.eval_batches, cfg.data.seq_len)


def check_workdir(cfg, workdir: str):
  """Writes DIR/config.json, or checks that the one there describes the same model and data."""
  faults.check_writable(workdir, checkpoint.directory(workdir))  # now, not at the first save
  path = os.path.join(workdir, "config.json")
  # Only checkpoints can be mixed up: a config.json alone (of a run refused for bad data, say)
  # is replaced. data.long_records checks the data without changing it, and the memory levers
  # (model.remat, model.scan) and stochastic depth how the model is computed, not what it is.
  if os.path.exists(path) and checkpoint.has_steps(workdir):
    with open(path) as f:
      old = config_lib.from_json(f.read())
    if "model" in old:
      old.model = models.upgrade(old.model.to_dict())
    changed = config_lib.differences(
      old, cfg, within=("model.", "data."), ignore=("data.long_records", *models.HOW_TRAINED)
    )
    if changed:
      raise UserError(
        f"{workdir} holds a run of a different model or data ({'; '.join(changed)}). Resuming "
        "it with this experiment would mix the two: use a new --workdir, or the settings of "
        "the first run."
      )
  if jax.process_index() == 0:  # the other processes may be reading it (above): replaced whole
    with faults.replacing(path) as tmp, open(tmp, "w") as f:
      f.write(config_lib.to_json(cfg))


def evaluate(params, data: Data, *, graphdef, cfg, layout: parallel.Layout | None = None) -> dict:
  """Mean loss over the held-out rows (all of them unless train.eval_batches limits it), and a
  classifier's accuracy (CLIP's: zero-shot, by its class prompts).

  Runs as plain jit over the global (sharded) arrays: XLA partitions it, no shard_map needed;
  but a mesh that splits rows over `context` runs it as the train step runs (shard_map), each
  device given its share of every row."""
  if layout is not None and layout.sizes.get("context", 1) > 1:
    step = jax.jit(functools.partial(steps.sharded_eval_step, graphdef=graphdef, layout=layout))
  else:
    step = jax.jit(functools.partial(steps.eval_step, graphdef=graphdef, prompts=data.prompts))
  sums = {}
  for batch in data.eval_batches(
    data.eval, batch_size=cfg.train.batch_size, max_batches=cfg.train.eval_batches
  ):
    for k, v in step(params, steps.put_batch(batch, layout)).items():
      sums[k] = sums.get(k, 0.0) + float(v)
  count = max(sums["count"], 1.0)
  loss = sums["total"] / count
  if data.score is not None:
    return {"loss": loss, "targets": int(count), **data.score(graphdef, params)}
  if "correct" in sums:  # a classifier
    return {"loss": loss, "accuracy": sums["correct"] / count, "examples": int(sums["count"])}
  if cfg.get("diffusion") is not None:  # a denoiser's mean squared error: no perplexity
    return {"loss": loss, "examples": int(count)}
  return {"loss": loss, "perplexity": float(np.exp(min(loss, 50.0))), "targets": int(count)}
