"""The full-size LM recipes planned for 64-chip TPU slices of each generation with `zoo plan`
(or the larger slice of that generation a recipe's own mesh rule names, where 64 chips do not
hold its step: Mixtral and Qwen3-30B on v5e-128).

Each row compiles the recipe's real train step ahead of time on this machine (libtpu: `pip
install -e ".[tpu]"`), with the mesh rule the recipe picks for that slice, and prints: mesh,
memory per device, fits, the estimated step time (a roofline of the compiler's FLOPs and bytes:
see `nnx_zoo.common.plan.estimate_cost`) and MFU. Rows print as they finish (each takes minutes on a
small CPU).

  python bench/plan_recipes.py                      # every recipe on every generation
  python bench/plan_recipes.py --recipes lm/llama3-8b --topologies v5p-128 --no-time
"""

import argparse
import sys
import time

from nnx_zoo.common import plan
from nnx_zoo.common.errors import UserError

RECIPES = (
  "lm/llama3-8b",
  "lm/mistral-7b",
  "lm/llama2-7b",
  "lm/qwen3-0.6b",
  "lm/mixtral-8x7b",
  "lm/qwen3-30b-a3b",
)
TOPOLOGIES = ("v5p-128", "v6e-64", "v4-128", "v5e-64")  # 64 chips each


def recipe_topology(exp: str, topology: str) -> str:
  """`topology`, or the smallest larger slice of its generation that one of `exp`'s mesh rules
  names, where none names this one."""
  from nnx_zoo.common import experiments

  topo = plan.parse_topology(topology)
  patterns = {pattern for pattern, _ in experiments.get_config(exp).get("mesh_rules", [])}
  if topo.hardware in patterns:
    return topology
  for chips in sorted(n for n in plan.SHAPES[topo.chip.dims] if n > topo.chips):
    larger = f"{topo.generation}-{chips * topo.chip.cores_per_chip}"
    if plan.parse_topology(larger).hardware in patterns:
      return larger
  return topology


def row(exp: str, topology: str, *, estimate_time: bool) -> str:
  start = time.perf_counter()
  try:
    cfg = plan.config(exp, topology)
    r = plan.plan(cfg, topology, estimate_time=estimate_time)
  except UserError as e:
    return f"| {exp} | {topology} | | | error: {e} | | |"
  mesh = " ".join(f"{a}={n}" for a, n in r["mesh"].items() if n > 1)
  levers = f"remat {r['remat']}, micro {r['micro_batches']}"
  memory = f"{r['total_bytes'] / plan.GiB:.1f} / {r['hbm_bytes'] / plan.GiB:.0f} GiB"
  step = f"{r['step_s']:.2f} s" if r.get("step_s") else "-"
  mfu = f"{r['mfu']:.0%}" if r.get("mfu") else "-"
  took = time.perf_counter() - start
  return (
    f"| {exp} | {topology} | {mesh} ({levers}) | {memory} | {'yes' if r['fits'] else 'NO'} "
    f"| {step} | {mfu} | {took:.0f} s |"
  )


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--recipes", nargs="+", default=RECIPES)
  p.add_argument("--topologies", nargs="+", default=TOPOLOGIES)
  p.add_argument("--no-time", action="store_true", help="memory only (one compile a row)")
  args = p.parse_args(argv)
  print("| recipe | topology | mesh | memory/device | fits | step | MFU | planned in |")
  print("|---|---|---|---|---|---|---|---|")
  for exp in args.recipes:
    for topology in args.topologies:
      topology = recipe_topology(exp, topology)
      print(row(exp, topology, estimate_time=not args.no_time), flush=True)


if __name__ == "__main__":
  sys.exit(main())
