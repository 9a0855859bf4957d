"""The planned step time of LM recipes with `model.quant=int8` beside bf16, on TPU slices: a plan
(a roofline of XLA:TPU's counts), not a measurement.

Each row resolves the recipe for the slice (its mesh rule: `model.scan`, `remat=full` and
micro-batches), then compiles the loop-free probes `nnx_zoo.common.plan.estimate_cost` reads
the step's FLOPs and bytes from (one and two layers, one micro-batch), for each `model.quant`,
and prints `plan.roofline`'s step time: the int8 products (`plan.int8_flops`) at the chip's int8
peak, everything else at its bf16 peak, or HBM bandwidth where that binds. Memory is not
planned here (`zoo plan` or bench/plan_recipes.py: the full step's compile).

  python bench/plan_quant.py                                 # the table in README
  python bench/plan_quant.py --recipes lm/qwen3-0.6b --topologies v6e-64
"""

import argparse
import sys
import time

from nnx_zoo.common import mesh, parallel, plan

RECIPES = ("lm/llama3-8b", "lm/qwen3-0.6b")
TOPOLOGIES = ("v5e-64", "v6e-64")  # the generations with an int8 peak above their bf16 one
MODES = ("none", "int8")


def planned(exp: str, topology: str, quant: str) -> dict:
  topo = plan.parse_topology(topology)
  cfg = plan.config(exp, topo, {"model.quant": quant})
  if not cfg.model.get("scan", False) and cfg.train.micro_batches == 1:
    raise SystemExit(f"{exp} on {topology}: a loop-free step; plan it with `zoo plan`")
  devices = plan.devices(topo)
  layout = parallel.make_layout(mesh.resolve(cfg.mesh, len(devices)), devices)
  cost = plan.estimate_cost(cfg, layout, None)
  out = plan.roofline(cfg, topo, cost)
  # The roofline's two bounds, to say which binds.
  int8 = out["int8_flops_per_device"]
  flops = out["compiler_flops_per_device"] + out["kernel_flops_per_device"]
  out["compute_s"] = (flops - int8) / topo.chip.peak + int8 / topo.chip.int8
  out["hbm_s"] = cost["bytes accessed"] / topo.chip.bandwidth
  out["mesh"] = " ".join(f"{a}={n}" for a, n in layout.sizes.items() if n > 1)
  out["micro_batches"] = cfg.train.micro_batches
  return out


def times(r: dict) -> str:
  return f"{r['step_s']:.2f} s ({r['compute_s']:.2f} / {r['hbm_s']:.2f})"


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--recipes", nargs="+", default=RECIPES)
  p.add_argument("--topologies", nargs="+", default=TOPOLOGIES)
  args = p.parse_args(argv)
  print(
    "| recipe | topology | mesh | bf16 step (compute / HBM) | int8 step (compute / HBM) "
    "| int8 share of FLOPs | speed-up | MFU bf16 / int8 | planned in |"
  )
  print("|---|---|---|---|---|---|---|---|---|")
  for exp in args.recipes:
    for topology in args.topologies:
      start = time.perf_counter()
      bf16, int8 = (planned(exp, topology, q) for q in MODES)
      share = int8["int8_flops_per_device"] / (
        int8["compiler_flops_per_device"] + int8["kernel_flops_per_device"]
      )
      print(
        f"| {exp} | {topology} | {bf16['mesh']} (micro {bf16['micro_batches']}) "
        f"| {times(bf16)} | {times(int8)} | {share:.0%} "
        f"| {bf16['step_s'] / int8['step_s']:.2f}x | {bf16['mfu']:.0%} / {int8['mfu']:.0%} "
        f"| {time.perf_counter() - start:.0f} s |",
        flush=True,
      )


if __name__ == "__main__":
  sys.exit(main())
