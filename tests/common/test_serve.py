"""`zoo serve` (common/serve/): every endpoint through an in-process client (Starlette's
TestClient), the official `openai` client against a live uvicorn server on 127.0.0.1, and the
faults: bad input in OpenAI's error shape, a client that goes away, overload, SIGTERM.

The model is `tiny:llama` (a random 2-layer Llama as a Hugging Face directory, ChatML template),
loaded once; each server has its own engine over the same weights (the engines share their
compiled programs). Tool calls and stop strings over a known reply use `Scripted`, an engine of
the same interface that writes fixed tokens."""

import asyncio
import contextlib
import dataclasses
import json
import re
import signal
import subprocess
import sys
import threading
import time

import jax
import numpy as np
import pytest
from flax import nnx
from starlette.testclient import TestClient

from nnx_zoo.common import engine, models
from nnx_zoo.common.data import chat
from nnx_zoo.common.errors import UserError
from nnx_zoo.common.hub import weights
from nnx_zoo.common.serve import app, model, protocol, text
from nnx_zoo.common.tasks import tool_calls

httpx = pytest.importorskip("httpx")
uvicorn = pytest.importorskip("uvicorn")

SLOTS, MAX_LEN = 4, 128  # every engine here: so they share one set of compiled programs
HI = [{"role": "user", "content": "To be, or not to be?"}]


# --- the model, the engines, the servers ---


@dataclasses.dataclass
class Tiny:
  workdir: str
  cfg: object
  served: model.Served  # loaded as `zoo serve` loads it
  split: tuple  # (graphdef, params), for more engines


@pytest.fixture(scope="module")
def tiny() -> Tiny:
  workdir, cfg = weights.workdir_config("tiny:llama")
  served = model.load(cfg, workdir, slots=SLOTS, max_len=MAX_LEN, dtype=None)
  model.warm(served)
  model_cfg, params, _ = weights.read_zoo(workdir)
  split = (nnx.graphdef(models.abstract(model_cfg)), jax.tree.map(np.asarray, params))
  return Tiny(workdir, cfg, served, split)


def fresh(tiny: Tiny) -> model.Served:
  """The tiny model in a new engine (one per server: an engine has one owner thread)."""
  eng = engine.Engine(tiny.split, slots=SLOTS, max_len=MAX_LEN)
  return dataclasses.replace(tiny.served, engine=eng)


def wait_ready(get, timeout=60.0):
  start = time.monotonic()
  while time.monotonic() - start < timeout:
    if get("/health").status_code == 200:
      return
    time.sleep(0.02)
  raise AssertionError("the server did not become ready")


@contextlib.contextmanager
def in_process(served: model.Served, **kw):
  service = app.Service(lambda: served, name=kw.pop("name", "tiny"), **kw)
  with TestClient(app.create(service)) as client:
    wait_ready(client.get)
    yield client


@pytest.fixture(scope="module")
def client(tiny):
  with in_process(tiny.served, max_queue=2) as c:
    yield c


@contextlib.contextmanager
def live(served: model.Served, **kw):
  """A uvicorn server in a thread on a free port of 127.0.0.1: its base URL."""
  service = app.Service(lambda: served, name="tiny", **kw)
  config = uvicorn.Config(
    app.create(service), host="127.0.0.1", port=0, log_level="warning", lifespan="on"
  )
  server = uvicorn.Server(config)
  thread = threading.Thread(target=server.run, daemon=True)
  thread.start()
  try:
    while not server.started:
      assert thread.is_alive(), "uvicorn did not start"
      time.sleep(0.01)
    port = server.servers[0].sockets[0].getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    with httpx.Client(base_url=url, timeout=60) as http:
      wait_ready(http.get)
    yield url, service
  finally:
    server.should_exit = True
    thread.join(30)


@pytest.fixture(scope="module")
def server(tiny):
  with live(fresh(tiny), max_queue=2) as (url, service):
    yield url, service


@pytest.fixture(scope="module")
def openai_client(server):
  openai = pytest.importorskip("openai")
  return openai.OpenAI(base_url=server[0] + "/v1", api_key="none", max_retries=0)


def greedy(tiny: Tiny, prompt: list[int], max_tokens: int, stop_ids=()) -> list[int]:
  """The engine's own greedy tokens for a prompt (a lone request in an engine of its own)."""
  eng = engine.Engine(tiny.split, slots=SLOTS, max_len=MAX_LEN)
  params = engine.SamplingParams(max_tokens=max_tokens, temperature=0.0, stop_ids=stop_ids)
  rid = eng.submit(prompt, params, seed=0)
  return eng.run()[rid]


def chat_prompt(tiny: Tiny, messages) -> list[int]:
  served = tiny.served
  rendered = served.template.render(messages, add_generation_prompt=True)
  return served.tokenizer.encode_chat(rendered)[0].tolist()


def reply_text(tiny: Tiny, tokens: list[int]) -> str:
  stops = set(tiny.served.chat_stop_ids)
  return tiny.served.tokenizer.decode([t for t in tokens if t not in stops])


