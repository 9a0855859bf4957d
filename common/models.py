"""The family registry: every folder `zoo/<family>/` with a `model.py` is a family (it registers
itself by existing), and `model.family` in a config names it.

A family's model.py has `config(preset, **overrides)` and `Model` (a class of common/nn, e.g.
`transformer.Decoder`, or its own composition of the shared layers).
"""

import functools
import importlib
import pkgutil

import ml_collections
from flax import nnx

from nnx_zoo import zoo
from nnx_zoo.common.errors import UserError, suggest
from nnx_zoo.common.nn import keys, lora, memory, qlora, quant
from nnx_zoo.common.nn.denoiser import Denoiser
from nnx_zoo.common.nn.encoder_decoder import EncoderDecoder

# The model keys that say how a model is computed in training, not what it is: a workdir or a
# checkpoint matches its model whatever they were (the memory levers; quantized matmuls;
# stochastic depth).
HOW_TRAINED = (*memory.LEVERS, *quant.LEVERS, "model.drop_path")
# What an experiment whose model comes from its init_from checkpoint (`model_from="init_from"`)
# may still set of the model: how it is trained and computed (adapters, the memory levers,
# quantized matmuls, stochastic depth, precision, the attention kernel), never what it is.
LEVERS = (
  "model.lora",
  *HOW_TRAINED,
  "model.dtype",
  "model.param_dtype",
  "model.attention.impl",
)


def levers(**values) -> ml_collections.ConfigDict:
  """The `model` section of an experiment with `model_from="init_from"`: the LEVERS, at the
  values that change nothing (float32, no adapters, no remat), with `values` set (`lora=...`).
  The rest of the model config is the checkpoint's (`nnx_zoo.common.experiments`)."""
  cfg = ml_collections.ConfigDict(
    {
      "lora": lora.config(),
      "remat": "none",
      "scan": False,
      "pipeline_repeats": 1,
      "quant": "none",
      "quant_backward": True,
      "drop_path": 0.0,
      "dtype": "float32",
      "param_dtype": "float32",
      "attention": {"impl": "auto"},
    }
  )
  unknown = set(values) - set(cfg)
  if unknown:
    raise UserError(f"models.levers() takes no {sorted(unknown)}: it takes {sorted(cfg)}.")
  cfg.update(values)
  return cfg


def is_lever(key: str) -> bool:
  """Whether the dotted model key (`model.lora.rank`) is one of the LEVERS or under one."""
  return any(key == k or key.startswith(k + ".") for k in LEVERS)


@functools.cache
def families() -> dict[str, str]:
  """family name -> the module that builds it, one for each `zoo/<family>/model.py`."""
  found = {}
  for info in pkgutil.iter_modules(zoo.__path__):
    if info.ispkg and importlib.util.find_spec(f"nnx_zoo.zoo.{info.name}.model") is not None:
      found[info.name] = f"nnx_zoo.zoo.{info.name}.model"
  return dict(sorted(found.items()))


def family_module(name: str):
  if name not in families():
    raise UserError(f"Unknown model family {name!r}.{suggest(name, families())}")
  return importlib.import_module(families()[name])


def build(cfg, *, seed: int = 0) -> nnx.Module:
  """The NNX model of a `model` config, with freshly initialised weights (and LoRA adapters
  where `model.lora` asks for them, over a quantized base where `model.lora.base_quant` does).
  A config saved before some of today's keys is read as
  today's (`upgrade`): the layers index every key they read."""
  cfg = upgrade(cfg)
  qlora.check(cfg.lora)  # before anything is built
  model = family_module(cfg.family).Model(cfg, rngs=keys.Keys(seed))
  lora.apply(model, cfg.lora, seed=seed)
  qlora.apply(model, cfg.lora)  # the frozen base of the blocks' Linears quantized (QLoRA)
  return model


def abstract(cfg) -> nnx.Module:
  """The model with ShapeDtypeStructs for weights: nothing is allocated."""
  return nnx.eval_shape(lambda: build(cfg))


