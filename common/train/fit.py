"""`train.fit`: the train step's memory against the device's before the first step, the levers
that lower it (the list `zoo plan` prints too), and "auto"'s choice among them.

The step is compiled ahead of time on abstract inputs (`compile_step`); its compiled bytes
(common/device_memory.py) are compared with what a device has. A step that fits runs as
configured, unchanged. One that does not is refused in one line (`train.fit="off"`), or
(`"auto"`, the default) made to fit by the first candidate that does with 10% headroom, in a
fixed order, each candidate adding its lever to those before it as a user pulls levers one
after another (`candidates`): model.remat save_dots, then full; train.loss_chunk; blocked
attention; train.micro_batches x2, x4, ... with the same global batch. Each candidate is compiled,
never run. The choice is `train.fitted` ("model.remat=full train.loss_chunk=4096") in the
workdir's config.json, which a resumed run applies again (`resumed`), so it takes the same path.
"""

import copy
import dataclasses
import json
import math
import os

import jax
import numpy as np

from nnx_zoo.common import config as config_lib
from nnx_zoo.common import device_memory, mesh, parallel, tasks
from nnx_zoo.common.errors import UserError
from nnx_zoo.common.hub import checkpoint
from nnx_zoo.common.nn import attention_blocked, qlora
from nnx_zoo.common.train import step as steps

MODES = ("auto", "off")
LOSS_CHUNK = 1024
# A QLoRA step's chunk (`qlora_levers`): at 151,936 tokens of vocabulary (Qwen2.5) 1024 tokens'
# logits and their gradient are ~1.2 GiB of temporaries, more than the rest of an nf4 0.5 B
# model's step; 256 tokens' are a quarter of it (measured: the step 2.61 -> 1.74 GiB at 8 x 256).
QLORA_LOSS_CHUNK = 256


@dataclasses.dataclass(frozen=True)
class Lever:
  overrides: dict  # dotted key -> value, as --config gives it
  why: str

  @property
  def text(self) -> str:
    return " ".join(f"--config.{k}={v}" for k, v in self.overrides.items()) + f" ({self.why})"


def rows_per_device(cfg, sizes: dict[str, int]) -> int:
  """Rows of a step's batch one device holds (split over the batch axes)."""
  return cfg.train.batch_size // math.prod(sizes.get(a, 1) for a in parallel.BATCH_AXES)


# Each lever, once: `levers` (`zoo plan`'s list) and `candidates` (train.fit=auto) take them here.


def _remat(cfg, policy: str) -> Lever | None:
  """The remat lever, with `model.scan` where the blocks are not scanned yet: jax 0.10's XLA:CPU
  keeps a rematerialised stack of unrolled blocks' activations alive, scheduling every
  recomputation early, so remat alone barely lowers the step (SmolLM2's chat/sft at 8 x 1024:
  32.4 -> 31.0 GiB); in a scan the loop orders them (4.1 GiB). jax 0.12's schedules an unrolled
  stack well; the scan then costs little (a 6-layer step: 0.41x scanned, 0.39x unrolled)."""
  if "remat" not in cfg.model:
    return None
  overrides = {} if cfg.model.remat in ("full", policy) else {"model.remat": policy}
  if not cfg.model.get("scan", True) and (overrides or cfg.model.remat != "none"):
    overrides["model.scan"] = True
  if not overrides:
    return None
  what = "recompute activations in the backward pass"
  if policy != "full":
    what = "keep only the matmul outputs for the backward pass"
  return Lever(overrides, what + (", the blocks in one scanned loop" * ("model.scan" in overrides)))


def _loss_chunk(cfg, chunk: int = LOSS_CHUNK) -> Lever | None:
  if cfg.train.get("loss_chunk", 0) or cfg.model.get("vocab_size", 0) < 32768:
    return None
  return Lever(
    {"train.loss_chunk": chunk},
    f"the output head and loss {chunk:,} tokens at a time: no [tokens, vocab] logits alive",
  )


def _blocked_attention(cfg) -> Lever | None:
  # Blocked attention (query blocks, online softmax, recomputed in the backward pass) keeps no
  # [B, H, T, T] probabilities. A row of at most one block runs the dense path anyway
  # (attention_blocked.BLOCK).
  att = cfg.model.get("attention")
  if att is None or att.get("impl") not in ("auto", "xla"):
    return None
  if cfg.data.get("seq_len", 0) <= attention_blocked.BLOCK:
    return None
  return Lever({"model.attention.impl": "blocked"}, "attention a block of keys at a time")


