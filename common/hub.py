"""Zoo checkpoints and Hugging Face directories: `load` a model from either, `convert_hf` an HF
directory into a zoo checkpoint, `export_hf` a zoo checkpoint into an HF directory.

How a family's weights are named and laid out on the HF side lives in `zoo/<family>/params.py`:

- `MODEL_TYPES`: the HF `model_type`s (config.json) the family reads;
- `PREFIX`: the base model's prefix inside HF task models (`model.` in LlamaForCausalLM), read
  with or without it;
- `IGNORED`: regexes of HF tensors that have no zoo parameter and are dropped (buffers, task
  heads the zoo model lacks, a tied copy of the embedding);
- `config_from_hf(hf_config, names)` -> the zoo model config (`names`: the checkpoint's tensor
  names, for what config.json does not say), and `config_to_hf(cfg, model_type)` -> config.json
  (`model_type`: the source's on a round trip, kept when it fits);
- `rules(cfg)`: a list of `Rule`s, each moving one HF tensor to one or more zoo parameters and
  back, with HF names as `export_hf` writes them.

This module reads and writes the files, checks every name and shape against the rules before
touching a tensor, and reports every problem in one UserError. Nothing is written on bad input.
"""

import dataclasses
import importlib
import json
import os
import re
import shutil
from collections.abc import Callable

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from flax import nnx

from common import checkpoint, lora, models
from common import config as config_lib
from common import tokenizers as tokenizers_lib
from common.errors import UserError

# Tokenizer files copied along with the weights (whichever the directory has).
TOKENIZER_FILES = (
  "tokenizer.json",
  "tokenizer_config.json",
  "special_tokens_map.json",
  "added_tokens.json",
  "vocab.json",
  "merges.txt",
  "vocab.txt",
  "tokenizer.model",
)
# config.json fields of a converted checkpoint that its export does not carry over.
NOT_KEPT = ("architectures", "transformers_version", "dtype", "torch_dtype", "_name_or_path")
# transformers' own "legacy" renames, applied to every checkpoint it loads.
LEGACY_RENAMES = (
  (r"LayerNorm\.gamma$", "LayerNorm.weight"),
  (r"LayerNorm\.beta$", "LayerNorm.bias"),
)


# Key maps


@dataclasses.dataclass(frozen=True)
class Rule:
  """One HF tensor <-> the zoo parameters `zoo` (dotted paths). `to_zoo(x) -> tuple` and
  `to_hf(*xs) -> x` are jnp functions, inverse to each other, so that shapes are checked by
  tracing them abstractly before any tensor is read."""

  hf: str
  zoo: tuple[str, ...]
  to_zoo: Callable
  to_hf: Callable


def copy(hf: str, zoo: str) -> Rule:
  return Rule(hf, (zoo,), lambda x: (x,), lambda x: x)


def transpose(hf: str, zoo: str) -> Rule:
  """A torch Linear weight is [out, in]; our Linear kernel is [in, out]."""
  return Rule(hf, (zoo,), lambda x: (x.T,), lambda x: x.T)


def split(hf: str, zoo: tuple[str, ...]) -> Rule:
  """A fused tensor (GPT-2's c_attn) cut into equal parts along its last dim."""
  n = len(zoo)
  return Rule(
    hf, zoo, lambda x: tuple(jnp.split(x, n, axis=-1)), lambda *xs: jnp.concatenate(xs, axis=-1)
  )


def linear(hf: str, zoo: str, *, bias: bool) -> list[Rule]:
  """A torch Linear `hf` (.weight, .bias) as our Linear `zoo` (.kernel, .bias)."""
  return [transpose(f"{hf}.weight", f"{zoo}.kernel")] + (
    [copy(f"{hf}.bias", f"{zoo}.bias")] if bias else []
  )


def plain_transformer_activation(cfg, activations: dict, name: str) -> str:
  """HF's activation name for a GPT-2 or BERT model (learned positions, LayerNorm, plain
  multi-head attention, a plain MLP): a UserError for a config HF's class cannot express."""
  act = {ours: theirs for theirs, ours in reversed(activations.items())}.get(cfg.mlp.kind)
  att = cfg.attention
  if (
    act is None
    or cfg.position.kind != "learned"
    or cfg.norm.kind != "layer"
    or att.num_kv_heads != att.num_heads
    or att.window
    or att.qk_norm != "none"
  ):
    raise UserError(f"This model has settings HF's {name} does not have: export it as its family.")
  return act