def metric(text_: str, name: str) -> float:
  pattern = rf"^{re.escape(name)} (\S+)$"
  return sum(float(v) for v in re.findall(pattern, text_, re.M))


# --- a scripted engine: the engine's interface, writing fixed tokens ---


class Scripted:
  """Writes `reply` (then its first stop id, if it has any) a token a step, one request per slot;
  each token's log-probability -0.5, its alternatives the next ids. Records the prompts."""

  def __init__(self, reply: list[int], *, slots=2, max_len=4096):
    self.reply, self.slots, self.max_len = list(reply), slots, max_len
    self.prompts, self._next, self._reqs, self._waiting, self._cancel = [], 0, {}, [], []

  @property
  def busy(self):
    return bool(self._reqs)

  @property
  def num_running(self):
    return len(self._reqs) - len(self._waiting)

  @property
  def num_waiting(self):
    return len(self._waiting)

  def submit(self, prompt, params, *, seed=None, key=None):
    if len(prompt) + params.max_tokens > self.max_len:
      raise UserError(f"{len(prompt)} + {params.max_tokens} > {self.max_len}")
    rid, self._next = self._next, self._next + 1
    self.prompts.append(list(prompt))
    self._reqs[rid] = (params, [])
    self._waiting.append(rid)
    return rid

  def cancel(self, rid):
    self._cancel.append(rid)

  def step(self):
    outs = []
    for rid in self._cancel:
      if rid in self._reqs:
        del self._reqs[rid]
        self._waiting = [r for r in self._waiting if r != rid]
        outs.append(engine.Output(rid, [], finish_reason="cancelled"))
    self._cancel = []
    running = [r for r in self._reqs if r not in self._waiting]
    while self._waiting and len(running) < self.slots:
      running.append(self._waiting.pop(0))
    for rid in running:
      params, written = self._reqs[rid]
      script = self.reply + list(params.stop_ids[:1])
      token = script[len(written)] if len(written) < len(script) else 0
      written.append(token)
      out = engine.Output(rid, [token], prompt_tokens=3)
      if params.logprobs is not None:
        out.logprobs = [-0.5]
        out.top_logprobs = [[(token + i, -0.5 - i) for i in range(params.logprobs)]]
      if token in params.stop_ids:
        out.finish_reason = "stop"
      elif len(written) >= params.max_tokens:
        out.finish_reason = "length"
      if out.finish_reason:
        del self._reqs[rid]
      outs.append(out)
    return outs


