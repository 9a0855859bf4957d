"""Finding an experiment (a registered name or a file path, with an optional `:arg`) and
resolving its config with command-line overrides."""

import importlib
import importlib.util
import os

import ml_collections

from nnx_zoo.common import config as config_lib
from nnx_zoo.common import mesh, models, tasks
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
  exp: str,
  overrides: dict[str, str] | None = None,
  *,
  hardware: str | None = None,
  resolve: bool = True,
) -> ml_collections.ConfigDict:
  """The experiment's config; on `hardware` (see nnx_zoo.common.mesh.hardware_name), the first
  of its `mesh_rules` that matches is applied first, then the command line's overrides.

  An experiment with `model_from="init_from"` takes its model, tokenizer and chat template from
  its init_from checkpoint (`resolve_model`); `resolve=False` leaves them as the file declares
  them (the golden configs: the checkpoint's paths are the machine's)."""
  overrides = dict(overrides or {})
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
  model_from = cfg.get("model_from", "")
  if model_from not in ("", "init_from"):
    raise UserError(f"model_from={model_from!r}: use '' (the experiment's model) or 'init_from'.")
  if model_from:
    check_levers(name, overrides)
  cfg = config_lib.apply_overrides(cfg, overrides)
  if model_from and resolve:
    resolve_model(cfg, name, keep_tokenizer=any(k.startswith("data.tokenizer.") for k in overrides))
  if "task" not in cfg:  # an experiment file written before tasks were named: named here once
    cfg.task = models.infer_task(cfg)
  tasks.get(cfg.task)  # an unknown one is refused now, with the known ones
  cfg.experiment = exp
  return cfg


def check_levers(name: str, overrides: dict[str, str]):
  """An experiment whose model comes from init_from takes only the training levers of the model
  on the command line (models.LEVERS): the architecture is the checkpoint's."""
  for key in overrides:
    if key.startswith("model.") and not models.is_lever(key):
      raise UserError(
        f"--config.{key}: {name} takes its model from init_from, and {key} is that model's "
        "architecture, not a training setting. Only these model keys can be set: "
        f"{', '.join(k + ('.*' if k == 'model.lora' else '') for k in models.LEVERS)}. To train "
        "another architecture, give another checkpoint, or copy an experiment that declares "
        "its model."
      )


def resolve_model(cfg: ml_collections.ConfigDict, name: str, *, keep_tokenizer: bool = False):
  """Puts the init_from checkpoint's model config in `cfg.model`, the experiment's levers (its
  `model` section, with the command line's overrides) on top, and its tokenizer in
  `cfg.data.tokenizer` (unless `keep_tokenizer`: set on the command line) and its chat template
  in `cfg.data.chat_template` where the experiment gives none (a zoo run's template; "" for a
  Hugging Face directory, whose tokenizer has its own)."""
  from nnx_zoo.common.hub import weights

  if not cfg.init_from:
    raise UserError(
      f"{name} takes its model, tokenizer and chat template from init_from, which is empty: set "
      "--config.init_from to a zoo checkpoint (a `zoo run` workdir, a `zoo convert hf` output) "
      "or a Hugging Face directory."
    )
  src = weights.source(cfg.init_from)
  model = ml_collections.ConfigDict(src.model.to_dict())
  for key, value in config_lib.flatten(cfg.model, "model.").items():
    *parents, leaf = key.split(".")[1:]
    node = model
    for p in parents:
      node = node[p]
    node[leaf] = value
  spec = weights.layer_spec(cfg)
  if spec:  # a student made of some of init_from's layers (distill.student_layers)
    if len(model.get("layer_pattern", ())) > 1:
      raise UserError(
        f"distill.student_layers: {src.path}'s layers follow a pattern of "
        f"{len(model.layer_pattern)} kinds, which a subset of them would break: leave it empty."
      )
    model.num_layers = len(weights.select_layers(spec, src.model.num_layers))
  cfg.model = model
  if "data" not in cfg:
    return
  if not keep_tokenizer:
    if src.tokenizer is None:
      raise UserError(
        f"{src.path} ({src.kind}) has no tokenizer: copy its tokenizer files (tokenizer.json, "
        "tokenizer_config.json) into it, or give one with --config.data.tokenizer.kind and "
        "--config.data.tokenizer.path."
      )
    cfg.data.tokenizer = src.tokenizer
  if "chat_template" in cfg.data and not cfg.data.chat_template:
    cfg.data.chat_template = src.chat_template


def model_origin(cfg) -> str:
  """Where the model config of a resolved experiment came from, for `zoo show`."""
  if not cfg.get("model_from"):
    return "declared by the experiment"
  from nnx_zoo.common.hub import weights

  src = weights.source(cfg.init_from)
  return (
    f"read from init_from={cfg.init_from} ({src.kind}: {src.path}), with the experiment's "
    "training levers on top (models.LEVERS)"
  )


def describe(name: str) -> str:
  """The first line of the experiment's docstring."""
  doc = load_module(name).__doc__ or ""
  return doc.strip().splitlines()[0] if doc.strip() else ""