def params_module(family: str):
  """zoo/<family>/params.py, or a UserError if the family has no HF key map."""
  models.family_module(family)  # an unknown family fails here, with suggestions
  name = models.FAMILIES[family].rsplit(".", 1)[0] + ".params"
  try:
    return importlib.import_module(name)
  except ModuleNotFoundError:
    raise UserError(f"The {family} family has no Hugging Face key map ({name}).") from None


def family_of(model_type: str) -> str:
  """The zoo family whose params.py reads HF `model_type`."""
  families = {}
  for family in models.FAMILIES:
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
  state = nnx.state(models.abstract(cfg), nnx.Param)
  return {".".join(map(str, k)): v for k, v in nnx.to_flat_state(state)}


def _checked_rules(cfg, mod) -> tuple[list[Rule], dict[str, nnx.Param]]:
  """The family's rules, which must cover every zoo parameter exactly once (a bug otherwise)."""
  want = _abstract_params(cfg)
  rules = mod.rules(cfg)
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
  if "model_type" not in hf:
    raise UserError(f"{path} has no model_type: the zoo cannot tell the architecture.")
  return hf


class SafeTensors:
  """The tensors of an HF directory: model.safetensors, or the shards a
  model.safetensors.index.json names. Names, shapes and dtypes are read without the data."""

  def __init__(self, src: str):
    from safetensors import safe_open

    index = os.path.join(src, "model.safetensors.index.json")
    if os.path.isfile(index):
      with open(index) as f:
        weight_map = json.load(f)["weight_map"]
      files = sorted(set(weight_map.values()))
    elif os.path.isfile(os.path.join(src, "model.safetensors")):
      files = ["model.safetensors"]
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


def from_hf(cfg, mod, tensors: SafeTensors, *, src: str) -> tuple[nnx.State, list[str]]:
  """The zoo params (in cfg.param_dtype) of an HF checkpoint, and the names it dropped."""
  rules, want = _checked_rules(cfg, mod)
  by_name = {r.hf: r for r in rules}
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
    shape = jax.eval_shape(rule.to_hf, *(want[z] for z in rule.zoo)).shape
    if rule.hf not in found:
      problems.append(f"missing weight {rule.hf} {list(shape)}")
      continue
    got, dtype = tensors.shape(found[rule.hf]), tensors.dtype(found[rule.hf])
    if got != shape:
      problems.append(f"{found[rule.hf]} has shape {list(got)}, the model needs {list(shape)}")
    elif dtype not in FLOAT_DTYPES:
      problems.append(f"{found[rule.hf]} has dtype {dtype}, not a float")
  if problems:
    raise UserError(
      f"{src} does not fit the {cfg.family} model its config.json describes "
      f"({len(problems)} problem{'s' * (len(problems) > 1)}):\n  "
      + "\n  ".join(problems)
      + "\nCheck that config.json belongs to these weights."
    )
  param_dtype = jnp.dtype(cfg.param_dtype)
  flat = []
  for rule in rules:
    values = rule.to_zoo(jnp.asarray(tensors.get(found[rule.hf])))
    for z, value in zip(rule.zoo, values, strict=True):
      flat.append((_path(z), want[z].replace(value.astype(param_dtype))))
  return nnx.from_flat_state(flat), skipped


def to_hf(cfg, mod, params: nnx.State) -> dict[str, jax.Array]:
  """HF tensors (named as the rules name them) of zoo params."""
  rules, want = _checked_rules(cfg, mod)
  have = {".".join(map(str, k)): v for k, v in nnx.to_flat_state(params)}
  missing = sorted(set(want) - set(have))
  if missing:
    raise UserError(f"The checkpoint lacks the parameters {missing[:10]}.")
  return {r.hf: jnp.asarray(r.to_hf(*(jnp.asarray(have[z][...]) for z in r.zoo))) for r in rules}


# Zoo checkpoints


def is_zoo_checkpoint(path: str) -> bool:
  return os.path.isdir(checkpoint.directory(path))


