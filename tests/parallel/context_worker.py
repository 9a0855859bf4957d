"""Run by tests/parallel/test_context_parallel.py in a subprocess with 8 fake CPU devices: the
loss, gradients and auxiliary losses of one batch of each decoder family on meshes that split
the rows' tokens over `context` (mixed with data, fsdp, expert and tensor), and the same on one
device, printed as JSON. With `:blocked`, the family
with `attention.impl="blocked"` on meshes of data, fsdp and tensor instead."""

import json
import os
import sys

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"

import jax  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from nnx_zoo.common import (  # noqa: E402
  experiments,
  mesh,
  models,
  parallel,
  tasks,  # noqa: E402
)
from nnx_zoo.common.nn import attention_blocked  # noqa: E402
from nnx_zoo.common.train import step as steps  # noqa: E402
from nnx_zoo.zoo.gpt2 import model as gpt2  # noqa: E402

TASK = tasks.get("language_model")  # the task of every batch here

# (data, fsdp, expert, context, tensor): every family on context alone and on context with
# the others; the char model on more.
MESHES = {
  "all": [(1, 1, 1, 8, 1), (1, 2, 1, 2, 2)],
  "more": [(1, 1, 1, 8, 1), (2, 1, 1, 2, 2), (1, 2, 1, 4, 1), (1, 2, 1, 2, 2)],
  "moe": [(1, 1, 1, 8, 1), (1, 1, 2, 2, 2), (2, 1, 2, 2, 1)],
  # attention.impl="blocked": the heads split over tensor, the rows over data and fsdp.
  "blocked": [(4, 1, 1, 1, 2), (1, 4, 1, 1, 2), (2, 2, 1, 1, 2)],
}
# The decoder families and what each brings to attention: RoPE and GQA (the char model), a
# sliding window on every other layer, soft-caps and a chunked loss (Gemma 2), QK-norm and a
# local RoPE theta (Gemma 3), learned absolute positions (GPT-2), routed experts with their
# load-balancing loss (Qwen3 MoE).
FAMILIES = {
  "llama": ("lm/shakespeare-char:smoke", "more"),
  "gemma2": ("lm/gemma2-2b:smoke", "all"),
  "gemma3": ("lm/gemma3-1b:smoke", "all"),
  "gpt2": ("lm/shakespeare-char:smoke", "all"),
  "qwen3-moe": ("lm/qwen3-30b-a3b:smoke", "moe"),
}


def flat(tree):
  return {"/".join(map(str, k)): np.asarray(v).tolist() for k, v in nnx.to_flat_state(tree)}


def config(family: str, *, scan: bool):
  exp, _ = FAMILIES[family]
  cfg = experiments.get_config(exp, {"train.batch_size": "4"})
  if family == "gpt2":
    cfg.model = gpt2.config("tiny", vocab_size=cfg.model.vocab_size, max_len=64)
  cfg.data.seq_len = 32
  cfg.train.micro_batches = 1
  if scan:
    cfg.model.scan, cfg.model.remat = True, "full"
  return cfg


def batch_of(cfg) -> dict:
  rng = np.random.default_rng(0)
  B, T = cfg.train.batch_size, cfg.data.seq_len + 1
  tokens = rng.integers(0, cfg.model.vocab_size, (B, T)).astype(np.int32)
  # Documents of different lengths in each row (one ending mid-chunk), and padding at the end
  # of the last row: segment masks, per-document positions and weights are exercised too.
  segments = np.where(np.arange(T) < 11, 1, 2).astype(np.int32)[None].repeat(B, 0)
  segments[1] = np.where(np.arange(T) < 20, 1, 2)
  segments[-1, -5:] = 0
  return {"tokens": tokens, "segment_ids": segments}


def run(family: str, *, scan: bool, ring: bool, blocked: bool = False) -> dict:
  cfg = config(family, scan=scan)
  meshes = MESHES[FAMILIES[family][1]]
  if blocked:  # every layer kind's attention; rows of 32 in blocks of 8 (4 query blocks)
    cfg.model.attention.impl, attention_blocked.BLOCK = "blocked", 8
    meshes = MESHES["blocked"]
  if ring:  # every layer kind's attention: the kinds' overrides are merged into it
    cfg.model.attention.context_impl = "ring"
    # Rows of 1,024 on 4 context devices: 256 queries a device, run in blocks at each step.
    cfg.data.seq_len, cfg.train.batch_size = 1024, 2
  model = models.build(cfg.model, seed=cfg.seed)
  graphdef, params = nnx.split(model, nnx.Param)
  batch = batch_of(cfg)

  def result(sums, grads):
    return {
      "total": float(sums["total"]),
      "count": float(sums["count"]),
      "aux": {k: float(v) for k, v in sums["aux"].items()},
      "grads": flat(grads),
    }

  out = {
    "single": result(
      *jax.jit(steps.sums_and_grads, static_argnames=("graphdef", "task"))(
        params, batch, graphdef=graphdef, task=TASK
      )
    )
  }
  for sizes in [(1, 1, 1, 4, 1), (1, 2, 1, 4, 1)] if ring else meshes:
    n = int(np.prod(sizes))
    layout = parallel.make_layout(dict(zip(mesh.AXES[1:], sizes, strict=True)), jax.devices()[:n])
    placed = jax.device_put(params, layout.shardings(layout.param_specs(params)))
    fn = jax.jit(
      lambda p, b, layout=layout: steps.sharded_sums_and_grads(
        p, b, graphdef=graphdef, task=TASK, layout=layout
      )
    )
    placed_batch = steps.put_batch(batch, layout, TASK)
    out[str(sizes)] = result(*fn(placed, placed_batch))
    # What each device was fed: its share of the next-token rows, made on the host (without
    # context, whole rows: their inputs are all tokens but the last).
    if "next_token" in placed_batch:
      inputs = placed_batch["next_token"]["inputs"]
    else:
      inputs = placed_batch["tokens"][:, :-1]
    out[str(sizes)]["fed"] = sorted({tuple(s.data.shape) for s in inputs.addressable_shards})
    # How the layers attend across devices: the collectives in the lowered step.
    text = fn.lower(placed, placed_batch).as_text()
    out[str(sizes)]["collectives"] = {
      op: text.count(op) for op in ("collective_permute", "all_gather")
    }
  return out


def main(which: list[str]):
  """`which`: families, each optionally `:scan` (scanned, rematerialised), `:ring` or
  `:blocked`."""
  out = {}
  for name in which:
    family, _, how = name.partition(":")
    out[name] = run(family, scan=how == "scan", ring=how == "ring", blocked=how == "blocked")
  print(json.dumps(out))


if __name__ == "__main__":
  main(sys.argv[1:])
