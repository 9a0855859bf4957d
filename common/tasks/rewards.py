"""GRPO's reward functions (common/tasks/grpo.py): named in `grpo.reward`, loaded, called and
checked; and those that compare a completion with a record's `answer` (an episode's final reply,
or what its tools returned).

A reward has TRL's signature, `reward(prompts, completions, **fields) -> list[float]`: `prompts`
the records' prompts (lists of messages), `completions` one list of messages each (the
assistant's reply, `[{"role": "assistant", "content": text}]`), and every other field of the
records as a keyword list, one value a completion (an answer key reaches the reward so). Plain
Python, run on the host.
"""

import dataclasses
import hashlib
import importlib
import importlib.util
import math
import os
import re
from collections.abc import Callable

import numpy as np

from nnx_zoo.common.errors import UserError


@dataclasses.dataclass(frozen=True)
class Reward:
  name: str  # the function's name (`reward/NAME` in metrics.jsonl)
  fn: Callable
  weight: float = 1.0


def load(spec: str) -> list[Reward]:
  """The reward functions of `grpo.reward`: comma-separated `FILE.py:NAME` or `module:NAME`,
  each optionally `@WEIGHT` (1 by default)."""
  out = []
  for part in [p.strip() for p in spec.split(",") if p.strip()]:
    name, weight = part, 1.0
    if "@" in part:
      name, _, w = part.rpartition("@")
      try:
        weight = float(w)
      except ValueError:
        raise UserError(f"grpo.reward {part!r}: the weight after '@' is not a number.") from None
    where, _, attr = name.rpartition(":")
    if not where or not attr:
      raise UserError(
        f"grpo.reward {part!r} names no function: write FILE.py:NAME or module:NAME (e.g. "
        "nnx_zoo.common.tasks.rewards:exact_answer)."
      )
    fn = getattr(user_module(where, part), attr, None)
    if not callable(fn):
      raise UserError(f"grpo.reward {part!r}: {where} has no function {attr!r}.")
    out.append(Reward(attr, fn, weight))
  names = [r.name for r in out]
  if len(set(names)) < len(names):
    raise UserError(f"grpo.reward names a function twice ({', '.join(names)}): give each once.")
  if not out:
    raise UserError(
      "The grpo task needs a reward: set --config.grpo.reward=FILE.py:NAME (or module:NAME), "
      "comma-separated for several, each optionally @WEIGHT."
    )
  return out


def user_module(where: str, part: str, what: str = "grpo.reward"):
  """The module `where` names: a FILE.py (imported from its path) or a module name; `part` and
  `what` (the config key) name it in the one-line error when it does not import. Rewards,
  tools and environments are read through it."""
  if where.endswith(".py"):
    path = os.path.abspath(os.path.expanduser(where))
    if not os.path.isfile(path):
      raise UserError(f"{what} {part!r}: {where} is not a file.")
    # One module a file, named by its path: two files called rewards.py do not clash.
    name = "nnx_zoo_user_" + hashlib.sha1(path.encode()).hexdigest()[:12]
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    try:
      spec.loader.exec_module(module)
    except Exception as e:
      raise UserError(f"{what} {part!r}: {where} fails to import ({type(e).__name__}: {e}).") from e
    return module
  try:
    return importlib.import_module(where)
  except ImportError as e:
    raise UserError(f"{what} {part!r}: module {where!r} does not import ({e}).") from None


def score(rewards: list[Reward], prompts: list, completions: list, fields: dict) -> np.ndarray:
  """[F, N] float64: each reward function's value of each completion. A function that raises,
  returns another number of values, or a value that is not a finite number stops the run with
  a UserError naming the function and the completion."""
  n = len(completions)
  out = np.zeros((len(rewards), n))
  for f, r in enumerate(rewards):
    try:
      values = r.fn(prompts, completions, **fields)
    except Exception as e:
      raise UserError(f"The reward {r.name} raised {type(e).__name__}: {e}") from e
    try:
      values = list(values)
    except TypeError:
      raise UserError(
        f"The reward {r.name} returned {type(values).__name__}, not a list of {n} floats."
      ) from None
    if len(values) != n:
      raise UserError(
        f"The reward {r.name} returned {len(values)} values for {n} completions: one a completion."
      )
    for i, v in enumerate(values):
      try:
        v = float(v)
      except (TypeError, ValueError):
        v = math.nan
      if not math.isfinite(v):
        raise UserError(
          f"The reward {r.name} returned {values[i]!r} for completion {i} "
          f"({_text(completions[i])[:60]!r}): rewards must be finite numbers."
        )
      out[f, i] = v
  return out


def _text(completion) -> str:
  """A completion's text: the string itself, or its last assistant message's content (a turn's
  only message; an episode's final answer, after its tool calls and results)."""
  return _last_reply(completion).get("content") or ""


def _last_reply(completion) -> dict:
  """A completion's last assistant message (a string: that text as one)."""
  if isinstance(completion, str):
    return {"role": "assistant", "content": completion}
  replies = [m for m in completion if m.get("role", "assistant") == "assistant"]
  return replies[-1] if replies else completion[-1]


def _normal(text: str) -> str:
  return re.sub(r"\s+", " ", str(text)).strip()


def exact_answer(prompts, completions, answer, **_) -> list[float]:
  """1 where the reply, spaces normalised, is the record's `answer`, else 0."""
  return [float(_normal(_text(c)) == _normal(a)) for c, a in zip(completions, answer, strict=True)]


def contains_answer(prompts, completions, answer, **_) -> list[float]:
  """1 where the record's `answer` is in the reply as a whole word or number, else 0."""
  return [
    float(re.search(rf"(?<!\w){re.escape(_normal(a))}(?!\w)", _normal(_text(c))) is not None)
    for c, a in zip(completions, answer, strict=True)
  ]


def number_only(prompts, completions, **_) -> list[float]:
  """1 where the reply is one number and nothing else (a format a program checks), else 0."""
  return [float(re.fullmatch(r"-?\d+(\.\d+)?", _normal(_text(c))) is not None) for c in completions]


def answered(prompts, completions, **_) -> list[float]:
  """1 where an episode ends in a reply that calls no tool and says something (the model
  answered, rather than calling on until its turns or tokens ran out), else 0; a plain
  completion with text counts as answered. Rewards stopping, not being right: weigh it below
  the answer's own reward."""
  out = []
  for c in completions:
    last = _last_reply(c)
    out.append(float(bool(_normal(last.get("content") or "")) and not last.get("tool_calls")))
  return out


def answer_in_tool_result(prompts, completions, answer, **_) -> list[float]:
  """1 where an episode's tools returned the record's `answer` (its calls computed it, whether
  or not the final reply says so), else 0: a step short of `contains_answer` on the final
  reply, for a model that calls the tools right but does not yet answer."""
  return [
    float(
      any(
        m.get("role") == "tool" and _normal(m.get("content") or "") == _normal(a)
        for m in ([] if isinstance(c, str) else c)
      )
    )
    for c, a in zip(completions, answer, strict=True)
  ]