def read_zoo(path: str) -> tuple[ml_collections.ConfigDict, nnx.State, dict]:
  """The model config, params and `meta` of the latest checkpoint of a zoo run or conversion
  (a LoRA run's adapters merged into the base weights)."""
  ckpts, step = checkpoint.open_latest(path)
  try:
    meta = ckpts.meta(step)
    cfg = ml_collections.ConfigDict(meta["model"])
    abstract = nnx.state(models.abstract(cfg), nnx.Param)
    params = ckpts.restore_latest({"params": abstract})["params"]  # the newest undamaged step
  finally:
    ckpts.close()
  if cfg.get("lora") is not None and cfg.lora.rank:
    cfg, params = merge_lora(cfg, params)
  return cfg, params, meta


def merge_lora(cfg, params: nnx.State) -> tuple[ml_collections.ConfigDict, nnx.State]:
  """The config without adapters and the params with each adapter folded into its kernel."""
  model = nnx.merge(nnx.graphdef(models.abstract(cfg)), jax.tree.map(jnp.asarray, params))
  lora.merge(model)
  cfg = ml_collections.ConfigDict(cfg.to_dict())
  cfg.lora.rank = 0
  return cfg, nnx.state(model, nnx.Param)


def read_hf(src: str, *, param_dtype: str = "float32"):
  """The model config and params of an HF directory, and what was read: its config.json and
  the tensors dropped (IGNORED)."""
  hf = read_hf_config(src)
  mod = params_module(family_of(hf["model_type"]))
  tensors = SafeTensors(src)
  cfg = mod.config_from_hf(hf, tensors.names())
  cfg.param_dtype = param_dtype
  params, skipped = from_hf(cfg, mod, tensors, src=src)
  return cfg, params, {"config": hf, "skipped": skipped}


def read(path: str) -> tuple[ml_collections.ConfigDict, nnx.State]:
  """The model config and params at `path`: a zoo checkpoint (a `zoo run` workdir or the output
  of `zoo convert`) or a Hugging Face directory."""
  path = fetch(path)
  if not os.path.exists(path):
    raise UserError(f"{path!r} does not exist: give a zoo checkpoint or a Hugging Face directory.")
  if is_zoo_checkpoint(path):
    cfg, params, _ = read_zoo(path)
  else:
    cfg, params, _ = read_hf(path)
  return cfg, params


def load(path: str) -> nnx.Module:
  """The NNX model with weights from a zoo checkpoint or a Hugging Face directory. A decoder is
  called as `model(tokens)` -> logits [B, T, V]; BERT as `model(tokens, attention_mask=mask)`
  -> hidden states [B, T, D]."""
  cfg, params = read(path)
  graphdef = nnx.graphdef(models.abstract(cfg))
  return nnx.merge(graphdef, jax.tree.map(jnp.asarray, params))


# Writing


def _check_out(out: str):
  if os.path.exists(out) and (not os.path.isdir(out) or os.listdir(out)):
    raise UserError(f"{out} exists and is not empty: give a new --out directory.")


def _write_atomically(out: str, write: Callable[[str], None]):
  """Runs `write(tmp)` on a temporary directory next to `out`, then renames it to `out`, so a
  failure leaves nothing behind."""
  out = os.path.abspath(out)
  parent = os.path.dirname(out)
  os.makedirs(parent, exist_ok=True)
  tmp = os.path.join(parent, f".{os.path.basename(out)}.tmp-{os.getpid()}")
  shutil.rmtree(tmp, ignore_errors=True)
  try:
    write(tmp)
    if os.path.isdir(out):
      os.rmdir(out)  # empty: checked before
    os.rename(tmp, out)
  finally:
    shutil.rmtree(tmp, ignore_errors=True)


def _tokenizer_config(out: str, files: list[str]) -> ml_collections.ConfigDict:
  """The data.tokenizer config that loads the tokenizer files copied into `out`."""
  if "tokenizer.json" in files:
    return tokenizers_lib.config("hf", os.path.join(out, "tokenizer.json"))
  if "vocab.json" in files and "merges.txt" in files:
    return tokenizers_lib.config("gpt2", out)
  if "tokenizer.model" in files:
    return tokenizers_lib.config("sentencepiece", os.path.join(out, "tokenizer.model"))
  return tokenizers_lib.config("hf", "")


