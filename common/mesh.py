"""The device mesh `(data, fsdp, expert, tensor)`: sizes from config, -1 meaning "the rest"."""

import contextlib
import math
import os

import ml_collections

from nnx_zoo.common.errors import UserError

# tensor last: the innermost axis gets the nearest devices (its collectives run every layer).
AXES = ("data", "fsdp", "expert", "tensor")


def resolve(mesh_cfg, num_devices: int) -> dict[str, int]:
  """{"data": d, "fsdp": f, "expert": e, "tensor": t} with d * f * e * t == num_devices, or a
  UserError. An axis the config lacks (a config saved before it existed) has size 1."""
  sizes = {axis: int(mesh_cfg.get(axis, 1)) for axis in AXES}
  free = [a for a, s in sizes.items() if s == -1]
  bad = [a for a, s in sizes.items() if s == 0 or s < -1]
  if bad or len(free) > 1:
    raise UserError(
      f"mesh {sizes}: each of mesh.data, mesh.fsdp, mesh.expert, mesh.tensor is a positive "
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


def config(**sizes) -> ml_collections.ConfigDict:
  """The `mesh` config: a size per axis (1 unless given; -1 = the remaining devices)."""
  unknown = [a for a in sizes if a not in AXES]
  if unknown:
    raise UserError(f"mesh has no axis {unknown[0]!r}: its axes are {', '.join(AXES)}.")
  return ml_collections.ConfigDict({axis: sizes.get(axis, 1) for axis in AXES})
