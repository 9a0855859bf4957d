"""MoE layer impls vs a dense MLP of the same active size: forward + backward time.

    python bench/moe_layer.py [--tokens 1024,4096] [--impls blocked,ragged,loop] [--rounds 5]

A Mixtral-small layer (E=8 experts, top-2, D=256, F=768, SwiGLU, no shared expert) over B=1 rows
of T tokens, forward and backward (gradients of every parameter and of x), for each
`nnx_zoo.common.nn.moe` impl, and a dense SwiGLU MLP with hidden k * F: the same matmul work as what
one token computes through its k experts. Contenders alternate within each round, so a load change
on a shared machine hits all of them alike; the table gives the median over rounds and the routing
overhead, MoE time / dense time (the target: at most 1.5x). "loop" runs every expert on every
token (E / k = 4x the dense work), "ragged" is `jax.lax.ragged_dot`, "blocked" the padded-block
loop; `impl="auto"` picks the fastest one here for this backend.
"""

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from nnx_zoo.common.nn import mlp, moe

E, TOP_K, D, F = 8, 2, 256, 768


def step_fn(model):
  """jit(fwd + bwd) of sum(y * dy), as a function of (params, x, dy)."""
  graphdef, params = nnx.split(model)

  @jax.jit
  def step(params, x, dy):
    def loss(params, x):
      return jnp.sum(nnx.merge(graphdef, params)(x) * dy)

    return jax.grad(loss, argnums=(0, 1))(params, x)

  return step, params


def contenders(impls: list[str]):
  out = {}
  for impl in impls:
    cfg = moe.config(num_experts=E, top_k=TOP_K, hidden_dim=F, impl=impl)
    out[f"moe {impl}"] = moe.MoE(cfg, D, rngs=nnx.Rngs(0))
  out["dense k*F"] = mlp.MLP(mlp.config("swiglu", hidden_dim=TOP_K * F), D, rngs=nnx.Rngs(0))
  return out


def bench(tokens: int, impls: list[str], rounds: int) -> dict[str, float]:
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.standard_normal((1, tokens, D)), jnp.float32)
  dy = jnp.asarray(rng.standard_normal((1, tokens, D)), jnp.float32)
  steps = {}
  for name, model in contenders(impls).items():
    step, params = step_fn(model)
    jax.block_until_ready(step(params, x, dy))  # compile
    steps[name] = (step, params)
  times = {name: [] for name in steps}
  for _ in range(rounds):
    for name, (step, params) in steps.items():
      t0 = time.perf_counter()
      jax.block_until_ready(step(params, x, dy))
      times[name].append(time.perf_counter() - t0)
  return {name: float(np.median(ts)) * 1e3 for name, ts in times.items()}


def main():
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--tokens", default="1024,4096")
  ap.add_argument("--impls", default="blocked,ragged,loop")
  ap.add_argument("--rounds", type=int, default=5)
  args = ap.parse_args()
  impls = args.impls.split(",")
  print(f"backend {jax.default_backend()}; E={E} top-{TOP_K} D={D} F={F}; fwd+bwd, median ms")
  print(f"{'tokens':>7} {'contender':>14} {'ms':>9} {'MoE / dense':>12}")
  for tokens in map(int, args.tokens.split(",")):
    ms = bench(tokens, impls, args.rounds)
    dense = ms["dense k*F"]
    for name, t in ms.items():
      ratio = f"{t / dense:.2f}x" if name.startswith("moe") else ""
      print(f"{tokens:>7} {name:>14} {t:>9.1f} {ratio:>12}", flush=True)
  print(f"auto picks {moe.resolve_impl('auto')!r} on {jax.default_backend()}")


if __name__ == "__main__":
  main()
