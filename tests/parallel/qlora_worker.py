"""Run by tests/parallel/test_qlora_parallel.py in a subprocess with 8 fake CPU devices: the loss
and the adapters' gradients of one batch of a tiny QLoRA Llama (an nf4 base), on one device and
on data 2 x fsdp 4 under the trainer's shard_map (check_vma), as JSON; then whether placing a
model whose quantization blocks fsdp 4 cannot split is refused in one line (`qlora.check_mesh`)."""

import json
import os

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"

import jax  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from nnx_zoo.common import models, parallel  # noqa: E402
from nnx_zoo.common.errors import UserError  # noqa: E402
from nnx_zoo.common.nn import lora, qlora  # noqa: E402
from nnx_zoo.zoo.llama import model as llama  # noqa: E402

# Every block input dim a multiple of 64 x 4: its rows of scales split over fsdp 4.
WIDE = dict(dim=256, hidden_dim=512, num_layers=2, num_heads=4, num_kv_heads=2, vocab_size=256)


def loss_sum(graphdef, trained, rest, tokens_BT):
  """The summed next-token cross-entropy of a batch's rows (vocab-parallel under tensor)."""
  model = nnx.merge(graphdef, trained, rest)
  logits = model(tokens_BT[:, :-1])
  return parallel.cross_entropy(logits, tokens_BT[:, 1:]).sum()


def main():
  tokens = np.random.default_rng(0).integers(0, 256, (8, 33)).astype(np.int32)
  layout = parallel.make_layout({"data": 2, "fsdp": 4})
  cfg = llama.config("tiny", **WIDE)
  cfg.lora = lora.config(rank=4, targets="attn.*,mlp.*", base_quant="nf4")
  model = models.build(cfg, seed=1)
  for _, node in nnx.iter_graph(model):  # B nonzero, so the gradients reach every adapter
    if isinstance(node, lora.LoRAParam):
      node[...] = node[...] + 0.01
  graphdef, trained, rest = nnx.split(model, lora.trainable(cfg), ...)
  grad = jax.value_and_grad(loss_sum, argnums=1)
  out = {"single": jax.jit(lambda t, r, x: grad(graphdef, t, r, x))(trained, rest, tokens)}

  specs = (layout.param_specs(trained), layout.param_specs(rest))
  qlora.check_mesh(rest, layout)  # divisible: no error

  def local(trained, rest, tokens):
    with parallel.active(layout):
      loss, grads = grad(graphdef, trained, rest, tokens)
    return parallel.token_sum(loss), grads

  sharded = jax.jit(
    jax.shard_map(
      local,
      mesh=layout.mesh,
      in_specs=(*specs, layout.batch_spec),
      out_specs=(parallel.P(), specs[0]),
      check_vma=True,
    )
  )
  placed = [
    jax.device_put(p, layout.shardings(s)) for p, s in zip((trained, rest), specs, strict=True)
  ]
  rows = jax.sharding.NamedSharding(layout.mesh, layout.batch_spec)
  out["mesh"] = sharded(*placed, jax.device_put(tokens, rows))
  result = {
    name: {
      "loss": float(loss),
      "grads": {"/".join(map(str, k)): np.asarray(v).tolist() for k, v in nnx.to_flat_state(g)},
    }
    for name, (loss, g) in out.items()
  }

  narrow = llama.config("tiny", **{**WIDE, "dim": 128})  # 2 rows of scales over fsdp 4
  narrow.lora = lora.config(rank=4, targets="attn.*,mlp.*", base_quant="nf4")
  abstract = nnx.state(models.abstract(narrow), nnx.Param)
  try:
    qlora.check_mesh(abstract, layout)
    result["refused"] = ""
  except UserError as e:
    result["refused"] = str(e)
  print(json.dumps(result))


if __name__ == "__main__":
  main()
