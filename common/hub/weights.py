"""Zoo checkpoints and Hugging Face directories: `load` a model from either, `convert_hf` an HF
directory into a zoo checkpoint, `export_hf` a zoo checkpoint into an HF directory. Nothing is
written on bad input.
"""

import dataclasses
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from flax import nnx

from nnx_zoo.common import config as config_lib
from nnx_zoo.common import files, models, parallel
from nnx_zoo.common.errors import UserError
from nnx_zoo.common.hub import checkpoint, generation, gguf, paths, tiny, tokenizer_files
from nnx_zoo.common.hub.hf import (
  NOT_KEPT,
  SafeTensors,
  architecture,
  family_of,
  fetch,
  params_module,
  read_hf,
  read_hf_config,
  to_hf,
)
from nnx_zoo.common.nn import lora, qlora, stacking


def is_zoo_checkpoint(path: str) -> bool:
  return os.path.isdir(checkpoint.directory(path))


def params_key(meta: dict) -> str:
  """Which weights of a checkpoint are the model's: "ema", the moving average of a run with
  train.ema > 0 (its meta says so), else "params"."""
  return "ema" if meta.get("weights") == "ema" else "params"


def read_zoo(path: str, *, quantize=None) -> tuple[ml_collections.ConfigDict, nnx.State, dict]:
  """The model config, params and `meta` of the latest checkpoint of a zoo run or conversion
  (a LoRA run's adapters merged into the base weights, over its dequantized base if QLoRA).
  `quantize` (`qlora.quantizer`): the checkpoint of a model without adapters is then read a
  parameter at a time, each quantized as it is read."""
  ckpts, step = checkpoint.open_latest(path)
  try:
    meta = ckpts.meta(step)
    cfg = ml_collections.ConfigDict(models.upgrade(meta["model"]))
    abstract = nnx.state(models.abstract(cfg), nnx.Param)
    key = params_key(meta)
    stacked = stacking.layouts(k for k, _ in nnx.to_flat_state(abstract))
    if quantize is not None and not cfg.lora.rank and not stacked:
      params = _read_quantizing(ckpts, key, abstract, quantize)
      return cfg, params, meta
    params = ckpts.restore_latest({key: abstract})[key]  # the newest undamaged step
  finally:
    ckpts.close()
  if cfg.lora.rank:  # upgraded: every model config has model.lora
    cfg, params = merge_lora(cfg, params)
  if quantize is not None:  # whole: a LoRA run's merged weights, a stacked checkpoint
    flat = nnx.to_flat_state(stacking.unstack_layers(params))
    params = nnx.from_flat_state([kv for k, v in flat for kv in quantize(k, v)])
  return cfg, params, meta


def _read_quantizing(ckpts, key: str, abstract: nnx.State, quantize) -> nnx.State:
  """The params of a checkpoint, one tree per layer, restored a quantized kernel or a frozen
  table cast to bf16 (`qlora.frozen_dtype`) at a time (each converted before the next is read)
  and the rest at once (a model stored one tree per layer: a stacked kernel is whole in one
  array)."""
  flat = nnx.to_flat_state(abstract)
  alone = quantize.targets | quantize.casts
  targets = [(k, v) for k, v in flat if k in alone]
  rest = [(k, v) for k, v in flat if k not in alone]

  def restore(part):
    return nnx.to_flat_state(ckpts.restore_latest({key: nnx.from_flat_state(part)})[key])

  out = list(restore(rest)) if rest else []
  for k, v in targets:
    ((_, got),) = restore([(k, v)])
    out += quantize(k, got)
  return nnx.from_flat_state(out)


def merge_lora(cfg, params: nnx.State) -> tuple[ml_collections.ConfigDict, nnx.State]:
  """The config without adapters and the params with each adapter folded into its kernel (a
  QLoRA model's frozen embeddings and heads back in param_dtype: `qlora.frozen_dtype`)."""
  model = nnx.merge(nnx.graphdef(models.abstract(cfg)), jax.tree.map(jnp.asarray, params))
  lora.merge(model)
  cfg = ml_collections.ConfigDict(cfg.to_dict())
  cfg.lora.rank, cfg.lora.base_quant = 0, ""
  merged = nnx.state(model, nnx.Param)
  want = dict(nnx.to_flat_state(nnx.state(models.abstract(cfg), nnx.Param)))
  return cfg, nnx.from_flat_state(
    [
      (
        k,
        v if k not in want or v.dtype == want[k].dtype else v.replace(v[...].astype(want[k].dtype)),
      )
      for k, v in nnx.to_flat_state(merged)
    ]
  )


