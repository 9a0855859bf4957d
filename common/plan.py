"""`zoo plan`: an experiment's real train step compiled ahead of time for a TPU topology.

No TPU is needed: libtpu (`pip install -e ".[tpu]"`) describes a slice's chips
(`jax.experimental.topologies`), the step `zoo run` runs
(`nnx_zoo.common.train.step.make_train_step`) is lowered on abstract inputs placed on a mesh of
those chips, and XLA:TPU compiles it. The compiled program says what a device holds
(`memory_analysis`) and how many FLOPs and bytes it moves (`cost_analysis`), from which a roofline
gives the step time. `plan` returns those as a dict; `format` prints them; `zoo plan` exits 2 with
the levers to pull when it does not fit.
"""

import copy
import dataclasses
import importlib.util
import math
import os
import re
import time

import numpy as np

from nnx_zoo.common import device_memory, mesh
from nnx_zoo.common.errors import UserError, suggest

GiB = 2**30


@dataclasses.dataclass(frozen=True)
class Chip:
  """One TPU generation. hbm and peak are per chip, from the Cloud TPU pages (which print GB
  and TFLOPs; the compiler's own out-of-memory message reports v5p as 95.74 GiB)."""

  hbm: int  # bytes
  peak: float  # dense bf16 FLOP/s
  bandwidth: float  # HBM bytes/s
  kind: str  # jax's device_kind, as `nnx_zoo.common.mesh.hardware_name` reads it
  cores_per_chip: int  # what the Cloud name counts: v4 and v5p name TensorCores, two a chip
  dims: int  # 3-D torus (v4, v5p) or 2-D (v5e, v6e)
  # int8 x int8 ops/s (model.quant=int8's products): "Peak compute per chip (Int8)" of
  # cloud.google.com/tpu/docs/v5e (393 TOPs) and /tpu/docs/v6e (1836 TOPs). The v4 page gives
  # one figure for bf16 and int8, and the v5p page none for int8: there it is the bf16 peak.
  int8_peak: float = 0.0

  @property
  def int8(self) -> float:
    return self.int8_peak or self.peak


CHIPS = {
  "v4": Chip(hbm=32 * GiB, peak=275e12, bandwidth=1200e9, kind="TPU v4", cores_per_chip=2, dims=3),
  "v5e": Chip(
    hbm=16 * GiB,
    peak=197e12,
    bandwidth=819e9,
    kind="TPU v5 lite",
    cores_per_chip=1,
    dims=2,
    int8_peak=393e12,
  ),
  "v5p": Chip(hbm=95 * GiB, peak=459e12, bandwidth=2765e9, kind="TPU v5", cores_per_chip=2, dims=3),
  "v6e": Chip(
    hbm=32 * GiB,
    peak=918e12,
    bandwidth=1640e9,
    kind="TPU v6 lite",
    cores_per_chip=1,
    dims=2,
    int8_peak=1836e12,
  ),
}
ALIASES = {"v5litepod": "v5e"}  # the Cloud API's name for v5e slices
# The slice shapes Cloud TPU offers up to 256 chips, by chip count.
SHAPES = {
  2: {1: "1x1", 4: "2x2", 8: "2x4", 16: "4x4", 32: "4x8", 64: "8x8", 128: "8x16", 256: "16x16"},
  3: {
    4: "2x2x1",
    8: "2x2x2",
    16: "2x2x4",
    32: "2x4x4",
    64: "4x4x4",
    128: "4x4x8",
    256: "4x8x8",
  },
}


@dataclasses.dataclass(frozen=True)
class Topology:
  name: str  # as given
  generation: str  # v4, v5e, v5p, v6e
  shape: str  # "4x4x4"
  chips: int

  @property
  def chip(self) -> Chip:
    return CHIPS[self.generation]

  @property
  def jax_name(self) -> str:
    return f"{self.generation}:{self.shape}"

  @property
  def cloud_name(self) -> str:
    return f"{self.generation}-{self.chips * self.chip.cores_per_chip}"

  @property
  def hardware(self) -> str:
    """The name mesh rules match (`tpu-v5x64`), as `nnx_zoo.common.mesh.hardware_name` gives it
    on the slice itself (one device per chip: v4 and v5p run as megacore)."""
    return f"{self.chip.kind.lower().replace(' ', '-')}x{self.chips}"