def _micro_batches(cfg, sizes, factor: int) -> Lever | None:
  micro = cfg.train.micro_batches * factor
  rows = rows_per_device(cfg, sizes)
  if rows % micro or micro > rows:
    return None
  return Lever({"train.micro_batches": micro}, "fewer rows' activations alive at a time")


def qlora_levers(cfg) -> dict:
  """The levers a QLoRA step (`model.lora.base_quant`) takes by default under train.fit=auto,
  whether or not it fits as configured: a 4-bit base is asked for to save memory, and the base
  is then the small part of the step (Qwen2.5-0.5B at 8 x 256: 0.19 GiB of nf4 base, 11.6 GiB
  of activations and logits as configured). Remat full in a scan (each layer's input kept, one
  layer's activations and dequantized kernels alive at a time) and, at a vocabulary of 32k or
  more, the chunked loss, `QLORA_LOSS_CHUNK` tokens at a time. {} where they are pulled
  already, or under train.fit="off" (the step as configured)."""
  if cfg.train.fit != "auto" or not cfg.model.get("lora", {}).get("base_quant"):
    return {}
  pulled = {}
  for lever in (_remat(cfg, "full"), _loss_chunk(cfg, QLORA_LOSS_CHUNK)):
    if lever is not None:
      pulled.update(lever.overrides)
  return pulled


def with_qlora_levers(cfg):
  """`cfg` with `qlora_levers` pulled and added to `train.fitted` (so a resumed run, and
  `zoo show --memory`, take the same step); `cfg` itself where there are none."""
  pulled = qlora_levers(cfg)
  if not pulled:
    return cfg
  fitted = format_fitted({**parse_fitted(cfg.train.fitted), **pulled})
  cfg = with_overrides(cfg, pulled)
  cfg.train.fitted = fitted
  return cfg


def levers(cfg, sizes: dict[str, int]) -> list[Lever]:
  """The levers that lower a device's memory and are not pulled yet, most effective first (the
  list `zoo plan` prints, before "a larger topology")."""
  out = []
  if sizes["data"] > 1:  # the state is stored whole on each data replica, split over the rest
    out.append(
      Lever(
        {"mesh.fsdp": sizes["fsdp"] * sizes["data"], "mesh.data": 1},
        "shard parameters and optimizer state over more devices",
      )
    )
  out += [x for x in (_remat(cfg, "full"), _loss_chunk(cfg), _micro_batches(cfg, sizes, 2)) if x]
  if rows_per_device(cfg, sizes) // cfg.train.micro_batches <= 1:  # one row a slice already
    out = [x for x in out if "train.micro_batches" not in x.overrides]
  # Long token rows: each row's tokens over twice as many context devices, taken from fsdp (the
  # state stays as split: weights are stored over context too); a device group then has twice
  # the rows, run in twice the micro-batches, so a device holds half a row's activations.
  context, seq = sizes.get("context", 1), cfg.data.get("seq_len", 0)
  micro = cfg.train.micro_batches
  if sizes["fsdp"] % 2 == 0 and seq and seq % (4 * context) == 0 and seq // context >= 4096:
    out.append(
      Lever(
        {
          "mesh.context": 2 * context,
          "mesh.fsdp": sizes["fsdp"] // 2,
          "train.micro_batches": micro * 2,
        },  # fmt: skip
        f"each row's tokens over {2 * context} devices: half the activations a device holds",
      )
    )
  return out


def candidates(cfg, sizes: dict[str, int]) -> list[dict]:
  """train.fit=auto's candidates in their fixed order, each the overrides of the ones before it
  with one more lever: model.remat save_dots, then full; train.loss_chunk; blocked attention;
  then train.micro_batches x2, x4, ... while they divide a device's rows."""
  pulled, out = {}, []
  found = [_remat(cfg, "save_dots"), _remat(cfg, "full"), _loss_chunk(cfg)]
  found.append(_blocked_attention(cfg))
  factor = 2
  while (lever := _micro_batches(cfg, sizes, factor)) is not None:
    found.append(lever)
    factor *= 2
  for lever in found:
    if lever is not None:
      pulled = {**pulled, **lever.overrides}
      out.append(dict(pulled))
  return out


