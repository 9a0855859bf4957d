"""The attention paths side by side: the XLA path, blocked attention and the flash kernel, fwd+bwd
time and memory.

    python bench/attention.py [--lengths 512,1024,2048,4096,8192] [--steps 3]
    python bench/attention.py --impls xla,blocked --lengths 256,1024,4096   # blocked vs dense

One causal GQA attention (B=1, N=8, K=2, H=64), forward and backward (dq, dk, dv), at each
sequence length. "xla" is what the shared layer runs by default (`make_mask` +
`attend_in_blocks`: the logits materialised, a block of query rows at a time against the keys
causality lets it see); "xla whole" is the same as one block (`attend`: all [B, N, T, S]
logits); "blocked" is `attention.impl="blocked"` (common/nn/attention_blocked.py: query blocks
of --block rows, an online softmax over key blocks, each block recomputed in the backward pass;
a row of at most one block runs "xla"); "flash" is kernels/flash_attention.py with its default
blocks, compiled on GPU/TPU and in Pallas interpret mode on CPU (the kernel's grid run as XLA
loops, so its CPU time says little about a GPU). On a GPU "cudnn" (`jax.nn.dot_product_attention`)
is measured too. The implementations' steps are timed in turn. Memory is XLA's temp (scratch)
bytes of the compiled step, from `.memory_analysis()`: inputs and outputs, the same for all, are
left out. A run that would exceed --max-temp-gb or --max-step-s (extrapolated from the shorter
length) is not run, and the table says why.
"""

import argparse
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np

from nnx_zoo.common.nn import attention_blocked, attention_ref
from nnx_zoo.kernels import flash_attention as fa

B, N, K, H = 1, 8, 2, 64


def xla_path(q, k, v, *, blocks: bool = True):
  T, S = q.shape[1], k.shape[1]
  ones_BT, ones_BS = jnp.ones((B, T), jnp.int32), jnp.ones((B, S), jnp.int32)
  mask = attention_ref.make_mask(jnp.arange(T), jnp.arange(S), ones_BT, ones_BS, causal=True)
  if not blocks:
    return attention_ref.attend(q, k, v, mask_BTS=mask)
  return attention_ref.attend_in_blocks(q, k, v, mask_BTS=mask, causal=True, window=0)


def blocked_path(q, k, v):
  ones_BT = jnp.ones((B, q.shape[1]), jnp.int32)
  kw = dict(causal=True, window=None)
  return attention_blocked.attend_blocked(q, k, v, q_seg_BT=ones_BT, k_seg_BS=ones_BT, **kw)


def cudnn_path(q, k, v):
  return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")


IMPLS = {
  "xla": xla_path,
  "xla whole": functools.partial(xla_path, blocks=False),
  "blocked": blocked_path,
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
  p.add_argument("--impls", default="", help="comma-separated (default: all on this backend)")
  p.add_argument("--block", type=int, default=0, help="blocked's block (0: its default)")
  p.add_argument("--max-temp-gb", type=float, default=4.0, help="skip a run needing more")
  p.add_argument("--max-step-s", type=float, default=30.0, help="skip a run expected slower")
  args = p.parse_args()
  backend = jax.default_backend()
  dtype = jnp.float32 if backend == "cpu" else jnp.bfloat16
  impls = ["xla", "xla whole", "blocked", "flash"] + (["cudnn"] if backend == "gpu" else [])
  impls = args.impls.split(",") if args.impls else impls
  if args.block:
    attention_blocked.BLOCK = args.block
  mode = "Pallas interpret mode" if backend == "cpu" else "compiled"
  print(
    f"causal attention fwd+bwd, B={B} N={N} K={K} H={H} {jnp.dtype(dtype).name} on {backend} "
    f"({jax.devices()[0].device_kind}); flash: {mode}; median of {args.steps} steps"
  )
  others = [i for i in impls if i != "xla"] if "xla" in impls else []
  head = f"{'T':>6}" + "".join(f" {i + ' ms':>10}" for i in impls)
  head += "".join(f" {i + ' temp MB':>14}" for i in impls)
  head += "".join(f" {i + '/xla time':>15} {i + '/xla temp':>15}" for i in others)
  print(head)
  notes, last = [], {}
  for T in [int(t) for t in args.lengths.split(",")]:
    rng = np.random.default_rng(T)
    q, k, v, do = (
      jnp.asarray(rng.standard_normal(shape), dtype)
      for shape in ((B, T, N, H), (B, T, K, H), (B, T, K, H), (B, T, N, H))
    )
    temps, runnable = {}, {}
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
      runnable[name] = compiled
    # The implementations' steps taken in turn, so a busy machine slows them alike.
    samples = {name: [] for name in runnable}
    for _ in range(args.steps):
      for name, compiled in runnable.items():
        t0 = time.perf_counter()
        jax.block_until_ready(compiled(q, k, v, do))
        samples[name].append(time.perf_counter() - t0)
    times = {name: float(np.median(x)) for name, x in samples.items()}
    for name, t in times.items():
      last[name] = (t, T)
    row = f"{T:>6}" + "".join(
      f" {times[i] * 1e3:>10.1f}" if i in times else f" {'-':>10}" for i in impls
    )
    row += "".join(f" {temps[i] / 2**20:>14.1f}" for i in impls)
    for i in others:
      ratio = times[i] / times["xla"] if {i, "xla"} <= times.keys() else None
      row += f" {ratio:>14.2f}x" if ratio else f" {'-':>15}"
      row += f" {temps[i] / max(temps['xla'], 1):>14.2f}x"
    print(row, flush=True)
  for note in notes:
    print(note)


if __name__ == "__main__":
  main()
