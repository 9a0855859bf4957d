"""Tool calls in a model's reply, parsed: one parser per chat-template format, chosen by the
template (the one extension point: `register`), and the other forms small models write, read
as a setting (`reader`). `zoo serve` returns what it parses as OpenAI's `tool_calls`; GRPO's
episodes (common/tasks/episodes.py) and `zoo chat --tools` run them.

The template's own formats:

- Hermes and Qwen2.5 (and Qwen3, SmolLM3) wrap each call's JSON in `<tool_call>` tags:

      <tool_call>
      {"name": "get_weather", "arguments": {"city": "Paris"}}
      </tool_call>

- Llama 3.1, 3.2 and 3.3 (templates that speak of `<|python_tag|>` / `ipython`): the reply is
  the call's JSON itself, `{"name": ..., "parameters": {...}}`, maybe after `<|python_tag|>`,
  several separated by `;` (vLLM's llama3_json).

What small models write instead (Qwen2.5-Coder-0.5B-Instruct wrote no `<tool_call>` tags in
15 calls of 16, issue 59), read as llama.cpp's parsers read them:

- `json`: a bare JSON object with `name` and `arguments` (or `parameters`), maybe after text;
- `json_fence`: the same inside a ```json (or bare ```) code fence.

A parser returns None where the reply holds no well-formed call; then the reply is plain text.
"""

import dataclasses
import json
import re
import uuid
from collections.abc import Callable

from nnx_zoo.common.errors import UserError


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
  form: str = ""  # the parser's name: which form the calls were written in


class Parser:
  """A tool-call format. `start`: the text that opens a call (a streamed reply holds back what
  follows it, to send the calls whole at the end)."""

  name = ""
  start = ""

  def parse(self, text: str) -> Parsed | None:
    raise NotImplementedError

  def attempted(self, text: str) -> bool:
    """Whether the text tries a call in this form (parsed or not): a turn that tries and does
    not parse is counted."""
    return bool(self.start) and self.start in text


def _call(obj) -> ToolCall | None:
  """A call from a decoded JSON object with a `name` and `arguments` (or `parameters`)."""
  if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
    return None
  args = obj.get("arguments", obj.get("parameters", {}))
  if isinstance(args, str):  # a JSON string (OpenAI's): an object inside
    try:
      if not isinstance(json.loads(args), dict):
        return None
    except ValueError:
      return None
  elif isinstance(args, dict):
    args = json.dumps(args, ensure_ascii=False)
  else:
    return None
  return ToolCall(obj["name"], args)


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
        call = _call(json.loads(body))
      except ValueError:
        return None
      if call is None:
        return None
      calls.append(call)
    content = text[: text.index(self.start)].strip()
    return Parsed(content or None, calls, self.name)


_OBJECT_START = re.compile(r"\{\s*\"name\"\s*:")


def _objects(text: str, start: int, *, separators: str = "") -> tuple[list, int] | None:
  """The JSON values from `start` on, back to back (whitespace or one of `separators` between
  them), and where the last ends; None if the first does not decode."""
  decoder, out, at = json.JSONDecoder(), [], start
  while True:
    try:
      obj, at = decoder.raw_decode(text, at)
    except ValueError:
      return (out, at) if out else None
    out.append(obj)
    rest = text[at:].lstrip()
    if rest[:1] and rest[0] in separators:
      rest = rest[1:].lstrip()
    if not rest.startswith("{"):
      return out, at
    at = len(text) - len(rest)


class BareJson(Parser):
  """A bare JSON object `{"name": ..., "arguments": {...}}` (or several, or a list of them),
  maybe after some text: what small models write where their template asks for tags."""

  name = "json"

  def attempted(self, text):
    return _OBJECT_START.search(text) is not None

  def parse(self, text):
    found = _OBJECT_START.search(text)
    if found is None:
      return None
    start = found.start()
    if text[:start].rstrip().endswith("["):  # a list of calls
      start = text[:start].rstrip().rindex("[")
    got = _objects(text, start)
    if got is None:
      return None
    values, _ = got
    flat = [v for x in values for v in (x if isinstance(x, list) else [x])]
    calls = [_call(v) for v in flat]
    if not calls or any(c is None for c in calls):
      return None
    return Parsed(text[:start].strip() or None, calls, self.name)


