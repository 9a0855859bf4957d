"""The HTTP endpoints of `zoo serve` (Starlette): OpenAI's /v1/chat/completions, /v1/completions
and /v1/models, with /health and /metrics. Each request's choices go to the engine thread
(`worker`); their news comes back on an asyncio queue, and is answered whole or streamed as
server-sent events. A client that goes away cancels its choices."""

import asyncio
import contextlib
import dataclasses
import hmac
import json
import logging
import random
import threading
import time
import traceback
import uuid
from collections.abc import AsyncIterator, Callable

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from nnx_zoo.common import engine
from nnx_zoo.common.errors import UserError
from nnx_zoo.common.serve import metrics as metrics_lib
from nnx_zoo.common.serve import protocol, text, worker
from nnx_zoo.common.serve.model import Served
from nnx_zoo.common.serve.protocol import ApiError
from nnx_zoo.common.tasks import tool_calls

log = logging.getLogger("nnx_zoo.serve")
RETRY_AFTER_S = 1  # what a refused client is told to wait
OUTCOME_OF_STATUS = {400: "invalid", 401: "unauthorized", 404: "not_found", 429: "overloaded",
                     503: "unavailable"}  # fmt: skip


class Service:
  """What the endpoints share: the model once loaded, its worker, the metrics, the state."""

  def __init__(self, load: Callable[[], Served], *, name: str, api_key=None, max_queue=64):
    self.load, self.name, self.api_key, self.max_queue = load, name, api_key, max_queue
    self.metrics = metrics_lib.Metrics()
    self.served: Served | None = None
    self.worker: worker.Worker | None = None
    self.state = "loading"  # then "ready", "draining"; or "failed"
    self.error: BaseException | None = None
    self.created = int(time.time())
    self.loaded = threading.Event()  # set once loading ended, ready or failed
    self.on_failure: Callable[[BaseException], None] | None = None

  # --- loading, in a thread of its own, while the server already answers ---

  def start(self):
    threading.Thread(target=self._load, name="zoo-serve-load", daemon=True).start()

  def _load(self):
    try:
      served = self.load()
      self.worker = worker.Worker(served.engine, served.tokenizer, metrics=self.metrics)
      self.metrics.watch(
        slots=served.engine.slots,
        in_use=lambda: served.engine.num_running,
        waiting=self.worker.waiting,
      )
      self.served = served
      self.worker.start()
      if self.state == "loading":
        self.state = "ready"
    except BaseException as e:  # a UserError says what to fix; the server exits with it
      self.state, self.error = "failed", e
      if not isinstance(e, UserError):
        log.error("loading failed:\n%s", traceback.format_exc())
      if self.on_failure is not None:
        self.on_failure(e)
    finally:
      self.loaded.set()

  def stop(self):
    self.state = "draining" if self.state != "failed" else self.state
    if self.worker is not None:
      self.worker.stop()

  # --- checks every generating request passes ---

  def authorize(self, request: Request):
    if self.api_key is None:
      return
    given = request.headers.get("authorization", "")
    scheme, _, key = given.partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(key.strip(), self.api_key):
      raise ApiError(
        401,
        "Missing or wrong API key: send it as 'Authorization: Bearer KEY'.",
        code="invalid_api_key",
      )

  def check_model(self, body: dict):
    model = body.get("model")
    if isinstance(model, str) and model != self.name:
      raise ApiError(
        404,
        f"The model {model!r} does not exist: this server serves {self.name!r}.",
        param="model",
        code="model_not_found",
      )

  def ready(self) -> Served:
    if self.state != "ready":
      why = {"loading": "is loading the model", "draining": "is shutting down"}.get(
        self.state, "failed to load the model"
      )
      raise ApiError(
        503, f"The server {why}: retry later.", headers={"Retry-After": str(RETRY_AFTER_S)}
      )
    return self.served

  def capacity(self) -> int:
    return self.served.engine.slots + self.max_queue


# --- one request's choices in the engine ---