def locate(path: str) -> str:
  """The local path of a checkpoint named in a config or on the command line: a plain path, a
  `pkg:MODULE/path` in an installed package, a `tiny:NAME` checkpoint (made on first use), or a
  Hugging Face hub id (downloaded)."""
  if tiny.is_tiny(path):
    return tiny.checkpoint(path)
  return fetch(paths.resolve(path))


@dataclasses.dataclass(frozen=True)
class Source:
  """What a checkpoint says of itself, read without its weights: its model config, the
  `data.tokenizer` config of its tokenizer (None: it has none) and its chat template ("": the
  tokenizer's own). What an experiment with `model_from="init_from"` is resolved from."""

  path: str
  kind: str  # "zoo checkpoint" or "Hugging Face directory"
  model: ml_collections.ConfigDict
  tokenizer: ml_collections.ConfigDict | None
  chat_template: str = ""


def source(path: str) -> Source:
  """The `Source` of a zoo checkpoint (a `zoo run` workdir, a `zoo convert` output: its latest
  step's model config; a LoRA run's without its adapters, which `read` merges) or a Hugging Face
  directory (config.json and the tensors' names)."""
  path = os.path.abspath(locate(path))
  if not os.path.exists(path):
    raise UserError(
      f"init_from={path!r} does not exist: give the workdir of an earlier `zoo run`, a "
      "`zoo convert` output or a Hugging Face directory."
    )
  if path.endswith(".gguf"):  # a llama.cpp file: its tokenizer written once into the cache
    model, _ = gguf.read_config(path)
    return Source(path, "GGUF file", model, tokenizer_files.config("hf", gguf_tokenizer(path)))
  if is_zoo_checkpoint(path):
    ckpts, step = checkpoint.open_latest(path)
    try:
      meta = ckpts.meta(step)
    finally:
      ckpts.close()
    model = models.upgrade(meta["model"])
    model.lora.rank, model.lora.base_quant = 0, ""  # merged into the base weights by `read`
    data = meta.get("data", {})
    tokenizer = data.get("tokenizer")
    if tokenizer and tokenizer.get("kind") != "bytes" and not tokenizer.get("path"):
      tokenizer = None  # a conversion of a directory that had no tokenizer files
    tokenizer = ml_collections.ConfigDict(tokenizer) if tokenizer else None
    return Source(path, "zoo checkpoint", model, tokenizer, data.get("chat_template", ""))
  hf_config = read_hf_config(path)
  mod = params_module(family_of(architecture(hf_config)))
  model = mod.config_from_hf(hf_config, SafeTensors(path).names())
  found = [f for f in tokenizer_files.FILES if os.path.isfile(os.path.join(path, f))]
  tokenizer = tokenizer_files.of_directory(path, found)
  return Source(path, "Hugging Face directory", model, tokenizer if tokenizer.path else None)


def _file_key(path: str) -> str:
  """What a cache entry made from the file `path` is keyed by: its path, size and time."""
  stat = os.stat(path)
  key = f"{os.path.abspath(path)}:{stat.st_size}:{stat.st_mtime_ns}"
  return hashlib.sha256(key.encode()).hexdigest()[:24]


def gguf_tokenizer(path: str) -> str:
  """A Hugging Face tokenizer directory (with the chat template) of a GGUF file's tokenizer,
  written on first use under the zoo's cache, keyed by the file's path, size and time."""
  out = files.cache_dir("gguf-tokenizers", _file_key(path))
  if not os.path.isfile(os.path.join(out, "tokenizer.json")):
    tmp = f"{out}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
      gguf.tokenizer_dir(path, tmp)
      shutil.rmtree(out, ignore_errors=True)
      os.rename(tmp, out)
    finally:
      shutil.rmtree(tmp, ignore_errors=True)
  return out


