"""The thread that drives the engine. The engine is single-threaded: this thread alone submits,
cancels and steps it. Between steps it turns each request's new token ids into text, checks the
stop strings (ending a request whose text holds one: the engine is told to cancel it, the text is
cut where the stop string begins) and hands each request's news to the asyncio side
(`Choice.post`, which the server binds to `loop.call_soon_threadsafe`)."""

import collections
import contextlib
import dataclasses
import logging
import threading
import time
import traceback
from collections.abc import Callable

import jax

from nnx_zoo.common import engine
from nnx_zoo.common.errors import UserError
from nnx_zoo.common.serve import text as text_lib
from nnx_zoo.common.serve.protocol import ApiError

log = logging.getLogger("nnx_zoo.serve")


@dataclasses.dataclass
class Token:
  """A token of a reply (or of an echoed prompt) with its log-probabilities."""

  id: int
  text: str  # the token's own text (special tokens included)
  offset: int  # its first character in the reply's (or prompt's) text
  logprob: float | None = None
  top: list[tuple[int, str, float]] | None = None  # the most likely: (id, text, logprob)


@dataclasses.dataclass
class Event:
  """News of one choice: text that is final, the tokens it holds, and at the end the reason and
  the counts; or an error."""

  index: int
  text: str = ""
  tokens: list[Token] = dataclasses.field(default_factory=list)
  finish_reason: str | None = None  # "stop", "length", "cancelled"
  prompt_tokens: int = 0
  cached_tokens: int = 0
  completion_tokens: int = 0
  prompt: list[Token] | None = None  # the prompt's tokens, on the first event, when asked
  prompt_text: str = ""
  error: ApiError | None = None


@dataclasses.dataclass(eq=False)
class Choice:
  """One engine request, as the worker keeps it."""

  index: int
  prompt: list[int]
  params: "engine.SamplingParams"
  seed: int
  post: Callable[[Event], None]
  stops: tuple[str, ...] = ()
  arrival: float = dataclasses.field(default_factory=time.perf_counter)
  # the worker's
  rid: int | None = None
  done: bool = False
  cancelled: bool = False
  detok: text_lib.Detokenizer | None = None
  tokens: list[Token] = dataclasses.field(default_factory=list)
  count: int = 0  # tokens generated (a stop id included)
  sent_chars: int = 0
  sent_tokens: int = 0
  first: float | None = None
  last: float | None = None


