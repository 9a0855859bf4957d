"""The trainer's settings, declared once: every key of `train` and `optim` with its default, so
every experiment accepts every trainer key and an experiment file sets only what differs."""

import ml_collections

from nnx_zoo.common.errors import UserError, suggest

TRAIN = {
  "steps": 1000,
  "batch_size": 32,
  "log_every": 10,
  "eval_every": 0,  # 0: no evaluation while training (`zoo eval` evaluates a workdir)
  "eval_batches": 0,  # 0: every held-out batch
  "eval_batch_size": 0,  # held-out rows (examples) a batch; 0: batch_size
  "checkpoint_every": 1000,
  "keep_checkpoints": 3,
  # > 0: also save a temporary checkpoint when this many minutes have passed since the last
  # save (process 0's clock; with several processes, asked every log_every steps), kept only
  # until the next permanent one: a kill loses at most about this much work. 0: off.
  "checkpoint_minutes": 0.0,
  # Several processes: every log_every steps they share when each dispatched each step; one
  # whose mean lateness (after the earliest process) scores over straggler_threshold, as (its
  # lateness - the others' median) / max(1.4826 x their MAD, 10% of a step), in
  # straggler_windows logged windows in a row is named (a warning, `stragglers` in
  # metrics.jsonl; common/train/stragglers.py). 0: no check.
  "straggler_threshold": 3.0,
  "straggler_windows": 3,
  "nonfinite": "skip",  # a NaN/inf loss or gradient: skip that update and count it, or "stop"
  "micro_batches": 1,  # gradient accumulation: the batch run in this many slices
  # mesh.pipeline > 1: each slice's rows cut into this many micro-batches that the stages pass
  # on (common/nn/pipeline.py); 0: 2 x mesh.pipeline.
  "pipeline_microbatches": 0,
  "loss_chunk": 0,  # > 0: the output head and loss run this many tokens at a time
  # > 0: keep an exponential moving average of the weights with this decay (e.g. 0.999), capped
  # early by (1 + step) / (10 + step); it is what is evaluated, checkpointed beside the params
  # and read by zoo eval, generate, export and init_from. 0: none.
  "ema": 0.0,
  # Before the first step the compiled step's memory is compared with the device's
  # (common/train/fit.py): "auto" makes a step that does not fit fit by the first of its
  # candidates (remat, chunked loss, blocked attention, more micro-batches) that does; "off"
  # refuses it in one line with those candidates' figures.
  "fit": "auto",
  # The levers train.fit=auto pulled ("model.remat=full train.loss_chunk=4096"), written into
  # the workdir's config.json and applied again by a resumed run; "": none.
  "fitted": "",
  # Seconds without a new step after which a process is taken as hung: every thread's stack is
  # written to WORKDIR/hangs/ and the process exits 75 (common/train/watchdog.py). -1: 10 x the
  # slowest recent step, at least 300 s (and 2 x the first step's time until a later one is
  # measured); start-up and the steps to the first logged one (which
  # waits for those jax dispatched ahead), and evaluation, get 600 s more. 0: no watchdog.
  "watchdog_s": -1.0,
}
OPTIM = {
  "lr": 3e-4,
  "warmup_steps": 100,
  "schedule": "cosine",  # or "linear", "constant" (after the linear warm-up)
  "min_lr_ratio": 0.1,  # the decay ends at lr * min_lr_ratio
  "b1": 0.9,
  "b2": 0.95,
  "eps": 1e-8,
  "weight_decay": 0.1,  # AdamW's decoupled decay, on matrices only
  "clip_norm": 1.0,  # global gradient norm; 0: no clipping
}


def _make(group: str, defaults: dict, overrides: dict) -> ml_collections.ConfigDict:
  unknown = [k for k in overrides if k not in defaults]
  if unknown:
    raise UserError(
      f"{group} has no key {unknown[0]!r}.{suggest(unknown[0], defaults)} Its keys: "
      f"{', '.join(defaults)}."
    )
  return ml_collections.ConfigDict({**defaults, **overrides})


def train(**overrides) -> ml_collections.ConfigDict:
  """The `train` config: TRAIN's defaults with `overrides`."""
  return _make("train", TRAIN, overrides)


def optim(**overrides) -> ml_collections.ConfigDict:
  """The `optim` config: OPTIM's defaults with `overrides`."""
  return _make("optim", OPTIM, overrides)


def eval_batch_size(cfg) -> int:
  """The held-out examples a batch: train.eval_batch_size, or train.batch_size where it is 0."""
  return cfg.train.get("eval_batch_size", 0) or cfg.train.batch_size


def complete(cfg: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
  """`cfg` with every trainer key it lacks at its default (an experiment file written before a
  key existed, or one that builds its own dicts, still accepts every override)."""
  for group, defaults in (("train", TRAIN), ("optim", OPTIM)):
    if group not in cfg:
      cfg[group] = ml_collections.ConfigDict()
    for key, value in defaults.items():
      if key not in cfg[group]:
        cfg[group][key] = value
  return cfg
