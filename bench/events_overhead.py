"""The cost of the run's event records (common/train/events.py) on bench/llama-19m's step,
measured side by side in one process.

  python bench/events_overhead.py [--pairs 3] [--steps 30] [--log-every N]
      [--experiment NAME] [--set KEY=VALUE ...]

1. Runs: `--pairs` pairs of runs of `--steps` steps (bench/llama-19m unless `--experiment`),
   events on and off (a no-op recorder in their place), interleaved (on, off, off, on, ...), each
   in a fresh workdir; each run's step time is the median over its logged lines after step 3 of
   the time a step took between them (tokens_per_s in metrics.jsonl). Prints every run's and the
   ratio of the medians. `--log-every` above 1 lets the loop dispatch ahead of the devices
   between logged steps, where the waiter thread that times the steps runs beside it.
2. Calls: what the events cost per step, timed alone (the three marks, and the waiter thread's
   wait on a ready output and its line written and flushed, 10,000 times), as a share of the
   measured step time: the same figure without the machine's noise.
"""

import argparse
import json
import os
import statistics
import tempfile
import time

import jax
import jax.numpy as jnp

from nnx_zoo.common import experiments
from nnx_zoo.common.train import events, trainer

EXP = "bench/llama-19m"
NO_SUMMARY = {"goodput": 0.0, "goodput_h": 0.0, "wall_h": 0.0, "badput": {}, "step_time": {}}


class NoEvents(events.Events):
  """The recorder with every method a no-op: the run as it was before events."""

  def __init__(self, workdir):
    self.window = []

  def record(self, *a, **k):
    pass

  def open(self):
    pass

  def close(self, how):
    pass

  def step_start(self):
    pass

  def data_ready(self):
    pass

  def dispatched(self, step, outputs):
    pass

  def wait_steps(self):
    pass


def run(steps: int, on: bool, root: str, *, experiment: str, overrides: dict) -> float:
  workdir = tempfile.mkdtemp(dir=root)
  cfg = experiments.get_config(
    experiment, {"train.steps": str(steps), "train.checkpoint_every": "1000", **overrides}
  )
  real, summary = trainer.events.Events, trainer.goodput.summary
  if not on:  # and no goodput summary at the end, with no events to read
    trainer.events.Events, trainer.goodput.summary = NoEvents, lambda workdir: NO_SUMMARY
  try:
    trainer.train(cfg, workdir, progress=False)
  finally:
    trainer.events.Events, trainer.goodput.summary = real, summary
  tokens = cfg.train.batch_size * cfg.data.seq_len
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    per_step = [tokens / r["tokens_per_s"] for r in map(json.loads, f) if r["step"] > 3]
  return statistics.median(per_step)


def calls(root: str, n: int = 10_000) -> float:
  """Seconds per step of the events' own work, the waiter thread's included."""
  ev = events.Events(os.path.join(root, "calls"))
  ev.open()
  ready = {"loss": jnp.zeros(())}  # a step's output, already computed
  jax.block_until_ready(ready)
  t0 = time.perf_counter()
  for step in range(n):
    ev.step_start()
    ev.data_ready()
    ev.dispatched(step, ready)
    if step % 100 == 0:
      ev.take_window()
  ev.wait_steps()
  seconds = (time.perf_counter() - t0) / n
  ev.close("finished")
  return seconds


def main():
  p = argparse.ArgumentParser()
  p.add_argument("--pairs", type=int, default=3)
  p.add_argument("--steps", type=int, default=30)
  p.add_argument("--log-every", type=int, default=0, help="0: the experiment's")
  p.add_argument("--experiment", default=EXP)
  p.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="config overrides")
  args = p.parse_args()
  overrides = dict(kv.split("=", 1) for kv in args.set)
  if args.log_every:
    overrides["train.log_every"] = str(args.log_every)
  root = tempfile.mkdtemp(prefix="events-overhead-")
  times = {True: [], False: []}
  for i in range(args.pairs):
    for on in (True, False) if i % 2 == 0 else (False, True):
      times[on].append(run(args.steps, on, root, experiment=args.experiment, overrides=overrides))
      print(f"events {'on ' if on else 'off'}: {times[on][-1] * 1e3:.1f} ms a step", flush=True)
  on, off = statistics.median(times[True]), statistics.median(times[False])
  print(f"median step: on {on * 1e3:.1f} ms, off {off * 1e3:.1f} ms: ratio {on / off:.4f}")
  cost = calls(root)
  print(f"the events' own work: {cost * 1e6:.1f} us a step, {100 * cost / off:.4f}% of a step")


if __name__ == "__main__":
  main()