class Worker:
  """Owns the engine. `submit` and `cancel` may be called from any thread; `run` is the thread."""

  def __init__(self, eng, tokenizer, *, metrics=None):
    self.eng, self.tokenizer, self.metrics = eng, tokenizer, metrics
    self._lock = threading.Lock()
    self._inbox: collections.deque = collections.deque()
    self._wake = threading.Event()
    self._stopping = False
    self._active: dict[int, Choice] = {}  # rid -> choice
    self.load = 0  # choices taken and not finished
    self.pending = 0  # choices taken, not yet given to the engine
    self.thread = threading.Thread(target=self.run, name="zoo-serve-engine", daemon=True)

  # --- any thread ---

  def start(self):
    self.thread.start()

  def reserve(self, n: int, capacity: int) -> bool:
    """Takes room for `n` choices if the load stays within `capacity`."""
    with self._lock:
      if self.load + n > capacity:
        return False
      self.load += n
      return True

  def submit(self, choice: Choice):
    """Hands a choice (its room `reserve`d) to the engine thread."""
    with self._lock:
      self.pending += 1
      self._inbox.append(("submit", choice))
    self._wake.set()

  def cancel(self, choice: Choice):
    with self._lock:
      self._inbox.append(("cancel", choice))
    self._wake.set()

  def waiting(self) -> int:
    return self.pending + self.eng.num_waiting

  def stop(self, timeout: float = 10.0):
    self._stopping = True
    self._wake.set()
    if self.thread.is_alive():
      self.thread.join(timeout)

  # --- the engine thread ---

  def run(self):
    while not self._stopping:
      self._take_inbox()
      if not self.eng.busy:
        self._wake.wait(1.0)
        self._wake.clear()
        continue
      try:
        outputs = self.eng.step()
      except Exception as e:  # an engine fault: its requests fail, the server goes on
        log.error("engine step failed:\n%s", traceback.format_exc())
        self._fail_all(ApiError(500, f"The engine failed ({type(e).__name__}: {e})."))
        continue
      for out in outputs:
        choice = self._active.get(out.rid)
        if choice is not None:
          try:
            self._update(choice, out)
          except Exception as e:  # the tokenizer on this reply: it alone fails
            log.error("request failed:\n%s", traceback.format_exc())
            self._finish(choice, error=ApiError(500, f"{type(e).__name__}: {e}"))
    self._fail_all(ApiError(503, "The server is shutting down."))

  def _take_inbox(self):
    while True:
      with self._lock:
        if not self._inbox:
          return
        what, choice = self._inbox.popleft()
        if what == "submit":
          self.pending -= 1
      if what == "cancel":
        choice.cancelled = True
        if choice.rid is not None and not choice.done:
          self.eng.cancel(choice.rid)
      elif choice.cancelled:  # gone before it was submitted
        self._release(choice)
      else:
        self._submit(choice)

  def _submit(self, choice: Choice):
    try:
      key = jax.random.fold_in(jax.random.key(choice.seed), choice.index)
      choice.rid = self.eng.submit(list(choice.prompt), choice.params, key=key)
    except UserError as e:
      self._finish(choice, error=ApiError(400, str(e), code="invalid_value"))
      return
    except Exception as e:
      log.error("submit failed:\n%s", traceback.format_exc())
      self._finish(choice, error=ApiError(500, f"{type(e).__name__}: {e}"))
      return
    choice.detok = text_lib.Detokenizer(self.tokenizer)
    self._active[choice.rid] = choice

  def _token(self, token_id: int, offset: int, logprob=None, top=None) -> Token:
    text = self.tokenizer.token_text
    top = None if top is None else [(int(i), text(i), float(lp)) for i, lp in top]
    return Token(int(token_id), text(token_id), offset, logprob, top)

  def _update(self, choice: Choice, out):
    """An engine Output of `choice`: its tokens into text, the stop strings checked, the news
    posted."""
    now = time.perf_counter()
    event = Event(choice.index, prompt_tokens=out.prompt_tokens, cached_tokens=out.cached_tokens)
    if out.prompt_logprobs is not None:
      event.prompt, event.prompt_text = self._prompt(choice, out)
    stop_ids = set(choice.params.stop_ids)
    cut, finish = None, None
    for k, token_id in enumerate(out.tokens):
      choice.count += 1
      if out.finish_reason == "stop" and k == len(out.tokens) - 1 and token_id in stop_ids:
        break  # the stop id: counted, not text
      logprob = out.logprobs[k] if out.logprobs is not None else None
      top = out.top_logprobs[k] if out.top_logprobs is not None else None
      checked = len(choice.detok.text)
      choice.detok.add(token_id)
      choice.tokens.append(self._token(token_id, choice.detok.offsets[-1], logprob, top))
      if choice.stops:
        longest = max(map(len, choice.stops))
        cut = text_lib.find_stop(choice.detok.text, choice.stops, max(0, checked - longest + 1))
        if cut is not None:
          finish = "stop"
          self.eng.cancel(choice.rid)  # the engine ends it at its next step
          break
    if out.tokens:
      choice.first = choice.first or now
      choice.last = now
      if self.metrics is not None and choice.first == now:
        self.metrics.ttft.observe(now - choice.arrival)
    finish = finish or out.finish_reason
    if finish and cut is None:
      choice.detok.flush()
    text = choice.detok.text if cut is None else choice.detok.text[:cut]
    visible = len(text) if finish else len(text) - text_lib.held_back(text, choice.stops)
    visible = max(visible, choice.sent_chars)
    event.text = text[choice.sent_chars : visible]
    ready = [t for t in choice.tokens[choice.sent_tokens :] if t.offset < visible]
    event.tokens = ready
    choice.sent_chars, choice.sent_tokens = visible, choice.sent_tokens + len(ready)
    if finish:
      self._finish(choice, event=event, reason=finish)
    elif event.text or event.tokens or event.prompt is not None:
      _post(choice, event)

  def _prompt(self, choice: Choice, out) -> tuple[list[Token], str]:
    detok = text_lib.Detokenizer(self.tokenizer)
    tops = out.prompt_top_logprobs or [None] * len(choice.prompt)
    tokens = []
    for token_id, logprob, top in zip(choice.prompt, out.prompt_logprobs, tops, strict=True):
      detok.add(token_id)
      tokens.append(self._token(token_id, detok.offsets[-1], logprob, top))
    return tokens, detok.text

  def _finish(self, choice: Choice, *, event: Event | None = None, reason=None, error=None):
    if choice.done:
      return
    event = event or Event(choice.index)
    event.finish_reason, event.error = reason, error
    event.completion_tokens = choice.count
    if self.metrics is not None and error is None:
      self.metrics.prompt_tokens.inc(event.prompt_tokens)
      self.metrics.cached_tokens.inc(event.cached_tokens)
      self.metrics.output_tokens.inc(choice.count)
      if choice.count > 1 and choice.first is not None:
        self.metrics.tpot.observe((choice.last - choice.first) / (choice.count - 1))
    self._release(choice)
    _post(choice, event)

  def _release(self, choice: Choice):
    choice.done = True
    if choice.rid is not None:
      self._active.pop(choice.rid, None)
    with self._lock:
      self.load -= 1

  def _fail_all(self, error: ApiError):
    for choice in list(self._active.values()):
      if not choice.done:
        # An engine already in a bad way: its request is dropped here all the same.
        with contextlib.suppress(Exception):
          self.eng.cancel(choice.rid)
      self._finish(choice, error=error)


def _post(choice: Choice, event: Event):
  with contextlib.suppress(RuntimeError):  # the server's loop has closed: nobody is waiting
    choice.post(event)
