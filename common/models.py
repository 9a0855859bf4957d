"""The family registry: `model.family` in a config names the module that builds the model."""

import importlib

import jax
import jax.numpy as jnp
from flax import nnx

from common.errors import UserError, suggest
from common.nn import lora

FAMILIES = {"llama": "zoo.llama.model", "gpt2": "zoo.gpt2.model", "bert": "zoo.bert.model"}


def family_module(name: str):
  if name not in FAMILIES:
    raise UserError(f"Unknown model family {name!r}.{suggest(name, FAMILIES)}")
  return importlib.import_module(FAMILIES[name])


def build(cfg, *, seed: int = 0) -> nnx.Module:
  """The NNX model of a `model` config, with freshly initialised weights (and LoRA adapters
  where `model.lora` asks for them)."""
  model = family_module(cfg.family).Model(cfg, rngs=nnx.Rngs(seed))
  if cfg.get("lora") is not None:
    lora.apply(model, cfg.lora, seed=seed)
  return model


def abstract(cfg) -> nnx.Module:
  """The model with ShapeDtypeStructs for weights: nothing is allocated."""
  return nnx.eval_shape(lambda: build(cfg))


def num_params(cfg, which=nnx.Param) -> int:
  """The number of parameters (of those the nnx filter `which` selects)."""
  state = nnx.state(abstract(cfg), which)
  return sum(int(x.size) for x in jax.tree.leaves(state))


def dtypes(cfg) -> dict:
  """The dtype keyword arguments every shared layer takes."""
  return {"dtype": jnp.dtype(cfg.dtype), "param_dtype": jnp.dtype(cfg.param_dtype)}