def gguf_workdir(path: str) -> str:
  """A zoo checkpoint of a GGUF file (`convert_gguf`), made on first use under the zoo's cache,
  keyed by the file's path, size and time: what `zoo generate` and `zoo chat` read for a
  `--workdir FILE.gguf`."""
  path = locate(path)
  if not os.path.isfile(path):
    raise UserError(f"{path!r} is not a file: give a .gguf file, or a zoo run's --workdir.")
  out = files.cache_dir("gguf-checkpoints", _file_key(path))
  if not is_zoo_checkpoint(out):
    convert_gguf(path, out)
  return out


def is_hf_directory(path: str) -> bool:
  """Whether `path` is a Hugging Face model directory (config.json with a `model_type` beside
  safetensors weights), not a zoo workdir (whose config.json holds a `model` section)."""
  config = os.path.join(path, "config.json")
  if not os.path.isfile(config) or is_zoo_checkpoint(path):
    return False
  try:
    with open(config) as f:
      hf_config = json.load(f)
  except (OSError, ValueError):
    return False
  return isinstance(hf_config, dict) and "model" not in hf_config and "model_type" in hf_config


def hf_workdir(path: str) -> str:
  """A zoo checkpoint of a Hugging Face directory (`convert_hf`), made on first use under the
  zoo's cache, keyed by the paths, sizes and times of its config and weights files: what `zoo
  generate`, `zoo chat` and `zoo serve` read for a `--workdir HF_DIR`."""
  path = os.path.abspath(locate(path))
  keyed = sorted(
    os.path.join(path, f)
    for f in os.listdir(path)
    if f == "config.json" or f.endswith((".safetensors", ".safetensors.index.json"))
  )
  key = hashlib.sha256("|".join(_file_key(f) for f in keyed).encode()).hexdigest()[:24]
  out = files.cache_dir("hf-checkpoints", key)
  if not is_zoo_checkpoint(out):
    convert_hf(path, out)
  return out


def as_workdir(path: str) -> str:
  """The zoo workdir that `--workdir PATH` names: PATH itself (a `zoo run` workdir or a `zoo
  convert` output), or for a .gguf file, a Hugging Face directory or `tiny:NAME`, a zoo
  checkpoint of it made once under the zoo's cache."""
  if path.endswith(".gguf"):
    return gguf_workdir(path)
  if tiny.is_tiny(path) or is_hf_directory(path):
    return hf_workdir(path)
  return path


def workdir_config(path: str) -> tuple[str, ml_collections.ConfigDict]:
  """The zoo workdir `--workdir PATH` names (`as_workdir`) and its config.json."""
  workdir = as_workdir(path)
  config = os.path.join(workdir, "config.json")
  if not os.path.exists(config):
    raise UserError(f"{workdir} has no config.json: give the --workdir of a `zoo run`.")
  with open(config) as f:
    return workdir, config_lib.from_json(f.read())


def read(path: str, *, quantize=None) -> tuple[ml_collections.ConfigDict, nnx.State]:
  """The model config and params at `path`: a zoo checkpoint (a `zoo run` workdir or the output
  of `zoo convert`), a Hugging Face directory or a GGUF file. `quantize` (`qlora.quantizer`):
  applied to each parameter as it is read (a quantized base is never whole in fp32)."""
  path = locate(path)
  if not os.path.exists(path):
    raise UserError(f"{path!r} does not exist: give a zoo checkpoint or a Hugging Face directory.")
  if path.endswith(".gguf"):  # a llama.cpp file
    return gguf.read_gguf(path, quantize=quantize)[:2]
  if is_zoo_checkpoint(path):
    cfg, params, _ = read_zoo(path, quantize=quantize)
  else:
    cfg, params, _ = read_hf(path, quantize=quantize)
  return cfg, params


def load(path: str) -> nnx.Module:
  """The NNX model with weights from a zoo checkpoint or a Hugging Face directory. A decoder is
  called as `model(tokens)` -> logits [B, T, V]; BERT as `model(tokens, attention_mask=mask)`
  -> hidden states [B, T, D]."""
  cfg, params = read(path)
  graphdef = nnx.graphdef(models.abstract(cfg))
  return nnx.merge(graphdef, jax.tree.map(jnp.asarray, params))


