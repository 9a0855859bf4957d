"""The device mesh `(pipeline, data, fsdp, expert, context, tensor)`: sizes from config, -1
meaning "the rest". `context` splits the sequence of a language model's rows (common/parallel.py);
`pipeline` the stacked layers into stages (common/nn/pipeline.py)."""

import contextlib
import math
import os

import ml_collections

from nnx_zoo.common import attention_impl
from nnx_zoo.common.errors import UserError

# tensor last: the innermost axis gets the nearest devices (its collectives run every layer);
# context next to it, for the same reason (its key/value gathers run every layer too). pipeline
# first: the farthest devices (across slices) only pass activations from stage to stage.
AXES = ("pipeline", "data", "fsdp", "expert", "context", "tensor")


def resolve(mesh_cfg, num_devices: int) -> dict[str, int]:
  """{"pipeline": p, "data": d, "fsdp": f, "expert": e, "context": c, "tensor": t} whose
  product is num_devices, or a UserError. An axis the config lacks (a config saved before it
  existed) has size 1."""
  sizes = {axis: int(mesh_cfg.get(axis, 1)) for axis in AXES}
  free = [a for a, s in sizes.items() if s == -1]
  bad = [a for a, s in sizes.items() if s == 0 or s < -1]
  if bad or len(free) > 1:
    raise UserError(
      f"mesh {sizes}: each of {', '.join('mesh.' + a for a in AXES)} is a positive "
      "size, and at most one may be -1 (the remaining devices)."
    )
  fixed = math.prod(s for s in sizes.values() if s != -1)
  if free:
    if num_devices % fixed:
      raise UserError(
        f"mesh {sizes}: the fixed sizes multiply to {fixed}, which does not divide the "
        f"{num_devices} devices. Choose sizes whose product divides {num_devices}."
      )
    sizes[free[0]] = num_devices // fixed
  elif fixed != num_devices:
    raise UserError(
      f"mesh {sizes} needs {fixed} devices but {num_devices} are present. Set the sizes to "
      f"multiply to {num_devices}, or one of them to -1."
    )
  return sizes


# Mesh rules (AXLearn's idea): an experiment lists (hardware pattern, overrides) pairs; the first
# pattern that matches the hardware found at start-up sets the mesh and memory levers for it.


def hardware_name(devices=None) -> str:
  """`cpux1`, `gpu-nvidia-h100-80gb-hbm3x8`, `tpu-v5px64`: the device kind and count."""
  import jax

  if devices is None:
    with quiet_stderr():  # the first call starts the backends: libtpu's C-level noise on a CPU
      devices = jax.devices()
  d = devices[0]
  kind = d.device_kind.lower().replace(" ", "-")
  if not kind.startswith(d.platform):
    kind = f"{d.platform}-{kind}"
  return f"{kind}x{len(devices)}"


def platform_of(hardware: str) -> str:
  """The platform ("cpu", "gpu" or "tpu") a hardware name (`hardware_name`'s form) is on."""
  return next((p for p in ("gpu", "tpu") if hardware.startswith(p)), "cpu")


@contextlib.contextmanager
def quiet_stderr():
  """Silences stderr at the file-descriptor level: libtpu (installed with the tpu and test
  extras) warns from C, when jax starts its backends on a machine without a TPU, that it finds
  no TPU metadata; a user error should stay one line."""
  saved = os.dup(2)
  with open(os.devnull, "w") as null:
    os.dup2(null.fileno(), 2)
    try:
      yield
    finally:
      os.dup2(saved, 2)
      os.close(saved)


def pick_rule(rules, hardware: str) -> tuple[str, dict] | None:
  """The first (pattern, overrides) whose glob pattern matches `hardware`, or None."""
  import fnmatch

  for pattern, overrides in rules:
    if fnmatch.fnmatchcase(hardware, pattern):
      return pattern, dict(overrides)
  return None