def accepted() -> str:
  cloud = ", ".join(
    f"{g}-{{{','.join(str(n * c.cores_per_chip) for n in SHAPES[c.dims])}}}"
    for g, c in CHIPS.items()
  )
  return (
    f"Cloud names {cloud} (v4 and v5p count TensorCores, two a chip; v5e and v6e count chips; "
    "v5litepod-N = v5e-N), or JAX topology names GEN:SHAPE such as v5e:2x2, v5p:4x4x4"
  )


def parse_topology(name: str) -> Topology:
  """`v5p-128` or `v5p:4x4x4` -> Topology (64 chips, 4x4x4), or a UserError naming the accepted
  names. Needs no libtpu."""
  gen, sep, rest = name.partition(":")
  if not sep:
    gen, sep, rest = name.rpartition("-")
  gen = ALIASES.get(gen.lower(), gen.lower())
  chip = CHIPS.get(gen)
  if chip is None or not sep:
    raise UserError(
      f"Unknown topology {name!r}.{suggest(name, [f'{g}-8' for g in CHIPS])} Accepted: "
      f"{accepted()}."
    )
  if ":" in name:
    dims = rest.split("x")
    if len(dims) != chip.dims or not all(d.isdigit() and int(d) > 0 for d in dims):
      raise UserError(
        f"Topology {name!r}: a {gen} slice is {chip.dims}-D, e.g. {gen}:{SHAPES[chip.dims][4]}. "
        f"Accepted: {accepted()}."
      )
    return Topology(name, gen, rest, math.prod(int(d) for d in dims))
  cores = int(rest) if rest.isdigit() else -1
  chips, odd = divmod(cores, chip.cores_per_chip)
  if odd or chips not in SHAPES[chip.dims]:
    sizes = ", ".join(str(n * chip.cores_per_chip) for n in SHAPES[chip.dims])
    raise UserError(f"Unknown topology {name!r}: {gen} slices here are {gen}-{{{sizes}}}.")
  return Topology(name, gen, SHAPES[chip.dims][chips], chips)


def devices(topology: Topology) -> list:
  """The slice's devices (abstract: they compile, they never run), one per chip."""
  if importlib.util.find_spec("libtpu") is None:
    raise UserError(
      'Planning for TPU needs libtpu, which this environment lacks: pip install -e ".[tpu]"'
    )
  # libtpu takes a machine-wide lock that a second process (a test, a `zoo run` on a TPU VM)
  # would fail on; describing a topology touches no chip, so sharing is safe.
  os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
  from jax.experimental import topologies

  kw = {}
  if topology.chip.cores_per_chip == 2:
    kw["chip_config_name"] = "megacore"  # one device per chip, as Cloud TPU VMs run v4 and v5p
  if topology.chips == 1:
    kw["chips_per_host_bounds"] = (1, 1, 1)  # the default host is 2x2 chips
  try:
    with mesh.quiet_stderr():
      desc = topologies.get_topology_desc(platform="tpu", topology_name=topology.jax_name, **kw)
  except Exception as e:  # libtpu rejects a shape it cannot build
    raise UserError(f"libtpu cannot build topology {topology.jax_name}: {e}") from None
  return list(desc.devices)


# The plan


def _shard_bytes(tree) -> int:
  """Bytes one device holds of a tree of placed ShapeDtypeStructs (the largest shard: with
  uneven splits, the device that holds most)."""
  import jax

  total = 0
  for leaf in jax.tree.leaves(tree):
    shape = leaf.sharding.shard_shape(leaf.shape) if leaf.sharding is not None else leaf.shape
    total += math.prod(shape) * np.dtype(leaf.dtype).itemsize
  return total


