"""Run by tests/parallel/test_expert_parallel.py in a subprocess with 8 fake CPU devices: the
real step's sums and gradients of one batch of lm/shakespeare-moe:smoke (4 experts, top-2) on
meshes with an expert axis and on one device, printed as JSON."""

import json
import os
import sys

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"

import jax  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from nnx_zoo.common import experiments, models, parallel, tasks  # noqa: E402
from nnx_zoo.common.nn import stacking  # noqa: E402
from nnx_zoo.common.train import optim  # noqa: E402
from nnx_zoo.common.train import step as steps  # noqa: E402

TASK = tasks.get("language_model")  # the task of every batch here

# (data, fsdp, expert, tensor): expert 4 and 2, with data, fsdp and tensor beside it.
MESHES = [(2, 1, 4, 1), (1, 2, 2, 2), (1, 1, 4, 2), (2, 2, 2, 1)]


def main(exp: str):
  cfg = experiments.get_config(exp, {"train.batch_size": "8"})
  tx = optim.optimizer(cfg.optim, cfg.train.steps)
  graphdef, state = steps.init_state(cfg, tx)
  rng = np.random.default_rng(0)
  B, T = cfg.train.batch_size, cfg.data.seq_len + 1
  tokens = rng.integers(0, cfg.model.vocab_size, (B, T)).astype(np.int32)
  segments = np.where(np.arange(T) < T // 3, 1, 2).astype(np.int32)[None].repeat(B, 0)
  batch = {"tokens": tokens, "segment_ids": segments}

  def result(sums, grads):
    return {
      "total": float(sums["total"]),
      "count": float(sums["count"]),
      "aux": {k: float(v) for k, v in sums["aux"].items()},
      "grads": {"/".join(map(str, k)): np.asarray(v).tolist() for k, v in nnx.to_flat_state(grads)},
    }

  out = {
    "single": result(
      *jax.jit(lambda p, b: steps.sums_and_grads(p, b, graphdef=graphdef, task=TASK))(
        state.params, batch
      )
    )
  }
  scanned = cfg.model.copy_and_resolve_references()
  scanned.scan, scanned.remat = True, "save_dots"
  scan_model = nnx.eval_shape(lambda: models.build(scanned))
  scan_graphdef = nnx.graphdef(scan_model)
  # The same values stored stacked (model.scan): the gradients come back one tree per layer.
  scan_params = stacking.match_layers(state.params, nnx.state(scan_model, nnx.Param))
  runs = [(str(sizes), sizes, graphdef, state.params) for sizes in MESHES]
  # The MoE in a scanned body.
  runs.append(("(1, 2, 2, 2) scan", (1, 2, 2, 2), scan_graphdef, scan_params))
  for name, sizes, gd, run_params in runs:
    axes = ("data", "fsdp", "expert", "tensor")
    layout = parallel.make_layout(dict(zip(axes, sizes, strict=True)))
    params = jax.device_put(run_params, layout.shardings(layout.param_specs(run_params)))
    fn = jax.jit(
      lambda p, b, layout=layout, gd=gd: steps.sharded_sums_and_grads(
        p, b, graphdef=gd, task=TASK, layout=layout
      )
    )
    sums, grads = fn(params, steps.put_batch(batch, layout))
    out[name] = result(sums, stacking.unstack_layers(grads))
    # Each weight's placement and the shape of one device's shard: the experts apart.
    placed = {
      "/".join(map(str, k)): [str(v.sharding.spec), list(v.addressable_shards[0].data.shape)]
      for k, v in nnx.to_flat_state(params)
    }
    expert = lambda key: key.split("/")[-1] in ("gate", "up", "down") and "mlp" in key
    out[name]["experts"] = {k: v for k, v in placed.items() if expert(k)}
    out[name]["others"] = {k: v for k, v in placed.items() if not expert(k)}
  print(json.dumps(out))


if __name__ == "__main__":
  main(sys.argv[1])