# TPU slices by the hardware name jax's devices give (v5p reports "TPU v5", v5e "TPU v5 lite";
# the chip count follows an "x"), and the mesh each one's HBM calls for with a 7-8B model on 64
# chips: FSDP over every chip where 95 GiB a chip leaves room, heads split over `tensor` where 32
# or 16 GiB do not. A larger slice puts its extra chips on `fsdp`.
TPU_SLICES = {
  "v5p": ("tpu-v5", {"mesh.fsdp": 64}),
  "v4": ("tpu-v4", {"mesh.fsdp": 32, "mesh.tensor": 2}),
  "v6e": ("tpu-v6-lite", {"mesh.fsdp": 32, "mesh.tensor": 2}),
  "v5e": ("tpu-v5-lite", {"mesh.fsdp": 16, "mesh.tensor": 4}),
}


def tpu_rules(
  *, max_tensor: int = 0, expert: int = 1, chips: int = 64, **micro_batches: int
) -> list[tuple[str, dict]]:
  """Mesh rules for TPU slices of `chips` chips (64: a v5p-128, v4-128, v6e-64, v5e-64), one per
  generation given (`tpu_rules(v5p=2, v5e=16)`), each with that slice's mesh, `train.micro_batches`
  as given, splash attention (`attention.impl=flash`: no [T, S] scores), `model.remat=full` and
  `model.scan`. Size them with `zoo plan` (bench/plan_recipes.py prints the table).

  max_tensor: the most `mesh.tensor` the model's heads allow (a model with one kv head: 1); a
  slice whose mesh splits heads further moves the rest of its chips to `fsdp` (0: no limit).
  expert: `mesh.expert` for a mixture of experts, its chips taken from `fsdp` (each chip then
  keeps E / expert experts whole instead of a slice of every expert).
  chips: the slice size (a multiple of 64), for a model whose state does not fit 64 chips."""
  unknown = sorted(set(micro_batches) - set(TPU_SLICES))
  if unknown:
    raise UserError(f"tpu_rules knows no generation {unknown}: it knows {', '.join(TPU_SLICES)}.")
  if chips % 64:
    raise UserError(f"tpu_rules(chips={chips}): slices of a multiple of 64 chips only.")

  def sized(sizes: dict) -> dict:
    sizes = {**sizes, "mesh.fsdp": sizes["mesh.fsdp"] * chips // 64}
    tensor = sizes.get("mesh.tensor", 1)
    if max_tensor and tensor > max_tensor:
      sizes.update(
        {"mesh.fsdp": sizes["mesh.fsdp"] * tensor // max_tensor, "mesh.tensor": max_tensor}
      )
    if expert > 1:
      if sizes["mesh.fsdp"] % expert:
        raise UserError(
          f"tpu_rules(expert={expert}): the slice's fsdp={sizes['mesh.fsdp']} has no room for it."
        )
      sizes.update({"mesh.fsdp": sizes["mesh.fsdp"] // expert, "mesh.expert": expert})
    return sizes

  return [
    (
      f"{prefix}x{chips}",
      {
        **sized(sizes),
        "model.attention.impl": "flash",
        "model.remat": "full",
        "model.scan": True,
        "train.micro_batches": micro_batches[gen],
      },
    )
    for gen, (prefix, sizes) in TPU_SLICES.items()
    if gen in micro_batches
  ]


# GPUs by memory, as jax names them (`hardware_name`): 80 GB parts (H100 SXM and PCIe, A100
# 80GB) and 141 GB ones (H200). XLA takes 75% of a GPU's memory at start by default
# (XLA_PYTHON_CLIENT_MEM_FRACTION), so that is what a step is sized to.
GPU_MEMORY = {80: ("gpu-*h100*", "gpu-*80gb*"), 141: ("gpu-*h200*",)}
XLA_MEMORY_FRACTION = 0.75
GPU_RESERVE = 2 * 2**30  # cuDNN/cuBLAS workspaces, the FSDP gathers' double buffers, fragmentation


def _param_count(m) -> int:
  """A decoder's parameters by arithmetic (norms left out): what `gpu_rules` sizes the state by,
  without building the model (get_config runs often; models.num_params builds it abstractly)."""
  a = m.attention
  N, K, H, D, L = a.num_heads, a.num_kv_heads, a.head_dim, m.dim, m.num_layers
  mlp = m.mlp
  moe = mlp.kind == "moe"
  experts = mlp.num_experts if moe else 0
  ffn = 3 * D * mlp.hidden_dim * max(experts, 1) + D * experts
  ffn += 3 * D * (mlp.shared_hidden_dim if moe else 0)
  embed = m.vocab_size * D * (1 if m.tie_embeddings else 2)
  return L * (D * (N + 2 * K) * H + N * H * D + ffn) + embed


def _activation_bytes_per_row(m, seq_len: int) -> int:
  """One row's activation memory in a step with `model.remat=full`: the bf16 residual stream
  kept at each layer boundary, plus one layer recomputed in the backward (its q/k/v/o, norms and
  MLP hidden in fp32, doubled for their gradients). Where "auto" attention runs the xla path on a
  Hopper GPU (a soft-cap: Gemma 2), that layer's [N, T, T] fp32 scores and probabilities too.
  An MoE layer's MLP is its routed k experts' (and its dispatch buffers, the same again)."""
  a, mlp = m.attention, m.mlp
  moe = mlp.kind == "moe"
  hidden = mlp.hidden_dim * (2 * mlp.top_k if moe else 1) + (mlp.shared_hidden_dim if moe else 0)
  layer = seq_len * (2 * (a.num_heads + 2 * a.num_kv_heads) * a.head_dim + 4 * m.dim + 3 * hidden)
  impl, _ = attention_impl.resolve_auto(
    platform="gpu",
    dtype=m.dtype,
    head_dim=a.head_dim,
    seq_len=seq_len,
    segments=True,
    softcap=bool(a.softcap),
    device_kind="NVIDIA H100",
  )
  if a.impl == "xla" or (a.impl == "auto" and impl == "xla"):
    layer += 2 * a.num_heads * seq_len * seq_len
  return m.num_layers * seq_len * m.dim * 2 + 2 * 4 * layer


def gpu_rules(model_cfg, *, batch_size: int, seq_len: int) -> list[tuple[str, dict]]:
  """Mesh rules for one GPU and for 8 GPUs, of 80 GB and of 141 GB: FSDP over the GPUs,
  `model.remat=full`, `model.scan` and the fewest micro-batches whose activations fit beside the
  state (attention.impl stays "auto": cuDNN where it applies). Sized by arithmetic, none measured:
  16 bytes a parameter (fp32 params and gradients, AdamW's two moments) over the GPUs, plus
  `_activation_bytes_per_row` for each row of a micro-batch, within XLA's 75% of the memory less
  GPU_RESERVE. A size whose state alone does not fit gets no rule (a 7-8 B model on one GPU):
  the config as written then applies, and `zoo run` says the step is out of memory."""
  state = 16 * _param_count(model_cfg)
  per_row = _activation_bytes_per_row(model_cfg, seq_len)
  rules = []
  for gpus in (1, 8):
    for memory, patterns in GPU_MEMORY.items():
      room = memory * 1e9 * XLA_MEMORY_FRACTION - GPU_RESERVE - state / gpus
      rows = batch_size // gpus  # each GPU's rows of the global batch (fsdp splits the batch)
      fit = int(room // per_row) if room > 0 else 0
      if fit < 1 or rows < 1:
        continue
      micro = next(mb for mb in range(1, rows + 1) if rows % mb == 0 and rows // mb <= fit)
      overrides = {"model.remat": "full", "model.scan": True, "train.micro_batches": micro}
      if gpus > 1:
        overrides = {"mesh.fsdp": gpus, **overrides}
      rules += [(f"{pattern}x{gpus}", dict(overrides)) for pattern in patterns]
  return rules


def config(**sizes) -> ml_collections.ConfigDict:
  """The `mesh` config: a size per axis (1 unless given; -1 = the remaining devices)."""
  unknown = [a for a in sizes if a not in AXES]
  if unknown:
    raise UserError(f"mesh has no axis {unknown[0]!r}: its axes are {', '.join(AXES)}.")
  return ml_collections.ConfigDict({axis: sizes.get(axis, 1) for axis in AXES})
