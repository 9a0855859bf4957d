"""Tool calls in a model's reply, parsed into OpenAI's `tool_calls`: one parser per chat-template
format, chosen by the template (the one extension point: `register`).

Each format is what the template teaches the model to write. Hermes and Qwen2.5 (and Qwen3,
SmolLM3) wrap each call's JSON, `{"name": ..., "arguments": {...}}`, in `<tool_call>` tags:

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

A parser returns None where the reply holds no well-formed call; then the reply is plain text.
"""

import dataclasses
import json
import re
import uuid
from collections.abc import Callable


@dataclasses.dataclass(frozen=True)
class ToolCall:
  name: str
  arguments: str  # a JSON object, as OpenAI sends it

  def to_openai(self, index: int | None = None) -> dict:
    out = {
      "id": f"call_{uuid.uuid4().hex[:24]}",
      "type": "function",
      "function": {"name": self.name, "arguments": self.arguments},
    }
    return out if index is None else {"index": index, **out}


@dataclasses.dataclass(frozen=True)
class Parsed:
  content: str | None  # the text outside the calls (None: none)
  calls: list[ToolCall]


class Parser:
  """A tool-call format. `start`: the text that opens a call (a streamed reply holds back what
  follows it, to send the calls whole at the end)."""

  name = ""
  start = ""

  def parse(self, text: str) -> Parsed | None:
    raise NotImplementedError


class Hermes(Parser):
  """`<tool_call>{json}</tool_call>`, one block per call; the last may be left open where the
  model stopped at its end token first."""

  name = "hermes"
  start = "<tool_call>"
  _BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.S)

  def parse(self, text):
    if self.start not in text:
      return None
    calls = []
    for body in self._BLOCK.findall(text):
      try:
        call = json.loads(body)
      except ValueError:
        return None
      if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return None
      args = call.get("arguments", call.get("parameters", {}))
      if not isinstance(args, str):
        args = json.dumps(args, ensure_ascii=False)
      calls.append(ToolCall(call["name"], args))
    content = text[: text.index(self.start)].strip()
    return Parsed(content or None, calls)


# (which templates, parser): the first whose test passes on the template's source is used.
_PARSERS: list[tuple[Callable[[str], bool], Parser]] = []


def register(matches: Callable[[str], bool], parser: Parser):
  """Adds a format: `matches(template_source)` says whether a chat template writes it."""
  _PARSERS.append((matches, parser))


def for_template(source: str) -> Parser | None:
  """The parser of the tool-call format a chat template defines, or None (no tool calls)."""
  return next((parser for matches, parser in _PARSERS if matches(source)), None)


def takes_tools(source: str) -> bool:
  """Whether a chat template reads the `tools` it is given."""
  return re.search(r"\btools\b", source) is not None


register(lambda source: "<tool_call>" in source, Hermes())
