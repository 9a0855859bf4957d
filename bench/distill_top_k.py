"""The distill task's divergence over the teacher's top-k ids (renormalised, what a run on
`zoo data prepare`'s teacher outputs trains on) against the full one, on held-out batches of a
distill experiment: docs/distill.md's "Top-k against the full KL".

  python bench/distill_top_k.py chat/smollm2-distill --batches 4 [--workdir runs/smollm2-distill]

Both are computed by the task's own `_terms` (the full one with the teacher run in the step, the
top-k one from the teacher's top-k log-probabilities as `zoo data prepare` writes them), over
the same weighted tokens, for the student of `--workdir`'s latest checkpoint (or init_from's
student before training); also the teacher's mass inside its top k.
"""

import argparse
import json

import jax
import jax.numpy as jnp
from flax import nnx

from nnx_zoo.common import experiments, tasks
from nnx_zoo.common.hub import weights
from nnx_zoo.common.tasks import losses
from nnx_zoo.common.train import trainer


def main():
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("experiment")
  ap.add_argument("--workdir", default="", help="the student's run ('': init_from's student)")
  ap.add_argument("--batches", type=int, default=4)
  ap.add_argument("--batch-size", type=int, default=2)
  ap.add_argument("--k", default="4,16,64")
  args = ap.parse_args()
  ks = [int(k) for k in args.k.split(",")]
  cfg = experiments.get_config(args.experiment, {"train.batch_size": str(args.batch_size)})
  task = tasks.of(cfg)
  data = trainer.load_data(cfg, train=False)
  task.prepare(data, cfg=cfg)
  if args.workdir:
    graphdef, params, step = weights.restore_params(cfg, args.workdir)
  else:
    graphdef, params = weights.init_from_params(cfg)
    step = 0

  @jax.jit
  def measure(params, batch):
    model = nnx.merge(graphdef, params)
    d_full, _, w = task._terms(model, batch)
    rows = losses.next_token_rows(batch)
    teacher = nnx.merge(task._teacher_graphdef, batch[tasks.FROZEN])
    t_logits = teacher(
      rows["inputs"], positions_BT=rows["positions"], segment_ids_BT=rows["segment_ids"]
    )
    logps, ids = jax.lax.top_k(jax.nn.log_softmax(t_logits.astype(jnp.float32), -1), max(ks))
    pad = ((0, 0), (1, 0), (0, 0))  # index t of a row: its token t (`zoo data prepare`'s layout)
    logps, ids = jnp.pad(logps, pad), jnp.pad(ids, pad)
    out = {"count": jnp.sum(w), "full": jnp.sum(d_full * w)}
    for k in ks:
      prepared = {k_: v for k_, v in batch.items() if k_ != tasks.FROZEN}
      prepared.update(teacher_logps=logps[..., :k], teacher_ids=ids[..., :k])
      d_k, _, _ = task._terms(model, prepared)
      out[f"top{k}"] = jnp.sum(d_k * w)
      out[f"mass{k}"] = jnp.sum(jnp.exp(logps[:, 1:, :k]).sum(-1) * w)
    return out

  sums = {}
  for batch in data.eval_batches(data.eval, batch_size=args.batch_size, max_batches=args.batches):
    batch = task.complete({k: jnp.asarray(v) for k, v in batch.items()}, params)
    for key, value in measure(params, batch).items():
      sums[key] = sums.get(key, 0.0) + float(value)
  n = sums.pop("count")
  result = {"experiment": args.experiment, "student_step": step, "tokens": int(n)}
  result.update({k: round(v / n, 4) for k, v in sums.items()})
  print(json.dumps(result))


if __name__ == "__main__":
  main()
