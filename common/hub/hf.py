"""Hugging Face directories <-> zoo params, through a family's key map.

How a family's weights are named and laid out on the HF side lives in `zoo/<family>/params.py`:

- `MODEL_TYPES`: the HF `model_type`s (config.json) the family reads;
- `PREFIX`: the base model's prefix inside HF task models (`model.` in LlamaForCausalLM), read
  with or without it;
- `IGNORED`: regexes of HF tensors that have no zoo parameter and are dropped (buffers, task
  heads the zoo model lacks, a tied copy of the embedding);
- `config_from_hf(hf_config, names)` -> the zoo model config (`names`: the checkpoint's tensor
  names, for what config.json does not say), and `config_to_hf(cfg, model_type)` -> config.json
  (`model_type`: the source's on a round trip, kept when it fits);
- `rules(cfg)`: a list of `nnx_zoo.common.keymap.Rule`s, each moving one HF tensor to one or
  more zoo parameters and back, with HF names as `export_hf` writes them.

This module reads the files, checks every name and shape against the rules before touching a
tensor, and reports every problem in one UserError.
"""

import importlib
import inspect
import json
import math
import os
import re

import jax
import jax.numpy as jnp
from flax import nnx

from nnx_zoo.common import models
from nnx_zoo.common.errors import UserError
from nnx_zoo.common.keymap import Rule, hf_names
from nnx_zoo.common.nn import stacking

# config.json fields of a converted checkpoint that its export does not carry over.
NOT_KEPT = ("architectures", "transformers_version", "dtype", "torch_dtype", "_name_or_path")
# transformers' own "legacy" renames, applied to every checkpoint it loads.
LEGACY_RENAMES = (
  (r"LayerNorm\.gamma$", "LayerNorm.weight"),
  (r"LayerNorm\.beta$", "LayerNorm.bias"),
)


def params_module(family: str):
  """zoo/<family>/params.py, or a UserError if the family has no HF key map."""
  models.family_module(family)  # an unknown family fails here, with suggestions
  name = models.families()[family].rsplit(".", 1)[0] + ".params"
  try:
    return importlib.import_module(name)
  except ModuleNotFoundError:
    raise UserError(f"The {family} family has no Hugging Face key map ({name}).") from None


def family_of(model_type: str) -> str:
  """The zoo family whose params.py reads HF `model_type`."""
  families = {}
  for family in models.families():
    try:
      families.update({t: family for t in params_module(family).MODEL_TYPES})
    except UserError:  # a family without a key map
      continue
  if model_type not in families:
    raise UserError(
      f"Unknown architecture: model_type {model_type!r} in config.json. The zoo converts "
      f"{', '.join(sorted(families))}."
    )
  return families[model_type]


def _path(dotted: str) -> tuple:
  return tuple(int(p) if p.isdigit() else p for p in dotted.split("."))


def _abstract_params(cfg) -> dict[str, nnx.Param]:
  """The model's parameters by dotted path, one tree per layer (`blocks.3.attn.q.kernel`):
  the key maps name each layer's, whether `model.scan` stores them stacked or not."""
  state = stacking.unstack_layers(nnx.state(models.abstract(cfg), nnx.Param))
  return {".".join(map(str, k)): v for k, v in nnx.to_flat_state(state)}


def _stacked_as(cfg) -> dict:
  """The stacks the model of `cfg` stores stacked (`stacking.layouts`)."""
  return stacking.layouts(k for k, _ in nnx.to_flat_state(nnx.state(models.abstract(cfg))))


def _checked_rules(cfg, mod, names=None) -> tuple[list[Rule], dict[str, nnx.Param]]:
  """The family's rules, which must cover every zoo parameter exactly once (a bug otherwise)."""
  want = _abstract_params(cfg)
  rules = _rules_for(cfg, mod, names)
  covered = [z for r in rules for z in r.zoo]
  assert sorted(covered) == sorted(want), (
    f"{mod.__name__}.rules does not cover the model exactly once: "
    f"uncovered {sorted(set(want) - set(covered))}, unknown {sorted(set(covered) - set(want))}"
  )
  return rules, want


# Hugging Face files


HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
HUB_FILES = ["*.json", "*.safetensors", "*.model", "*.txt"]  # weights, configs, tokenizers


def fetch(src: str) -> str:
  """A local directory for `src`: itself, or for a hub id (`Qwen/Qwen3-0.6B`) that is not a
  local path, the files the zoo reads, downloaded into the Hugging Face cache."""
  if os.path.exists(src) or not HUB_ID.match(src):
    return src
  try:
    from huggingface_hub import snapshot_download

    return snapshot_download(src, allow_patterns=HUB_FILES)
  except Exception as e:  # no network, no such repo, a gated model...
    raise UserError(
      f"{src!r} is not a local directory, and fetching it from the Hugging Face hub failed "
      f"({type(e).__name__}: {str(e)[:200]}). Give a local directory (`hf download {src} "
      "--local-dir DIR` on a machine with network), or check the id."
    ) from None


