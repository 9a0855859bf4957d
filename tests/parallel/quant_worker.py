"""Run by tests/parallel/test_quant_parallel.py in a subprocess with 8 fake CPU devices: the
loss and gradients of one batch of the tiny Llama with model.quant none, int8 and fp8, on one
device and on data 2 x fsdp 2 x tensor 2 under the trainer's shard_map (check_vma), as JSON."""

import json
import os

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"

import jax  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from nnx_zoo.common import models, parallel  # noqa: E402
from nnx_zoo.zoo.llama import model as llama  # noqa: E402

MODES = ("none", "int8", "fp8")


def loss_sum(graphdef, params, tokens_BT, segment_ids_BT):
  """The summed next-token cross-entropy of a batch's rows (vocab-parallel under tensor)."""
  model = nnx.merge(graphdef, params)
  logits = model(tokens_BT[:, :-1], segment_ids_BT=segment_ids_BT[:, :-1])
  return parallel.cross_entropy(logits, tokens_BT[:, 1:]).sum()


def main():
  rng = np.random.default_rng(0)
  B, T = 8, 33
  tokens = rng.integers(0, 256, (B, T)).astype(np.int32)
  segments = np.where(np.arange(T) < T // 3, 1, 2).astype(np.int32)[None].repeat(B, 0)
  layout = parallel.make_layout({"data": 2, "fsdp": 2, "tensor": 2})
  out = {}
  for mode in MODES:
    cfg = llama.config("tiny", vocab_size=256)
    cfg.quant = mode
    graphdef, params = nnx.split(models.build(cfg), nnx.Param)
    single = jax.jit(jax.value_and_grad(lambda p, t, s, g=graphdef: loss_sum(g, p, t, s)))
    specs = layout.param_specs(params)

    def local(params, tokens, segments, graphdef=graphdef):
      with parallel.active(layout):
        loss, grads = jax.value_and_grad(loss_sum, argnums=1)(graphdef, params, tokens, segments)
      return parallel.token_sum(loss), grads

    sharded = jax.jit(
      jax.shard_map(
        local,
        mesh=layout.mesh,
        in_specs=(specs, layout.batch_spec, layout.batch_spec),
        out_specs=(parallel.P(), specs),
        check_vma=True,
      )
    )
    placed = jax.device_put(params, layout.shardings(specs))
    rows = jax.sharding.NamedSharding(layout.mesh, layout.batch_spec)
    for name, fn, args in (
      ("single", single, (params, tokens, segments)),
      ("mesh", sharded, (placed, *(jax.device_put(x, rows) for x in (tokens, segments)))),
    ):
      loss, grads = fn(*args)
      flat = {"/".join(map(str, k)): np.asarray(v).tolist() for k, v in nnx.to_flat_state(grads)}
      out[f"{mode} {name}"] = {"loss": float(loss), "grads": flat}
  print(json.dumps(out))


if __name__ == "__main__":
  main()