class Run:
  """The choices of one HTTP request, submitted to the worker, and their events in order."""

  def __init__(self, svc: Service, choices: list[worker.Choice], queue: asyncio.Queue):
    self.svc, self.choices, self.queue = svc, choices, queue
    self.open = len(choices)

  @classmethod
  def start(cls, svc: Service, specs: list[tuple[list[int], "engine.SamplingParams", tuple]],
            seed: int | None, *, arrival: float) -> "Run":  # fmt: skip
    """Submits one choice per (prompt, params, stop strings) of `specs`: choice i draws with
    `fold_in(key(seed), i)` (a random seed if none is given), or refuses them all (429) if the
    engine's slots and queue are full. `arrival`: when the request came (time to first token
    counts from it)."""
    if len(specs) > svc.capacity():  # never fits: retrying would not help
      raise protocol.bad(
        "n",
        f"The request asks for {len(specs)} choices, and this server takes at most "
        f"{svc.capacity()} at once (--slots {svc.served.engine.slots} and --max-queue "
        f"{svc.max_queue}): ask for fewer.",
      )
    if not svc.worker.reserve(len(specs), svc.capacity()):
      raise ApiError(
        429,
        f"The server is at capacity ({svc.served.engine.slots} slots and a queue of "
        f"{svc.max_queue} requests): retry later.",
        code="queue_full",
        headers={"Retry-After": str(RETRY_AFTER_S)},
      )
    seed = random.getrandbits(32) if seed is None else seed
    loop, queue = asyncio.get_running_loop(), asyncio.Queue()

    def post(event):  # from the engine's thread
      loop.call_soon_threadsafe(queue.put_nowait, event)

    choices = [
      worker.Choice(i, prompt, params, seed, post, stops, arrival=arrival)
      for i, (prompt, params, stops) in enumerate(specs)
    ]
    for choice in choices:
      svc.worker.submit(choice)
    return cls(svc, choices, queue)

  async def next(self, gone: asyncio.Future) -> worker.Event | None:
    """The next event, or None once every choice has ended; raises ClientGone when `gone`
    (the client's disconnect) comes first."""
    if not self.open:
      return None
    get = asyncio.ensure_future(self.queue.get())
    done, _ = await asyncio.wait({get, gone}, return_when=asyncio.FIRST_COMPLETED)
    if get not in done:
      get.cancel()
      raise ClientGone()
    event = get.result()
    if event.finish_reason is not None or event.error is not None:
      self.open -= 1
    return event

  def cancel(self):
    for choice in self.choices:
      if not choice.done:
        self.svc.worker.cancel(choice)


class ClientGone(Exception):
  pass


async def _disconnected(request: Request):
  """Returns when the client has gone (the body is read already)."""
  while True:
    message = await request.receive()
    if message["type"] == "http.disconnect":
      return


# --- the endpoints ---


def error_response(e: ApiError) -> JSONResponse:
  return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


def endpoint(name: str):
  """An endpoint: its errors answered in OpenAI's shape, every request counted by outcome."""

  def wrap(handler):
    async def run(request: Request):
      svc: Service = request.app.state.service
      request.state.arrival = time.perf_counter()
      try:
        return await handler(request, svc)
      except ApiError as e:
        svc.metrics.count(name, OUTCOME_OF_STATUS.get(e.status, "error"))
        return error_response(e)
      except ClientGone:
        svc.metrics.count(name, "cancelled")
        return Response(status_code=499)
      except Exception as e:
        log.error("%s failed:\n%s", name, traceback.format_exc())
        svc.metrics.count(name, "error")
        return error_response(ApiError(500, f"{type(e).__name__}: {e}"))

    return run

  return wrap


async def _body(request: Request, svc: Service) -> tuple[dict, Served]:
  svc.authorize(request)
  body = protocol.parse_json(await request.body())
  svc.check_model(body)
  return body, svc.ready()


def _params(s: protocol.Sampling, max_tokens: int, stop_ids, *, prompt_logprobs=False):
  return engine.SamplingParams(
    max_tokens=max_tokens,
    temperature=s.temperature,
    top_k=s.top_k,
    top_p=s.top_p,
    stop_ids=tuple(dict.fromkeys([*stop_ids, *s.stop_token_ids])),
    logprobs=s.logprobs,
    prompt_logprobs=prompt_logprobs,
  )


