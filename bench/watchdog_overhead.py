"""What the hang watchdog and its progress file cost a training step of bench/llama-19m: the same
compiled step, in one process, in blocks with a watchdog thread running (beaten every step, its
progress file rewritten every second) and blocks without, interleaved on/off/off/on/...

    python bench/watchdog_overhead.py [--rounds 6] [--steps 5]

Prints the median step time of each mode and their ratio, and what the loop's one call (`beat`)
and the thread's one tick (writing the progress file) take.
"""

import argparse
import functools
import os
import statistics
import tempfile
import time

import jax

from nnx_zoo.common import experiments, tasks
from nnx_zoo.common.train import optim, trainer, watchdog
from nnx_zoo.common.train import step as steps

EXP = "bench/llama-19m"


def train_step(cfg):
  """The state, the jitted step (as trainer.train builds it for one device) and a batch."""
  tx = optim.optimizer(cfg.optim, cfg.train.steps)
  graphdef, state = steps.init_state(cfg, tx)
  task = tasks.of(cfg)
  step = functools.partial(
    steps.train_step, graphdef=graphdef, task=task, tx=tx, loss_chunk=cfg.train.loss_chunk
  )
  batch = steps.put_batch(next(trainer.load_data(cfg).iterator), None, task)
  return state, jax.jit(step, donate_argnums=0), batch


def block(state, step, batch, *, n: int, dog) -> tuple[object, list[float]]:
  times = []
  for i in range(n):
    start = time.perf_counter()
    state, metrics = step(state, batch)
    float(metrics["loss"])  # the trainer's log line syncs every step here (log_every=1)
    if dog is not None:
      dog.beat(i)
    times.append(time.perf_counter() - start)
  return state, times


def in_process() -> tuple[float, float]:
  """Seconds per `beat` and per progress-file write."""
  with tempfile.TemporaryDirectory() as root:
    dog = watchdog.Watchdog(60, workdir=root, process=0)
    n = 100_000
    start = time.perf_counter()
    for step in range(n):
      dog.beat(step)
    beat = (time.perf_counter() - start) / n
    path = watchdog.progress_path(root, 0)
    os.makedirs(os.path.dirname(path))
    m = 1000
    start = time.perf_counter()
    for _ in range(m):
      dog._write_progress(path, step=1, stood=0.1, limit=60.0)
    write = (time.perf_counter() - start) / m
  return beat, write


def main():
  p = argparse.ArgumentParser()
  p.add_argument("--rounds", type=int, default=6)
  p.add_argument("--steps", type=int, default=5, help="steps a block")
  args = p.parse_args()
  cfg = experiments.get_config(EXP)
  state, step, batch = train_step(cfg)
  state, _ = block(state, step, batch, n=2, dog=None)  # compile, warm up
  times = {"on": [], "off": []}
  with tempfile.TemporaryDirectory() as root:
    for r in range(args.rounds):
      for mode in ("on", "off") if r % 2 == 0 else ("off", "on"):
        dog = None
        if mode == "on":
          dog = watchdog.Watchdog(watchdog.AUTO, workdir=root, process=0).start()
        state, got = block(state, step, batch, n=args.steps, dog=dog)
        if dog is not None:
          dog.stop()
        times[mode] += got
      print(
        f"round {r}: on {statistics.median(times['on']) * 1e3:.1f} ms, off "
        f"{statistics.median(times['off']) * 1e3:.1f} ms (medians so far)",
        flush=True,
      )
  on, off = statistics.median(times["on"]), statistics.median(times["off"])
  print(f"median step: on {on * 1e3:.1f} ms, off {off * 1e3:.1f} ms, on/off {on / off:.4f}")
  beat, write = in_process()
  print(
    f"beat {beat * 1e6:.2f} us a step ({beat / off:.1e} of a step); progress file "
    f"{write * 1e6:.0f} us a second on the watchdog's thread"
  )


if __name__ == "__main__":
  main()
