"""Tools a model calls and environments it acts in, as TRL's GRPOTrainer takes them (`tools=`,
`environment_factory=`), so a user's TRL tools carry over: loaded from `FILE.py:NAME` or
`module:NAME` (`grpo.tools`, `grpo.environment`, `zoo chat --tools`), each tool's JSON schema
built from its type hints and Google-style docstring by transformers' `get_json_schema`, and a
call run with a time limit, whatever goes wrong becoming the tool's message to the model.

- A tool is a plain function with type hints on every argument and a docstring describing each.
- An environment is a class: one instance per episode; `reset(**fields)` gets the record's
  fields (all but its prompt) and may return text appended to the prompt's last message; every
  other public method is a tool (`reset`, `reward` and `get_reward` are not); an optional
  `reward()` (or TRL's `get_reward()`) gives the episode's reward, `reward/environment`.

Used by GRPO's episodes (common/tasks/episodes.py) and `zoo chat --tools`; nothing here knows
of either.
"""

import dataclasses
import inspect
import json
import threading
from collections.abc import Callable

from nnx_zoo.common.errors import UserError
from nnx_zoo.common.tasks import rewards

NOT_TOOLS = ("reset", "reward", "get_reward")  # an environment's methods that are not tools


@dataclasses.dataclass(frozen=True)
class Tool:
  name: str
  fn: Callable
  schema: dict  # {"type": "function", "function": {"name", "description", "parameters"}}


def schema_of(fn, where: str) -> dict:
  """The JSON schema of a tool, as transformers' `get_json_schema` builds it (what
  `apply_chat_template(tools=[fn])` gives the template); a function without type hints or a
  docstring for each argument is refused, naming it."""
  from transformers.utils import chat_template_utils as ctu

  try:
    return ctu.get_json_schema(fn)
  except (ctu.TypeHintParsingException, ctu.DocstringParsingException) as e:
    raise UserError(
      f"{where}: {getattr(fn, '__name__', fn)!r} cannot be a tool ({e}): give every argument a "
      "type hint and the function a Google-style docstring with an Args: line for each."
    ) from None


def _named(part: str, what: str):
  where, _, attr = part.rpartition(":")
  if not where or not attr:
    raise UserError(f"{what} {part!r} names nothing: write FILE.py:NAME or module:NAME.")
  module = rewards.user_module(where, part, what)
  if not hasattr(module, attr):
    raise UserError(f"{what} {part!r}: {where} has no {attr!r}.")
  return getattr(module, attr)


def load_tools(spec: str, *, what: str = "grpo.tools") -> list[Tool]:
  """The functions of a comma-separated list of `FILE.py:NAME` or `module:NAME`, as tools."""
  out = []
  for part in [p.strip() for p in spec.split(",") if p.strip()]:
    fn = _named(part, what)
    if not callable(fn) or inspect.isclass(fn):
      raise UserError(f"{what} {part!r} is not a function: a tool is a plain function.")
    out.append(Tool(fn.__name__, fn, schema_of(fn, f"{what} {part!r}")))
  _check_names([t.name for t in out], what)
  return out


def _check_names(names: list[str], what: str):
  twice = sorted({n for n in names if names.count(n) > 1})
  if twice:
    raise UserError(f"{what}: two tools are named {', '.join(twice)}: give each a name once.")


def load_environment(spec: str, *, what: str = "grpo.environment") -> type:
  """The class of `FILE.py:NAME` or `module:NAME`, checked as an environment: a class with a
  `reset`, whose tools (its other public methods) all have schemas."""
  cls = _named(spec.strip(), what)
  if not inspect.isclass(cls):
    raise UserError(f"{what} {spec!r} is not a class: an environment is a class, one per episode.")
  if not callable(getattr(cls, "reset", None)):
    raise UserError(
      f"{what} {spec!r}: {cls.__name__} has no reset(**fields), which starts each episode."
    )
  for name in method_names(cls):
    schema_of(getattr(cls, name), f"{what} {spec!r}")
  return cls


def method_names(cls) -> list[str]:
  """An environment's tools: its public methods but reset, reward and get_reward."""
  return [
    name
    for name, member in inspect.getmembers(cls, callable)
    if not name.startswith("_") and name not in NOT_TOOLS and not inspect.isclass(member)
  ]


def environment_tools(instance) -> list[Tool]:
  """An environment instance's tools: its methods, bound."""
  cls = type(instance)
  return [
    Tool(name, getattr(instance, name), schema_of(getattr(cls, name), cls.__name__))
    for name in method_names(cls)
  ]


def environment_reward(instance) -> float | None:
  """The episode's reward an environment gives (`reward()`, or TRL's `get_reward()`), or None
  where it has neither."""
  for name in ("reward", "get_reward"):
    fn = getattr(instance, name, None)
    if callable(fn):
      return fn()
  return None


def has_reward(cls) -> bool:
  """Whether an environment class (or None: no environment) gives a reward."""
  return cls is not None and any(
    callable(getattr(cls, name, None)) for name in ("reward", "get_reward")
  )


# --- running a call ---

OK, ERROR, BAD_ARGUMENTS, TIMEOUT, UNKNOWN = "ok", "error", "bad_arguments", "timeout", "unknown"


@dataclasses.dataclass(frozen=True)
class Result:
  """A call's outcome: the text the model reads (`content`) and what happened (`status`: ok,
  error (the tool raised), bad_arguments, timeout, unknown (no such tool))."""

  name: str
  content: str
  status: str = OK


def as_text(value) -> str:
  """A tool's return value as the model reads it: a string as it is, else JSON where it can
  be, else str()."""
  if isinstance(value, str):
    return value
  try:
    return json.dumps(value, ensure_ascii=False)
  except (TypeError, ValueError):
    return str(value)


def run(tools: dict[str, Tool], name: str, arguments: str, *, timeout_s: float) -> Result:
  """Call tool `name` with `arguments` (a JSON object) within `timeout_s` seconds (0: no
  limit). An unknown tool, arguments that are not an object of its parameters, an exception or
  the time running out become the tool's message; nothing is raised. A call past its time is
  left running on its own (daemon) thread: Python cannot stop it."""
  tool = tools.get(name)
  if tool is None:
    known = ", ".join(sorted(tools)) or "none"
    return Result(name, f"Error: there is no tool {name!r} (tools: {known}).", UNKNOWN)
  try:
    args = json.loads(arguments) if arguments.strip() else {}
  except ValueError as e:
    return Result(name, f"Error: the arguments are not JSON ({e}).", BAD_ARGUMENTS)
  if not isinstance(args, dict):
    return Result(name, "Error: the arguments are not a JSON object.", BAD_ARGUMENTS)
  try:
    inspect.signature(tool.fn).bind(**args)
  except TypeError as e:
    return Result(name, f"Error: bad arguments for {name}: {e}.", BAD_ARGUMENTS)
  box: dict = {}

  def call():
    try:
      box["value"] = tool.fn(**args)
    except BaseException as e:  # the tool's failure is its message, whatever it raised
      box["error"] = e

  thread = threading.Thread(target=call, name=f"tool-{name}", daemon=True)
  thread.start()
  thread.join(timeout_s if timeout_s > 0 else None)
  if thread.is_alive():
    return Result(name, f"Error: {name} did not finish within {timeout_s:g} s.", TIMEOUT)
  if "error" in box:
    e = box["error"]
    return Result(name, f"Error: {name} raised {type(e).__name__}: {e}", ERROR)
  return Result(name, as_text(box.get("value")))