# A template in the shape of Qwen2.5's: the tools in a system turn, calls as <tool_call> JSON.
TOOLS_TEMPLATE = (
  "{%- if messages[0].role == 'tool' %}{{ raise_exception('A conversation cannot open with a "
  "tool result.') }}{% endif %}"
  "{%- if tools %}<|im_start|>system\nYou may call these functions:\n<tools>"
  "{%- for tool in tools %}\n{{ tool | tojson }}{%- endfor %}\n</tools>\nReturn each call as "
  '<tool_call>\n{"name": <name>, "arguments": <args>}\n</tool_call><|im_end|>\n{% endif %}'
  "{%- for m in messages %}"
  "{%- if m.role == 'assistant' and m.tool_calls %}<|im_start|>assistant"
  '{%- for c in m.tool_calls %}\n<tool_call>\n{"name": "{{ c.function.name }}", '
  '"arguments": {{ c.function.arguments | tojson }}}\n</tool_call>{%- endfor %}<|im_end|>\n'
  "{%- elif m.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m.content }}\n"
  "</tool_response><|im_end|>\n"
  "{%- else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}"
  "{%- endfor %}{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
WEATHER = {
  "type": "function",
  "function": {
    "name": "get_weather",
    "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
  },
}


def scripted(tiny: Tiny, reply: str, **kw) -> model.Served:
  tok = tiny.served.tokenizer
  template = chat.Template(TOOLS_TEMPLATE, tiny.served.template.special)
  return dataclasses.replace(
    tiny.served,
    engine=Scripted(tok.encode(reply).tolist(), **kw),
    template=template,
    tool_parser=tool_calls.for_template(template.source),
  )


# --- units: text and tool calls ---


def test_detokenizer_gives_the_whole_decode_token_by_token(tiny):
  tok = tiny.served.tokenizer
  sample = "To be, or not to be — that is the question: 12 + 30 = 42. Ünïcödé ✓"
  ids = tok.encode(sample).tolist()
  detok = text.Detokenizer(tok)
  pieces = [detok.add(i) for i in ids]
  assert "".join(pieces) == detok.text == tok.decode(ids)
  assert all("\ufffd" not in p for p in pieces)  # a character split over tokens waits
  assert detok.offsets == sorted(detok.offsets) and len(detok.offsets) == len(ids)


def test_stop_strings_and_what_is_held_back():
  assert text.find_stop("abc STOP def", ("STOP", "def")) == 4
  assert text.find_stop("abc", ("x",)) is None
  assert text.held_back("hello ST", ("STOP",)) == 2
  assert text.held_back("hello S", ("STOP", "Sx")) == 1
  assert text.held_back("hello", ("STOP",)) == 0


def test_hermes_tool_calls():
  parser = tool_calls.for_template(TOOLS_TEMPLATE)
  assert parser is not None and parser.name == "hermes"
  assert tool_calls.for_template(chat.Template("{{ messages }}").source) is None
  got = parser.parse(
    'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
    '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {}}'  # the last left open
  )
  assert got.content == "Let me look."
  assert [(c.name, json.loads(c.arguments)) for c in got.calls] == [
    ("get_weather", {"city": "Paris"}),
    ("get_time", {}),
  ]
  assert parser.parse("no calls here") is None
  assert parser.parse("<tool_call>{not json}</tool_call>") is None


# --- the endpoints, in process ---


def test_health_models_and_metrics(client):
  assert client.get("/health").json() == {"status": "ready"}
  models_ = client.get("/v1/models").json()
  assert models_["object"] == "list"
  assert [m["id"] for m in models_["data"]] == ["tiny"]
  assert models_["data"][0]["max_model_len"] == MAX_LEN
  assert client.get("/v1/models/tiny").json()["id"] == "tiny"
  client.post("/v1/completions", json={"prompt": "To be", "max_tokens": 2})
  page = client.get("/metrics")
  assert page.status_code == 200 and page.headers["content-type"].startswith("text/plain")
  for name in ("zoo_requests_total", "zoo_time_to_first_token_seconds_count",
               "zoo_time_per_output_token_seconds_count", "zoo_prompt_tokens_total",
               "zoo_generation_tokens_total", "zoo_slots_in_use", "zoo_queue_length"):  # fmt: skip
    assert re.search(rf"^{name}", page.text, re.M), name
  assert metric(page.text, 'zoo_requests_total{endpoint="completions",outcome="length"}') >= 1
  assert metric(page.text, "zoo_slots") == SLOTS


def test_greedy_chat_equals_the_engines_own(client, tiny):
  prompt = chat_prompt(tiny, HI)
  want = greedy(tiny, prompt, 12, tiny.served.chat_stop_ids)
  body = {"model": "tiny", "messages": HI, "max_tokens": 12, "temperature": 0}
  out = client.post("/v1/chat/completions", json=body).json()
  (choice,) = out["choices"]
  assert choice["message"] == {"role": "assistant", "content": reply_text(tiny, want)}
  assert choice["finish_reason"] == ("stop" if want[-1] in tiny.served.chat_stop_ids else "length")
  assert out["object"] == "chat.completion" and out["model"] == "tiny"
  usage = out["usage"]
  assert usage["prompt_tokens"] == len(prompt) and usage["completion_tokens"] == len(want)
  assert usage["total_tokens"] == len(prompt) + len(want)


def test_completions_token_ids_echo_logprobs_as_lm_eval_reads_them(client, tiny):
  """lm-eval's local-completions scoring request: token-id prompts, echo, logprobs=1,
  max_tokens=1; the prompt's log-probabilities are the model's own log-softmax."""
  prompts = [[1, 40, 41, 42, 43, 44], [7, 8, 9]]
  body = {"model": "tiny", "prompt": prompts, "max_tokens": 1, "temperature": 0, "echo": True,
          "logprobs": 1, "seed": 1234}  # fmt: skip
  out = client.post("/v1/completions", json=body).json()
  assert out["object"] == "text_completion"
  graphdef, params = tiny.split
  net = nnx.merge(graphdef, params)
  for prompt, choice in zip(prompts, sorted(out["choices"], key=lambda c: c["index"]), strict=True):
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == len(prompt) + 1  # the prompt and the one new token
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    logp = np.asarray(jax.nn.log_softmax(net(np.asarray([prompt]))[0].astype(np.float32)))
    want = [float(logp[i - 1, prompt[i]]) for i in range(1, len(prompt))]
    np.testing.assert_allclose(lp["token_logprobs"][1 : len(prompt)], want, atol=1e-4)
    for token_lp, top in zip(lp["token_logprobs"][1:], lp["top_logprobs"][1:], strict=True):
      assert max(top.values()) >= token_lp - 1e-6
    assert lp["text_offset"] == sorted(lp["text_offset"])
    assert choice["text"].startswith(tiny.served.tokenizer.decode(prompt))
  lm_eval = pytest.importorskip("lm_eval.models.openai_completions")
  scored = lm_eval.LocalCompletionsAPI.parse_logprobs(out, ctxlens=[len(p) - 1 for p in prompts])
  assert len(scored) == 2 and all(np.isfinite(s) for s, _ in scored)


def test_completions_text_prompt_and_max_tokens_zero_with_echo(client, tiny):
  tok = tiny.served.tokenizer
  out = client.post("/v1/completions", json={"prompt": "To be", "max_tokens": 3, "temperature": 0})
  (choice,) = out.json()["choices"]
  want = greedy(tiny, tok.encode("To be").tolist(), 3, tiny.served.eos_ids)
  assert choice["text"] == reply_text(tiny, want)
  score = {"prompt": "To be", "max_tokens": 0, "echo": True, "logprobs": 0}
  out = client.post("/v1/completions", json=score).json()
  assert out["choices"][0]["text"] == "To be" and out["usage"]["completion_tokens"] == 0
  assert len(out["choices"][0]["logprobs"]["tokens"]) == len(tok.encode("To be"))


def test_completions_stream_equals_the_whole_answer(client):
  body = {"prompt": "To be", "max_tokens": 6, "temperature": 0, "echo": True, "logprobs": 2}
  whole = client.post("/v1/completions", json=body).json()["choices"][0]
  r = client.post("/v1/completions", json={**body, "stream": True})
  chunks = [json.loads(x[6:])["choices"][0] for x in r.text.splitlines() if x.startswith("data: {")]
  assert "".join(c["text"] for c in chunks) == whole["text"]
  joined = {k: [] for k in whole["logprobs"]}
  for c in chunks:
    for k in joined:
      joined[k] += (c["logprobs"] or {}).get(k, [])
  assert joined == whole["logprobs"]
  assert chunks[-1]["finish_reason"] == whole["finish_reason"]


def test_chat_stream_equals_the_whole_answer(client):
  body = {"messages": HI, "max_tokens": 10, "temperature": 0}
  whole = client.post("/v1/chat/completions", json=body).json()
  stream = {**body, "stream": True, "stream_options": {"include_usage": True}}
  r = client.post("/v1/chat/completions", json=stream)
  assert r.headers["content-type"].startswith("text/event-stream")
  events = [line[len("data: ") :] for line in r.text.splitlines() if line.startswith("data: ")]
  assert events[-1] == "[DONE]"
  chunks = [json.loads(e) for e in events[:-1]]
  assert all(c["object"] == "chat.completion.chunk" for c in chunks)
  assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
  content = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
  assert content == whole["choices"][0]["message"]["content"]
  finish = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]]
  assert finish[-1] == whole["choices"][0]["finish_reason"] and not any(finish[:-1])
  # The same counts (the stream's prompt may come from the cache the whole answer left).
  counts = ("prompt_tokens", "completion_tokens", "total_tokens")
  assert chunks[-1]["choices"] == []
  assert [chunks[-1]["usage"][k] for k in counts] == [whole["usage"][k] for k in counts]
  assert all(c["usage"] is None for c in chunks[:-1])


