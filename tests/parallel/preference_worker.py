"""Run by tests/parallel/test_preference_parallel.py in a subprocess with 8 fake CPU devices: the
dpo task's summed loss and gradients of one batch of pairs on several meshes and on one device
(its reference log-probabilities set at random: they only shift each pair's margin), as JSON."""

import json
import os

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"

import jax  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from nnx_zoo.common import experiments, parallel, tasks  # noqa: E402
from nnx_zoo.common.train import optim, trainer  # noqa: E402
from nnx_zoo.common.train import step as steps  # noqa: E402

MESHES = [(8, 1, 1), (2, 4, 1), (2, 2, 2)]  # (data, fsdp, tensor)


def main():
  cfg = experiments.get_config("chat/shakespeare-dialogue-dpo:smoke", {"train.batch_size": "16"})
  tx = optim.optimizer(cfg.optim, cfg.train.steps)
  graphdef, state = steps.init_state(cfg, tx)
  batch = {k: np.array(v) for k, v in next(trainer.load_data(cfg).iterator).items()}
  batch["reference"] = np.random.default_rng(0).normal(-200, 5, (16, 2)).astype(np.float32)
  for k in ("tokens", "segment_ids", "loss_weights"):  # two pairs of padding: counted nowhere
    batch[k][-2:] = 0
  task = tasks.of(cfg)

  def flat(grads):
    return {"/".join(map(str, k)): np.asarray(v).tolist() for k, v in nnx.to_flat_state(grads)}

  def result(sums, grads):
    return {"total": float(sums["total"]), "count": float(sums["count"]), "grads": flat(grads)}

  sums, grads = jax.jit(lambda p, b: steps.sums_and_grads(p, b, graphdef=graphdef, task=task))(
    state.params, batch
  )
  out = {"single": result(sums, grads)}
  for sizes in MESHES:
    layout = parallel.make_layout(dict(zip(("data", "fsdp", "tensor"), sizes, strict=True)))
    _, shardings = steps.placed_abstract_state(cfg, tx, layout)
    params = jax.device_put(state.params, shardings.params)
    fn = jax.jit(
      lambda p, b, layout=layout: steps.sharded_sums_and_grads(
        p, b, graphdef=graphdef, task=task, layout=layout
      )
    )
    out[str(sizes)] = result(*fn(params, steps.put_batch(batch, layout, task)))
  print(json.dumps(out))


if __name__ == "__main__":
  main()
