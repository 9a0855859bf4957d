"""Run by tests/parallel/test_parallel.py in a subprocess with 8 fake CPU devices: computes the
loss and gradients of one batch on several meshes and on one device, and prints them as JSON."""

import json
import os
import sys

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"

import jax  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from nnx_zoo.common import experiments, models, parallel, tasks  # noqa: E402
from nnx_zoo.common.nn import lora, stacking
from nnx_zoo.common.train import optim
from nnx_zoo.common.train import step as steps

TASK = tasks.get("language_model")  # the task of every batch here

MESHES = [(2, 2, 2), (8, 1, 1), (1, 8, 1), (1, 4, 2), (1, 1, 2)]


def sums_and_grads(*args, **kw):
  """(total, count, grads) of `steps.sums_and_grads`."""
  sums, grads = steps.sums_and_grads(*args, **kw)
  return sums["total"], sums["count"], grads


def sharded_sums_and_grads(*args, **kw):
  sums, grads = steps.sharded_sums_and_grads(*args, **kw)
  return sums["total"], sums["count"], grads


def main(exp: str):
  cfg = experiments.get_config(exp, {"train.batch_size": "8"})
  tx = optim.optimizer(cfg.optim, cfg.train.steps)
  graphdef, state = steps.init_state(cfg, tx)
  rng = np.random.default_rng(0)
  B, T = cfg.train.batch_size, cfg.data.seq_len + 1
  tokens = rng.integers(0, cfg.model.vocab_size, (B, T)).astype(np.int32)
  # Two documents per row, so segment masking and positions are exercised too.
  segments = np.where(np.arange(T) < T // 3, 1, 2).astype(np.int32)[None].repeat(B, 0)
  batch = {"tokens": tokens, "segment_ids": segments}

  def flat(grads):
    return {"/".join(map(str, k)): np.asarray(v).tolist() for k, v in nnx.to_flat_state(grads)}

  total, count, grads = jax.jit(lambda p, b: sums_and_grads(p, b, graphdef=graphdef, task=TASK))(
    state.params, batch
  )
  out = {"single": {"total": float(total), "count": float(count), "grads": flat(grads)}}
  for sizes in MESHES:
    n = int(np.prod(sizes))
    layout = parallel.make_layout(
      dict(zip(("data", "fsdp", "tensor"), sizes, strict=True)), jax.devices()[:n]
    )
    _, shardings = steps.placed_abstract_state(cfg, tx, layout)
    params = jax.device_put(state.params, shardings.params)
    placed = steps.put_batch(batch, layout)
    fn = jax.jit(
      lambda p, b, layout=layout: sharded_sums_and_grads(
        p, b, graphdef=graphdef, task=TASK, layout=layout
      )
    )
    total, count, grads = fn(params, placed)
    # Each parameter's placement, and how many bytes of it one device holds.
    placement = {
      "/".join(map(str, k)): [str(v.sharding.spec), v.addressable_shards[0].data.nbytes, v.nbytes]
      for k, v in nnx.to_flat_state(params)
    }
    # Bytes one device holds of the whole train state (params + AdamW moments + counters).
    placed_state = jax.device_put(state, shardings)
    leaves = jax.tree.leaves(placed_state)
    replicated = [x for x in leaves if x.ndim < 2]  # norm scales, counters, step, rng
    out[str(sizes)] = {
      "state_bytes_per_device": sum(x.addressable_shards[0].data.nbytes for x in leaves),
      "state_bytes_total": sum(x.nbytes for x in leaves),
      "replicated_bytes": sum(x.nbytes for x in replicated),
      "total": float(total),
      "count": float(count),
      "grads": flat(grads),
      "placement": placement,
    }
  # Gradient accumulation inside the sharded step: each device runs its rows in 2 slices.
  layout = parallel.make_layout({"data": 2, "fsdp": 2, "tensor": 2})
  _, shardings = steps.placed_abstract_state(cfg, tx, layout)
  total, count, grads = jax.jit(
    lambda p, b: sharded_sums_and_grads(
      p, b, graphdef=graphdef, task=TASK, layout=layout, micro_batches=2
    )
  )(jax.device_put(state.params, shardings.params), steps.put_batch(batch, layout))
  out["(2, 2, 2) micro_batches=2"] = {"total": float(total), "count": float(count)}
  out["(2, 2, 2) micro_batches=2"]["grads"] = flat(grads)
  # Scan over the layers (remat'd body) inside the sharded step: the per-layer gathers run in
  # the loop body. Same values: model.scan stores the layers stacked ([L, ...], the layer axis
  # on no mesh axis), and the gradients come back one tree per layer.
  scanned = cfg.model.copy_and_resolve_references()
  scanned.scan, scanned.remat = True, "save_dots"
  scan_model = nnx.eval_shape(lambda: models.build(scanned))
  scan_graphdef = nnx.graphdef(scan_model)
  scan_params = stacking.match_layers(state.params, nnx.state(scan_model, nnx.Param))

  def place(x):
    return jax.device_put(x, layout.shardings(layout.param_specs(x)))

  total, count, grads = jax.jit(
    lambda p, b: sharded_sums_and_grads(p, b, graphdef=scan_graphdef, task=TASK, layout=layout)
  )(place(scan_params), steps.put_batch(batch, layout))
  grads = stacking.unstack_layers(grads)
  out["(2, 2, 2) scan"] = {"total": float(total), "count": float(count), "grads": flat(grads)}
  # Rematerialised in full, with micro-batches: the layers add each slice's gradients into the
  # running sums in their own backward loop (accumulate.accumulating), under shard_map.
  full = scanned.copy_and_resolve_references()
  full.remat = "full"
  full_graphdef = nnx.graphdef(nnx.eval_shape(lambda: models.build(full)))
  total, count, grads = jax.jit(
    lambda p, b: sharded_sums_and_grads(
      p, b, graphdef=full_graphdef, task=TASK, layout=layout, micro_batches=2
    )
  )(place(scan_params), steps.put_batch(batch, layout))
  grads = stacking.unstack_layers(grads)
  out["(2, 2, 2) scan full micro_batches=2"] = {
    "total": float(total),
    "count": float(count),
    "grads": flat(grads),
  }
  # Where each stacked leaf is placed, and where the same layer's leaf is unstacked (slot j
  # of the one-layer pattern holds layers j, j + 1...: blocks.0's placement is every layer's).
  plain_specs = dict(nnx.to_flat_state(layout.param_specs(state.params)))
  out["(2, 2, 2) scan placements"] = {
    "/".join(map(str, k)): [list(v.sharding.spec), list(plain_specs[("blocks", *k[1:])])]
    for k, v in nnx.to_flat_state(place(scan_params))
    if k[0] == "stacked"
  }
  # LoRA on every projection (column- and row-parallel, so the adapters' own gathers and psums
  # run): the gradient of the trained part only, base weights frozen, on (1, 4, 2).
  lora_cfg = cfg.model.copy_and_resolve_references()
  lora_cfg.lora = lora.config(rank=4, targets="attn.*,mlp.*")
  lora_model = models.build(lora_cfg, seed=cfg.seed)
  for path, b in nnx.to_flat_state(nnx.state(lora_model, lora.LoRAParam)):
    if path[-1] == "b":  # nonzero, so the adapters change the outputs and A gets a gradient
      b[...] = 0.1 * jax.random.normal(jax.random.key(len(path)), b[...].shape)
  lora_graphdef, lora_params = nnx.split(lora_model, nnx.Param)
  trained, frozen = nnx.split_state(lora_params, lora.trainable(lora_cfg), ...)
  total, count, grads = jax.jit(
    lambda t, f, b: sums_and_grads(t, b, graphdef=lora_graphdef, task=TASK, frozen=f)
  )(trained, frozen, batch)
  out["lora single"] = {"total": float(total), "count": float(count), "grads": flat(grads)}
  layout = parallel.make_layout({"data": 1, "fsdp": 4, "tensor": 2})

  total, count, grads = jax.jit(
    lambda t, f, b: sharded_sums_and_grads(
      t, b, graphdef=lora_graphdef, task=TASK, layout=layout, frozen=f
    )
  )(place(trained), place(frozen), steps.put_batch(batch, layout))
  out["(1, 4, 2) lora"] = {"total": float(total), "count": float(count), "grads": flat(grads)}
  # The same, scanned and rematerialised in full with micro-batches: frozen stacked base
  # weights beside the trained adapters in the layers' own backward loop.
  lora_full = lora_cfg.copy_and_resolve_references()
  lora_full.scan, lora_full.remat = True, "full"
  full_model = nnx.eval_shape(lambda: models.build(lora_full))
  full_params = stacking.match_layers(lora_params, nnx.state(full_model, nnx.Param))
  trained, frozen = nnx.split_state(full_params, lora.trainable(lora_full), ...)
  total, count, grads = jax.jit(
    lambda t, f, b: sharded_sums_and_grads(
      t, b, graphdef=nnx.graphdef(full_model), task=TASK, layout=layout, frozen=f, micro_batches=2
    )
  )(place(trained), place(frozen), steps.put_batch(batch, layout))
  grads = stacking.unstack_layers(grads)
  out["(1, 4, 2) lora scan full micro_batches=2"] = {
    "total": float(total),
    "count": float(count),
    "grads": flat(grads),
  }
  # Stochastic depth (common/nn/noise.py): every row's masks come from its index in the global
  # batch, so the sharded step draws what one device draws, scanned and in micro-batches too.
  noisy = scanned.copy_and_resolve_references()
  noisy.scan, noisy.remat, noisy.drop_path = False, "none", 0.5
  noisy_graphdef = nnx.graphdef(nnx.eval_shape(lambda: models.build(noisy)))
  draws = dict(noise_key=jax.random.key_data(jax.random.key(7)), rows=np.arange(B))
  total, count, grads = jax.jit(
    lambda p, b: sums_and_grads(p, b, graphdef=noisy_graphdef, task=TASK, **draws)
  )(state.params, batch)
  out["drop_path single"] = {"total": float(total), "count": float(count), "grads": flat(grads)}
  layout = parallel.make_layout({"data": 2, "fsdp": 2, "tensor": 2})
  total, count, grads = jax.jit(
    lambda p, b: sharded_sums_and_grads(
      p, b, graphdef=noisy_graphdef, task=TASK, layout=layout, **draws
    )
  )(place(state.params), steps.put_batch(batch, layout))
  out["(2, 2, 2) drop_path"] = {"total": float(total), "count": float(count), "grads": flat(grads)}
  noisy.scan, noisy.remat = True, "full"
  noisy_graphdef = nnx.graphdef(nnx.eval_shape(lambda: models.build(noisy)))
  total, count, grads = jax.jit(
    lambda p, b: sharded_sums_and_grads(
      p, b, graphdef=noisy_graphdef, task=TASK, layout=layout, micro_batches=2, **draws
    )
  )(place(scan_params), steps.put_batch(batch, layout))
  out["(2, 2, 2) drop_path scan full micro_batches=2"] = {
    "total": float(total),
    "count": float(count),
    "grads": flat(stacking.unstack_layers(grads)),
  }
  # Where the compiled step gathers the weights under fsdp=8, scanned: the all-gathers at the
  # top level of the program (ENTRY) and in all (bench/fsdp_gathers.py prints more).
  layout = parallel.make_layout({"data": 1, "fsdp": 8, "tensor": 1})
  _, shardings = steps.placed_abstract_state(cfg, tx, layout)
  hlo = (
    jax.jit(
      lambda p, b: sharded_sums_and_grads(p, b, graphdef=scan_graphdef, task=TASK, layout=layout)
    )
    .lower(place(scan_params), steps.put_batch(batch, layout))
    .compile()
    .as_text()
  )
  entry = hlo[hlo.index("\nENTRY") :]
  entry = entry[: entry.index("\n}")]
  out["fsdp=8 scan all-gathers"] = {
    "entry": entry.count(" all-gather("),
    "all": hlo.count(" all-gather("),
    "outside blocks": sum(
      1 for k, v in nnx.to_flat_state(state.params) if k[0] != "blocks" and v.ndim == 2
    ),
  }
  print(json.dumps(out))


if __name__ == "__main__":
  main(sys.argv[1])