def test_n_choices_seeded_are_reproducible_and_differ(client):
  body = {"messages": HI, "max_tokens": 8, "temperature": 1.0, "n": 3, "seed": 7}
  first = client.post("/v1/chat/completions", json=body).json()
  again = client.post("/v1/chat/completions", json=body).json()
  texts = [c["message"]["content"] for c in first["choices"]]
  assert texts == [c["message"]["content"] for c in again["choices"]]
  assert [c["index"] for c in first["choices"]] == [0, 1, 2]
  assert len(set(texts)) > 1  # each choice draws with its own key: fold_in(key(seed), i)
  other = client.post("/v1/chat/completions", json={**body, "seed": 8}).json()
  assert [c["message"]["content"] for c in other["choices"]] != texts


def test_stop_strings_cut_the_reply_where_they_begin(client, tiny):
  body = {"messages": HI, "max_tokens": 16, "temperature": 0}
  full = client.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]["content"]
  stop = full[5:8]
  assert len(stop) == 3 and full.index(stop) == 5, full
  out = client.post("/v1/chat/completions", json={**body, "stop": [stop, "\x01never"]}).json()
  assert out["choices"][0]["message"]["content"] == full[:5]
  assert out["choices"][0]["finish_reason"] == "stop"
  r = client.post("/v1/chat/completions", json={**body, "stop": stop, "stream": True})
  chunks = [json.loads(x[6:]) for x in r.text.splitlines() if x.startswith("data: {")]
  assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == full[:5]


def test_scripted_stop_string_streamed_holds_back_its_start(tiny):
  served = scripted(tiny, "Hello world. STOP here")
  with in_process(served) as c:
    body = {"messages": HI, "max_tokens": 40, "stop": ["STOP"], "stream": True}
    r = c.post("/v1/chat/completions", json=body)
    chunks = [json.loads(x[6:]) for x in r.text.splitlines() if x.startswith("data: {")]
    pieces = [c["choices"][0]["delta"].get("content", "") for c in chunks]
    assert "".join(pieces) == "Hello world. "
    assert not any("S" in p for p in pieces)
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"