def with_overrides(cfg, overrides: dict):
  """A copy of `cfg` with the dotted `overrides` (values as --config gives them) set."""
  cfg = copy.deepcopy(cfg)
  config_lib.apply_overrides(cfg, {k: str(v) for k, v in overrides.items()})
  return cfg


def parse_fitted(text: str) -> dict[str, str]:
  """'model.remat=full train.micro_batches=2' -> {key: value}; a UserError for another form."""
  items = text.split()
  if not all("=" in item for item in items):
    raise UserError(
      f"train.fitted={text!r}: it is KEY=VALUE pairs separated by spaces, as train.fit writes "
      "it (e.g. 'model.remat=full train.micro_batches=2')."
    )
  return dict(item.split("=", 1) for item in items)


def format_fitted(overrides: dict) -> str:
  return " ".join(f"{k}={v}" for k, v in overrides.items())


# The compiled step


def peek(iterator) -> dict | None:
  """The shapes and dtypes of the training iterator's next batch, the iterator left where it
  was (its state, which checkpoints save, set back); None if it keeps no state."""
  if iterator is None or not hasattr(iterator, "get_state"):
    return None
  state = iterator.get_state()
  batch = next(iterator)
  iterator.set_state(state)
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), np.asarray(x).dtype), batch)


def placed(batch: dict, layout) -> dict:
  """The batch as the step takes it: on one device, every array on it (the host's and those the
  task made on the device alike, as `abstract_batch` describes them), so the program compiled
  ahead of time is the one that runs; on a mesh, as `step.put_batch` placed it."""
  if layout is not None:
    return batch
  return jax.device_put(batch, jax.sharding.SingleDeviceSharding(jax.devices()[0]))


def abstract_batch(cfg, layout, example: dict | None = None) -> dict:
  """The batch the step takes, as `zoo run` feeds it: the task's global batch
  (`Task.batch_shapes`) with the arrays of the data's own batches it does not name (`example`:
  `peek`'s, such as chat's loss weights; not for a task that completes its batches), split
  over the batch axes (one device: on it, `placed`); under `mesh.context` the rows the task
  splits (a language model's next-token rows [B, seq_len]), split over it too, as
  `step.put_batch` makes them."""
  task = tasks.of(cfg)
  whole = {k: jax.ShapeDtypeStruct(*v) for k, v in task.batch_shapes(cfg).items()}
  # A task that makes its batches itself (`Task.complete`: grpo's rollouts) names them whole; one
  # that trains on the data's batches as they come takes the data's other arrays too.
  given = example if type(task).complete is tasks.Task.complete else None
  for k, v in (given or {}).items():
    if k not in whole and not isinstance(v, dict):
      whole[k] = jax.ShapeDtypeStruct((cfg.train.batch_size, *v.shape[1:]), v.dtype)
  if layout is None:
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    return {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=device) for k, v in whole.items()}
  if layout.sizes.get("context", 1) > 1:
    rows = jax.eval_shape(task.context_rows, whole)
    if rows is not None:
      sharding = jax.sharding.NamedSharding(layout.mesh, layout.token_spec)
      rows = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=sharding) for k, v in rows.items()}
      return {"next_token": rows}
  sharding = jax.sharding.NamedSharding(layout.mesh, layout.batch_spec)
  return {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=sharding) for k, v in whole.items()}


def compile_step(cfg, *, tx, layout, example: dict | None = None):
  """(the jitted step `zoo run` runs, its program compiled for abstract inputs: `abstract_batch`
  of `example`). The trainer calls the jitted step itself on batches so shaped and `placed`:
  jax keeps the compiled program, so it is not compiled again."""
  abstract, shardings = steps.placed_abstract_state(cfg, tx, layout)
  step_fn = steps.make_train_step(cfg, tx=tx, layout=layout, shardings=shardings)
  batch = abstract_batch(cfg, layout, example)
  return step_fn, step_fn.lower(abstract, batch).compile()


def _knows_batches(cfg) -> bool:
  try:
    tasks.of(cfg).batch_shapes(cfg)
  except UserError:  # a task whose batches nothing describes yet (seq2seq, ...): not checked
    return False
  return True