# Starting points of a run: its own latest checkpoint, or another run's weights (init_from)


def restore_params(cfg, workdir: str, layout=None) -> tuple[nnx.GraphDef, nnx.State, int]:
  """The model of experiment config `cfg` with the params of the latest checkpoint in
  `workdir` (what `zoo eval` and `zoo generate` read; a train.ema run's average), and its
  step; placed on the mesh of `parallel.Layout` `layout` as the train step places them, if
  given. A model config saved before the shared layers' configs changed (a workdir's
  config.json) is read as today's."""
  model_cfg = models.upgrade(cfg.model.to_dict())
  abstract = models.abstract(model_cfg)
  graphdef = nnx.graphdef(abstract)
  ckpts, step = checkpoint.open_latest(workdir)
  try:
    # A checkpoint of another model fails deep in orbax: say which keys differ instead.
    meta = ckpts.meta(step)
    saved = ml_collections.ConfigDict({"model": models.upgrade(meta["model"])})
    changed = config_lib.differences(
      saved, {"model": model_cfg.to_dict()}, ignore=models.HOW_TRAINED
    )
    if changed:
      raise UserError(
        f"{workdir} holds a checkpoint of a different model ({'; '.join(changed)}): give the "
        "experiment (and --config overrides) that trained it."
      )
    # Params (the moving average where the run kept one) and step only (whatever optimizer
    # trained it, or none: `zoo convert`), from the newest undamaged step.
    key = params_key(meta)
    params = nnx.state(abstract, nnx.Param)
    if layout is not None:
      params = jax.tree.map(
        lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
        params,
        layout.shardings(layout.param_specs(params)),
      )
    wanted = {key: params, "step": jax.ShapeDtypeStruct((), jnp.int32)}
    state = ckpts.restore_latest(wanted)
  finally:
    ckpts.close()
  return graphdef, state[key], int(state["step"])


def with_init_from(loaded: nnx.State, fresh: nnx.State, shardings) -> nnx.State:
  """`fresh` params (placed, in the model's layout) with what `init_params` read in their place:
  what init_from does not give (adapters, init_reinit) stays fresh; placed as `shardings`."""
  params = jax.tree.map(  # one tree per layer (init_params), stacked back if scanned
    lambda got, new: new if isinstance(got, jax.ShapeDtypeStruct) else got,
    loaded,
    stacking.unstack_layers(fresh),
  )
  return jax.device_put(stacking.match_layers(params, fresh), shardings)


def start_params(loaded: nnx.State, make: Callable[[], nnx.State], like, shardings) -> nnx.State:
  """init_from's params (`init_params`, one tree per layer) with what it does not give
  (adapters, init_reinit: left abstract there) taken from `make()`, a fresh model's params, in
  the layout of `like` (a state of the model), placed as `shardings`.

  Only those fresh params are computed (`make` is traced and the rest of it never runs): a
  QLoRA run's random fp32 base kernels, and any fresh copy of what init_from gives, are never
  made, so a start from init_from holds its loaded weights and the adapters alone."""
  flat = nnx.to_flat_state(loaded)
  keys = {_dotted(k) for k, v in flat if isinstance(v.get_value(), jax.ShapeDtypeStruct)}

  def fresh():
    made = nnx.to_flat_state(stacking.unstack_layers(make()))
    return {_dotted(k): v.get_value() for k, v in made if _dotted(k) in keys}

  got = jax.jit(fresh)() if keys else {}
  params = nnx.from_flat_state(
    [(k, v.replace(got[_dotted(k)]) if _dotted(k) in got else v) for k, v in flat]
  )
  return jax.device_put(stacking.match_layers(params, like), shardings)


def init_from_params(cfg, layout=None) -> tuple[nnx.GraphDef, nnx.State]:
  """The model of `cfg` with the weights of its `init_from` (a run's starting point, and the dpo
  task's reference model), placed on `layout`'s mesh as the train step places params."""
  abstract = models.abstract(cfg.model)
  graphdef, abstract_params = nnx.graphdef(abstract), nnx.state(abstract, nnx.Param)
  shardings = parallel.placement(abstract_params, layout)
  params = start_params(
    init_params(cfg, abstract_params),
    lambda: nnx.state(models.build(cfg.model, seed=cfg.seed), nnx.Param),
    abstract_params,
    shardings,
  )
  return graphdef, params