def test_tool_calls_come_back_as_tool_calls(tiny):
  call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
  served = scripted(tiny, "Checking." + call)
  with in_process(served) as c:
    body = {"messages": HI, "tools": [WEATHER], "max_tokens": 200}
    out = c.post("/v1/chat/completions", json=body).json()
    (choice,) = out["choices"]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["content"] == "Checking."
    (tc,) = choice["message"]["tool_calls"]
    assert tc["type"] == "function" and tc["id"].startswith("call_")
    assert tc["function"]["name"] == "get_weather"
    assert json.loads(tc["function"]["arguments"]) == {"city": "Paris"}
    # The tools reached the template; the reply's turn round-trips through it.
    prompt = tiny.served.tokenizer.decode(served.engine.prompts[-1])
    assert "<tools>" in prompt and '"get_weather"' in prompt
    follow = [*HI, choice["message"], {"role": "tool", "tool_call_id": tc["id"], "content": "9C"}]
    assert c.post("/v1/chat/completions", json={**body, "messages": follow}).status_code == 200
    assert '"city": "Paris"' in tiny.served.tokenizer.decode(served.engine.prompts[-1])
    # Streamed: the text before the call, then the call whole, then finish_reason tool_calls.
    r = c.post("/v1/chat/completions", json={**body, "stream": True})
    deltas = [
      json.loads(x[6:])["choices"][0] for x in r.text.splitlines() if x.startswith("data: {")
    ]
    content = "".join(d["delta"].get("content") or "" for d in deltas)
    assert content == "Checking."
    (calls,) = [d["delta"]["tool_calls"] for d in deltas if "tool_calls" in d["delta"]]
    assert calls[0]["index"] == 0 and calls[0]["function"]["name"] == "get_weather"
    assert deltas[-1]["finish_reason"] == "tool_calls"
    # Without tools offered, the same reply is text.
    plain = c.post("/v1/chat/completions", json={"messages": HI, "max_tokens": 200}).json()
    assert plain["choices"][0]["message"]["content"].endswith("</tool_call>")
    assert plain["choices"][0]["finish_reason"] == "stop"


def error_of(r, status: int, param=None) -> dict:
  assert r.status_code == status, (r.status_code, r.text)
  err = r.json()["error"]
  assert set(err) == {"message", "type", "param", "code"}, err
  assert err["message"]
  if param is not None:
    assert err["param"] == param, err
  return err