def agreed_budget() -> device_memory.Budget | None:
  """What a device has, the least over the job's processes: every process must take the same
  step (hosts' free memory differs)."""
  has = device_memory.budget()
  if has is None or jax.process_count() == 1:
    return has
  from jax.experimental import multihost_utils

  # In KiB: jax gathers int32 unless x64 is on, and a host's bytes overflow it (a negative
  # budget refused every two-process run on a machine with more than 4 GiB free).
  kib = multihost_utils.process_allgather(np.asarray(has.bytes // 1024, np.int32))
  return dataclasses.replace(has, bytes=int(np.min(kib)) * 1024)


@dataclasses.dataclass
class Search:
  """The step as configured, and what train.fit=auto's candidates need."""

  first: device_memory.Fit
  step_fn: object
  tried: list = dataclasses.field(default_factory=list)  # (overrides, Fit), in order
  chosen: tuple | None = None  # (cfg, step_fn, overrides, Fit) of the first that fits


def search(cfg, *, tx, layout, example=None, progress=None) -> Search | None:
  """The configured step compiled and measured; where it does not fit, the candidates compiled
  in their order until one fits with 10% headroom. None: the task's batches are unknown.
  `progress(line)`: told each figure as it is known (a large step compiles for minutes)."""
  progress = progress or (lambda line: None)
  if not _knows_batches(cfg):
    return None
  has = agreed_budget()
  step_fn, compiled = compile_step(cfg, tx=tx, layout=layout, example=example)
  result = Search(device_memory.measure(compiled, against=has), step_fn)
  del compiled
  progress(f"the train step {result.first.summary()}")
  if result.first.fits():
    return result
  sizes = layout.sizes if layout is not None else mesh.resolve(cfg.mesh, 1)
  for overrides in candidates(cfg, sizes):
    candidate = with_overrides(cfg, overrides)
    try:
      parallel.check_experiment(candidate, sizes)
    except UserError:  # a lever this mesh cannot take (a pipeline's micro-batches)
      continue
    c_step, c_compiled = compile_step(candidate, tx=tx, layout=layout, example=example)
    measured = device_memory.measure(c_compiled, against=has)
    del c_compiled
    result.tried.append((overrides, measured))
    progress(f"with {format_fitted(overrides)}: {device_memory.gib(measured.needed)}")
    if measured.fits(headroom=device_memory.HEADROOM):
      result.chosen = (candidate, c_step, overrides, measured)
      break
  return result


def _tried(result: Search) -> str:
  """Each candidate tried with its figure, most effective first."""
  ranked = sorted(result.tried, key=lambda t: t[1].needed)
  return "; ".join(
    f"{format_fitted(o)}: {device_memory.gib(f.needed)}"
    + (" (fits)" if f.fits(headroom=device_memory.HEADROOM) else "")
    for o, f in ranked
  )


def _name(cfg) -> str:
  return cfg.get("experiment", "") or "the experiment"


def fitted_step(cfg, *, tx, layout, example=None):
  """(cfg, its jitted train step): the step compiled for batches shaped as `example` (`peek`'s)
  and checked against the device's memory before it runs. With train.fit="auto" a step that
  does not fit comes back with the first candidate that does (its levers in `cfg` and in
  `train.fitted`, logged once); with "off", or where nothing fits, a UserError of one line with
  the candidates' figures."""
  if cfg.train.fit not in MODES:
    raise UserError(f"train.fit={cfg.train.fit!r}: it is one of {', '.join(MODES)}.")
  pulled = qlora_levers(cfg)
  if pulled:
    cfg = with_qlora_levers(cfg)
    if jax.process_index() == 0:
      print(
        f"train.fit=auto: a QLoRA step (model.lora.base_quant) trains with "
        f"{format_fitted(pulled)}, as config.json's train.fitted records (train.fit=off: the "
        "step as configured)",
        flush=True,
      )
  result = search(cfg, tx=tx, layout=layout, example=example)
  if result is None:
    abstract, shardings = steps.placed_abstract_state(cfg, tx, layout)
    return cfg, steps.make_train_step(cfg, tx=tx, layout=layout, shardings=shardings)
  if result.first.fits():
    return cfg, result.step_fn
  what = f"{_name(cfg)}'s train step"
  if result.chosen is not None and cfg.train.fit == "auto":
    candidate, c_step, overrides, measured = result.chosen
    candidate.train.fitted = format_fitted({**parse_fitted(cfg.train.fitted), **overrides})
    if jax.process_index() == 0:
      print(
        f"train.fit=auto: {what} needs {device_memory.gib(result.first.needed)}, the device "
        f"has {device_memory.gib(result.first.available)}; training with {format_fitted(overrides)}"
        f" ({device_memory.gib(measured.needed)}), as config.json's train.fitted records",
        flush=True,
      )
    return candidate, c_step
  raise device_memory.refusal(what, result.first, fix(result, cfg))


def fix(result: Search, cfg) -> str:
  """The refusal's advice: what fits (and train.fit=auto would take), or what was tried."""
  if result.chosen is not None:
    return (
      f"It fits with --config.{' --config.'.join(format_fitted(result.chosen[2]).split())} "
      f"(train.fit=auto takes it); tried: {_tried(result)}."
    )
  if not result.tried:
    return "No lever train.fit=auto knows is left to pull: use a device with more memory."
  return f"Nothing train.fit=auto tries fits ({_tried(result)}): use a device with more memory."


def report(cfg, *, tx, layout) -> str:
  """`zoo show --memory`: what the step needs on this machine, what it has, whether it fits,
  and what train.fit=auto would do."""

  def progress(line: str):
    print(f"# memory: {line}", flush=True)

  pulled = qlora_levers(cfg)
  cfg = with_qlora_levers(cfg)
  if pulled:
    progress(f"a QLoRA step takes {format_fitted(pulled)} under train.fit=auto")
  result = search(cfg, tx=tx, layout=layout, progress=progress)
  if result is None:
    return f"# memory: the {tasks.of(cfg).name} task's batches are not described: not checked"
  if cfg.model.get("lora", {}).get("base_quant"):
    progress(qlora_parts(cfg, result.first, tx=tx))
  first, lines = result.first, []
  if first.fits():
    more = " more" if pulled else ""
    lines.append(f"# memory: fits; train.fit changes nothing{more}")
    return "\n".join(lines)
  lines.append(f"# memory: DOES NOT FIT; candidates (most effective first): {_tried(result)}")
  if result.chosen is not None:
    lines.append(f"# memory: train.fit=auto would train with {format_fitted(result.chosen[2])}")
  else:
    lines.append("# memory: nothing train.fit=auto tries fits: use a device with more memory")
  return "\n".join(lines)


def qlora_parts(cfg, fit: device_memory.Fit, *, tx) -> str:
  """A QLoRA step's parts (`zoo show --memory`, bench/memory.py): its quantized base, frozen
  embeddings and heads, one layer's dequantized kernels, the rest of its arguments (adapters,
  their optimizer state, the batch) and the rest of its temporaries (activations, logits,
  gradients), from the params' shapes and the compiled step's figures."""
  params = steps.abstract_state(cfg, tx).params
  got = qlora.parts(params, dtype=cfg.model.dtype, train=cfg.model.lora.train)
  dtype = qlora.frozen_dtype(cfg.model.lora)
  rest = fit.argument - got["base"] - got["tables"]
  return (
    f"QLoRA {cfg.model.lora.base_quant}: base {device_memory.gib(got['base'])} (codes and "
    f"scales), embeddings and heads {device_memory.gib(got['tables'])} ({dtype}), "
    f"adapters, optimizer state and batch {device_memory.gib(rest)}; "
    f"one layer's dequantized kernels {device_memory.gib(got['layer'])}, activations, logits "
    f"and gradients {device_memory.gib(max(fit.temp - got['layer'], 0))} (temporaries "
    f"{device_memory.gib(fit.temp)})"
  )


def resumed(cfg, workdir: str):
  """`cfg` with the levers train.fit chose for the run in `workdir` (its config.json's
  train.fitted, where it has checkpoints) or given as train.fitted, so a resumed run takes the
  same path."""
  fitted = cfg.train.fitted
  path = os.path.join(workdir, "config.json")
  if not fitted and os.path.exists(path) and checkpoint.has_steps(workdir):
    with open(path) as f:
      fitted = json.load(f).get("train", {}).get("fitted", "")
  if not fitted:
    return cfg
  cfg = with_overrides(cfg, parse_fitted(fitted))
  cfg.train.fitted = fitted
  return cfg
