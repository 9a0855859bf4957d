"""Are FSDP's per-layer all-gathers done one layer at a time, or hoisted to the start of the step?

    python bench/fsdp_gathers.py [--layers 4] [--dim 256]

Compiles the sharded train step of a Llama (weights much larger than its activations) on 8 fake
CPU devices with fsdp=8, for model.scan off/on and each model.remat policy, and prints from the
compiled program: how many all-gathers run at the top level of the step (and how many of those
are scheduled before any matmul, i.e. hoisted) and how many inside a loop body (the scan's while
loop), and XLA's temp bytes per device next to the bytes of one layer's gathered weights and of
all layers' (it sets XLA_FLAGS itself; it trains nothing).
"""

import argparse
import functools
import os
import re

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"

import jax  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from nnx_zoo.common import experiments, models, parallel, tasks  # noqa: E402
from nnx_zoo.common.train import optim
from nnx_zoo.common.train import step as steps
from nnx_zoo.zoo.llama import model as llama  # noqa: E402

DTYPE_BYTES = {"f32": 4, "bf16": 2, "f16": 2, "s32": 4}


def computations(hlo: str) -> dict[str, str]:
  """Computation name -> its body text ("ENTRY" for the entry computation)."""
  out, name, lines = {}, None, []
  for line in hlo.splitlines():
    head = re.match(r"^(ENTRY )?%?([\w.\-]+) .*\{$", line)
    if head:
      name, lines = ("ENTRY" if head[1] else head[2]), []
    elif line.startswith("}") and name:
      out[name] = "\n".join(lines)
      name = None
    elif name:
      lines.append(line)
  return out


def in_loops(comps: dict[str, str]) -> set[str]:
  """The computations run inside a while loop's body (directly or through calls)."""
  callees = {
    name: set(
      re.findall(r"(?:body|condition|to_apply|calls|branch_computations)=\{?%?([\w.\-]+)", t)
    )
    for name, t in comps.items()
  }
  bodies = {b for t in comps.values() for b in re.findall(r"body=%?([\w.\-]+)", t)}
  seen, todo = set(), list(bodies)
  while todo:
    c = todo.pop()
    if c not in seen:
      seen.add(c)
      todo.extend(callees.get(c, ()))
  return seen


def gathers(hlo: str) -> dict[str, list[int]]:
  """Bytes of each all-gather's output, by where it runs: "top" level or "loop" body."""
  comps = computations(hlo)
  loops = in_loops(comps)
  out = {"top": [], "loop": []}
  for name, text in comps.items():
    for dtype, dims in re.findall(r"= (\w+)\[([\d,]*)\]\{[^}]*\} all-gather(?:-start)?\(", text):
      size = DTYPE_BYTES.get(dtype, 4) * int(np.prod([int(d) for d in dims.split(",") if d]))
      out["loop" if name in loops else "top"].append(size)
  return out


def gathered_before_compute(hlo: str) -> int:
  """How many all-gathers the scheduled top level runs before its first matmul or loop."""
  entry = computations(hlo)["ENTRY"].splitlines()
  first = next(
    (i for i, line in enumerate(entry) if re.search(r" (dot|while)\(|calls=%\S*dot", line)),
    len(entry),
  )
  return sum(" all-gather(" in line for line in entry[:first])


def compile_step(cfg, layout):
  tx = optim.optimizer(cfg.optim, cfg.train.steps)
  graphdef = nnx.graphdef(nnx.eval_shape(lambda: models.build(cfg.model)))
  abstract, shardings = steps.placed_abstract_state(cfg, tx, layout)
  B, T = cfg.train.batch_size, cfg.data.seq_len + 1
  batch_sharding = parallel.NamedSharding(layout.mesh, layout.batch_spec)
  batch = {
    k: jax.ShapeDtypeStruct((B, T), np.int32, sharding=batch_sharding)
    for k in ("tokens", "segment_ids")
  }
  step = jax.jit(
    functools.partial(
      steps.train_step, graphdef=graphdef, task=tasks.of(cfg), tx=tx, layout=layout
    ),
    donate_argnums=0,
    out_shardings=(shardings, None),
  )
  return step.lower(abstract, batch).compile()


def main():
  p = argparse.ArgumentParser()
  p.add_argument("--layers", type=int, default=4)
  p.add_argument("--dim", type=int, default=256)
  p.add_argument("--batch-size", type=int, default=8)
  args = p.parse_args()
  cfg = experiments.get_config("lm/shakespeare-char:smoke", {"train.batch_size": "8"})
  cfg.train.batch_size = args.batch_size
  model = llama.config(
    "tiny", dim=args.dim, num_layers=args.layers, num_heads=4, num_kv_heads=4,
    hidden_dim=4 * args.dim, vocab_size=256,
  )  # fmt: skip
  layout = parallel.make_layout({"data": 1, "fsdp": 8, "tensor": 1})
  shapes = nnx.to_flat_state(nnx.state(models.abstract(model), nnx.Param))
  layer = sum(v.size * 4 for k, v in shapes if k[:2] == ("blocks", 0) and v.ndim == 2)
  local_rows = args.batch_size // 8
  print(
    f"llama {args.layers} layers, dim {args.dim}, fsdp=8, {local_rows} row(s) x "
    f"{cfg.data.seq_len} tokens per device; one layer's gathered weights {layer / 2**20:.2f} "
    f"MiB, all {args.layers} layers' {args.layers * layer / 2**20:.2f} MiB"
  )
  print(
    f"{'scan':>5} {'remat':>10} {'gathers top':>12} {'before 1st dot':>14} {'in loop':>8} "
    f"{'top MiB':>8} {'loop MiB':>9} {'temp MiB':>9} {'temp/layer':>10}"
  )
  for scan in (False, True):
    for remat in ("none", "full", "save_dots"):
      cfg.model = model.copy_and_resolve_references()
      cfg.model.scan, cfg.model.remat = scan, remat
      compiled = compile_step(cfg, layout)
      hlo = compiled.as_text()
      g = gathers(hlo)
      temp = compiled.memory_analysis().temp_size_in_bytes
      print(
        f"{scan!s:>5} {remat:>10} {len(g['top']):12d} {gathered_before_compute(hlo):14d} "
        f"{len(g['loop']):8d} "
        f"{sum(g['top']) / 2**20:8.2f} {sum(g['loop']) / 2**20:9.2f} {temp / 2**20:9.2f} "
        f"{temp / layer:10.2f}"
      )


if __name__ == "__main__":
  main()