@pytest.mark.parametrize(
  "body,param,words",
  [
    ("{not json", None, "JSON"),
    ({"model": "tiny"}, "messages", "required"),
    ({"messages": "hello"}, "messages", "list"),
    ({"messages": [{"role": "robot", "content": "x"}]}, "messages", "role"),
    ({"messages": HI, "temperature": "hot"}, "temperature", "number"),
    ({"messages": HI, "temperature": 3}, "temperature", "[0, 2]"),
    ({"messages": HI, "max_tokens": "8"}, "max_tokens", "integer"),
    ({"messages": HI, "n": True}, "n", "integer"),
    ({"messages": HI, "stop": [1, 2]}, "stop", "string"),
    ({"messages": HI, "top_logprobs": 2}, "top_logprobs", "logprobs"),
    ({"messages": HI, "max_tokens": 1000}, "max_tokens", f"{MAX_LEN}"),
    ({"messages": HI, "logit_bias": {"5": 10}}, "logit_bias", "not implemented"),
    ({"messages": HI, "presence_penalty": 0.5}, "presence_penalty", "not implemented"),
    ({"messages": HI, "response_format": {"type": "json_object"}}, "response_format", "not impl"),
    ({"messages": HI, "tool_choice": "required"}, "tool_choice", "not implemented"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages", "image"),
  ],
)
def test_bad_chat_requests_get_400_naming_the_field(client, body, param, words):
  raw = body if isinstance(body, str) else json.dumps(body)
  r = client.post("/v1/chat/completions", content=raw, headers={"content-type": "application/json"})
  err = error_of(r, 400, param)
  assert words in err["message"], err
  assert err["type"] == "invalid_request_error"


def test_too_long_names_both_numbers(client, tiny):
  prompt = chat_prompt(tiny, HI)
  r = client.post("/v1/chat/completions", json={"messages": HI, "max_tokens": 120})
  message = error_of(r, 400, "max_tokens")["message"]
  assert f"{len(prompt)} tokens" in message and "120" in message and f"{MAX_LEN}" in message
  r = client.post("/v1/completions", json={"prompt": list(range(1, 130)), "max_tokens": 1})
  assert "129 tokens" in error_of(r, 400)["message"]


def test_bad_completion_requests(client):
  error_of(client.post("/v1/completions", json={"max_tokens": 3}), 400, "prompt")
  error_of(client.post("/v1/completions", json={"prompt": [1, 99999]}), 400, "prompt")
  error_of(client.post("/v1/completions", json={"prompt": "x", "max_tokens": 0}), 400)
  error_of(client.post("/v1/completions", json={"prompt": "x", "logprobs": 50}), 400, "logprobs")
  error_of(client.post("/v1/completions", json={"prompt": "x", "best_of": 3}), 400, "best_of")
  error_of(client.post("/v1/completions", json={"prompt": "x", "suffix": "y"}), 400, "suffix")


def test_neutral_and_unknown_fields_are_accepted(client):
  body = {"messages": HI, "max_tokens": 2, "logit_bias": {}, "presence_penalty": 0,
          "frequency_penalty": 0.0, "response_format": {"type": "text"}, "tool_choice": "auto",
          "parallel_tool_calls": True, "user": "me", "metadata": {"a": "b"}, "store": False,
          "some_future_field": [1, 2], "max_completion_tokens": 3}  # fmt: skip
  out = client.post("/v1/chat/completions", json=body)
  assert out.status_code == 200, out.text
  assert out.json()["usage"]["completion_tokens"] <= 3


def test_unknown_model_404_unknown_path_404(client):
  body = {"model": "gpt-4", "messages": HI}
  err = error_of(client.post("/v1/chat/completions", json=body), 404, "model")
  assert "gpt-4" in err["message"] and "tiny" in err["message"]
  error_of(client.get("/v1/models/gpt-4"), 404)
  error_of(client.get("/v1/nothing"), 404)


def test_api_key(tiny):
  with in_process(fresh(tiny), api_key="sesame") as c:
    assert c.get("/health").status_code == 200  # probes need no key
    error_of(c.get("/v1/models"), 401)
    wrong = {"Authorization": "Bearer open"}
    error_of(c.post("/v1/chat/completions", json={"messages": HI}, headers=wrong), 401)
    right = {"Authorization": "Bearer sesame"}
    assert c.get("/v1/models", headers=right).status_code == 200


def test_template_and_tokenizer_failures_leave_the_engine_serving(tiny):
  class Broken:
    """The tiny tokenizer, whose encode fails on one word."""

    def __init__(self, tok):
      self.tok = tok

    def __getattr__(self, name):
      return getattr(self.tok, name)

    def encode_chat(self, text_):
      if "explode" in text_:
        raise RuntimeError("the tokenizer broke")
      return self.tok.encode_chat(text_)

  served = dataclasses.replace(scripted(tiny, "fine"), tokenizer=Broken(tiny.served.tokenizer))
  with in_process(served) as c:
    opened = [{"role": "tool", "content": "x"}, *HI]
    err = error_of(c.post("/v1/chat/completions", json={"messages": opened}), 400, "messages")
    assert "tool result" in err["message"]
    bad = [{"role": "user", "content": "explode"}]
    err = error_of(c.post("/v1/chat/completions", json={"messages": bad, "max_tokens": 4}), 500)
    assert "the tokenizer broke" in err["message"]
    ok = c.post("/v1/chat/completions", json={"messages": HI, "max_tokens": 4})
    assert ok.json()["choices"][0]["message"]["content"] == "fine"


def test_more_choices_than_the_server_ever_takes_is_400(client):
  # SLOTS slots and a queue of 2: n beyond both could never be served (no 429 to retry on).
  body = {"messages": HI, "max_tokens": 2, "n": SLOTS + 3}
  err = error_of(client.post("/v1/chat/completions", json=body), 400, "n")
  assert f"{SLOTS + 2}" in err["message"]
  ok = client.post("/v1/chat/completions", json={**body, "n": SLOTS + 2})
  assert ok.status_code == 200 and len(ok.json()["choices"]) == SLOTS + 2


def test_health_is_503_while_loading(tiny):
  gate = threading.Event()

  served = fresh(tiny)

  def load():
    gate.wait(30)
    return served

  service = app.Service(load, name="tiny")
  with TestClient(app.create(service)) as c:
    r = c.get("/health")
    assert r.status_code == 503 and r.json() == {"status": "loading"}
    error_of(c.post("/v1/chat/completions", json={"messages": HI}), 503)
    assert c.get("/v1/models").status_code == 200  # the name is known before the weights
    gate.set()
    wait_ready(c.get)


# --- the official openai client against a live server ---


def test_openai_client_plain_stream_logprobs_and_usage(openai_client, tiny):
  c = openai_client
  plain = c.chat.completions.create(model="tiny", messages=HI, max_tokens=10, temperature=0)
  text_ = plain.choices[0].message.content
  want = greedy(tiny, chat_prompt(tiny, HI), 10, tiny.served.chat_stop_ids)
  assert text_ == reply_text(tiny, want)
  assert plain.usage.completion_tokens == len(want)
  assert plain.usage.prompt_tokens == len(chat_prompt(tiny, HI))
  pieces, usage = [], None
  stream = c.chat.completions.create(
    model="tiny", messages=HI, max_tokens=10, temperature=0, stream=True,
    stream_options={"include_usage": True},
  )  # fmt: skip
  for chunk in stream:
    if chunk.choices:
      pieces.append(chunk.choices[0].delta.content or "")
    if chunk.usage is not None:
      usage = chunk.usage
  assert "".join(pieces) == text_
  assert usage.completion_tokens == plain.usage.completion_tokens
  lp = c.chat.completions.create(
    model="tiny", messages=HI, max_tokens=5, temperature=0, logprobs=True, top_logprobs=3
  )
  content = lp.choices[0].logprobs.content
  assert len(content) == lp.usage.completion_tokens - (lp.choices[0].finish_reason == "stop")
  for entry in content:
    assert len(entry.top_logprobs) == 3
    assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob, abs=1e-5)  # greedy
  comp = c.completions.create(model="tiny", prompt="To be", max_tokens=4, temperature=0)
  assert comp.usage.completion_tokens >= 1 and isinstance(comp.choices[0].text, str)


