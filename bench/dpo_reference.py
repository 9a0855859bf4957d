"""DPO's reference log-probabilities: precomputed once for every pair, or computed for each
batch (what the dpo task does: a forward pass before the step), side by side in one run.

Times, at chat/shakespeare-dialogue-dpo's shapes (its model, batch and rows): the gradient step
of the DPO loss with the reference read from the batch; the reference's forward pass of one
batch (the dpo task's cost per step); the same step with that forward inside it (stop_gradient,
a second copy of the weights: what fusing it into the step would give); and what precomputing
costs, the forward pass once per pair of both splits rather than once per visit, spread over
the recipe's steps.

  python bench/dpo_reference.py [--steps 10] [--exp chat/shakespeare-dialogue-dpo]
"""

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from nnx_zoo.common import experiments, models
from nnx_zoo.common.tasks import preference
from nnx_zoo.common.train import trainer


def timed(fn, *args, steps: int) -> float:
  jax.block_until_ready(fn(*args))  # compile
  start = time.perf_counter()
  for _ in range(steps):
    out = fn(*args)
  jax.block_until_ready(out)
  return (time.perf_counter() - start) / steps


def main():
  p = argparse.ArgumentParser()
  p.add_argument("--exp", default="chat/shakespeare-dialogue-dpo")
  p.add_argument("--steps", type=int, default=10)
  args = p.parse_args()
  cfg = experiments.get_config(args.exp, {"init_from": ""})
  data = trainer.load_data(cfg)
  batch = {k: jnp.asarray(v) for k, v in next(data.iterator).items()}
  model = models.build(cfg.model, seed=0)
  graphdef, params = nnx.split(model, nnx.Param)
  reference = jax.tree.map(jnp.copy, params)  # the frozen copy an in-step reference needs
  beta = cfg.preference.beta

  def dpo(policy, ref):
    margin = beta * ((policy[:, 0] - ref[:, 0]) - (policy[:, 1] - ref[:, 1]))
    return jnp.sum(-jax.nn.log_sigmoid(margin))

  def logps(params, batch):
    return preference.sequence_logps(nnx.merge(graphdef, params), batch)

  @jax.jit
  def precomputed(params, batch):
    return jax.grad(lambda p: dpo(logps(p, batch), batch["reference"]))(params)

  @jax.jit
  def in_step(params, reference, batch):
    ref = jax.lax.stop_gradient(logps(reference, batch))
    return jax.grad(lambda p: dpo(logps(p, batch), ref))(params)

  forward = jax.jit(logps)
  t_pre = timed(precomputed, params, batch, steps=args.steps)
  t_in = timed(in_step, params, reference, batch, steps=args.steps)
  t_fwd = timed(forward, params, batch, steps=args.steps)
  pairs = len(data.train.packed["tokens"]) + len(data.eval.packed["tokens"])
  batches = int(np.ceil(pairs / cfg.train.batch_size))
  once = batches * t_fwd  # the precomputation, both splits
  print(f"{args.exp}: batch {cfg.train.batch_size} pairs of 2 x {cfg.data.seq_len + 1} tokens")
  print(f"  step, reference precomputed:  {t_pre * 1e3:8.1f} ms")
  print(f"  reference forward, a batch:   {t_fwd * 1e3:8.1f} ms  (step + forward "
        f"{(t_pre + t_fwd) / t_pre:.2f}x the step)")  # fmt: skip
  print(f"  step, reference in the step:  {t_in * 1e3:8.1f} ms  ({t_in / t_pre:.2f}x)")
  print(f"  precomputing {pairs} pairs once: {once:.1f} s = {once / cfg.train.steps * 1e3:.1f} "
        f"ms a step over {cfg.train.steps} steps ({once / cfg.train.steps / t_fwd:.2f}x the "
        "forward a step)")  # fmt: skip


if __name__ == "__main__":
  main()