def sequence(cfg) -> int:
  """Tokens a row: data.seq_len, or a ViT's patches."""
  m = cfg.model
  if "seq_len" in cfg.data:
    return cfg.data.seq_len
  return (m.image_size // m.patch) ** 2 if "image_size" in m and "patch" in m else 1


def step_rows(cfg) -> int:
  """Rows the model reads in one step: train.batch_size examples of the task's rows each (a DPO
  pair is two, `Task.rows_per_example`)."""
  from nnx_zoo.common import tasks

  return cfg.train.batch_size * tasks.of(cfg).rows_per_example


def tokens(cfg) -> int:
  """Tokens one step trains on: `step_rows` rows of `sequence` tokens."""
  return step_rows(cfg) * sequence(cfg)


def model_flops(cfg) -> tuple[float, str]:
  """Training FLOPs of one step by the usual count (PaLM, appendix B): 6 per parameter a token
  computes with per token for the matmuls (forward + backward; an MoE layer's experts count
  top_k / num_experts of their size; the input embedding table is a gather, not counted unless
  tied to the output head) and 12 * layers * heads * head_dim * context per token for
  attention's two matmuls, with the full (not causally halved) context, capped by a window.
  Rematerialisation is not counted: this is the model's work, not the hardware's."""
  from nnx_zoo.common import models

  m = cfg.model
  params = models.num_active_params(m)
  if "vocab_size" in m and "dim" in m and not m.get("tie_embeddings", False):
    params -= m.vocab_size * m.dim
  n = tokens(cfg)
  flops = 6.0 * params * n
  how = f"6 x {params:.3g} active params x {n:,} tokens"
  att = m.get("attention")
  if att is not None and "num_layers" in m:
    context = min(sequence(cfg), att.window) if att.window else sequence(cfg)
    flops += 12.0 * m.num_layers * att.num_heads * att.head_dim * context * n
    how += " + attention"
  return flops, how


def _score_pairs(T: int, *, causal: bool, window: int) -> int:
  """(query, key) pairs a [T, T] attention mask lets through: |t - s| < window (0: any), and
  s <= t when causal."""
  t = np.arange(T)
  back = np.minimum(t, window - 1) if window else t  # keys before each query
  ahead = 0 if causal else (np.minimum(T - 1 - t, window - 1) if window else T - 1 - t)
  return int(np.sum(back + ahead + 1))


def kernel_flops(cfg) -> tuple[float, str]:
  """FLOPs of the step that run inside Mosaic kernels, which XLA's cost analysis counts as none:
  splash attention (`model.attention.impl="flash"` on TPU: kernels/tpu_attention.py) in every
  layer that uses it. Per (query, key) pair the mask lets through (the kernel skips key blocks
  its mask rules out; partly masked blocks are counted as their unmasked pairs) and head dim H:
  4 H for the forward's two matmuls, 14 H for its backward (the dK/dV and dQ kernels each
  recompute the scores: seven matmuls), 4 H more for the forward that `model.remat=full`
  recomputes. (0, "") for any other attention ("auto" is splash on a TPU)."""
  from nnx_zoo.common import attention_impl
  from nnx_zoo.common.nn import stack

  m = cfg.model
  if "attention" not in m or "num_layers" not in m:
    return 0.0, ""
  T, B = sequence(cfg), step_rows(cfg)
  per_pair = 4 + 14 + (4 if m.remat == "full" else 0)
  flops = 0.0
  for i in range(m.num_layers):
    layer = stack.layer_config(m, i)
    att = layer.attention
    bias = layer.position.kind in ("alibi", "relative")  # biases: xla
    impl = att.impl
    if impl == "auto":  # as the layer resolves it when traced for the slice
      impl, _ = attention_impl.resolve_auto(
        platform="tpu", dtype=m.dtype, head_dim=att.head_dim, seq_len=T, bias=bias
      )
    if impl != "flash" or bias:
      continue
    pairs = _score_pairs(T, causal=att.mask == "causal", window=att.window)
    flops += per_pair * att.head_dim * att.num_heads * pairs * B
  return flops, ("splash attention, outside XLA's counts" if flops else "")


def int8_flops(cfg) -> tuple[float, str]:
  """FLOPs of the step's int8 products (`model.quant=int8`, common/nn/quant.py): 2 per weight
  of each quantized projection per token, in the forward (twice with `model.remat=full`, which
  recomputes it) and, with `model.quant_backward`, in both gradients. (0, "") otherwise."""
  from flax import nnx

  from nnx_zoo.common import models
  from nnx_zoo.common.nn.linear import Linear

  m = cfg.model
  if m.quant != "int8":
    return 0.0, ""
  weights = sum(
    int(x.kernel.size)
    for _, x in nnx.iter_graph(models.abstract(m))
    if isinstance(x, Linear) and x.quant is not None
  )
  passes = ["forward"]
  if m.remat == "full":
    passes.append("its recomputation")
  if m.quant_backward:
    passes += ["input gradient", "weight gradient"]
  how = f"int8 products ({', '.join(passes)}) at the chip's int8 peak"
  return 2.0 * len(passes) * weights * tokens(cfg), how


_OOM = re.compile(
  r"required for HLO temporaries \(([\d.]+)([KMGT]?)\).*available HBM \(([\d.]+)([KMGT]?)\)"
)


def _bytes(value: str, unit: str) -> int:
  return int(float(value) * 1024 ** " KMGT".index(unit or " "))


def abstract_batch(cfg, layout) -> dict:
  """The batch the step takes, as `zoo run` feeds it (`fit.abstract_batch`)."""
  from nnx_zoo.common.train import fit

  return fit.abstract_batch(cfg, layout)


def _compile(cfg, layout):
  """(abstract state, compiled step) of `cfg` on `layout`: the step `zoo run` runs."""
  from nnx_zoo.common.train import fit, optim
  from nnx_zoo.common.train import step as steps

  tx = optim.optimizer(cfg.optim, cfg.train.steps)
  abstract = steps.placed_abstract_state(cfg, tx, layout)[0]
  return abstract, fit.compile_step(cfg, tx=tx, layout=layout)[1]


def _cost(compiled) -> dict:
  cost = compiled.cost_analysis() or {}
  if isinstance(cost, list | tuple):  # older jax: one dict per program
    cost = cost[0] if cost else {}
  return {k: float(cost.get(k, 0.0)) for k in ("flops", "bytes accessed", "optimal_seconds")}


def estimate_cost(cfg, layout, compiled) -> dict:
  """The step's per-device flops and bytes accessed as XLA's cost analysis counts them. That
  analysis counts a loop's body once, whatever its trip count, so a scanned model (`model.scan`)
  or micro-batches would read as one layer or one slice: then two loop-free probes of one and
  two layer-pattern periods (no scan, one micro-batch of B / micro_batches rows) give the cost
  outside the layers and per period, and the step is micro_batches x (outside + layers / period
  x per period). A loop-free step (or a model without `num_layers`) is read as `compiled`."""
  layers = cfg.model.get("num_layers")
  if not layers or (not cfg.model.scan and cfg.train.micro_batches == 1):
    return _cost(compiled)
  from nnx_zoo.common import parallel
  from nnx_zoo.common.nn import pipeline

  period = len(cfg.model.layer_pattern) or 1
  micro = cfg.train.micro_batches
  # Pipelined, the probes run on one stage's devices (no pipeline): every stage computes what is
  # outside the layers in full, and its 1 / S of the layers stretched by the bubbles.
  schedule = pipeline.schedule_of(layout)
  stretch = 1.0
  if schedule is not None:
    sizes = {**layout.sizes, "pipeline": 1}
    stage = np.asarray(layout.mesh.devices)[0].reshape(-1)
    layout = parallel.make_layout(sizes, list(stage))
    stretch = schedule.iterations / (schedule.microbatches * schedule.repeats) / schedule.stages
  probes = []
  for n in (period, 2 * period):
    probe = copy.deepcopy(cfg)
    probe.model.num_layers = n
    probe.model.scan = False
    probe.train.micro_batches = 1
    probe.train.batch_size = cfg.train.batch_size // micro
    probes.append(_cost(_compile(probe, layout)[1]))
  per_period = {k: probes[1][k] - probes[0][k] for k in probes[0]}
  return {
    k: micro * (probes[0][k] - per_period[k] + layers / period * stretch * per_period[k])
    for k in probes[0]
  }


def pipeline_figures(cfg, layout, abstract) -> dict | None:
  """Per device, for `mesh.pipeline` > 1 (None otherwise): the schedule, its bubble fraction,
  the bytes of the stage's stacked weights, the inputs the iterations keep for the backward pass
  (one micro-batch's activations each, and the delay line between repeats once), and the bytes
  a stage sends on per step (its activations forward and their gradients back, in every
  iteration of every `train.micro_batches` slice, and the last stage's outputs by psum)."""
  from flax import nnx

  from nnx_zoo.common.nn import pipeline, stacking

  schedule = pipeline.schedule_of(layout)
  if schedule is None:
    return None
  sizes = layout.sizes
  rows = cfg.train.batch_size // (
    sizes["data"] * sizes["fsdp"] * sizes["expert"] * cfg.train.micro_batches
  )
  dtype = np.dtype(cfg.model.get("dtype", "float32"))
  micro_bytes = rows // schedule.microbatches * sequence(cfg) * cfg.model.dim * dtype.itemsize
  delay = schedule.delay if schedule.repeats > 1 else 0
  stacked = [v for k, v in nnx.to_flat_state(abstract.params) if stacking.STACKED in k]
  return {
    "stages": schedule.stages,
    "repeats": schedule.repeats,
    "microbatches": schedule.microbatches,
    "bubble": schedule.bubble,
    "stage_weight_bytes": _shard_bytes(stacked),
    "saved_iteration_bytes": (schedule.iterations + delay) * micro_bytes,
    "sent_bytes": cfg.train.micro_batches
    * (2 * schedule.iterations * micro_bytes + 2 * schedule.microbatches * micro_bytes),
  }


