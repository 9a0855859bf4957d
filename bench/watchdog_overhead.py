"""What the hang watchdog and its progress file cost a training step: `zoo run bench/llama-19m`
with `train.watchdog_s` at its default (-1: on) and at 0 (off), runs interleaved on/off/on/...

    python bench/watchdog_overhead.py [--pairs 3] [--steps 25]

Prints each run's median step time (from metrics.jsonl's tokens_per_s, the first 5 steps left
out: compilation), the ratio on/off of the medians over the pairs, and, in-process, what the
loop's one call (`beat`) and the thread's one tick (writing the progress file) take.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

from nnx_zoo.common.train import watchdog


def step_times(workdir: str, tokens_per_step: int) -> list[float]:
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    lines = [json.loads(x) for x in f if '"split"' not in x]
  return [tokens_per_step / r["tokens_per_s"] for r in lines if r["step"] > 5]


def run(exp: str, steps: int, watchdog_s: float, root: str, index: int) -> float:
  workdir = os.path.join(root, f"run{index}")
  argv = [sys.executable, "-m", "nnx_zoo.common.cli", "run", exp, "--workdir", workdir, "--quiet"]
  argv += [f"--config.train.steps={steps}", f"--config.train.watchdog_s={watchdog_s}"]
  argv += ["--config.train.checkpoint_every=100000"]
  subprocess.run(argv, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
  return statistics.median(step_times(workdir, 8 * 256))


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
  p.add_argument("--exp", default="bench/llama-19m")
  p.add_argument("--pairs", type=int, default=3)
  p.add_argument("--steps", type=int, default=25)
  args = p.parse_args()
  times = {"on": [], "off": []}
  with tempfile.TemporaryDirectory() as root:
    for i in range(args.pairs):
      for name, value in (("on", -1), ("off", 0)) if i % 2 == 0 else (("off", 0), ("on", -1)):
        t = run(args.exp, args.steps, value, root, len(times["on"]) + len(times["off"]))
        times[name].append(t)
        print(f"pair {i}: watchdog {name:>3}: median step {t * 1e3:.1f} ms", flush=True)
  on, off = statistics.median(times["on"]), statistics.median(times["off"])
  print(f"median step: on {on * 1e3:.1f} ms, off {off * 1e3:.1f} ms, on/off {on / off:.4f}")
  beat, write = in_process()
  print(
    f"in-process: beat {beat * 1e6:.2f} us a step ({beat / off:.1e} of a step); progress "
    f"file {write * 1e6:.0f} us a second on the watchdog's thread ({write:.1e} of its time)"
  )


if __name__ == "__main__":
  main()