def num_params(cfg, which=nnx.Param) -> int:
  """The number of parameters (of those the nnx filter `which` selects); a base kernel stored
  quantized (QLoRA) counts its weights, not its bytes."""
  state = nnx.state(abstract(cfg), which)
  return sum(qlora.weights(k, v) for k, v in nnx.to_flat_state(state))


def num_fixed(cfg) -> int:
  """The values of the fixed tables a model computes instead of storing (sinusoidal positions),
  which other implementations may hold as frozen weights (transformers' Whisper)."""
  from nnx_zoo.common.nn import position

  model = abstract(cfg)
  return sum(
    m.max_len * m.dim for _, m in nnx.iter_graph(model) if isinstance(m, position.Sinusoidal)
  )


def num_active_params(cfg) -> int:
  """The parameters one token computes with: an MoE layer's experts (the weights with logical
  axis E) count top_k / num_experts of their size, everything else whole."""
  experts = cfg.mlp.num_experts if cfg.mlp.kind == "moe" else 0
  total = 0
  for path, var in nnx.to_flat_state(nnx.state(abstract(cfg), nnx.Param)):
    size = qlora.weights(path, var)
    if experts and "E" in (getattr(var, "axes", None) or ()):
      size = size * cfg.mlp.top_k // experts
    total += size
  return total


# Model configs saved before a change of the shared layers' configs (a checkpoint's meta, a
# workdir's config.json) read as the configs of today.
OLD_MLP_KINDS = ("swiglu", "geglu", "gelu", "gelu_exact", "relu")


def upgrade(saved: dict) -> ml_collections.ConfigDict:
  """A saved model config in today's form, meaning the same model: `mlp.kind` was the
  activation (now `kind = dense` and `activation`), and keys added since take the family's
  defaults (which are what their absence meant: e.g. `norm_placement`, `attention.scale`)."""
  saved = ml_collections.ConfigDict(saved).to_dict()
  mlp_cfg = saved.get("mlp", {})
  if mlp_cfg.get("kind") in OLD_MLP_KINDS and "activation" not in mlp_cfg:
    mlp_cfg["activation"], mlp_cfg["kind"] = mlp_cfg["kind"], "dense"
  lora_cfg = saved.get("lora", {})
  if lora_cfg.get("base_quant") and "frozen_dtype" not in lora_cfg:
    lora_cfg["frozen_dtype"] = "param_dtype"  # QLoRA saved before the key: tables as they were
  family = saved.get("family")
  if family in families():
    _fill(saved, family_module(family).config().to_dict())
  return ml_collections.ConfigDict(saved)


def _fill(saved: dict, defaults: dict):
  for key, value in defaults.items():
    if key not in saved:
      saved[key] = value
    elif (
      isinstance(value, dict)
      and isinstance(saved[key], dict)
      and key != "layer_kinds"
      # A sub-config of another kind (RoPE saved where the default is learned) keeps its own
      # keys: only a sub-config of the same kind is completed.
      and saved[key].get("kind", value.get("kind")) == value.get("kind")
    ):
      _fill(saved[key], value)


def infer_task(cfg) -> str:
  """The task of a config that names none, from what it holds: a diffusion section (denoiser), a
  preference section (dpo), a grpo section (grpo), a distill section (distill), an
  encoder-decoder of frames (speech) or of tokens (seq2seq), a CLIP pair of towers (contrastive),
  a classifier head (classifier), else a language model."""
  if cfg.get("diffusion") is not None:
    return "denoiser"
  if cfg.get("preference") is not None:
    return "dpo"
  if cfg.get("grpo") is not None:
    return "grpo"
  if cfg.get("distill") is not None:
    return "distill"
  model_cls = family_module(cfg.model.family).Model
  if issubclass(model_cls, Denoiser):
    return "denoiser"
  if issubclass(model_cls, EncoderDecoder):
    return "speech" if cfg.model.get("inputs") == "frames" else "seq2seq"
  if "vision" in cfg.model and "text" in cfg.model:
    return "contrastive"
  if cfg.model.get("num_labels", 0) or not hasattr(model_cls, "init_cache"):
    return "classifier"
  return "language_model"