def plan(cfg, topology: str | Topology, *, estimate_time: bool = True) -> dict:
  """Compiles `cfg`'s train step for `topology` and reports, per device: parameter, optimizer
  and temporary bytes, the total against the chip's HBM; with `estimate_time`, the step's FLOPs
  (`estimate_cost`), its roofline time, tokens/s and MFU. `cfg` is used as
  given: `config(exp, topology)` resolves an experiment with its mesh rule for this hardware."""
  import jax

  from nnx_zoo.common import parallel
  from nnx_zoo.common.train import optim
  from nnx_zoo.common.train import step as steps

  topo = topology if isinstance(topology, Topology) else parse_topology(topology)
  devs = devices(topo)
  sizes = mesh.resolve(cfg.mesh, len(devs))
  parallel.check_experiment(cfg, sizes)
  # Always a mesh, even of one device: without one the step would be placed on this machine's
  # own default device (the CPU), not on the slice.
  layout = parallel.experiment_layout(cfg, sizes, devs)
  result = {
    "experiment": cfg.get("experiment", ""),
    "topology": topo.cloud_name,
    "jax_topology": topo.jax_name,
    "hardware": topo.hardware,
    "chips": topo.chips,
    "mesh": sizes,
    "mesh_rule": cfg.get("mesh_rule", ""),
    "batch_size": cfg.train.batch_size,
    "seq_len": sequence(cfg),
    "micro_batches": cfg.train.micro_batches,
    "remat": cfg.model.remat,
    "quant": cfg.model.quant,
    "hbm_bytes": topo.chip.hbm,
  }
  tx = optim.optimizer(cfg.optim, cfg.train.steps)
  abstract = steps.placed_abstract_state(cfg, tx, layout)[0]
  result["param_bytes"] = _shard_bytes(abstract.params)
  if (figures := pipeline_figures(cfg, layout, abstract)) is not None:
    result["pipeline"] = figures
  result["optimizer_bytes"] = _shard_bytes(abstract.opt_state)
  state_bytes = result["param_bytes"] + result["optimizer_bytes"]
  if state_bytes > result["hbm_bytes"]:
    # The weights and optimizer state alone overflow: no need to compile to say so.
    result.update(compile_s=0.0, temp_bytes=0, total_bytes=state_bytes, fits=False)
    result["fixes"] = fixes(cfg, sizes)
    return result
  start = time.perf_counter()
  try:
    compiled = _compile(cfg, layout)[1]
  except jax.errors.JaxRuntimeError as e:
    # XLA:TPU refuses a program whose temporaries overflow HBM; its message has both sizes.
    found = _OOM.search(str(e))
    if "RESOURCE_EXHAUSTED" not in str(e) or not found:
      raise
    result["compile_s"] = time.perf_counter() - start
    result["temp_bytes"] = _bytes(*found.groups()[:2])
    result["total_bytes"] = result["temp_bytes"] + state_bytes
    result["hbm_bytes"] = _bytes(*found.groups()[2:])  # the compiler's usable HBM
    result["fits"] = False
    result["compiler_says"] = str(e).splitlines()[0][:300]
    result["fixes"] = fixes(cfg, sizes)
    return result
  result["compile_s"] = time.perf_counter() - start

  # Live at the peak: the inputs (state and batch), the outputs not aliased to a donated input,
  # the temporaries and the program itself (as the trainer counts them: common/device_memory.py).
  mem = device_memory.program_bytes(compiled)
  result["argument_bytes"] = mem["argument"]
  result["output_bytes"] = mem["output"]
  result["temp_bytes"] = mem["temp"]
  result["code_bytes"] = mem["code"]
  result["total_bytes"] = (
    result["argument_bytes"] + result["output_bytes"] + result["temp_bytes"] + result["code_bytes"]
  )
  result["fits"] = result["total_bytes"] <= result["hbm_bytes"]
  result["fixes"] = [] if result["fits"] else fixes(cfg, sizes)
  flops, how = model_flops(cfg)
  result["model_flops"], result["model_flops_how"] = flops, how
  if not estimate_time:
    return result
  start = time.perf_counter()
  cost = estimate_cost(cfg, layout, compiled)
  result["estimate_s"] = time.perf_counter() - start
  result.update(roofline(cfg, topo, cost))
  return result


