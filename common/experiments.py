"""Finding an experiment (a registered name or a file path, with an optional `:arg`) and
resolving its config with command-line overrides."""

import importlib
import importlib.util
import os

import ml_collections

from nnx_zoo.common import config as config_lib
from nnx_zoo.common import mesh, tasks
from nnx_zoo.common.errors import UserError, suggest
from nnx_zoo.common.train import settings
from nnx_zoo.experiments import REGISTRY

# Keys every experiment has, so an override means the same thing everywhere (docs/DESIGN.md).
COMMON_KEYS = (
  "seed",
  "train.steps",
  "train.batch_size",
  "train.checkpoint_every",
  "mesh.data",
  "mesh.fsdp",
  "mesh.expert",
  "mesh.context",
  "mesh.tensor",
  "init_from",
  "init_reinit",
)


def split_arg(exp: str) -> tuple[str, str | None]:
  """ "lm/llama3-8b:smoke" -> ("lm/llama3-8b", "smoke"). A Windows drive colon is not an arg."""
  head, sep, arg = exp.rpartition(":")
  if not sep or not head or "/" in arg or "\\" in arg:
    return exp, None
  return head, arg


def load_module(name: str):
  if name in REGISTRY:
    return importlib.import_module(REGISTRY[name])
  if name.endswith(".py"):
    if not os.path.isfile(name):
      raise UserError(f"Experiment file {name!r} does not exist.")
    spec = importlib.util.spec_from_file_location(
      "zoo_experiment_" + os.path.basename(name)[:-3], name
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    if not hasattr(module, "get_config"):
      raise UserError(f"{name} has no get_config(arg=None): copy an experiment file as a start.")
    return module
  raise UserError(
    f"Unknown experiment {name!r}.{suggest(name, REGISTRY)} `zoo list` shows them all; "
    "a path to an experiment file (ending in .py) works too."
  )


def get_config(
  exp: str, overrides: dict[str, str] | None = None, *, hardware: str | None = None
) -> ml_collections.ConfigDict:
  """The experiment's config; on `hardware` (see nnx_zoo.common.mesh.hardware_name), the first
  of its `mesh_rules` that matches is applied first, then the command line's overrides."""
  name, arg = split_arg(exp)
  module = load_module(name)
  args = getattr(module, "ARGS", ("smoke",))
  if arg is not None and arg not in args:
    raise UserError(f"{name} takes no argument {arg!r}.{suggest(arg, args)} It takes: {args}.")
  cfg = module.get_config(arg) if arg is not None else module.get_config()
  settings.complete(cfg)  # every trainer key, whatever the file sets
  missing = [k for k in COMMON_KEYS if k not in config_lib.flatten(cfg)]
  if missing:
    raise UserError(f"Experiment {name} lacks the common keys {missing} (see docs/DESIGN.md).")
  cfg.mesh_rule = ""
  if hardware is not None:
    rule = mesh.pick_rule(cfg.get("mesh_rules", []), hardware)
    if rule is not None:
      pattern, rule_overrides = rule
      config_lib.apply_overrides(cfg, {k: str(v) for k, v in rule_overrides.items()})
    cfg.mesh_rule = (
      f"{hardware} matches {pattern!r}: {rule_overrides}"
      if rule
      else f"{hardware} matches no mesh rule: the mesh as written"
    )
  cfg = config_lib.apply_overrides(cfg, overrides or {})
  if "task" not in cfg:  # an experiment file written before tasks were named: named here once
    cfg.task = tasks.infer(cfg)
  tasks.get(cfg.task)  # an unknown one is refused now, with the known ones
  cfg.experiment = exp
  return cfg


def describe(name: str) -> str:
  """The first line of the experiment's docstring."""
  doc = load_module(name).__doc__ or ""
  return doc.strip().splitlines()[0] if doc.strip() else ""