def _max_tokens(s: protocol.Sampling, prompt_len: int, max_len: int, where: str) -> int:
  """The request's max_tokens, checked against the context: the rest of it if not given."""
  if prompt_len == 0:
    raise protocol.bad("prompt" if where == "prompt" else "messages", f"The {where} is empty.")
  if s.max_tokens is None:
    if prompt_len >= max_len:
      raise protocol.bad(
        "messages",
        f"The {where} has {prompt_len} tokens, and the context is {max_len}: shorten it.",
      )
    return max_len - prompt_len
  if prompt_len + s.max_tokens > max_len:
    raise protocol.bad(
      "max_tokens",
      f"The {where} has {prompt_len} tokens and max_tokens is {s.max_tokens}: together "
      f"{prompt_len + s.max_tokens}, beyond the context of {max_len} tokens. Shorten the "
      "prompt or lower max_tokens.",
    )
  return s.max_tokens


def _usage(prompt_tokens: int, completion_tokens: int, cached: int) -> dict:
  return {
    "prompt_tokens": prompt_tokens,
    "completion_tokens": completion_tokens,
    "total_tokens": prompt_tokens + completion_tokens,
    "prompt_tokens_details": {"cached_tokens": cached},
  }


def _chat_logprob(t: worker.Token) -> dict:
  def entry(token: str, logprob: float) -> dict:
    return {"token": token, "logprob": logprob, "bytes": list(token.encode("utf-8"))}

  tops = [entry(s, lp) for _, s, lp in t.top or []]
  return {**entry(t.text, t.logprob), "top_logprobs": tops}


@dataclasses.dataclass
class Reply:
  """What one choice has said so far."""

  text: str = ""
  tokens: list = dataclasses.field(default_factory=list)
  finish: str | None = None
  prompt_tokens: int = 0
  cached_tokens: int = 0
  completion_tokens: int = 0
  prompt: list | None = None
  prompt_text: str = ""
  started: bool = False  # a stream: the choice's first chunk sent
  sent: int = 0  # a chat stream: the characters of `text` sent as content
  echoed: int = 0  # a stream of completions: the characters of the echoed prompt

  def add(self, e: worker.Event):
    self.text += e.text
    self.tokens += e.tokens
    if e.prompt is not None:
      self.prompt, self.prompt_text = e.prompt, e.prompt_text
    if e.finish_reason is not None:
      self.finish = e.finish_reason
      self.prompt_tokens, self.cached_tokens = e.prompt_tokens, e.cached_tokens
      self.completion_tokens = e.completion_tokens


async def _first(run: Run, request: Request) -> tuple[worker.Event, asyncio.Future]:
  """The run's first event (its error raised as the answer), and the client's disconnect."""
  gone = asyncio.ensure_future(_disconnected(request))
  try:
    event = await run.next(gone)
  except BaseException:
    gone.cancel()
    run.cancel()
    raise
  if event.error is not None:
    gone.cancel()
    run.cancel()
    raise event.error
  return event, gone


async def _collect(run: Run, request: Request) -> list[Reply]:
  """Every choice's whole reply (a client that goes away cancels them)."""
  replies = [Reply() for _ in run.choices]
  event, gone = await _first(run, request)
  try:
    while event is not None:
      if event.error is not None:
        raise event.error
      replies[event.index].add(event)
      event = await run.next(gone)
  finally:
    gone.cancel()
    run.cancel()
  return replies


def _outcome(replies: list[Reply]) -> str:
  return replies[0].finish if replies[0].finish in metrics_lib.OUTCOMES else "stop"


class EventStream(Response):
  """Server-sent events from an async iterator of `data:` payloads, ended by `data: [DONE]`.
  The client's disconnect stops the iterator (its `finally` runs: its choices are cancelled)."""

  media_type = "text/event-stream"

  def __init__(self, events: AsyncIterator[str], gone: asyncio.Future):
    # As StreamingResponse: no body, so no content-length.
    self.status_code, self.background = 200, None
    self.init_headers({"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    self.events, self.gone = events, gone

  async def __call__(self, scope, receive, send):
    await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
    pump = asyncio.ensure_future(self._pump(send))
    went = True
    try:
      await asyncio.wait({pump, self.gone}, return_when=asyncio.FIRST_COMPLETED)
      went = self.gone.done()
    finally:
      if not pump.done():
        pump.cancel()
        with contextlib.suppress(asyncio.CancelledError, OSError):
          await pump
      self.gone.cancel()
      await self.events.aclose()
    if went or pump.cancelled():
      return  # the client went away: its choices are cancelled
    error = pump.exception()
    if error is not None and not isinstance(error, OSError | ClientGone):
      raise error

  async def _pump(self, send):
    async for data in self.events:
      await send({"type": "http.response.body", "body": f"data: {data}\n\n".encode(),
                  "more_body": True})  # fmt: skip
    await send({"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": False})


def _json(obj) -> str:
  return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))