def convert_hf(src: str, out: str, *, param_dtype: str = "float32") -> dict:
  """Writes the HF directory `src` as a zoo checkpoint at `out`: the layout of a `zoo run`
  workdir (config.json with `model` and `data.tokenizer`, checkpoints/0 with the params and the
  model config), and the tokenizer files, so `zoo generate --workdir OUT` and
  `--config.init_from=OUT` work on it. Returns a summary."""
  _check_out(out)
  if param_dtype not in ("float32", "bfloat16", "float16"):
    raise UserError(f"--param-dtype {param_dtype!r}: use float32, bfloat16 or float16.")
  src = fetch(src)
  cfg, params, info = read_hf(src, param_dtype=param_dtype)
  out = os.path.abspath(out)
  files = [f for f in TOKENIZER_FILES if os.path.isfile(os.path.join(src, f))]
  tokenizer = _tokenizer_config(out, files)
  source = {"hf": os.path.abspath(src), "config": info["config"]}
  run_config = ml_collections.ConfigDict(
    {"model": cfg.to_dict(), "data": {"tokenizer": tokenizer.to_dict()}, "source": source}
  )
  meta = {
    "family": cfg.family,
    "model": cfg.to_dict(),
    "data": run_config.data.to_dict(),
    "source": source,
  }

  def write(tmp):
    os.makedirs(tmp)
    for f in files:
      shutil.copy(os.path.join(src, f), os.path.join(tmp, f))
    with open(os.path.join(tmp, "config.json"), "w") as f:
      f.write(config_lib.to_json(run_config))
    ckpts = checkpoint.Checkpoints(tmp, keep=1)
    try:
      state = {"params": params, "step": jnp.zeros((), jnp.int32)}
      ckpts.save(0, state, meta=meta, force=True)
      ckpts.wait()
    finally:
      ckpts.close()

  _write_atomically(out, write)
  return {
    "out": out,
    "family": cfg.family,
    "params": int(sum(x.size for x in jax.tree.leaves(params))),
    "tokenizer": tokenizer.kind if tokenizer.path else "none",
    "skipped": info["skipped"],
  }


def export_hf(workdir: str, out: str) -> dict:
  """Writes the latest checkpoint in `workdir` (a `zoo run` workdir or a `zoo convert` output)
  as an HF directory: model.safetensors, config.json and the tokenizer files it has."""
  from safetensors.flax import save_file

  _check_out(out)
  if not os.path.isdir(workdir):
    raise UserError(f"{workdir!r} is not a directory: give the --workdir of a `zoo run`.")
  cfg, params, meta = read_zoo(workdir)
  mod = params_module(cfg.family)
  base = meta.get("source", {}).get("config", {})
  hf_config = mod.config_to_hf(cfg, base.get("model_type"))
  if base.get("model_type") == hf_config["model_type"]:
    # A conversion's own config.json gives what the zoo does not model (token ids, maximum
    # length...); ours overrides the rest.
    kept = {k: v for k, v in base.items() if k not in NOT_KEPT}
    hf_config = {**kept, **hf_config}
  tensors = to_hf(cfg, mod, params)
  files = [f for f in TOKENIZER_FILES if os.path.isfile(os.path.join(workdir, f))]
  tok = meta.get("data", {}).get("tokenizer", {})
  tok_json = tok.get("path", "") if tok.get("kind") == "hf" and not files else ""

  def write(tmp):
    os.makedirs(tmp)
    save_file(tensors, os.path.join(tmp, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(tmp, "config.json"), "w") as f:
      json.dump(hf_config, f, indent=2, sort_keys=True)
    for f in files:
      shutil.copy(os.path.join(workdir, f), os.path.join(tmp, f))
    if tok_json and os.path.isfile(tok_json):
      shutil.copy(tok_json, os.path.join(tmp, "tokenizer.json"))

  _write_atomically(out, write)
  return {
    "out": os.path.abspath(out),
    "architecture": hf_config["architectures"][0],
    "tensors": len(tensors),
    "params": int(sum(np.prod(t.shape) for t in tensors.values())),
  }
