"""Zoo checkpoints and Hugging Face directories: `load` a model from either, `convert_hf` an HF
directory into a zoo checkpoint, `export_hf` a zoo checkpoint into an HF directory. Nothing is
written on bad input.
"""

import json
import os
import shutil
from collections.abc import Callable

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from flax import nnx

from nnx_zoo.common import config as config_lib
from nnx_zoo.common import models, parallel, tasks
from nnx_zoo.common.data import tokenizers as tokenizers_lib
from nnx_zoo.common.errors import UserError
from nnx_zoo.common.hub import checkpoint, generation, paths
from nnx_zoo.common.hub.hf import (
  NOT_KEPT,
  TOKENIZER_FILES,
  architecture,
  fetch,
  params_module,
  read_hf,
  to_hf,
)
from nnx_zoo.common.nn import lora, stacking


def is_zoo_checkpoint(path: str) -> bool:
  return os.path.isdir(checkpoint.directory(path))


def params_key(meta: dict) -> str:
  """Which weights of a checkpoint are the model's: "ema", the moving average of a run with
  train.ema > 0 (its meta says so), else "params"."""
  return "ema" if meta.get("weights") == "ema" else "params"


def read_zoo(path: str) -> tuple[ml_collections.ConfigDict, nnx.State, dict]:
  """The model config, params and `meta` of the latest checkpoint of a zoo run or conversion
  (a LoRA run's adapters merged into the base weights)."""
  ckpts, step = checkpoint.open_latest(path)
  try:
    meta = ckpts.meta(step)
    cfg = ml_collections.ConfigDict(models.upgrade(meta["model"]))
    abstract = nnx.state(models.abstract(cfg), nnx.Param)
    key = params_key(meta)
    params = ckpts.restore_latest({key: abstract})[key]  # the newest undamaged step
  finally:
    ckpts.close()
  if cfg.lora.rank:  # upgraded: every model config has model.lora
    cfg, params = merge_lora(cfg, params)
  return cfg, params, meta


def merge_lora(cfg, params: nnx.State) -> tuple[ml_collections.ConfigDict, nnx.State]:
  """The config without adapters and the params with each adapter folded into its kernel."""
  model = nnx.merge(nnx.graphdef(models.abstract(cfg)), jax.tree.map(jnp.asarray, params))
  lora.merge(model)
  cfg = ml_collections.ConfigDict(cfg.to_dict())
  cfg.lora.rank = 0
  return cfg, nnx.state(model, nnx.Param)


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


def init_from_params(cfg, layout=None) -> tuple[nnx.GraphDef, nnx.State]:
  """The model of `cfg` with the weights of its `init_from` (a run's starting point, and the dpo
  task's reference model), placed on `layout`'s mesh as the train step places params."""
  abstract = models.abstract(cfg.model)
  graphdef, abstract_params = nnx.graphdef(abstract), nnx.state(abstract, nnx.Param)
  shardings = parallel.placement(abstract_params, layout)
  fresh = jax.jit(
    lambda: nnx.state(models.build(cfg.model, seed=cfg.seed), nnx.Param), out_shardings=shardings
  )()
  return graphdef, with_init_from(init_params(cfg, abstract_params), fresh, shardings)


def init_params(cfg, params: nnx.State) -> nnx.State:
  """`params` (arrays, or abstract ShapeDtypeStructs) with the weights of `init_from` (a zoo
  run's workdir, a `zoo convert` output or a Hugging Face directory) in their place, one tree
  per layer (`stacking.unstack_layers`) whatever the layout of `params` or of the checkpoint.

  Every parameter of the model must come from the checkpoint with its shape, except LoRA
  adapters and what `init_reinit` names (a new head, a resized vocab), which keep their fresh
  initialisation; every parameter of the checkpoint must be used. All that does not fit is
  reported in one error.
  """
  path = fetch(paths.resolve(cfg.init_from))  # a hub id is downloaded
  if not os.path.exists(path):
    raise UserError(
      f"init_from={path!r} does not exist: give the workdir of an earlier `zoo run`, a "
      "`zoo convert` output, a Hugging Face directory or hub id (or leave init_from empty)."
    )
  _, loaded = read(path)  # params only: the optimizer starts fresh
  reinit = lora.patterns(cfg.get("init_reinit", ""))
  # Compared and named one tree per layer (`blocks.3.attn.q`), whether either side stores its
  # layers stacked (model.scan): the result is in that layout too.
  want = dict(nnx.to_flat_state(stacking.unstack_layers(params)))
  got = dict(nnx.to_flat_state(stacking.unstack_layers(loaded)))

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
      + "\nUse a checkpoint of the same model config, change the experiment's model, or name "
      "the parameters to start fresh in init_reinit (e.g. --config.init_reinit='head.*')."
    )
  return nnx.from_flat_state(
    [
      (k, v if fresh(k) else v.replace(jnp.asarray(got[k][...], v.get_value().dtype)))
      for k, v in want.items()
    ]
  )


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


def _tokenizer_config(out: str, files: list[str]) -> ml_collections.ConfigDict:
  """The data.tokenizer config that loads the tokenizer files copied into `out`: the directory
  where a tokenizer_config.json or chat_template.jinja came along (its chat template and special
  tokens, what `zoo chat` renders with), else the tokenizer's own file."""
  if "tokenizer.json" in files:
    with_chat = {"tokenizer_config.json", "chat_template.jinja"} & set(files)
    return tokenizers_lib.config("hf", out if with_chat else os.path.join(out, "tokenizer.json"))
  if "vocab.json" in files and "merges.txt" in files:
    return tokenizers_lib.config("gpt2", out)
  if "tokenizer.model" in files:
    return tokenizers_lib.config("sentencepiece", os.path.join(out, "tokenizer.model"))
  return tokenizers_lib.config("hf", "")


def convert_hf(src: str, out: str, *, param_dtype: str = "float32") -> dict:
  """Writes the HF directory `src` as a zoo checkpoint at `out`: the layout of a `zoo run`
  workdir (config.json with `model` and `data.tokenizer`, checkpoints/0 with the params and the
  model config), the tokenizer files and generation_config.json, so `zoo generate --workdir OUT`
  and `--config.init_from=OUT` work on it. Returns a summary."""
  _check_out(out)
  if param_dtype not in ("float32", "bfloat16", "float16"):
    raise UserError(f"--param-dtype {param_dtype!r}: use float32, bfloat16 or float16.")
  src = fetch(src)
  cfg, params, info = read_hf(src, param_dtype=param_dtype)
  out = os.path.abspath(out)
  files = [f for f in TOKENIZER_FILES if os.path.isfile(os.path.join(src, f))]
  tokenizer = _tokenizer_config(out, files)
  if os.path.isfile(os.path.join(src, generation.FILE)):  # how `zoo generate` prompts it
    files.append(generation.FILE)
  source = {"hf": os.path.abspath(src), "config": info["config"]}
  run_config = ml_collections.ConfigDict(
    {"model": cfg.to_dict(), "data": {"tokenizer": tokenizer.to_dict()}, "source": source}
  )
  run_config.task = tasks.infer(run_config)  # what `zoo generate` does with it
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
    f for f in (*TOKENIZER_FILES, generation.FILE) if os.path.isfile(os.path.join(workdir, f))
  ]
  tok = meta.get("data", {}).get("tokenizer", {})
  tok_json = tok.get("path", "") if tok.get("kind") == "hf" and not files else ""
  if os.path.isdir(tok_json):  # a tokenizer directory: its files (template, special tokens)
    files = [os.path.join(tok_json, f) for f in TOKENIZER_FILES]
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