# --- /v1/chat/completions ---


def _render(served: Served, req: protocol.ChatRequest) -> list[int]:
  if served.template is None:
    raise ApiError(
      400,
      f"This model has no chat template, so it takes no messages: use /v1/completions. "
      f"({served.no_template})",
      param="messages",
      code="no_chat_template",
    )
  if req.tools and not tool_calls.takes_tools(served.template.source):
    raise ApiError(
      400,
      "This model's chat template takes no tools: leave 'tools' out.",
      param="tools",
      code="not_implemented",
    )
  try:
    rendered = served.template.render(req.messages, add_generation_prompt=True, tools=req.tools)
  except UserError as e:
    raise ApiError(400, str(e), param="messages", code="template_error") from None
  ids, _ = served.tokenizer.encode_chat(rendered)
  return [int(i) for i in ids]


@endpoint("chat")
async def chat_completions(request: Request, svc: Service):
  body, served = await _body(request, svc)
  req = protocol.chat_request(body, vocab_size=served.vocab_size)
  s = req.sampling
  prompt = await run_in_threadpool(_render, served, req)
  max_tokens = _max_tokens(s, len(prompt), served.max_len, "conversation")
  params = _params(s, max_tokens, served.chat_stop_ids)
  stops = tuple(dict.fromkeys([*s.stop, *served.chat_stops]))
  parser = served.tool_parser if req.tools else None
  run = Run.start(svc, [(prompt, params, stops)] * s.n, s.seed, arrival=request.state.arrival)
  head = {
    "id": f"chatcmpl-{uuid.uuid4().hex}",
    "created": int(time.time()),
    "model": svc.name,
  }
  if s.stream:
    event, gone = await _first(run, request)
    return EventStream(_chat_stream(svc, run, event, gone, head, s, parser), gone)
  replies = await _collect(run, request)
  choices = []
  for i, r in enumerate(replies):
    message = {"role": "assistant", "content": r.text}
    finish = r.finish
    parsed = parser.parse(r.text) if parser is not None else None
    if parsed is not None and parsed.calls:
      message = {"role": "assistant", "content": parsed.content,
                 "tool_calls": [c.to_openai() for c in parsed.calls]}  # fmt: skip
      finish = "tool_calls"
    logprobs = {"content": [_chat_logprob(t) for t in r.tokens]} if s.logprobs is not None else None
    choices.append({"index": i, "message": message, "logprobs": logprobs, "finish_reason": finish})
  first = replies[0]
  usage = _usage(
    first.prompt_tokens, sum(r.completion_tokens for r in replies), first.cached_tokens
  )
  tooled = choices[0]["finish_reason"] == "tool_calls"
  svc.metrics.count("chat", "tool_calls" if tooled else _outcome(replies))
  return JSONResponse(
    {**head, "object": "chat.completion", "choices": choices, "usage": usage},
  )