def read_hf_config(src: str) -> dict:
  path = os.path.join(src, "config.json")
  if not os.path.isdir(src):
    raise UserError(f"{src!r} is not a directory: give a Hugging Face model directory.")
  if not os.path.isfile(path):
    raise UserError(
      f"{src!r} has no config.json: give a Hugging Face model directory (config.json and "
      "*.safetensors, as `save_pretrained` writes)."
    )
  try:
    with open(path) as f:
      hf = json.load(f)
  except json.JSONDecodeError as e:
    raise UserError(f"{path} is not valid JSON ({e}).") from None
  if "model_type" not in hf and "_class_name" not in hf:
    raise UserError(f"{path} has no model_type: the zoo cannot tell the architecture.")
  return hf


def architecture(hf: dict) -> str:
  """What a config.json says the model is: transformers' `model_type`, or diffusers'
  `_class_name` (a diffusers model's config has no model_type)."""
  return hf.get("model_type") or hf["_class_name"]


# transformers' weights file, then diffusers' (a diffusers model directory).
WEIGHTS_NAMES = ("model.safetensors", "diffusion_pytorch_model.safetensors")


class SafeTensors:
  """The tensors of an HF directory: model.safetensors, or the shards a
  model.safetensors.index.json names (or diffusers' diffusion_pytorch_model.safetensors and
  its index). Names, shapes and dtypes are read without the data."""

  def __init__(self, src: str):
    from safetensors import safe_open

    indexes = [os.path.join(src, f"{name}.index.json") for name in WEIGHTS_NAMES]
    index = next((p for p in indexes if os.path.isfile(p)), indexes[0])
    single = [name for name in WEIGHTS_NAMES if os.path.isfile(os.path.join(src, name))]
    if os.path.isfile(index):
      with open(index) as f:
        weight_map = json.load(f)["weight_map"]
      files = sorted(set(weight_map.values()))
    elif single:
      files = single[:1]
    else:
      others = [f for f in os.listdir(src) if f.endswith((".bin", ".pt", ".h5", ".msgpack"))]
      raise UserError(
        f"{src} has no model.safetensors (nor model.safetensors.index.json)"
        + (f"; it has {others}: save it as safetensors first" if others else "")
        + "."
      )
    missing = [f for f in files if not os.path.isfile(os.path.join(src, f))]
    if missing:
      raise UserError(f"{index} names shards that are not there: {missing}.")
    self.handles = {f: safe_open(os.path.join(src, f), framework="flax") for f in files}
    # A safe_open handle is not a dict: keys() is how it lists its tensors.
    self.file_of = {k: f for f, h in self.handles.items() for k in h.keys()}  # noqa: SIM118

  def names(self) -> list[str]:
    return sorted(self.file_of)

  def shape(self, name: str) -> tuple[int, ...]:
    return tuple(self.handles[self.file_of[name]].get_slice(name).get_shape())

  def dtype(self, name: str) -> str:
    return self.handles[self.file_of[name]].get_slice(name).get_dtype()

  def get(self, name: str) -> jax.Array:
    return self.handles[self.file_of[name]].get_tensor(name)


def _hf_name(name: str, mod, expected) -> str | None:
  """The rule name a checkpoint's tensor name stands for (with or without the base model's
  prefix, legacy LayerNorm names), or None."""
  for old, new in LEGACY_RENAMES:
    name = re.sub(old, new, name)
  for candidate in (name, mod.PREFIX + name, name.removeprefix(mod.PREFIX)):
    if candidate in expected:
      return candidate
  return None


FLOAT_DTYPES = ("F32", "F16", "BF16", "F64")


def _rules_for(cfg, mod, names=None) -> list[Rule]:
  """The family's rules; a key map that reads several layouts (per-expert or fused MoE
  weights) takes the checkpoint's tensor names and picks the one it holds."""
  if names is not None and "names" in inspect.signature(mod.rules).parameters:
    return mod.rules(cfg, names=names)
  return mod.rules(cfg)


def _shapes(rule: Rule, want) -> tuple:
  """The HF shapes a rule expects, one per name, traced abstractly."""
  out = jax.eval_shape(rule.to_hf, *(want[z] for z in rule.zoo))
  return tuple(o.shape for o in out) if isinstance(rule.hf, tuple) else (out.shape,)


def _held(rule: Rule, want) -> int:
  """The values a rule holds at most while converting its HF tensors: theirs, twice where it
  transposes them (a copy). A rule with no zoo parameter (`keymap.fixed`: checked, dropped)
  holds its tensors only, and is not traced: its check needs their values."""
  shapes = _shapes(rule, want)
  if not rule.zoo:
    return sum(math.prod(s) for s in shapes)
  jaxpr = jax.make_jaxpr(rule.to_zoo)(*(jax.ShapeDtypeStruct(s, jnp.float32) for s in shapes))
  copies = 2 if any(e.primitive.name == "transpose" for e in jaxpr.eqns) else 1
  return copies * sum(math.prod(s) for s in shapes)