def init_params(cfg, params: nnx.State) -> nnx.State:
  """`params` (arrays, or abstract ShapeDtypeStructs) with the weights of `init_from` (a zoo
  run's workdir, a `zoo convert` output or a Hugging Face directory) in their place, one tree
  per layer (`stacking.unstack_layers`) whatever the layout of `params` or of the checkpoint.

  Every parameter of the model must come from the checkpoint with its shape, except LoRA
  adapters and what `init_reinit` names (a new head, a resized vocab), which keep their fresh
  initialisation; every parameter of the checkpoint must be used. All that does not fit is
  reported in one error.
  """
  path = locate(cfg.init_from)  # a hub id is downloaded, a tiny: checkpoint made
  if not os.path.exists(path):
    raise UserError(
      f"init_from={path!r} does not exist: give the workdir of an earlier `zoo run`, a "
      "`zoo convert` output, a Hugging Face directory or hub id (or leave init_from empty)."
    )
  # Compared and named one tree per layer (`blocks.3.attn.q`), whether either side stores its
  # layers stacked (model.scan): the result is in that layout too.
  want = dict(nnx.to_flat_state(stacking.unstack_layers(params)))
  kind = cfg.model.lora.base_quant
  # QLoRA: the base quantized as it is read, a tensor at a time (params only: the optimizer
  # starts fresh).
  _, loaded = read(path, quantize=qlora.quantizer(want, kind) if kind else None)
  reinit = lora.patterns(cfg.get("init_reinit", ""))
  got = dict(nnx.to_flat_state(stacking.unstack_layers(loaded)))
  spec = layer_spec(cfg)
  if spec:  # a model made of some of the checkpoint's layers (a distillation student)
    count = 1 + max((k[1] for k in got if k[0] == "blocks"), default=-1)
    picked = select_layers(spec, count)
    got = {
      (k[0], picked.index(k[1]), *k[2:]) if k[0] == "blocks" else k: v
      for k, v in got.items()
      if k[0] != "blocks" or k[1] in picked
    }

  def fresh(key) -> bool:
    return isinstance(want.get(key), lora.LoRAParam) or lora.matches(_dotted(key), reinit)

  problems = [
    f"{_dotted(k)}: checkpoint {got[k].shape if k in got else 'missing'} vs model {v.shape}"
    for k, v in want.items()
    if not fresh(k) and (k not in got or got[k].shape != v.shape)
  ]
  problems += [
    f"{_dotted(k)}: in the checkpoint, not in the model {got[k].shape}"
    for k in got
    if k not in want and not lora.matches(_dotted(k), reinit)
  ]
  if problems:
    raise UserError(
      f"The checkpoint in {path} does not fit this experiment's model ({len(problems)} "
      "parameters):\n  "
      + "\n  ".join(problems[:20])
      + ("\n  ..." if len(problems) > 20 else "")
      + "\nUse a checkpoint of the same model config, change the experiment's model, name "
      "the parameters to start fresh in init_reinit (e.g. --config.init_reinit='head.*'), or "
      "fine-tune it with an experiment that takes its model from init_from (chat/sft, chat/dpo, "
      "lm/continue)."
    )
  return nnx.from_flat_state(
    [
      (k, v if fresh(k) else v.replace(jnp.asarray(got[k][...], v.get_value().dtype)))
      for k, v in want.items()
    ]
  )


def layer_spec(cfg) -> str:
  """Which of init_from's layers the model is made of ("": all of them, as they are): the
  distill task's `distill.student_layers`, a student made of its teacher's layers (DistilBERT,
  Minitron)."""
  return cfg.distill.student_layers if "distill" in cfg else ""


