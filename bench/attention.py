"""Flash attention kernel vs the XLA attention path: fwd+bwd time and memory, side by side.

    python bench/attention.py [--lengths 512,1024,2048,4096,8192] [--steps 3]

One causal GQA attention (B=1, N=8, K=2, H=64), forward and backward (dq, dk, dv), at each
sequence length. "xla" is what the shared layer runs by default (`make_mask` +
`attend_in_blocks`: the logits materialised, a block of query rows at a time against the keys
causality lets it see); "xla whole" is the same as one block (`attend`: all [B, N, T, S]
logits); "flash" is kernels/flash_attention.py with its default blocks, compiled on GPU/TPU and
in Pallas interpret mode on CPU (the kernel's grid run as XLA loops, so its CPU time says little
about a GPU). On a GPU "cudnn" (`jax.nn.dot_product_attention`) is measured too. Memory is XLA's
temp (scratch) bytes of the compiled step, from `.memory_analysis()`: inputs and outputs, the
same for all, are left out. A run that would exceed --max-temp-gb or --max-step-s (extrapolated
from the shorter length) is not run, and the table says why.
"""

import argparse
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np

from nnx_zoo.common.nn import attention_ref
from nnx_zoo.kernels import flash_attention as fa

B, N, K, H = 1, 8, 2, 64


def xla_path(q, k, v, *, blocks: bool = True):
  T, S = q.shape[1], k.shape[1]
  ones_BT, ones_BS = jnp.ones((B, T), jnp.int32), jnp.ones((B, S), jnp.int32)
  mask = attention_ref.make_mask(jnp.arange(T), jnp.arange(S), ones_BT, ones_BS, causal=True)
  if not blocks:
    return attention_ref.attend(q, k, v, mask_BTS=mask)
  return attention_ref.attend_in_blocks(q, k, v, mask_BTS=mask, causal=True, window=0)


def cudnn_path(q, k, v):
  return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")


IMPLS = {
  "xla": xla_path,
  "xla whole": functools.partial(xla_path, blocks=False),
  "flash": functools.partial(fa.flash_attention, causal=True),
  "cudnn": cudnn_path,
}


def compile_step(fn, q, k, v, do):
  @jax.jit
  def step(q, k, v, do):
    _, vjp = jax.vjp(fn, q, k, v)
    return vjp(do)

  return step.lower(q, k, v, do).compile()


def main():
  p = argparse.ArgumentParser()
  p.add_argument("--lengths", default="512,1024,2048,4096,8192")
  p.add_argument("--steps", type=int, default=3, help="timed steps (median), after one warm-up")
  p.add_argument("--max-temp-gb", type=float, default=4.0, help="skip a run needing more")
  p.add_argument("--max-step-s", type=float, default=30.0, help="skip a run expected slower")
  args = p.parse_args()
  backend = jax.default_backend()
  dtype = jnp.float32 if backend == "cpu" else jnp.bfloat16
  impls = ["xla", "xla whole", "flash"] + (["cudnn"] if backend == "gpu" else [])
  mode = "Pallas interpret mode" if backend == "cpu" else "compiled"
  print(
    f"causal attention fwd+bwd, B={B} N={N} K={K} H={H} {jnp.dtype(dtype).name} on {backend} "
    f"({jax.devices()[0].device_kind}); flash: {mode}; median of {args.steps} steps"
  )
  head = f"{'T':>6}" + "".join(f" {i + ' ms':>10}" for i in impls)
  head += "".join(f" {i + ' temp MB':>14}" for i in impls) + f" {'xla/flash time':>14}"
  head += f" {'xla/flash temp':>14}"
  print(head)
  notes, last = [], {}
  for T in [int(t) for t in args.lengths.split(",")]:
    rng = np.random.default_rng(T)
    q, k, v, do = (
      jnp.asarray(rng.standard_normal(shape), dtype)
      for shape in ((B, T, N, H), (B, T, K, H), (B, T, K, H), (B, T, N, H))
    )
    times, temps = {}, {}
    for name in impls:
      compiled = compile_step(IMPLS[name], q, k, v, do)
      temps[name] = compiled.memory_analysis().temp_size_in_bytes
      # Causal attention's work grows as T^2: estimate this length from the last one.
      expected = last.get(name, (0.0, T))[0] * (T / last.get(name, (0.0, T))[1]) ** 2
      if temps[name] > args.max_temp_gb * 2**30:
        notes.append(f"T={T} {name}: not run, needs {temps[name] / 2**30:.1f} GB of temp memory")
        continue
      if expected > args.max_step_s:
        notes.append(f"T={T} {name}: not run, expected ~{expected:.0f} s a step (T^2 from below)")
        continue
      jax.block_until_ready(compiled(q, k, v, do))
      samples = []
      for _ in range(args.steps):
        t0 = time.perf_counter()
        jax.block_until_ready(compiled(q, k, v, do))
        samples.append(time.perf_counter() - t0)
      times[name] = float(np.median(samples))
      last[name] = (times[name], T)
    row = f"{T:>6}" + "".join(
      f" {times[i] * 1e3:>10.1f}" if i in times else f" {'-':>10}" for i in impls
    )
    row += "".join(f" {temps[i] / 2**20:>14.1f}" for i in impls)
    ratio = times["xla"] / times["flash"] if {"xla", "flash"} <= times.keys() else None
    row += f" {ratio:>13.2f}x" if ratio else f" {'-':>14}"
    row += f" {temps['xla'] / temps['flash']:>13.1f}x"
    print(row, flush=True)
  for note in notes:
    print(note)


if __name__ == "__main__":
  main()
