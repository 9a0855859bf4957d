"""Step time and per-device memory of one experiment on each mesh, side by side in one run.

    python bench/parallel_meshes.py [EXP] [--steps N]
    python bench/parallel_meshes.py --context [--seq-len 2048]
    python bench/parallel_meshes.py --pipeline

Runs on 8 fake CPU devices (it sets XLA_FLAGS itself). Prints, per mesh (data, fsdp, expert,
context, tensor): the median train-step time relative to the same step on the first mesh, the
bytes of params + optimizer state one device holds, and XLA's temp (activation) bytes per
device. On fake CPU devices the times show the cost of the collectives, not a speed-up: all 8
"devices" share the same cores. `--context`: two rows of `--seq-len` tokens, one a device on
`data=2`, then each row's tokens split 2, 4 ways over `context` (and fsdp beside it): the
activations a device holds, side by side with context = 1. `--pipeline`: the model with 8
layers, stacked and rematerialised, in 2, 4 and 8 stages (pipeline, data, fsdp, expert, context,
tensor) beside FSDP alone over the 8 devices.
"""

import argparse
import functools
import os
import time

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"

import jax  # noqa: E402
import numpy as np  # noqa: E402

from nnx_zoo.common import experiments, mesh, parallel, tasks  # noqa: E402
from nnx_zoo.common.train import optim  # noqa: E402
from nnx_zoo.common.train import step as steps  # noqa: E402

# (data, fsdp, expert, context, tensor)
MESHES = [
  (1, 1, 1, 1, 1),
  (8, 1, 1, 1, 1),
  (1, 8, 1, 1, 1),
  (2, 2, 1, 1, 2),
  (1, 4, 1, 1, 2),
  (1, 1, 1, 1, 2),
  (1, 2, 1, 4, 1),
]
# (pipeline, data, fsdp, expert, context, tensor): FSDP alone first
PIPELINE_MESHES = [
  (1, 1, 8, 1, 1, 1),
  (2, 1, 4, 1, 1, 1),
  (4, 1, 2, 1, 1, 1),
  (4, 2, 1, 1, 1, 1),
  (8, 1, 1, 1, 1, 1),
]
CONTEXT_MESHES = [(2, 1, 1, 1, 1), (2, 1, 1, 2, 1), (2, 1, 1, 4, 1), (1, 2, 1, 4, 1)]


def measure(cfg, sizes, rounds):
  tx = optim.optimizer(cfg.optim, cfg.train.steps)
  graphdef, state = steps.init_state(cfg, tx)
  n = int(np.prod(sizes))
  layout = None
  if n > 1:
    axes = mesh.AXES if len(sizes) == len(mesh.AXES) else mesh.AXES[1:]
    layout = parallel.experiment_layout(cfg, dict(zip(axes, sizes, strict=True)), jax.devices()[:n])
  _, shardings = steps.placed_abstract_state(cfg, tx, layout)
  state = jax.device_put(state, shardings)
  rng = np.random.default_rng(0)
  B, T = cfg.train.batch_size, cfg.data.seq_len + 1
  batch = {
    "tokens": rng.integers(0, cfg.model.vocab_size, (B, T)).astype(np.int32),
    "segment_ids": np.ones((B, T), np.int32),
  }
  batch = steps.put_batch(batch, layout)
  step = jax.jit(
    functools.partial(
      steps.train_step, graphdef=graphdef, task=tasks.of(cfg), tx=tx, layout=layout
    ),
    donate_argnums=0,
    out_shardings=(shardings, None),
  )
  compiled = step.lower(state, batch).compile()
  temp = compiled.memory_analysis().temp_size_in_bytes
  state, m = step(state, batch)
  jax.block_until_ready(m)
  times = []
  for _ in range(rounds):
    t = time.perf_counter()
    state, m = step(state, batch)
    jax.block_until_ready(m)
    times.append(time.perf_counter() - t)
  state_bytes = sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(state))
  return float(np.median(times)), state_bytes, temp


def main():
  p = argparse.ArgumentParser()
  p.add_argument("exp", nargs="?", default="lm/llama3-8b:smoke")
  p.add_argument("--steps", type=int, default=10)
  p.add_argument("--batch-size", type=int, default=16)
  p.add_argument("--context", action="store_true", help="long rows split over mesh.context")
  p.add_argument("--seq-len", type=int, default=2048, help="the rows' length with --context")
  p.add_argument("--pipeline", action="store_true", help="stages over mesh.pipeline vs FSDP")
  args = p.parse_args()
  overrides = {"train.batch_size": "2" if args.context else str(args.batch_size)}
  if args.context:
    overrides.update({"data.seq_len": str(args.seq_len), "model.remat": "full"})
  if args.pipeline:
    overrides.update({"model.num_layers": "8", "model.scan": "True", "model.remat": "full"})
  cfg = experiments.get_config(args.exp, overrides)
  if cfg.model.attention.num_kv_heads % 2:
    cfg.model.attention.num_kv_heads = 2  # so tensor=2 fits (the smoke GQA ratio is 4:1)
  print(
    f"{args.exp}, batch {cfg.train.batch_size} x {cfg.data.seq_len}, median of {args.steps} steps"
  )
  axes = "mesh (p,d,f,e,c,t)" if args.pipeline else "mesh (d,f,e,c,t)"
  print(f"{axes:>18} {'step ms':>8} {'vs first':>8} {'state KB/dev':>13} {'temp MB/dev':>12}")
  base = None
  meshes = CONTEXT_MESHES if args.context else PIPELINE_MESHES if args.pipeline else MESHES
  for sizes in meshes:
    t, state_bytes, temp = measure(cfg, sizes, args.steps)
    base = base or t
    print(
      f"{str(sizes):>18} {t * 1e3:8.1f} {t / base:8.2f} {state_bytes / 1024:13.1f} "
      f"{temp / 2**20:12.2f}"
    )


if __name__ == "__main__":
  main()
