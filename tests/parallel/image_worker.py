"""Run by tests/parallel/test_image_parallel.py in a subprocess with 8 fake CPU devices: the
summed loss and gradients of one batch of a task whose rows are whole examples (ViT
classification, CLIP's contrastive loss over the global batch, DiT, DPO's pairs) on several
meshes and on one device, printed as JSON."""

import json
import os
import sys

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"

import jax  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from nnx_zoo.common import experiments, parallel, tasks  # noqa: E402
from nnx_zoo.common.train import optim, trainer  # noqa: E402
from nnx_zoo.common.train import step as steps  # noqa: E402

MESHES = [(8, 1, 1), (2, 4, 1), (2, 2, 2)]  # (data, fsdp, tensor)


def main(exp: str):
  cfg = experiments.get_config(exp, {"train.batch_size": "16"})
  tx = optim.optimizer(cfg.optim, cfg.train.steps)
  graphdef, state = steps.init_state(cfg, tx)
  batch = {k: np.array(v) for k, v in next(trainer.load_data(cfg).iterator).items()}
  if "weights" in batch:  # images: padding rows, neither scored nor negatives, on any mesh
    batch["weights"][-3:] = 0.0
  else:  # DPO's pairs: three of padding, and reference log-probabilities (at random: they
    # only shift each pair's margin)
    for k in ("tokens", "segment_ids", "loss_weights"):
      batch[k][-3:] = 0
    batch["reference"] = np.random.default_rng(0).normal(-200, 5, (16, 2)).astype(np.float32)

  def flat(grads):
    return {"/".join(map(str, k)): np.asarray(v).tolist() for k, v in nnx.to_flat_state(grads)}

  sums, grads = jax.jit(
    lambda p, b: steps.sums_and_grads(p, b, graphdef=graphdef, task=tasks.of(cfg))
  )(state.params, batch)
  out = {
    "single": {"total": float(sums["total"]), "count": float(sums["count"]), "grads": flat(grads)}
  }
  for sizes in MESHES:
    layout = parallel.make_layout(dict(zip(("data", "fsdp", "tensor"), sizes, strict=True)))
    _, shardings = steps.placed_abstract_state(cfg, tx, layout)
    params = jax.device_put(state.params, shardings.params)
    fn = jax.jit(
      lambda p, b, layout=layout: steps.sharded_sums_and_grads(
        p, b, graphdef=graphdef, task=tasks.of(cfg), layout=layout
      )
    )
    sums, grads = fn(params, steps.put_batch(batch, layout, tasks.of(cfg)))
    out[str(sizes)] = {
      "total": float(sums["total"]),
      "count": float(sums["count"]),
      "grads": flat(grads),
    }
  print(json.dumps(out))


if __name__ == "__main__":
  main(sys.argv[1])