def test_openai_client_n2_seeded_twice_and_stop(openai_client):
  c = openai_client
  kw = dict(model="tiny", messages=HI, max_tokens=8, temperature=1.0, n=2, seed=11)
  first = [ch.message.content for ch in c.chat.completions.create(**kw).choices]
  again = [ch.message.content for ch in c.chat.completions.create(**kw).choices]
  assert first == again and len(first) == 2
  full = c.chat.completions.create(model="tiny", messages=HI, max_tokens=16, temperature=0)
  whole = full.choices[0].message.content
  cut = c.chat.completions.create(
    model="tiny", messages=HI, max_tokens=16, temperature=0, stop=[whole[4:7]]
  )
  assert cut.choices[0].message.content == whole[: whole.index(whole[4:7])]
  assert cut.choices[0].finish_reason == "stop"
  openai = pytest.importorskip("openai")
  with pytest.raises(openai.NotFoundError):
    c.chat.completions.create(model="nope", messages=HI)
  with pytest.raises(openai.BadRequestError, match="logit_bias"):
    c.chat.completions.create(model="tiny", messages=HI, logit_bias={"3": 5})


@pytest.mark.slow
def test_lm_eval_local_completions_scores_and_generates_through_the_server(server, tiny):
  """lm-evaluation-harness's own `local-completions` model against the live server: its
  log-likelihoods equal the model's log-softmax on the same tokens (to 1e-4), and its greedy
  generation equals the engine's, cut at the `until` string."""
  pytest.importorskip("tenacity", reason="lm-eval's API models need lm-eval[api]")
  from lm_eval.api.instance import Instance
  from lm_eval.models.openai_completions import LocalCompletionsAPI

  lm = LocalCompletionsAPI(
    base_url=server[0] + "/v1/completions", model="tiny", tokenizer=weights.locate("tiny:llama"),
    tokenizer_backend="huggingface", num_concurrent=1, max_retries=1,
  )  # fmt: skip
  pairs = [("To be", " or not to be"), ("The answer is", " 42")]
  got = lm.loglikelihood([Instance("loglikelihood", {}, p, i) for i, p in enumerate(pairs)])
  net = nnx.merge(*tiny.split)
  for (context, continuation), (logprob, _) in zip(pairs, got, strict=True):
    ctx, cont = lm._encode_pair(context, continuation)
    tokens = np.asarray([ctx + cont])
    logp = np.asarray(jax.nn.log_softmax(net(tokens)[0].astype(np.float32)))
    want = sum(logp[len(ctx) - 1 + j, t] for j, t in enumerate(cont))
    assert logprob == pytest.approx(float(want), abs=1e-4)
  until = {"until": ["\n"], "max_gen_toks": 8}
  (text_,) = lm.generate_until([Instance("generate_until", {}, ("To be", until), 0)])
  prompt = lm.tok_encode("To be")
  want = reply_text(tiny, greedy(tiny, prompt, 8, tiny.served.eos_ids))
  assert text_ == want.split("\n")[0]


def test_client_that_goes_away_frees_its_slot(server):
  url, service = server
  eng = service.served.engine

  async def main():
    async with httpx.AsyncClient(base_url=url, timeout=30) as http:
      body = {"messages": HI, "max_tokens": 100, "temperature": 0, "stream": True,
              "n": SLOTS}  # fmt: skip
      async with http.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
          if '"content":"' in line and '"content":""' not in line:
            break  # tokens are coming: go away
      start = time.monotonic()
      while service.worker.load or eng.busy:
        assert time.monotonic() - start < 5, "the slots were not freed"
        await asyncio.sleep(0.01)
      page = (await http.get("/metrics")).text
      assert metric(page, "zoo_slots_in_use") == 0
      assert metric(page, 'zoo_requests_total{endpoint="chat",outcome="cancelled"}') >= 1

  asyncio.run(main())


def test_overload_of_concurrent_requests_gets_429_then_serves_again(tiny):
  """Requests up to the slots and the queue are taken (the engine held still meanwhile); the
  next is refused with 429 and Retry-After; once they are done, the server serves again."""
  served = scripted(tiny, "fine", slots=2)
  gate = threading.Event()
  step = served.engine.step
  served.engine.step = lambda: (gate.wait(30), step())[1]
  service = app.Service(lambda: served, name="tiny", max_queue=1)
  service.start()
  assert service.loaded.wait(30) and service.state == "ready"
  capacity = 2 + 1

  async def main():
    transport = httpx.ASGITransport(app=app.create(service))
    async with httpx.AsyncClient(transport=transport, base_url="http://zoo") as http:
      body = {"messages": HI, "max_tokens": 4}
      taken = [asyncio.ensure_future(http.post("/v1/chat/completions", json=body))
               for _ in range(capacity)]  # fmt: skip
      while service.worker.load < capacity:
        await asyncio.sleep(0.01)
      refused = await http.post("/v1/chat/completions", json=body)
      error_of(refused, 429)
      assert int(refused.headers["retry-after"]) >= 1
      assert refused.json()["error"]["type"] == "rate_limit_error"
      page = (await http.get("/metrics")).text
      assert metric(page, "zoo_queue_length") >= 1
      gate.set()
      for r in await asyncio.gather(*taken):
        assert r.json()["choices"][0]["message"]["content"] == "fine"
      ok = await http.post("/v1/chat/completions", json=body)
      assert ok.status_code == 200
      page = (await http.get("/metrics")).text
      assert metric(page, 'zoo_requests_total{endpoint="chat",outcome="overloaded"}') == 1

  try:
    asyncio.run(main())
  finally:
    gate.set()
    service.stop()


