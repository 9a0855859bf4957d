"""How a scanned step's planned temporaries grow with the layers: `zoo plan` (memory
only) of one recipe on one TPU slice at two depths, and the growth per layer in bytes and in
units of one layer's fp32 parameter shard (the params' own growth per layer).

  python bench/scan_growth.py                    # Qwen3-30B-A3B on v5e-64, 12 and 48 layers
  python bench/scan_growth.py --recipe lm/mixtral-8x7b --layers 8 32

The mesh is given (`--set`), not the recipe's rule, so that a slice the recipe has no rule for
(a v5e-64 for the MoE recipes) is planned with the same levers as the ones it has: v5e's rule
of `nnx_zoo.common.mesh.tpu_rules` (fsdp=16 tensor=4, micro 32, splash attention, remat=full,
scan).
"""

import argparse

from nnx_zoo.common import plan

V5E = (
  "mesh.data=1",
  "mesh.fsdp=16",
  "mesh.tensor=4",
  "mesh.expert=1",
  "train.micro_batches=32",
  "model.attention.impl=flash",
  "model.remat=full",
  "model.scan=True",
)


def measure(recipe: str, topology: str, layers: int, sets) -> dict:
  overrides = dict(s.split("=", 1) for s in sets)
  cfg = plan.config(recipe, topology, {**overrides, "model.num_layers": str(layers)})
  return plan.plan(cfg, topology, estimate_time=False)


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--recipe", default="lm/qwen3-30b-a3b")
  p.add_argument("--topology", default="v5e-64")
  p.add_argument("--layers", nargs=2, type=int, default=(12, 48))
  p.add_argument("--set", nargs="*", default=V5E, help="config overrides KEY=VALUE")
  args = p.parse_args(argv)
  rows = {n: measure(args.recipe, args.topology, n, args.set) for n in args.layers}
  for n, r in rows.items():
    print(
      f"{args.recipe} on {args.topology}, {n} layers: params {r['param_bytes'] / plan.GiB:.2f}, "
      f"optimizer {r['optimizer_bytes'] / plan.GiB:.2f}, temporaries "
      f"{r['temp_bytes'] / plan.GiB:.2f}, total {r['total_bytes'] / plan.GiB:.2f} of "
      f"{r['hbm_bytes'] / plan.GiB:.0f} GiB ({'fits' if r['fits'] else 'does not fit'})"
    )
  (a, ra), (b, rb) = rows.items()
  layer = (rb["param_bytes"] - ra["param_bytes"]) / (b - a)  # one layer's fp32 shard
  grow = (rb["temp_bytes"] - ra["temp_bytes"]) / (b - a)
  fixed = ra["temp_bytes"] - a * grow
  print(
    f"temporaries grow {grow / plan.GiB:.3f} GiB a layer = {grow / layer:.2f}x a layer's fp32 "
    f"shard ({layer / 2**20:.0f} MiB); {fixed / plan.GiB:.2f} GiB do not grow"
  )


if __name__ == "__main__":
  main()
