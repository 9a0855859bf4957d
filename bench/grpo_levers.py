"""GRPO's levers measured on a recipe: each lever alone and in combination, held-out reward at
steps 20 and 40 and the run's wall time, one `zoo run` per (setting, seed).

    pip install -e ".[smollm2]" && python bench/grpo_levers.py --out runs/levers
    python bench/grpo_levers.py --out runs/levers --only base,filter --seeds 0,1,2

Each run's workdir is OUT/NAME-sSEED; a finished run (its step-40 evaluation in metrics.jsonl)
is read, not rerun, so the scan can be stopped and picked up again. The table is printed as
markdown: one row per setting, the mean over the seeds that finished (and their number).
"""

import argparse
import json
import os
import resource
import subprocess
import sys
import time

import numpy as np

EXP = "chat/smollm2-arithmetic-grpo"
BATCH = 4  # the recipe's prompts a step
NAN = float("nan")

# The plain GRPO step, the recipe's default before the scan: every setting starts from it, so a
# row's meaning does not move with the recipe's defaults (which are now the scan's best).
PLAIN = {"filter_tied_groups": False, "num_iterations": 1, "epsilon_high": 0.0}

# name -> overrides of the plain step's grpo section (TRL's names); a dotted key is a path
# in the whole config (optim.lr).
SETTINGS = {
  "base": {},
  "mu2": {"num_iterations": 2},
  "mu2-clip-higher": {"num_iterations": 2, "epsilon_high": 0.28},
  "mu2-gspo": {"num_iterations": 2, "importance_sampling_level": "sequence"},
  "filter": {"filter_tied_groups": True},
  "soft-punish": {"soft_punish_cache": 8},
  "grpo-loss": {"loss_type": "grpo"},
  "filter-mu2-clip-higher": {"filter_tied_groups": True, "num_iterations": 2, "epsilon_high": 0.28},
  "filter-mu2-gspo": {
    "filter_tied_groups": True,
    "num_iterations": 2,
    "importance_sampling_level": "sequence",
  },
  "filter-mu2-clip-higher-lr2x": {
    "filter_tied_groups": True,
    "num_iterations": 2,
    "epsilon_high": 0.28,
    "optim.lr": 1e-4,
  },
}


def read(workdir):
  """{step: held-out reward}, the run's (wall, CPU) seconds from its own record, and the
  prompts it sampled (dynamic sampling's extra ones included)."""
  path = os.path.join(workdir, "metrics.jsonl")
  if not os.path.exists(path):
    return {}, (NAN, NAN), 0
  with open(path) as f:
    lines = [json.loads(line) for line in f if line.strip()]
  held = {x["step"]: x["reward"] for x in lines if x.get("split") == "eval"}
  wall = cpu = NAN
  timing = os.path.join(workdir, "wall_s.json")
  if os.path.exists(timing):
    with open(timing) as f:
      record = json.load(f)
    wall, cpu = record["wall_s"], record.get("cpu_s", NAN)
  elif lines:  # not run by this script: from its first file to its last line
    wall = os.path.getmtime(path) - os.path.getmtime(os.path.join(workdir, "config.json"))
  # A rollout's prompts (an update on a held rollout, num_iterations > 1, samples none).
  updates = [x for x in lines if "split" not in x and "sample_s" in x and x["sample_s"] > 0]
  sampled = sum(x.get("sampled_prompts", BATCH) for x in updates)
  return held, (wall, cpu), sampled


def right(workdir, step: int) -> float:
  """The share of held-out replies with the right sum in them at `step` (the recipe's
  contains_answer term: the reward's part that is not the format's)."""
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    lines = [json.loads(line) for line in f if '"split": "eval"' in line]
  return next((x["reward/contains_answer"] for x in lines if x["step"] == step), NAN)


def children_cpu() -> float:
  """CPU seconds (user + system) of the finished child processes: a run's cost where the
  machine is shared, which its wall time is not."""
  usage = resource.getrusage(resource.RUSAGE_CHILDREN)
  return usage.ru_utime + usage.ru_stime


def run(name, seed, out, steps):
  workdir = os.path.join(out, f"{name}-s{seed}")
  held, _, _ = read(workdir)
  if steps in held:
    return workdir
  if os.path.exists(workdir):  # a run stopped half-way: its time would not add up
    subprocess.run(["rm", "-rf", workdir], check=True)
  argv = ["zoo", "run", EXP, "--workdir", workdir, "--quiet", f"--config.seed={seed}"]
  for k, v in {**PLAIN, **SETTINGS[name]}.items():
    argv.append(f"--config.{k if '.' in k else 'grpo.' + k}={v}")
  t0, cpu0 = time.time(), children_cpu()
  print(" ".join(argv), flush=True)
  subprocess.run(argv, check=True)
  with open(os.path.join(workdir, "wall_s.json"), "w") as f:
    json.dump({"wall_s": time.time() - t0, "cpu_s": children_cpu() - cpu0}, f)
  return workdir


def main():
  p = argparse.ArgumentParser()
  p.add_argument("--out", default="runs/levers")
  p.add_argument("--only", help="comma-separated settings (default: all)")
  p.add_argument("--seeds", default="0")
  p.add_argument("--steps", type=int, default=40)
  p.add_argument("--table", action="store_true", help="the table of what has run; run nothing")
  args = p.parse_args()
  names = args.only.split(",") if args.only else list(SETTINGS)
  unknown = [n for n in names if n not in SETTINGS]
  if unknown:
    sys.exit(f"unknown setting(s) {unknown}: choose from {', '.join(SETTINGS)}")
  seeds = [int(s) for s in args.seeds.split(",")]
  if not args.table:
    for name in names:
      for seed in seeds:
        run(name, seed, args.out, args.steps)
  print(
    f"| setting | overrides | seeds | held out @20 | held out @{args.steps} (each seed) "
    f"| sum right @{args.steps} | wall (min) | CPU (min) | prompts sampled |"
  )
  print("|---|---|---|---|---|---|---|---|---|")
  for name in names:
    rows = []
    for entry in sorted(os.listdir(args.out)) if os.path.isdir(args.out) else []:
      if entry.rsplit("-s", 1)[0] == name:
        workdir = os.path.join(args.out, entry)
        held, (wall, cpu), sampled = read(workdir)
        if args.steps in held:
          right_at = right(workdir, args.steps)
          rows.append((held.get(20, NAN), held[args.steps], right_at, wall, cpu, sampled))
    if not rows:
      continue
    n = len(rows)
    # Each column's mean over the seeds that have it (a run not timed by this script has no CPU).
    mean = [float(np.nanmean([r[i] for r in rows])) for i in range(6)]
    over = ", ".join(f"{k}={v}" for k, v in SETTINGS[name].items()) or "(the plain step)"
    each = " (" + ", ".join(f"{r[1]:.3f}" for r in rows) + ")" if n > 1 else ""
    print(
      f"| {name} | {over} | {n} | {mean[0]:.3f} | {mean[1]:.3f}{each} | {mean[2]:.3f} | "
      f"{mean[3] / 60:.1f} | {mean[4] / 60:.1f} | {mean[5]:.0f} |"
    )


if __name__ == "__main__":
  main()