def select_layers(spec: str, count: int) -> tuple[int, ...]:
  """The indices a layer selection names among `count` layers: "every:K" (0, K, 2K, ...) or a
  list "0,2,5" (increasing); an index out of range is a UserError naming it."""
  spec = str(spec).strip()
  try:
    if spec.startswith("every:"):
      step = int(spec[len("every:") :])
      if step < 1:
        raise ValueError
      picked = tuple(range(0, count, step))
    else:
      picked = tuple(int(i) for i in spec.replace(" ", "").split(","))
  except ValueError:
    raise UserError(
      f"distill.student_layers={spec!r}: write every:K (every K-th layer, from the first) or "
      "a list of layer indices (0,2,4)."
    ) from None
  bad = [i for i in picked if not 0 <= i < count]
  if bad or not picked:
    raise UserError(
      f"distill.student_layers={spec!r} names layer {bad[0] if bad else 'none'}, and the "
      f"checkpoint has {count} layers (0..{count - 1}): name layers in that range."
    )
  if list(picked) != sorted(set(picked)):
    raise UserError(f"distill.student_layers={spec!r}: name each layer once, in increasing order.")
  return picked


def _dotted(key: tuple) -> str:
  return ".".join(map(str, key))


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


def _check_param_dtype(param_dtype: str):
  if param_dtype not in ("float32", "bfloat16", "float16"):
    raise UserError(f"--param-dtype {param_dtype!r}: use float32, bfloat16 or float16.")


def convert_hf(src: str, out: str, *, param_dtype: str = "float32") -> dict:
  """Writes the HF directory `src` as a zoo checkpoint at `out`: the layout of a `zoo run`
  workdir (config.json with `model` and `data.tokenizer`, checkpoints/0 with the params and the
  model config), the tokenizer files and generation_config.json, so `zoo generate --workdir OUT`
  and `--config.init_from=OUT` work on it. Returns a summary."""
  _check_out(out)
  _check_param_dtype(param_dtype)
  src = fetch(src)
  cfg, params, info = read_hf(src, param_dtype=param_dtype)
  files = [f for f in tokenizer_files.FILES if os.path.isfile(os.path.join(src, f))]
  if os.path.isfile(os.path.join(src, generation.FILE)):  # how `zoo generate` prompts it
    files.append(generation.FILE)

  def add_files(tmp):
    for f in files:
      shutil.copy(os.path.join(src, f), os.path.join(tmp, f))

  source = {"hf": os.path.abspath(src), "config": info["config"]}
  summary = write_converted(out, cfg, params, source=source, files=files, add_files=add_files)
  return {**summary, "skipped": info["skipped"]}


def write_converted(
  out: str, cfg, params: nnx.State, *, source: dict, files: list[str], add_files: Callable
) -> dict:
  """Writes a converted model (`convert_hf`, `convert_gguf`) as a zoo checkpoint at `out`
  (checked new): config.json with `model`, `data.tokenizer` and `source`, checkpoints/0, and the
  tokenizer and generation files `files`, which `add_files(dir)` puts into the new directory.
  Returns a summary."""
  out = os.path.abspath(out)
  tokenizer = tokenizer_files.of_directory(out, files)
  run_config = ml_collections.ConfigDict(
    {"model": cfg.to_dict(), "data": {"tokenizer": tokenizer.to_dict()}, "source": source}
  )
  run_config.task = models.infer_task(run_config)  # what `zoo generate` does with it
  meta = {
    "family": cfg.family,
    "model": cfg.to_dict(),
    "data": run_config.data.to_dict(),
    "source": source,
  }

  def write(tmp):
    os.makedirs(tmp)
    add_files(tmp)
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
  }


