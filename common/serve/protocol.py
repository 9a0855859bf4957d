"""The fields of OpenAI's requests that `zoo serve` reads, checked, and its errors in OpenAI's
shape. A field the server honours is typed and bounded; a known OpenAI field it does not
implement is accepted at the value that changes nothing and refused otherwise (never silently
ignored); any other field is ignored, as clients send many."""

import dataclasses
import json
import math

MAX_TOP_LOGPROBS = 20  # OpenAI's bound on top_logprobs (the engine's too)

# OpenAI's error types by status.
ERROR_TYPES = {
  400: "invalid_request_error",
  401: "authentication_error",
  404: "not_found_error",
  429: "rate_limit_error",
  500: "server_error",
  503: "service_unavailable",
}


class ApiError(Exception):
  """An answer other than 200: its status, and the error object OpenAI's clients parse."""

  def __init__(self, status: int, message: str, *, param=None, code=None, headers=None):
    super().__init__(message)
    self.status, self.message, self.param, self.code = status, message, param, code
    self.headers = headers or {}

  def body(self) -> dict:
    kind = ERROR_TYPES.get(self.status, "server_error")
    return {
      "error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}
    }


def bad(param: str, message: str) -> ApiError:
  return ApiError(400, message, param=param, code="invalid_value")


# Known OpenAI (and vLLM) fields this server does not implement: each accepted only at a value
# that changes nothing, described for the error.
NEUTRAL = {
  "response_format": ('{"type": "text"} or null', lambda v: v in (None, {"type": "text"})),
  "logit_bias": ("{} or null", lambda v: v in (None, {})),
  "presence_penalty": ("0", lambda v: v in (None, 0)),
  "frequency_penalty": ("0", lambda v: v in (None, 0)),
  "repetition_penalty": ("1", lambda v: v in (None, 1)),
  "min_p": ("0", lambda v: v in (None, 0)),
  "min_tokens": ("0", lambda v: v in (None, 0)),
  "ignore_eos": ("false", lambda v: v in (None, False)),
  "tool_choice": ('"auto" or "none"', lambda v: v in (None, "auto", "none")),
  "parallel_tool_calls": ("true", lambda v: v in (None, True)),
  "functions": ("null (use tools)", lambda v: v in (None, [])),
  "function_call": ("null (use tools)", lambda v: v in (None, "auto", "none")),
  "suffix": ("null", lambda v: v in (None, "")),
  "audio": ("null", lambda v: v is None),
  "modalities": ('["text"]', lambda v: v in (None, ["text"])),
  "prediction": ("null", lambda v: v is None),
  "reasoning_effort": ("null", lambda v: v is None),
  "web_search_options": ("null", lambda v: v is None),
  "guided_json": ("null", lambda v: v is None),
  "guided_regex": ("null", lambda v: v is None),
  "guided_choice": ("null", lambda v: v is None),
  "guided_grammar": ("null", lambda v: v is None),
}
# best_of: neutral when it equals n (checked with n).


@dataclasses.dataclass
class Sampling:
  """What a request asks of each of its choices."""

  max_tokens: int | None  # None: to the end of the context
  temperature: float = 1.0
  top_p: float = 1.0
  top_k: int = 0
  n: int = 1
  seed: int | None = None
  stop: tuple[str, ...] = ()
  stop_token_ids: tuple[int, ...] = ()
  logprobs: int | None = None  # None: none; k: the chosen token's and the k most likely
  stream: bool = False
  include_usage: bool = False


@dataclasses.dataclass
class ChatRequest:
  model: str | None
  messages: list[dict]
  tools: list[dict] | None
  sampling: Sampling


@dataclasses.dataclass
class CompletionRequest:
  model: str | None
  prompts: list  # each a string or a list of token ids
  echo: bool
  sampling: Sampling


def parse_json(raw: bytes) -> dict:
  try:
    body = json.loads(raw)
  except (ValueError, UnicodeDecodeError) as e:
    raise ApiError(400, f"The body is not valid JSON ({e}).", code="invalid_json") from None
  if not isinstance(body, dict):
    raise ApiError(400, "The body must be a JSON object.", code="invalid_json")
  return body


def _typed(body, name, kinds, what, *, default=None, required=False):
  value = body.get(name)
  if value is None:
    if required:
      raise ApiError(400, f"'{name}' is required: give {what}.", param=name, code="missing")
    return default
  # bool is an int to Python; a JSON true is no number.
  if isinstance(value, bool) and bool not in kinds or not isinstance(value, kinds):
    raise bad(name, f"'{name}' must be {what}, not {json.dumps(value)[:80]}.")
  return value


