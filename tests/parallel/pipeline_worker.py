"""Run by tests/parallel/test_pipeline.py in a subprocess with 8 fake CPU devices: the circular
schedule on toy stages, and the loss and gradients of pipelined steps against one device's, for
the cases named on the command line. Prints one JSON object: per case, the relative error of the
loss and of each gradient (against one device), and whether every gradient is finite."""

import json
import os
import sys

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from nnx_zoo.common import experiments, models, parallel, tasks  # noqa: E402
from nnx_zoo.common.nn import lora, pipeline  # noqa: E402
from nnx_zoo.common.train import step as steps  # noqa: E402

TASK = tasks.get("language_model")
AXES = ("pipeline", "data", "fsdp", "expert", "context", "tensor")

# name: (experiment, layers, mesh (pipeline, data, fsdp, expert, context, tensor), R, M, batch,
# overrides). Reference: one device, the same weights and batch; for MoE, whose load-balancing
# loss is over each micro-batch's rows, one device with the same micro-batches (`same_slices`).
CASES = {
  "p4 d2 R1 M4": ("lm/shakespeare-char:smoke", 8, (4, 2, 1, 1, 1, 1), 1, 4, 16, {}),
  "p4 d2 R2 M8 drop_path": (
    "lm/shakespeare-char:smoke",
    8,
    (4, 2, 1, 1, 1, 1),
    2,
    8,
    16,
    {"model.drop_path": "0.5"},
  ),
  "p4 d2 R2 M5 nan bubbles": ("lm/shakespeare-char:smoke", 8, (4, 2, 1, 1, 1, 1), 2, 5, 20, {}),
  "p2 f2 t2 R2 M4": ("lm/shakespeare-char:smoke", 8, (2, 1, 2, 1, 1, 2), 2, 4, 16, {}),
  "p2 e2 d2 qwen3-moe": ("lm/qwen3-30b-a3b:smoke", 4, (2, 2, 1, 2, 1, 1), 1, 4, 16, {}),
  "p2 f2 d2 R2 gemma2": ("lm/gemma2-2b:smoke", 8, (2, 2, 2, 1, 1, 1), 2, 4, 16, {}),
  "p2 f2 t2 R2 lora": (
    "lm/shakespeare-char:smoke",
    8,
    (2, 1, 2, 1, 1, 2),
    2,
    4,
    16,
    {"model.lora.rank": "4", "model.lora.targets": "attn.*,mlp.*"},
  ),
}


def config(exp, layers, R, M, batch, overrides):
  return experiments.get_config(
    exp,
    {
      "train.batch_size": str(batch),
      "model.num_layers": str(layers),
      "model.scan": "True",
      "model.pipeline_repeats": str(R),
      "train.pipeline_microbatches": str(M),
      **overrides,
    },
  )


