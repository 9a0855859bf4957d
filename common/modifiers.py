"""Config modifiers: plain functions ConfigDict -> ConfigDict that rewrite matching sub-configs.

After AXLearn's `replace_config`: one modifier changes a choice in every experiment at once (the
position encoding, the attention implementation), with no edit to any model.
"""

from collections.abc import Callable

import ml_collections

from nnx_zoo.common.nn import position


def replace(cfg, match: Callable, new: Callable):
  """A copy of `cfg` where every sub-config for which `match(sub)` is true becomes `new(sub)`."""
  cfg = ml_collections.ConfigDict(cfg.to_dict())  # a deep copy, unlocked
  for key, value in list(cfg.items()):
    if isinstance(value, ml_collections.ConfigDict):
      cfg[key] = new(value) if match(value) else replace(value, match, new)
  return cfg


def is_kind(kind: str) -> Callable:
  return lambda sub: sub.get("kind") == kind


def rope_to_alibi(cfg):
  return replace(cfg, is_kind("rope"), lambda _: position.config("alibi"))


def rope_to_none(cfg):
  return replace(cfg, is_kind("rope"), lambda _: position.config("none"))


def rope_to_yarn(cfg, factor: float = 4.0, original_max_len: int = 4096):
  def new(rope):
    rope.scaling = position.rope_scaling("yarn", factor=factor, original_max_len=original_max_len)
    return rope

  return replace(cfg, is_kind("rope"), new)