# --- the command ---


def test_serve_refuses_bad_options(capsys):
  from nnx_zoo.common import cli

  for argv, words in (
    (["--workdir", "/no/such/dir"], "does not exist"),
    (["--workdir", ".", "--slots", "0"], "--slots"),
    (["--workdir", ".", "--dtype", "float16"], "--dtype"),
  ):
    capsys.readouterr()
    assert cli.main(["serve", *argv]) == 2
    assert words in capsys.readouterr().err


def test_serve_that_cannot_load_exits_2_with_the_reason(capsys, tmp_path):
  """The port is bound first, the model loaded behind it: a workdir that does not load ends the
  server with exit code 2 and the one-line reason."""
  from nnx_zoo.common import cli

  code = cli.main(["serve", "--workdir", str(tmp_path), "--port", "0"])
  err = capsys.readouterr().err
  assert code == 2 and "listening on http://127.0.0.1:" in err
  assert "has no config.json" in err and "Traceback" not in err


def test_an_hf_directory_is_a_workdir(tiny):
  hf_dir = weights.locate("tiny:llama")
  assert weights.is_hf_directory(hf_dir) and not weights.is_hf_directory(tiny.workdir)
  assert weights.as_workdir(hf_dir) == tiny.workdir  # converted once, then found in the cache
  assert weights.as_workdir(tiny.workdir) == tiny.workdir


def test_bfloat16_casts_the_weights(tiny):
  cfg, params, _ = weights.read_zoo(tiny.workdir)
  cfg, params = model.cast(cfg, params, "bfloat16")
  assert cfg.dtype == cfg.param_dtype == "bfloat16"
  assert {x.dtype for x in jax.tree.leaves(params)} == {np.dtype("bfloat16")}


def test_protocol_tool_call_arguments_become_objects_for_the_template():
  req = protocol.chat_request(
    {"messages": [*HI, {"role": "assistant", "content": None, "tool_calls": [
      {"id": "c1", "type": "function",
       "function": {"name": "f", "arguments": '{"x": 1}'}}]}]},
    vocab_size=320,
  )  # fmt: skip
  (call,) = req.messages[1]["tool_calls"]
  assert call["function"]["arguments"] == {"x": 1}


@pytest.mark.slow
def test_sigterm_drains_in_flight_requests_and_exits_0():
  """A `zoo serve` process (bfloat16: the cast path end to end). SIGTERM comes as a long stream
  begins: new connections are refused from then on, the stream still ends whole (every token it
  asked for, its usage), and the process exits 0."""
  argv = [sys.executable, "-m", "nnx_zoo.common.cli", "serve", "--workdir", "tiny:llama",
          "--port", "0", "--slots", "1", "--max-len", "1024", "--grace-s", "120",
          "--dtype", "bfloat16", "--model-name", "tiny"]  # fmt: skip
  proc = subprocess.Popen(argv, stderr=subprocess.PIPE, text=True)
  lines = []
  try:
    url = None
    while True:
      line = proc.stderr.readline()
      assert line, "zoo serve ended:\n" + "".join(lines)
      lines.append(line)
      if "listening on" in line:
        url = re.search(r"http://[\d.:]+", line).group(0)
      if "ready" in line:
        break
    max_tokens = 900
    body = {"messages": HI, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}  # fmt: skip
    got, refused_at = [], None
    with httpx.Client(base_url=url, timeout=120) as http:
      assert http.get("/health").status_code == 200
      with http.stream("POST", "/v1/chat/completions", json=body) as r:
        for line in r.iter_lines():
          if not line:
            continue
          got.append(line)
          if len(got) == 1:
            proc.send_signal(signal.SIGTERM)
          elif refused_at is None:
            try:
              httpx.get(url + "/health", timeout=2)
            except httpx.ConnectError:  # the listener is closed: new clients are refused
              refused_at = len(got)
    chunks = [json.loads(x[6:]) for x in got if x.startswith("data: {")]
    assert got[-1] == "data: [DONE]"
    assert chunks[-1]["usage"]["completion_tokens"] == max_tokens
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    assert refused_at is not None and refused_at < len(got) - 10, (refused_at, len(got))
    assert proc.wait(60) == 0, "".join(lines) + proc.stderr.read()
  finally:
    if proc.poll() is None:
      proc.kill()
      proc.wait()