def roofline(cfg, topo: Topology, cost: dict) -> dict:
  """The step's time from its per-device cost (`estimate_cost`): the compiler's FLOPs and bytes,
  the Mosaic kernels' FLOPs, each at the chip's peak, with tokens/s and MFU (the model's FLOPs
  over the chips' bf16 peak)."""
  out = {
    "compiler_flops_per_device": cost["flops"],
    "bytes_accessed_per_device": cost["bytes accessed"],
  }
  # Mosaic kernels are opaque to the cost analysis; their work is spread evenly over the chips
  # (batch rows over data x fsdp x expert, heads over tensor).
  extra, what = kernel_flops(cfg)
  out["kernel_flops_per_device"], out["kernel_flops_how"] = extra / topo.chips, what
  cost = dict(cost, flops=cost["flops"] + extra / topo.chips)
  # XLA:TPU's own `optimal_seconds` comes out negative for full-size steps (measured: -1.8 s for
  # one Llama 3 8B layer), so the time is a roofline of its counts instead: each device at peak
  # FLOP/s or at full HBM bandwidth, whichever is slower; collectives are not counted. The
  # cost analysis counts an int8 product's FLOPs as any other's: those run at the int8 peak.
  out["xla_optimal_seconds"] = cost["optimal_seconds"]
  int8, int8_how = int8_flops(cfg)
  int8 = min(int8 / topo.chips, cost["flops"])
  out["int8_flops_per_device"], out["int8_flops_how"] = int8, int8_how
  compute = (cost["flops"] - int8) / topo.chip.peak + int8 / topo.chip.int8
  seconds = max(compute, cost["bytes accessed"] / topo.chip.bandwidth)
  out["step_s"] = seconds if seconds > 0 else None
  if out["step_s"]:
    out["tokens_per_s"] = tokens(cfg) / seconds
    out["mfu"] = model_flops(cfg)[0] / (seconds * topo.chips * topo.chip.peak)
  return out