def from_hf(
  cfg, mod, tensors: SafeTensors, *, src: str, quantize=None
) -> tuple[nnx.State, list[str]]:
  """The zoo params (in cfg.param_dtype, in the layout of cfg's model: stacked if
  `model.scan`) of an HF checkpoint, and the names it dropped. `quantize` (`qlora.quantizer`):
  applied to each parameter as soon as it is read, so that a quantized base is never whole in
  fp32."""
  rules, want = _checked_rules(cfg, mod, names=tensors.names())
  by_name = {n: r for r in rules for n in hf_names(r)}
  found, skipped, extra = {}, [], []
  for name in tensors.names():
    hf = _hf_name(name, mod, by_name)
    if hf in found:
      extra.append(f"{name} (a second copy of {hf}, after {found[hf]})")
    elif hf is not None:
      found[hf] = name
    elif any(re.search(p, name) for p in mod.IGNORED):
      skipped.append(name)
    else:
      extra.append(f"{name} {list(tensors.shape(name))}")
  problems = [f"unexpected weight {n}" for n in extra]
  for rule in rules:
    for hf, shape in zip(hf_names(rule), _shapes(rule, want), strict=True):
      if hf not in found:
        problems.append(f"missing weight {hf} {list(shape)}")
        continue
      got, dtype = tensors.shape(found[hf]), tensors.dtype(found[hf])
      if got != shape:
        problems.append(f"{found[hf]} has shape {list(got)}, the model needs {list(shape)}")
      elif dtype not in FLOAT_DTYPES:
        problems.append(f"{found[hf]} has dtype {dtype}, not a float")
  if problems:
    raise UserError(
      f"{src} does not fit the {cfg.family} model its config.json describes "
      f"({len(problems)} problem{'s' * (len(problems) > 1)}):\n  "
      + "\n  ".join(problems)
      + "\nCheck that config.json belongs to these weights."
    )
  param_dtype = jnp.dtype(cfg.param_dtype)
  # Read the rules that hold most while converted first, while little else is held yet: a
  # transposed tensor is held twice (read and transposed: Qwen2.5-0.5B's untied head, 545 MiB
  # each); the params are then listed in the rules' order.
  held = [_held(rule, want) for rule in rules]
  order = sorted(range(len(rules)), key=lambda i: -held[i])
  read = {}
  for i in order:
    rule = rules[i]
    # A host array read (GGUF's, dequantized) becomes the jax array without a copy.
    values = rule.to_zoo(
      *(jax.device_put(tensors.get(found[n]), may_alias=True) for n in hf_names(rule))
    )
    # Converted before the next tensor is read (jax runs it asynchronously: the read tensor
    # would otherwise be held beside the next one).
    jax.block_until_ready(values)
    read[i] = []
    for z, value in zip(rule.zoo, values, strict=True):
      var = want[z].replace(value.astype(param_dtype))
      read[i].extend([(_path(z), var)] if quantize is None else quantize(_path(z), var))
    jax.block_until_ready(read[i])  # quantized, its fp32 source freed
    del values  # the fp32 tensors of this rule, before the next is read
  flat = [kv for i in range(len(rules)) for kv in read[i]]
  return stacking.stack_layers(nnx.from_flat_state(flat), _stacked_as(cfg)), skipped


def to_hf(cfg, mod, params: nnx.State) -> dict[str, jax.Array]:
  """HF tensors (named as the rules name them) of zoo params."""
  rules, want = _checked_rules(cfg, mod)
  have = {".".join(map(str, k)): v for k, v in nnx.to_flat_state(stacking.unstack_layers(params))}
  missing = sorted(set(want) - set(have))
  if missing:
    raise UserError(f"The checkpoint lacks the parameters {missing[:10]}.")
  out = {}
  for r in rules:
    tensors = r.to_hf(*(jnp.asarray(have[z][...]) for z in r.zoo))
    tensors = tensors if isinstance(r.hf, tuple) else (tensors,)
    out.update({n: jnp.asarray(x) for n, x in zip(hf_names(r), tensors, strict=True)})
  return out


def read_hf(src: str, *, param_dtype: str = "float32", quantize=None):
  """The model config and params of an HF directory, and what was read: its config.json and
  the tensors dropped (IGNORED). `quantize`: as `from_hf`."""
  hf = read_hf_config(src)
  mod = params_module(family_of(architecture(hf)))
  tensors = SafeTensors(src)
  cfg = mod.config_from_hf(hf, tensors.names())
  cfg.param_dtype = param_dtype
  params, skipped = from_hf(cfg, mod, tensors, src=src, quantize=quantize)
  return cfg, params, {"config": hf, "skipped": skipped}