def _number(body, name, default, lo, hi, what):
  value = _typed(body, name, (int, float), f"a number {what}", default=default)
  if not (math.isfinite(value) and lo <= value <= hi):
    raise bad(name, f"'{name}' is {value}: give a number {what}.")
  return float(value)


def _int(body, name, default, lo, hi=None, *, what=None):
  what = what or (f"an integer >= {lo}" if hi is None else f"an integer in [{lo}, {hi}]")
  value = _typed(body, name, (int,), what, default=default)
  if value is not None and (value < lo or (hi is not None and value > hi)):
    raise bad(name, f"'{name}' is {value}: give {what}.")
  return value


def _check_neutral(body, *, fields):
  for name in fields:
    if name in body:
      neutral, ok = NEUTRAL[name]
      value = body[name]
      try:
        fine = ok(value)
      except TypeError:  # an unhashable value compared
        fine = False
      if not fine:
        raise ApiError(
          400,
          f"'{name}' = {json.dumps(value)[:80]} is not implemented by this server: leave it out "
          f"or send {neutral}.",
          param=name,
          code="not_implemented",
        )


def _stop(body) -> tuple[str, ...]:
  value = body.get("stop")
  if value is None:
    return ()
  if isinstance(value, str):
    value = [value]
  if not isinstance(value, list) or not all(isinstance(s, str) for s in value):
    raise bad("stop", "'stop' must be a string or a list of strings.")
  return tuple(s for s in value if s)


def _sampling(body, *, max_tokens_default, vocab_size) -> Sampling:
  n = _int(body, "n", 1, 1, 128)
  best_of = body.get("best_of")
  if best_of is not None and best_of != n:
    raise ApiError(
      400,
      f"'best_of' = {json.dumps(best_of)[:40]} is not implemented by this server: leave it out "
      "or send the value of n.",
      param="best_of",
      code="not_implemented",
    )
  max_tokens = _int(body, "max_completion_tokens", None, 0)
  if max_tokens is None:
    max_tokens = _int(body, "max_tokens", max_tokens_default, 0)
  top_k = _int(body, "top_k", 0, -1)
  stream_options = _typed(body, "stream_options", (dict,), "an object", default={})
  include_usage = _typed(stream_options, "include_usage", (bool,), "true or false", default=False)
  stop_ids = _typed(body, "stop_token_ids", (list,), "a list of token ids", default=[])
  if not all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < vocab_size
             for i in stop_ids):  # fmt: skip
    raise bad("stop_token_ids", f"'stop_token_ids' must be token ids in [0, {vocab_size}).")
  seed = _typed(body, "seed", (int,), "an integer", default=None)
  return Sampling(
    max_tokens=max_tokens,
    temperature=_number(body, "temperature", 1.0, 0.0, 2.0, "in [0, 2]"),
    top_p=_number(body, "top_p", 1.0, 1e-9, 1.0, "in (0, 1]"),
    top_k=max(top_k, 0),
    n=n,
    seed=None if seed is None else seed % (1 << 32),  # jax's key takes 32 bits of it
    stop=_stop(body),
    stop_token_ids=tuple(stop_ids),
    stream=_typed(body, "stream", (bool,), "true or false", default=False),
    include_usage=include_usage,
  )


CHAT_NEUTRAL = tuple(k for k in NEUTRAL if k != "suffix")
ROLES = ("system", "developer", "user", "assistant", "tool")


def _content(value, where: str) -> str | None:
  """A message's content: a string, or a list of text parts (joined); None for an assistant's
  tool calls."""
  if value is None or isinstance(value, str):
    return value
  if isinstance(value, list):
    texts = []
    for part in value:
      if not isinstance(part, dict) or part.get("type") != "text":
        kind = part.get("type") if isinstance(part, dict) else type(part).__name__
        raise ApiError(
          400,
          f"{where}: a content part of type {kind!r} is not implemented: this model reads text.",
          param="messages",
          code="not_implemented",
        )
      if not isinstance(part.get("text"), str):
        raise bad("messages", f"{where}: a text part needs a string 'text'.")
      texts.append(part["text"])
    return "".join(texts)
  raise bad("messages", f"{where}: 'content' must be a string or a list of text parts.")