async def _chat_stream(svc, run: Run, event, gone, head, s: protocol.Sampling, parser):
  """The `chat.completion.chunk` payloads of a run: each choice's role, its text as it comes
  (with a tool-call format: the text up to the first call, then the calls whole at the end),
  its finish reason; the usage last if asked."""
  head = {**head, "object": "chat.completion.chunk"}
  replies = [Reply() for _ in run.choices]
  usage_field = {"usage": None} if s.include_usage else {}
  outcome = None

  def chunk(i, delta, *, logprobs=None, finish=None):
    choice = {"index": i, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
    return _json({**head, "choices": [choice], **usage_field})

  try:
    while event is not None:
      if event.error is not None:
        yield _json(event.error.body())
        outcome = "error"
        return
      r = replies[event.index]
      r.add(event)
      i = event.index
      if not r.started:
        r.started = True
        yield chunk(i, {"role": "assistant", "content": ""})
      logprobs = None
      if s.logprobs is not None and event.tokens:
        logprobs = {"content": [_chat_logprob(t) for t in event.tokens]}
      if parser is None:
        new, r.sent = r.text[r.sent :], len(r.text)
      else:  # hold back from the start of a call (or what may begin one)
        at = r.text.find(parser.start)
        end = at if at >= 0 else len(r.text) - text.held_back(r.text, (parser.start,))
        new, r.sent = r.text[r.sent : max(end, r.sent)], max(end, r.sent)
      if new or logprobs:
        yield chunk(i, {"content": new}, logprobs=logprobs)
      if r.finish is not None:
        finish = r.finish
        parsed = parser.parse(r.text) if parser is not None else None
        if parsed is not None and parsed.calls:
          calls = [c.to_openai(index=k) for k, c in enumerate(parsed.calls)]
          yield chunk(i, {"tool_calls": calls})
          finish = "tool_calls"
        elif r.sent < len(r.text):
          yield chunk(i, {"content": r.text[r.sent :]})
        yield chunk(i, {}, finish=finish)
        outcome = outcome or finish
      event = await run.next(gone)
    if s.include_usage:
      first = replies[0]
      completion = sum(r.completion_tokens for r in replies)
      usage = _usage(first.prompt_tokens, completion, first.cached_tokens)
      yield _json({**head, "choices": [], "usage": usage})
  finally:
    run.cancel()
    if outcome is None:
      outcome = "cancelled"
    svc.metrics.count("chat", outcome if outcome in metrics_lib.OUTCOMES else "stop")


# --- /v1/completions ---


def _encode_prompts(served: Served, prompts: list) -> list[list[int]]:
  return [
    [int(i) for i in served.tokenizer.encode(p)] if isinstance(p, str) else list(p) for p in prompts
  ]


def _legacy_logprobs(tokens: list[worker.Token], start: int) -> dict:
  """OpenAI's legacy `logprobs` of tokens whose offsets count from `start`: the token strings,
  their log-probabilities, for each the most likely as {token: logprob} (the chosen one
  included), and where each begins in the choice's text."""
  out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
  for t in tokens:
    out["tokens"].append(t.text)
    out["token_logprobs"].append(t.logprob)
    top = None
    if t.logprob is not None:
      top = {s: lp for _, s, lp in t.top or []}
      top.setdefault(t.text, t.logprob)
    out["top_logprobs"].append(top)
    out["text_offset"].append(start + t.offset)
  return out


@endpoint("completions")
async def completions(request: Request, svc: Service):
  body, served = await _body(request, svc)
  req = protocol.completion_request(body, vocab_size=served.vocab_size)
  s = req.sampling
  prompts = await run_in_threadpool(_encode_prompts, served, req.prompts)
  score_only = s.max_tokens == 0  # echo's log-probabilities of the prompt alone
  specs = []
  for prompt in prompts:
    max_tokens = 1 if score_only else s.max_tokens
    s_one = dataclasses.replace(s, max_tokens=max_tokens)
    max_tokens = _max_tokens(s_one, len(prompt), served.max_len, "prompt")
    echo_logprobs = req.echo and s.logprobs is not None
    params = _params(s, max_tokens, served.eos_ids, prompt_logprobs=echo_logprobs)
    specs += [(prompt, params, s.stop)] * s.n
  run = Run.start(svc, specs, s.seed, arrival=request.state.arrival)
  head = {"id": f"cmpl-{uuid.uuid4().hex}", "created": int(time.time()), "model": svc.name}
  if s.stream:
    event, gone = await _first(run, request)
    return EventStream(_completion_stream(svc, run, event, gone, head, s, req.echo), gone)
  replies = await _collect(run, request)
  choices = []
  for i, r in enumerate(replies):
    if score_only:
      r.text, r.tokens, r.completion_tokens, r.finish = "", [], 0, "length"
    prompt_text = ""
    if req.echo:
      prompt_text = r.prompt_text if r.prompt is not None else served.tokenizer.decode(specs[i][0])
    logprobs = None
    if s.logprobs is not None:
      logprobs = _legacy_logprobs(r.tokens, len(prompt_text))
      if req.echo:
        echoed = _legacy_logprobs(r.prompt or [], 0)
        logprobs = {k: echoed[k] + logprobs[k] for k in logprobs}
    choices.append(
      {"index": i, "text": prompt_text + r.text, "logprobs": logprobs, "finish_reason": r.finish}
    )
  per_prompt = replies[:: s.n]
  usage = _usage(
    sum(r.prompt_tokens for r in per_prompt),
    sum(r.completion_tokens for r in replies),
    sum(r.cached_tokens for r in per_prompt),
  )
  svc.metrics.count("completions", _outcome(replies))
  return JSONResponse({**head, "object": "text_completion", "choices": choices, "usage": usage})


async def _completion_stream(svc, run: Run, event, gone, head, s: protocol.Sampling, echo: bool):
  head = {**head, "object": "text_completion"}
  replies = [Reply() for _ in run.choices]
  usage_field = {"usage": None} if s.include_usage else {}
  outcome = None

  def chunk(i, text_, *, logprobs=None, finish=None):
    choice = {"index": i, "text": text_, "logprobs": logprobs, "finish_reason": finish}
    return _json({**head, "choices": [choice], **usage_field})

  try:
    while event is not None:
      if event.error is not None:
        yield _json(event.error.body())
        outcome = "error"
        return
      r = replies[event.index]
      r.add(event)
      i = event.index
      prefix, logprobs = "", None
      if not r.started:
        r.started = True
        if echo:
          prefix = (
            r.prompt_text
            if r.prompt is not None
            else svc.served.tokenizer.decode(run.choices[i].prompt)
          )
      if prefix:
        r.echoed = len(prefix)
      if s.logprobs is not None:
        logprobs = _legacy_logprobs(event.tokens, r.echoed)
        if echo and event.prompt is not None:
          echoed = _legacy_logprobs(event.prompt, 0)
          logprobs = {k: echoed[k] + logprobs[k] for k in logprobs}
      if prefix or event.text or (logprobs and logprobs["tokens"]):
        yield chunk(i, prefix + event.text, logprobs=logprobs)
      if r.finish is not None:
        yield chunk(i, "", finish=r.finish)
        outcome = outcome or r.finish
      event = await run.next(gone)
    if s.include_usage:
      per_prompt = replies[:: s.n]
      usage = _usage(
        sum(r.prompt_tokens for r in per_prompt),
        sum(r.completion_tokens for r in replies),
        sum(r.cached_tokens for r in per_prompt),
      )
      yield _json({**head, "choices": [], "usage": usage})
  finally:
    run.cancel()
    svc.metrics.count("completions", outcome if outcome in metrics_lib.OUTCOMES else "cancelled")


# --- the rest ---


def _model_card(svc: Service) -> dict:
  card = {"id": svc.name, "object": "model", "created": svc.created, "owned_by": "nnx-zoo"}
  if svc.served is not None:
    card["max_model_len"] = svc.served.max_len
  return card


@endpoint("models")
async def models(request: Request, svc: Service):
  svc.authorize(request)
  model_id = request.path_params.get("model")
  if model_id is not None:
    svc.check_model({"model": model_id})
  svc.metrics.count("models", "ok")
  if model_id is not None:
    return JSONResponse(_model_card(svc))
  return JSONResponse({"object": "list", "data": [_model_card(svc)]})


async def health(request: Request):
  svc: Service = request.app.state.service
  status = 200 if svc.state == "ready" else 503
  body = {"status": svc.state}
  if svc.state == "failed":
    body["error"] = str(svc.error)
  headers = {} if status == 200 else {"Retry-After": str(RETRY_AFTER_S)}
  return JSONResponse(body, status_code=status, headers=headers)


async def metrics(request: Request):
  svc: Service = request.app.state.service
  return Response(svc.metrics.text(), media_type=metrics_lib.CONTENT_TYPE)


async def _http_error(request: Request, exc: HTTPException):
  message = f"{request.method} {request.url.path}: {exc.detail}"
  return error_response(ApiError(exc.status_code, message))


def create(service: Service) -> Starlette:
  """The ASGI app of a service; its lifespan starts loading and, at the end, stops the worker."""

  @contextlib.asynccontextmanager
  async def lifespan(app):
    service.start()
    yield
    service.stop()

  app = Starlette(
    routes=[
      Route("/v1/chat/completions", chat_completions, methods=["POST"]),
      Route("/v1/completions", completions, methods=["POST"]),
      Route("/v1/models", models, methods=["GET"]),
      Route("/v1/models/{model:path}", models, methods=["GET"]),
      Route("/health", health, methods=["GET"]),
      Route("/metrics", metrics, methods=["GET"]),
    ],
    exception_handlers={HTTPException: _http_error},
    lifespan=lifespan,
  )
  app.state.service = service
  return app
