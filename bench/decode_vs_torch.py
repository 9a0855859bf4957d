"""Greedy decoding speed: the zoo's compiled sampling (common/sampling.py) vs Hugging Face
`generate` (use_cache=True) on the same weights, batch 1 and 8, 256 new tokens.

    pip install -e ".[bench]" && python bench/decode_vs_torch.py [--rounds 3] [--new 256]

The model is bench/llama-19m's (LlamaForCausalLM with random weights, saved with
`save_pretrained` and read by `nnx_zoo.common.hub.load`, as a user's HF directory would be). The two
run in turn, `--rounds` times after a warm-up (which compiles the zoo's step), so load from other
processes hits both alike; tokens/s counts new tokens at the median time. The outputs are checked
token for token; where they part, the zoo's gap between its top two logits at that step is shown
(a near-tie that fp32 rounding can flip, or a real difference).
"""

import argparse
import os
import statistics
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

from nnx_zoo.common import engine, hub
from nnx_zoo.experiments.bench.llama_19m import HF_CONFIG


def main():
  p = argparse.ArgumentParser()
  p.add_argument("--rounds", type=int, default=3)
  p.add_argument("--new", type=int, default=256, help="new tokens per sequence")
  p.add_argument("--prompt-len", type=int, default=16)
  p.add_argument("--batches", default="1,8")
  p.add_argument(
    "--hf-dir", help="a Hugging Face directory to use instead (SmolLM2-135M-Instruct: README)"
  )
  args = p.parse_args()

  import torch
  import transformers

  threads = len(os.sched_getaffinity(0))  # what XLA:CPU's thread pool uses
  torch.set_num_threads(threads)
  torch.manual_seed(0)
  if args.hf_dir:
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(args.hf_dir, dtype=torch.float32)
    hf_model = hf_model.eval()
    zoo_model = hub.load(args.hf_dir)
    vocab_size, name = hf_model.config.vocab_size, args.hf_dir
  else:
    hf_model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**HF_CONFIG)).float().eval()
    with tempfile.TemporaryDirectory() as tmp:
      hf_model.save_pretrained(tmp, safe_serialization=True)
      zoo_model = hub.load(tmp)
    vocab_size, name = HF_CONFIG["vocab_size"], "llama-19m"
  print(f"{name} weights, greedy, {args.new} new tokens after a {args.prompt_len}-token prompt")
  print(f"threads: JAX {threads} (XLA:CPU pool), torch {torch.get_num_threads()}")

  rows = []
  for B in [int(b) for b in args.batches.split(",")]:
    prompt = np.random.default_rng(B).integers(0, vocab_size, (B, args.prompt_len))
    prompt_t = torch.from_numpy(prompt.astype(np.int64))

    def zoo(prompt=prompt):
      out = engine.generate(
        zoo_model, prompt, max_new_tokens=args.new, rng=jax.random.key(0), temperature=0
      )
      return np.asarray(jax.block_until_ready(out))

    def hf(prompt_t=prompt_t):
      with torch.no_grad():
        out = hf_model.generate(
          prompt_t,
          attention_mask=torch.ones_like(prompt_t),
          max_new_tokens=args.new,
          min_new_tokens=args.new,  # no stopping at an eos id: the same length as the zoo
          do_sample=False,
          use_cache=True,
          pad_token_id=0,
        )
      return out.numpy()

    t = time.perf_counter()
    zoo_out = zoo()
    zoo_first = time.perf_counter() - t
    hf_out = hf()
    times = {"zoo": [], "HF generate": []}
    for _ in range(args.rounds):
      for name, run in (("zoo", zoo), ("HF generate", hf)):
        t = time.perf_counter()
        run()
        times[name].append(time.perf_counter() - t)
    tps = {n: B * args.new / statistics.median(ts) for n, ts in times.items()}
    same = hf_out.shape == zoo_out.shape and (hf_out == zoo_out).all()
    agree = "all tokens equal" if same else first_difference(zoo_model, zoo_out, hf_out, args)
    rows.append((B, tps["zoo"], tps["HF generate"], zoo_first, agree))

  print("\n| batch | zoo tokens/s | HF generate tokens/s | zoo / HF | zoo first call (compile) s |")
  print("|---|---|---|---|---|")
  for B, z, h, first, _ in rows:
    print(f"| {B} | {z:.0f} | {h:.0f} | {z / h:.1f}x | {first:.1f} |")
  print()
  for B, *_, agree in rows:
    print(f"batch {B}: greedy outputs: {agree}")


def first_difference(zoo_model, zoo_out, hf_out, args) -> str:
  """Where the two greedy sequences first part, and the zoo's top-2 logit gap there."""
  diff = np.argwhere(zoo_out != hf_out)
  row, col = diff[np.lexsort((diff[:, 0], diff[:, 1]))[0]]
  logits = zoo_model(jnp.asarray(zoo_out[row : row + 1, :col]))[0, -1]
  top2 = np.sort(np.asarray(logits))[-2:]
  rows_equal = int((zoo_out == hf_out).all(axis=1).sum())
  return (
    f"{rows_equal}/{len(zoo_out)} rows equal; first difference in row {row} at new token "
    f"{col - args.prompt_len}, where the zoo's top two logits differ by {top2[1] - top2[0]:.2e}"
  )


if __name__ == "__main__":
  main()