def _message(m, i: int) -> dict:
  where = f"messages[{i}]"
  if not isinstance(m, dict):
    raise bad("messages", f"{where} must be an object with 'role' and 'content'.")
  role = m.get("role")
  if role not in ROLES:
    raise bad("messages", f"{where} has role {json.dumps(role)}: use one of {', '.join(ROLES)}.")
  out = {**m, "role": "system" if role == "developer" else role}
  out["content"] = _content(m.get("content"), where)
  calls = m.get("tool_calls")
  if role == "assistant" and calls:
    if not isinstance(calls, list):
      raise bad("messages", f"{where}: 'tool_calls' must be a list.")
    out["tool_calls"] = [_tool_call(c, f"{where}.tool_calls[{j}]") for j, c in enumerate(calls)]
  elif out["content"] is None:
    raise ApiError(400, f"{where} has no 'content'.", param="messages", code="missing")
  return out


def _tool_call(call, where: str) -> dict:
  """An assistant's tool call as chat templates read it: `arguments` a JSON object (OpenAI
  sends a JSON string), under `function` and at the top (templates read either)."""
  fn = call.get("function") if isinstance(call, dict) else None
  if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
    raise bad("messages", f"{where} needs a 'function' with a 'name'.")
  args = fn.get("arguments", {})
  if isinstance(args, str):
    try:
      args = json.loads(args) if args.strip() else {}
    except ValueError:
      raise bad("messages", f"{where}: 'arguments' is not a JSON object.") from None
  fn = {**fn, "arguments": args}
  return {**call, "function": fn, "name": fn["name"], "arguments": args}


def chat_request(body: dict, *, vocab_size: int) -> ChatRequest:
  messages = _typed(body, "messages", (list,), "a list of messages", required=True)
  if not messages:
    raise bad("messages", "'messages' is empty: give at least one message.")
  _check_neutral(body, fields=CHAT_NEUTRAL)
  tools = _typed(body, "tools", (list,), "a list of tools", default=None)
  for j, tool in enumerate(tools or []):
    fn = tool.get("function") if isinstance(tool, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
      raise bad("tools", f"tools[{j}] must be {{'type': 'function', 'function': {{'name': ...}}}}.")
  if body.get("tool_choice") == "none":
    tools = None  # as if none were given: the template does not offer them
  sampling = _sampling(body, max_tokens_default=None, vocab_size=vocab_size)
  if sampling.max_tokens == 0:
    raise bad("max_tokens", "'max_tokens' is 0: give at least 1, or leave it out.")
  if _typed(body, "logprobs", (bool,), "true or false", default=False):
    sampling.logprobs = _int(body, "top_logprobs", 0, 0, MAX_TOP_LOGPROBS)
  elif body.get("top_logprobs") is not None:
    raise bad("top_logprobs", "'top_logprobs' needs 'logprobs': true.")
  return ChatRequest(
    model=_typed(body, "model", (str,), "a string", default=None),
    messages=[_message(m, i) for i, m in enumerate(messages)],
    tools=tools or None,
    sampling=sampling,
  )


def completion_request(body: dict, *, vocab_size: int) -> CompletionRequest:
  prompt = body.get("prompt")
  if prompt is None:
    raise ApiError(400, "'prompt' is required: give a string or token ids.", param="prompt",
                   code="missing")  # fmt: skip
  if isinstance(prompt, str) or (
    isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt)
  ):
    prompts = [prompt]
  elif isinstance(prompt, list) and prompt:
    prompts = prompt
  else:
    raise bad("prompt", "'prompt' must be a string, a list of token ids, or a list of either.")
  for i, p in enumerate(prompts):
    if isinstance(p, str):
      continue
    if not isinstance(p, list) or not all(isinstance(t, int) and not isinstance(t, bool)
                                          for t in p):  # fmt: skip
      raise bad("prompt", f"prompt[{i}] must be a string or a list of token ids.")
    if any(not 0 <= t < vocab_size for t in p):
      raise bad("prompt", f"prompt[{i}] has a token id outside [0, {vocab_size}).")
  _check_neutral(
    body, fields=[k for k in NEUTRAL if k not in ("tool_choice", "parallel_tool_calls")]
  )
  sampling = _sampling(body, max_tokens_default=16, vocab_size=vocab_size)  # OpenAI's default
  sampling.logprobs = _int(body, "logprobs", None, 0, MAX_TOP_LOGPROBS)
  echo = _typed(body, "echo", (bool,), "true or false", default=False)
  if sampling.max_tokens == 0 and not echo:
    raise bad("max_tokens", "'max_tokens' is 0: give at least 1 (0 only with echo).")
  return CompletionRequest(
    model=_typed(body, "model", (str,), "a string", default=None),
    prompts=prompts,
    echo=echo,
    sampling=sampling,
  )