def fixes(cfg, sizes: dict[str, int]) -> list[str]:
  """The levers that lower memory per device and are not pulled yet, most effective first: the
  trainer's (`fit.levers`), then more chips."""
  from nnx_zoo.common.train import fit

  return [lever.text for lever in fit.levers(cfg, sizes)] + [
    "a larger topology (more chips: more HBM in all)"
  ]


def config(exp: str, topology: str | Topology, overrides: dict[str, str] | None = None):
  """The experiment's config on `topology`: its mesh rule for that hardware, then `overrides`."""
  from nnx_zoo.common import experiments

  topo = topology if isinstance(topology, Topology) else parse_topology(topology)
  return experiments.get_config(exp, overrides, hardware=topo.hardware)


_gib = device_memory.gib


def format(result: dict) -> str:  # noqa: A001 (the module's formatter, as `plan.format`)
  """The plan as a few aligned lines."""
  r = result
  mesh_txt = " ".join(f"{k}={v}" for k, v in r["mesh"].items())
  lines = [
    f"{r['experiment']} on {r['topology']} ({r['jax_topology']}, {r['chips']} chips, "
    f"hardware name {r['hardware']})",
    f"  mesh rule      {r['mesh_rule'] or 'none'}",
    f"  mesh           {mesh_txt}; batch {r['batch_size']} x {r['seq_len']} tokens, "
    f"micro_batches {r['micro_batches']}, remat {r['remat']}"
    + (f", quant {r['quant']}" if r.get("quant", "none") != "none" else ""),
    f"  memory/device  params {_gib(r['param_bytes'])}, optimizer {_gib(r['optimizer_bytes'])}, "
    f"temporaries {_gib(r['temp_bytes'])}; total {_gib(r['total_bytes'])} of "
    f"{_gib(r['hbm_bytes'])} HBM: {'fits' if r['fits'] else 'DOES NOT FIT'}",
  ]
  if "pipeline" in r:
    p = r["pipeline"]
    lines.append(
      f"  pipeline       {p['stages']} stages x {p['repeats']} repeats, {p['microbatches']} "
      f"micro-batches: bubble {p['bubble']:.1%}; stage weights {_gib(p['stage_weight_bytes'])}, "
      f"saved iteration inputs {_gib(p['saved_iteration_bytes'])}, sent between stages "
      f"{_gib(p['sent_bytes'])}/step"
    )
  if "compiler_says" in r:
    lines.append(f"  compiler       {r['compiler_says']}")
  if "model_flops" in r:
    compiler = (
      f"; compiler {r['compiler_flops_per_device']:.3g}/device"
      if "compiler_flops_per_device" in r
      else ""
    )
    if r.get("kernel_flops_per_device"):
      compiler += f" + {r['kernel_flops_per_device']:.3g} ({r['kernel_flops_how']})"
    if r.get("int8_flops_per_device"):
      compiler += f", of which {r['int8_flops_per_device']:.3g} {r['int8_flops_how']}"
    lines.append(
      f"  FLOPs          model {r['model_flops']:.3g}/step ({r['model_flops_how']}){compiler}"
    )
  if r.get("step_s"):
    lines.append(
      f"  time           {r['step_s']:.3g} s/step (roofline of XLA's counts), "
      f"{r['tokens_per_s']:,.0f} tokens/s, MFU {r['mfu']:.0%}"
    )
  elif "estimate_s" in r:
    lines.append("  time           the compiler gave no time estimate")
  extra = f" + {r['estimate_s']:.1f} s for the time estimate" if "estimate_s" in r else ""
  lines.append(f"  compile        {r['compile_s']:.1f} s{extra} on this machine")
  if r["fixes"]:
    lines.append("  to fit, try    " + "\n                 ".join(r["fixes"]))
  return "\n".join(lines)