class JsonFence(Parser):
  """Calls in a ```json (or bare ```) code fence: one object, several, or a list."""

  name = "json_fence"
  _FENCE = re.compile(r"```(?:json)?\s*\n?(.*?)(?:```|$)", re.S)

  def attempted(self, text):
    return any(_OBJECT_START.search(b) for b in self._FENCE.findall(text))

  def parse(self, text):
    calls, first = [], None
    for m in self._FENCE.finditer(text):
      body = m.group(1).strip()
      if not _OBJECT_START.search(body):
        continue
      values = _objects(body, 0)
      if values is None:
        return None
      flat = [v for x in values[0] for v in (x if isinstance(x, list) else [x])]
      got = [_call(v) for v in flat]
      if not got or any(c is None for c in got):
        return None
      calls += got
      first = m.start() if first is None else first
    if not calls:
      return None
    return Parsed(text[:first].strip() or None, calls, self.name)


class Llama3Json(Parser):
  """Llama 3.x's JSON calls: the reply is `{"name": ..., "parameters": {...}}` (or
  `arguments`), maybe after `<|python_tag|>`, several separated by `;`."""

  name = "llama3_json"
  start = "<|python_tag|>"

  def attempted(self, text):
    t = text.strip()
    return t.startswith(self.start) or _OBJECT_START.match(t) is not None

  def parse(self, text):
    t = text.strip()
    t = t.removeprefix(self.start).lstrip()
    if not t.startswith("{"):
      return None
    got = _objects(t, 0, separators=";")
    if got is None:
      return None
    values, end = got
    if t[end:].strip():  # text after the calls: not a call reply
      return None
    calls = [_call(v) for v in values]
    if not calls or any(c is None for c in calls):
      return None
    return Parsed(None, calls, self.name)


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
register(lambda source: "<|python_tag|>" in source or "ipython" in source, Llama3Json())

# The forms a reader may take besides the template's own (`reader(forms=...)`).
FORMS = ("template", "json_fence", "json")  # the order they are tried in
_EXTRA = {"json": BareJson(), "json_fence": JsonFence()}


@dataclasses.dataclass(frozen=True)
class Reading:
  """What a reader made of a reply: its calls (none where nothing parsed), the text outside
  them, which form they were in (`template` for the template's own), and whether the reply
  tried a call that did not parse (`malformed`)."""

  content: str
  calls: list[ToolCall]
  form: str = ""
  malformed: bool = False


class Reader:
  """Reads a reply's calls in the chosen forms: the template's own first, then the others in
  FORMS order; a reply whose calls parse in none is a reply without calls."""

  def __init__(self, template_parser: Parser | None, forms: tuple[str, ...]):
    self.parsers = []
    for form in FORMS:
      if form not in forms:
        continue
      if form == "template":
        if template_parser is not None:
          self.parsers.append(("template", template_parser))
      else:
        self.parsers.append((form, _EXTRA[form]))

  def read(self, text: str) -> Reading:
    tried = False
    for form, parser in self.parsers:
      parsed = parser.parse(text)
      if parsed is not None and parsed.calls:
        return Reading(parsed.content or "", parsed.calls, form)
      tried = tried or parser.attempted(text)
    return Reading(text, [], "", malformed=tried)


def parse_forms(spec: str, *, what: str = "grpo.call_forms") -> tuple[str, ...]:
  """The comma-separated forms of a setting, checked."""
  forms = tuple(f.strip() for f in spec.split(",") if f.strip())
  unknown = [f for f in forms if f not in FORMS]
  if unknown or not forms:
    raise UserError(f"{what}={spec!r}: give some of {', '.join(FORMS)}, comma-separated.")
  return forms


def reader(template_source: str, forms: str = ",".join(FORMS)) -> Reader:
  """The reader of a chat template's calls in the forms of `forms` (FORMS, comma-separated)."""
  return Reader(for_template(template_source), parse_forms(forms))
