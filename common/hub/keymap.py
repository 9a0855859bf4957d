"""The vocabulary a family's `params.py` names its Hugging Face weights with: one `Rule` per HF
tensor (copied, transposed or split into zoo parameters, and back)."""

import dataclasses
from collections.abc import Callable

import jax.numpy as jnp

from common.errors import UserError

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