def make_batch(cfg, B):
  rng = np.random.default_rng(0)
  T = cfg.data.seq_len + 1
  tokens = rng.integers(0, cfg.model.vocab_size, (B, T)).astype(np.int32)
  # Two documents per row: segment masking and positions are cut into micro-batches too.
  segments = np.where(np.arange(T) < T // 3, 1, 2).astype(np.int32)[None].repeat(B, 0)
  return {"tokens": tokens, "segment_ids": segments}


def same_slices(B, sizes, M):
  """The order of the batch's rows in which one device's M slices (train.micro_batches) are the
  pipeline's micro-batches: slice m holds micro-batch m of every batch shard."""
  shards = sizes[1] * sizes[2] * sizes[3]
  b = B // shards
  mb = b // M
  return np.concatenate([d * b + m * mb + np.arange(mb) for m in range(M) for d in range(shards)])


def errors(ref, ref_grads, got, got_grads) -> dict:
  out = {"loss": abs(float(got["total"]) - float(ref["total"])) / abs(float(ref["total"]))}
  got_flat = dict(nnx.to_flat_state(got_grads))
  grads, finite = {}, True
  for k, g in nnx.to_flat_state(ref_grads):
    g, h = np.asarray(g), np.asarray(got_flat[k])
    finite &= bool(np.isfinite(h).all())
    grads["/".join(map(str, k))] = float(np.max(np.abs(h - g)) / (np.max(np.abs(g)) + 1e-12))
  aux = {k: abs(float(got["aux"][k]) - float(v)) for k, v in ref["aux"].items()}
  return {**out, "grads": grads, "finite": finite, "aux": aux, "count": float(got["count"])}


def model_case(name):
  exp, layers, sizes, R, M, B, overrides = CASES[name]
  cfg = config(exp, layers, R, M, B, overrides)
  model = models.build(cfg.model, seed=0)
  for path, b in nnx.to_flat_state(nnx.state(model, lora.LoRAParam)):
    if path[-1] == "b":  # nonzero, so the adapters change the outputs and A gets a gradient
      b[...] = 0.1 * jax.random.normal(jax.random.key(len(path)), b[...].shape)
  graphdef, params = nnx.split(model, nnx.Param)
  # LoRA: the adapters' gradients, the base weights frozen (all of it without adapters).
  trained, frozen = nnx.split_state(params, lora.trainable(cfg.model), ...)
  batch = make_batch(cfg, B)
  kw = {}
  if "drop_path" in name:  # every row's masks come from its index in the global batch
    kw = dict(noise_key=jax.random.key_data(jax.random.key(7)), rows=np.arange(B))
  ref_batch, ref_kw = batch, dict(kw)
  if "moe" in name:
    order = same_slices(B, sizes, M)
    ref_batch = {k: v[order] for k, v in batch.items()}
    ref_kw["micro_batches"] = M
  ref, ref_grads = jax.jit(
    lambda p, f, b: steps.sums_and_grads(p, b, graphdef=graphdef, task=TASK, frozen=f, **ref_kw)
  )(trained, frozen, ref_batch)
  layout = parallel.experiment_layout(cfg, dict(zip(AXES, sizes, strict=True)))
  parallel.check_experiment(cfg, layout.sizes)

  def place(x):
    return jax.device_put(x, layout.shardings(layout.param_specs(x)))

  pipeline.FILL = float("nan") if "nan" in name else 0.0
  got, got_grads = jax.jit(
    lambda p, f, b: steps.sharded_sums_and_grads(
      p, b, graphdef=graphdef, task=TASK, layout=layout, frozen=f, **kw
    )
  )(place(trained), place(frozen), steps.put_batch(batch, layout))
  return errors(ref, ref_grads, got, got_grads)


def schedule_case(S, R, M, fill):
  """Toy stages on a pipeline-only mesh: chunk c = r x S + s writes the count of chunks run so
  far into slot c of its micro-batch's vector and counts one more; `extra` counts each (chunk,
  micro-batch) run. In layer order, exactly once each: slot c holds c + 1, the count is C = S x R,
  every (chunk, micro-batch) ran once, and each micro-batch keeps its own id."""
  C = S * R
  mesh = jax.sharding.Mesh(np.asarray(jax.devices()[:S]), ("pipeline",))
  schedule = pipeline.Schedule(S, R, M)

  def local(x_M):
    s = jax.lax.axis_index("pipeline")

    def fn(x, r, m, valid):
      c = r * S + s
      y = x.at[c].set(x[C] + 1).at[C].add(1)
      ran = jnp.zeros((C, M)).at[c, m].set(1.0)
      return y, ran

    return pipeline.circulate(fn, x_M, schedule=schedule, fill=fill)

  x_M = jnp.zeros((M, C + 2)).at[:, C + 1].set(jnp.arange(M))
  out, ran = jax.jit(
    jax.shard_map(
      local, mesh=mesh, in_specs=jax.sharding.PartitionSpec(), out_specs=jax.P(), check_vma=True
    )
  )(x_M)
  out, ran = np.asarray(out), np.asarray(ran)
  return {
    "order": bool((out[:, :C] == np.arange(1, C + 1)).all()),
    "count": bool((out[:, C] == C).all()),
    "ids": bool((out[:, C + 1] == np.arange(M)).all()),
    "once": bool((ran == 1).all()),
    "finite": bool(np.isfinite(out).all()),
  }


def main(names):
  out = {}
  for name in names:
    if name.startswith("schedule"):
      S, R, M = (int(v) for v in name.split()[1:4])
      out[name] = schedule_case(S, R, M, float("nan") if "nan" in name else 0.0)
    else:
      out[name] = model_case(name)
  print(json.dumps(out))


if __name__ == "__main__":
  main(sys.argv[1:])