def convert_gguf(src: str, out: str, *, param_dtype: str = "float32") -> dict:
  """Writes the GGUF file `src` as a zoo checkpoint at `out`, as `weights.convert_hf` writes
  an HF directory: the checkpoint, config.json, the tokenizer (with its chat template) and a
  generation_config.json with the file's end token, so `zoo generate --workdir OUT` and
  `--config.init_from=OUT` work on it. Returns a summary."""
  _check_out(out)
  _check_param_dtype(param_dtype)
  src = locate(src)
  cfg, params, info = gguf.read_gguf(src, param_dtype=param_dtype)
  meta = info["gguf"]
  generation_config = {
    k: meta[f"tokenizer.ggml.{g}_token_id"]
    for k, g in (("bos_token_id", "bos"), ("eos_token_id", "eos"), ("pad_token_id", "padding"))
    if f"tokenizer.ggml.{g}_token_id" in meta
  }
  with tempfile.TemporaryDirectory() as tokdir:
    has_tokenizer = "tokenizer.ggml.model" in meta
    files = gguf.tokenizer_dir(src, tokdir) if has_tokenizer else []
    with open(os.path.join(tokdir, generation.FILE), "w") as f:
      json.dump(generation_config, f, indent=2)
    files.append(generation.FILE)

    def add_files(tmp):
      for f in files:
        shutil.copy(os.path.join(tokdir, f), os.path.join(tmp, f))

    # The source's tokenizer pre-tokenizer name: what `export_gguf` writes back.
    source = {
      "gguf": os.path.abspath(src),
      "config": info["config"],
      "tokenizer_pre": meta.get("tokenizer.ggml.pre", ""),
    }
    summary = write_converted(out, cfg, params, source=source, files=files, add_files=add_files)
  return {**summary, "skipped": info["skipped"]}


def export_gguf(workdir: str, out: str, *, type: str = "f32") -> dict:  # noqa: A002
  """Writes the latest checkpoint in `workdir` (LoRA merged) as the GGUF file `out`
  (`gguf.write`): llama.cpp's metadata and tensor names, the tokenizer and chat template."""
  if os.path.exists(out):
    raise UserError(f"{out} exists: give a new --out file.")
  if not os.path.isdir(workdir):
    raise UserError(f"{workdir!r} is not a directory: give the --workdir of a `zoo run`.")
  cfg, params, meta = read_zoo(workdir)
  return gguf.write(cfg, params, meta, workdir, out, type=type)


def export_hf(workdir: str, out: str) -> dict:
  """Writes the latest checkpoint in `workdir` (a `zoo run` workdir or a `zoo convert` output)
  as an HF directory: model.safetensors, config.json and the tokenizer files and
  generation_config.json it has."""
  from safetensors.flax import save_file

  _check_out(out)
  if not os.path.isdir(workdir):
    raise UserError(f"{workdir!r} is not a directory: give the --workdir of a `zoo run`.")
  cfg, params, meta = read_zoo(workdir)
  mod = params_module(cfg.family)
  base = meta.get("source", {}).get("config", {})
  hf_config = mod.config_to_hf(cfg, base.get("model_type"))
  if base and architecture(base) == architecture(hf_config):
    # A conversion's own config.json gives what the zoo does not model (token ids, maximum
    # length...); ours overrides the rest.
    kept = {k: v for k, v in base.items() if k not in NOT_KEPT}
    hf_config = {**kept, **hf_config}
  tensors = to_hf(cfg, mod, params)
  files = [
    f for f in (*tokenizer_files.FILES, generation.FILE) if os.path.isfile(os.path.join(workdir, f))
  ]
  tok = meta.get("data", {}).get("tokenizer", {})
  tok_json = tok.get("path", "") if tok.get("kind") == "hf" and not files else ""
  if os.path.isdir(tok_json):  # a tokenizer directory: its files (template, special tokens)
    files = [os.path.join(tok_json, f) for f in tokenizer_files.FILES]
    files = [f for f in files if os.path.isfile(f)]
    tok_json = ""

  def write(tmp):
    os.makedirs(tmp)
    # diffusers' models name their weights file otherwise (a family's params.WEIGHTS_NAME).
    weights_name = getattr(mod, "WEIGHTS_NAME", "model.safetensors")
    save_file(tensors, os.path.join(tmp, weights_name), metadata={"format": "pt"})
    with open(os.path.join(tmp, "config.json"), "w") as f:
      json.dump(hf_config, f, indent=2, sort_keys=True)
    for f in files:  # names in the workdir, or paths in a tokenizer directory
      shutil.copy(os.path.join(workdir, f), os.path.join(tmp, os.path.basename(f)))
    if tok_json and os.path.isfile(tok_json):
      shutil.copy(tok_json, os.path.join(tmp, "tokenizer.json"))

  _write_atomically(out, write)
  return {
    "out": os.path.abspath(out),
    "architecture": (hf_config.get("architectures") or [architecture(hf_config)])[0],
    "tensors": len(tensors),
    "params": int(sum(np.prod(t.shape) for t in tensors.values())),
  }
