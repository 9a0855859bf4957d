"""Tools, their call parsers and multi-turn episodes (common/tasks/tools.py, tool_calls.py,
episodes.py): scripted turns on a fake engine (a random model makes no calls), against
transformers' `apply_chat_template` with the same tools on Qwen2.5's own chat template; one
episode on the real engine for its prefix reuse."""

import json
import pathlib
import time

import jax
import numpy as np
import pytest

from nnx_zoo.common import engine
from nnx_zoo.common.data import chat, tokenizers
from nnx_zoo.common.errors import UserError
from nnx_zoo.common.tasks import episodes, tool_calls, tools

# Qwen2.5-Instruct's chat template as its tokenizer ships it (tools in the system turn, calls as
# <tool_call> JSON, results as <tool_response> in a user turn).
QWEN = (pathlib.Path(__file__).parent / "qwen2_5_chat_template.jinja").read_text()


def multiply(a: int, b: int) -> int:
  """Multiplies two integers.

  Args:
    a: The first factor.
    b: The second factor.
  """
  return a * b


def fails(x: int) -> int:
  """Always raises.

  Args:
    x: Anything.
  """
  raise ValueError(f"no {x}")


def sleeps(seconds: float) -> str:
  """Sleeps.

  Args:
    seconds: How long.
  """
  time.sleep(seconds)
  return "woke"


class Guess:
  """An environment: guess the record's number; the reward is 1 once guessed."""

  def reset(self, answer, **_):
    self.answer, self.right = int(answer), False
    return "Guess my number with the guess tool."

  def guess(self, n: int) -> str:
    """Tries a number.

    Args:
      n: The guess.
    """
    self.right = self.right or n == self.answer
    return "yes" if n == self.answer else "no"

  def reward(self):
    return float(self.right)


@pytest.fixture(scope="module")
def kit():
  """The tiny:llama tokenizer (ChatML's special tokens) under Qwen2.5's template, and
  transformers' tokenizer of the same directory."""
  transformers = pytest.importorskip("transformers")
  from nnx_zoo.common.hub import tiny

  path = tiny.checkpoint("tiny:llama")
  tokenizer = tokenizers.load(tokenizers.config(kind="hf", path=path))
  template = chat.Template(QWEN)
  return tokenizer, template, transformers.AutoTokenizer.from_pretrained(path), path


def agent_for(kit, functions=(multiply, fails, sleeps), environment=None, forms="template"):
  tokenizer, template, _, _ = kit
  tools_ = [tools.Tool(f.__name__, f, tools.schema_of(f, "test")) for f in functions]
  return episodes.Agent(tools_, environment, forms=forms).prepare(template, tokenizer)


class Scripted:
  """An engine whose requests write scripted turns: the episode submitted with key(e) writes
  scripts[e][k] (text, then the end of turn) on its k-th turn; `prompts` keeps every prompt."""

  def __init__(self, agent, scripts):
    self.agent, self.scripts = agent, scripts
    self.waiting, self.turn, self.prompts = [], {}, []
    self.rid = 0

  @property
  def busy(self):
    return bool(self.waiting)

  def submit(self, prompt, params, *, key):
    e = int(jax.random.key_data(key)[-1])
    self.prompts.append((e, list(prompt)))
    self.waiting.append((self.rid, e, params))
    self.rid += 1
    return self.rid - 1

  def step(self):
    rid, e, params = self.waiting.pop(0)
    k = self.turn.get(e, 0)
    self.turn[e] = k + 1
    ids = self.agent.tokenizer.encode_chat(self.scripts[e][k])[0].tolist() + [self.agent.end_id]
    if len(ids) > params.max_tokens:
      return [engine.Output(rid, ids[: params.max_tokens], finish_reason="length")]
    return [engine.Output(rid, ids, finish_reason="stop")]


def play(agent, scripts, prompt=None, fields=None, **settings):
  prompt = prompt or [{"role": "user", "content": "What is 3 x 4?"}]
  fake = Scripted(agent, scripts)
  starts = [(prompt, fields or {}, jax.random.key(e)) for e in range(len(scripts))]
  settings = episodes.Settings(
    **{"max_new_tokens": 128, "max_episode_tokens": 1024, "tool_timeout_s": 5.0, **settings}
  )
  return agent.run(starts, settings, engine_for=lambda n, p: fake), fake


# A short ChatML template that takes tools (Qwen's system prompt is ~1,300 of the tiny byte-level
# tokenizer's tokens): for the real engine's test, which compiles for its lengths.
SHORT = (
  "{% if tools %}<|im_start|>system\n{{ tools | length }} tools<|im_end|>\n{% endif %}"
  "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
  "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
HERMES = '<tool_call>\n{"name": "%s", "arguments": %s}\n</tool_call>'


# The parsers


def test_each_form_parses_and_the_reader_reads_the_chosen_ones():
  hermes = tool_calls.for_template(QWEN)
  assert hermes.name == "hermes"
  args = '{"a": 3, "b": 4}'
  for text in (HERMES % ("multiply", args), f"Sure.\n{HERMES % ('multiply', args)}"):
    (call,) = hermes.parse(text).calls
    assert (call.name, json.loads(call.arguments)) == ("multiply", {"a": 3, "b": 4})
  bare = '{"name": "multiply", "arguments": {"a": 3, "b": 4}}'
  fenced = f"Let me call it.\n```json\n{bare}\n```"
  everything = tool_calls.reader(QWEN, "template,json_fence,json")
  assert everything.read(bare).form == "json" and everything.read(fenced).form == "json_fence"
  assert everything.read(fenced).content == "Let me call it."
  assert everything.read(HERMES % ("multiply", args)).form == "template"
  two = everything.read('[{"name": "f", "arguments": {}}, {"name": "g", "arguments": {"x": 1}}]')
  assert [c.name for c in two.calls] == ["f", "g"]
  only_template = tool_calls.reader(QWEN, "template")
  assert only_template.read(bare).calls == [] and not only_template.read("12").malformed
  # A call that tries and does not parse: no calls, counted as malformed.
  for text in ("<tool_call>{not json}</tool_call>", '<tool_call>{"arguments": {}}</tool_call>'):
    got = everything.read(text)
    assert got.calls == [] and got.malformed and got.content == text
  assert everything.read('{"name": "f", "arguments": [1]}').malformed
  assert not everything.read("The answer is 12.").malformed
  with pytest.raises(UserError, match="grpo.call_forms"):
    tool_calls.reader(QWEN, "template,xml")


def test_llama3_json_calls():
  source = "{{- '<|python_tag|>' }}{% if message.role == 'ipython' %}{% endif %}"
  parser = tool_calls.for_template(source)
  assert parser.name == "llama3_json"
  one = parser.parse('{"name": "multiply", "parameters": {"a": 3, "b": 4}}')
  assert one.calls[0] == tool_calls.ToolCall("multiply", '{"a": 3, "b": 4}')
  two = parser.parse(
    '<|python_tag|>{"name": "f", "parameters": {}}; {"name": "g", "arguments": {}}'
  )
  assert [c.name for c in two.calls] == ["f", "g"]
  assert parser.parse("The answer is 12.") is None
  assert parser.parse('{"name": "f", "parameters": {}} and more words') is None
  assert parser.attempted('{"name": "f", "parameters": ') and parser.parse('{"name": "f"') is None


# Tools


def test_schemas_are_transformers_and_bad_tools_are_named(tmp_path):
  assert tools.schema_of(multiply, "t") == {
    "type": "function",
    "function": {
      "name": "multiply",
      "description": "Multiplies two integers.",
      "parameters": {
        "type": "object",
        "properties": {
          "a": {"type": "integer", "description": "The first factor."},
          "b": {"type": "integer", "description": "The second factor."},
        },
        "required": ["a", "b"],
      },
      "return": {"type": "integer"},
    },
  }
  (tmp_path / "t.py").write_text(
    "def ok(a: int) -> int:\n  '''Ok.\n\n  Args:\n    a: A.\n  '''\n  return a\n"
    "def no_hints(a):\n  '''No hints.\n\n  Args:\n    a: A.\n  '''\n"
    "def no_doc(a: int):\n  return a\n"
    "class NoReset:\n  def go(self, a: int):\n    '''Go.\n\n    Args:\n      a: A.\n    '''\n"
    "class BadTool:\n  def reset(self, **_): pass\n  def go(self, a): pass\n"
  )
  f = tmp_path / "t.py"
  (ok,) = tools.load_tools(f"{f}:ok")
  assert ok.name == "ok" and ok.fn(2) == 2
  assert [t.name for t in tools.load_tools("tests.common.test_tools:multiply")] == ["multiply"]
  for spec, match in (
    (f"{tmp_path}/none.py:ok", "is not a file"),
    (f"{f}:missing", "has no 'missing'"),
    (f"{f}:no_hints", "'no_hints' cannot be a tool .*missing a type hint"),
    (f"{f}:no_doc", "'no_doc' cannot be a tool .*no docstring"),
    ("no_such_module_here:f", "does not import"),
    (f"{f}:ok,{f}:ok", "two tools are named ok"),
  ):
    with pytest.raises(UserError, match=match):
      tools.load_tools(spec)
  with pytest.raises(UserError, match="NoReset has no reset"):
    tools.load_environment(f"{f}:NoReset")
  with pytest.raises(UserError, match="'go' cannot be a tool"):
    tools.load_environment(f"{f}:BadTool")
  with pytest.raises(UserError, match="is not a class"):
    tools.load_environment(f"{f}:ok")
  assert tools.method_names(Guess) == ["guess"] and tools.has_reward(Guess)


def test_a_call_never_raises():
  named = {f.__name__: tools.Tool(f.__name__, f, {}) for f in (multiply, fails, sleeps)}
  assert tools.run(named, "multiply", '{"a": 3, "b": 4}', timeout_s=5) == tools.Result(
    "multiply", "12"
  )
  for name, args, status, says in (
    ("fails", '{"x": 1}', tools.ERROR, "fails raised ValueError: no 1"),
    ("multiply", '{"a": 3}', tools.BAD_ARGUMENTS, "missing a required argument: 'b'"),
    ("multiply", '{"a": 3, "b": 4, "c": 5}', tools.BAD_ARGUMENTS, "unexpected keyword"),
    ("multiply", "[3, 4]", tools.BAD_ARGUMENTS, "not a JSON object"),
    ("divide", "{}", tools.UNKNOWN, "there is no tool 'divide'"),
    ("sleeps", '{"seconds": 5}', tools.TIMEOUT, "did not finish within 0.2 s"),
  ):
    start = time.perf_counter()
    got = tools.run(named, name, args, timeout_s=0.2)
    assert got.status == status and says in got.content, got
    assert time.perf_counter() - start < 1.0


# Episodes


def test_an_episode_in_the_template_format_is_transformers_rendering(kit):
  """The tokens of an episode whose calls are in the template's format are transformers'
  `apply_chat_template` of its messages with the same tools, token for token (but the newline
  after the last end of turn), and the mask covers exactly the model's tokens."""
  _, _, hf, _ = kit
  agent = agent_for(kit)
  turns = [HERMES % ("multiply", '{"a": 3, "b": 4}'), "3 x 4 is 12."]
  (ep,), fake = play(agent, [turns])
  prompt = [{"role": "user", "content": "What is 3 x 4?"}]
  assert [m["role"] for m in ep.messages] == ["assistant", "tool", "assistant"]
  assert ep.messages[0]["tool_calls"][0]["function"] == {
    "name": "multiply",
    "arguments": {"a": 3, "b": 4},
  }
  assert ep.messages[1] == {"role": "tool", "name": "multiply", "content": "12"}
  assert (ep.turns, ep.tool_calls, ep.template_calls, ep.end) == (2, 1, 1, "answer")
  want = hf.apply_chat_template(
    prompt + ep.messages, tools=[multiply, fails, sleeps], tokenize=True, chat_template=QWEN
  )["input_ids"]
  assert ep.tokens == want[: len(ep.tokens)]
  assert hf.decode(want[len(ep.tokens) :]) == "\n"
  # The prompt is transformers' with the generation prompt.
  first = hf.apply_chat_template(
    prompt, tools=[multiply, fails, sleeps], tokenize=True, chat_template=QWEN,
    add_generation_prompt=True,
  )["input_ids"]  # fmt: skip
  assert ep.tokens[: ep.prompt_len] == first
  # The model's tokens, and only they, are masked in: each turn as written, with its end.
  written = [agent.tokenizer.encode_chat(t)[0].tolist() + [agent.end_id] for t in turns]
  mask = np.asarray(ep.mask, bool)
  assert np.asarray(ep.tokens)[mask].tolist() == written[0] + written[1]
  assert ep.model_tokens == len(written[0]) + len(written[1])
  assert ep.context_tokens == len(ep.tokens) - ep.prompt_len - ep.model_tokens > 0
  assert mask[ep.prompt_len : ep.prompt_len + len(written[0])].all()
  # The second turn continues the first's tokens exactly as they were.
  assert fake.prompts[1][1] == ep.tokens[: len(fake.prompts[1][1])]
  laid = episodes.rows([ep, None], 2048)
  assert laid["model"][0].sum() == ep.model_tokens and laid["segment_ids"][1].sum() == 0
  assert "[tool multiply] 12" in episodes.transcript(ep)


def test_calls_that_parse_that_do_not_and_tools_that_fail(kit):
  agent = agent_for(kit, forms="template,json_fence,json")
  eps, _ = play(
    agent,
    [
      ['{"name": "multiply", "arguments": {"a": 3, "b": 4}}', "12"],  # bare JSON: read
      ["<tool_call>{not json}</tool_call>"],  # tried, did not parse: an answer
      [HERMES % ("fails", '{"x": 1}'), HERMES % ("multiply", '{"a": 1}'), "sorry"],
      [HERMES % ("sleeps", '{"seconds": 5}'), "late"],
      [HERMES % ("nope", "{}"), "ok"],
    ],
    tool_timeout_s=0.2,
  )
  bare, broken, failing, slow, unknown = eps
  assert (bare.turns, bare.tool_calls, bare.template_calls) == (2, 1, 0)
  assert bare.messages[1]["content"] == "12"
  assert (broken.turns, broken.tool_calls, broken.unparsed_turns, broken.end) == (1, 0, 1, "answer")
  assert broken.messages[0]["content"] == "<tool_call>{not json}</tool_call>"
  assert (failing.turns, failing.tool_errors) == (3, 2)
  assert "fails raised ValueError: no 1" in failing.messages[1]["content"]
  assert "missing a required argument" in failing.messages[3]["content"]
  assert (slow.turns, slow.tool_timeouts, slow.tool_errors) == (2, 1, 0)
  assert "did not finish within 0.2 s" in slow.messages[1]["content"]
  assert unknown.tool_errors == 1 and "no tool 'nope'" in unknown.messages[1]["content"]
  only_template = agent_for(kit, forms="template")
  (ep,), _ = play(only_template, [['{"name": "multiply", "arguments": {"a": 3, "b": 4}}']])
  assert (ep.turns, ep.tool_calls, ep.unparsed_turns) == (1, 0, 0)  # plain text to it


def test_max_turns_and_max_episode_tokens_end_an_episode(kit):
  agent = agent_for(kit)
  call = HERMES % ("multiply", '{"a": 3, "b": 4}')
  (ep,), fake = play(agent, [[call] * 5], max_turns=3)
  assert (ep.turns, ep.tool_calls, ep.end, ep.truncated) == (3, 3, "max_turns", False)
  assert [m["role"] for m in ep.messages] == ["assistant", "tool"] * 2 + ["assistant"]
  assert len(fake.prompts) == 3
  (ep,), _ = play(agent, [[call] * 5], max_turns=5, max_episode_tokens=200)
  assert ep.truncated and ep.end == "length" and len(ep.tokens) - ep.prompt_len <= 200
  assert 1 < ep.turns < 5
  (ep,), _ = play(agent, [["a long answer " * 20]], max_new_tokens=16)
  assert ep.truncated and ep.model_tokens == 16 and ep.end == "length"


def test_an_environment_per_episode_with_its_reward(kit):
  agent = agent_for(kit, functions=(multiply,), environment=Guess)
  assert [s["function"]["name"] for s in agent.schemas] == ["multiply", "guess"]
  eps, fake = play(
    agent,
    [[HERMES % ("guess", '{"n": 7}'), "got it"], [HERMES % ("guess", '{"n": 3}'), "hm"]],
    fields={"answer": 7},
  )
  assert [ep.environment is not None for ep in eps] == [True, True]
  assert eps[0].environment is not eps[1].environment
  assert episodes.environment_rewards(eps).tolist() == [1.0, 0.0]
  assert [ep.messages[1]["content"] for ep in eps] == ["yes", "no"]
  text = agent.tokenizer.decode(fake.prompts[0][1])
  assert "What is 3 x 4?\n\nGuess my number with the guess tool." in text
  assert episodes.template_format_share(eps).tolist() == [1.0, 1.0]


def test_bad_templates_are_refused(kit):
  tokenizer, _, _, _ = kit
  agent = episodes.Agent([tools.Tool("multiply", multiply, tools.schema_of(multiply, "t"))],
                         None, forms="template")  # fmt: skip
  from nnx_zoo.common.hub import tiny

  with pytest.raises(UserError, match="takes no tools"):
    agent.prepare(chat.Template(tiny.CHATML), tokenizer)
  with pytest.raises(UserError, match="An episode needs tools"):
    episodes.Agent([], None, forms="template")


def test_episodes_continue_on_the_engine_reading_only_what_is_new(kit):
  """On the real engine with tiny:llama, greedy: every turn's tokens are `engine.generate`'s
  of the episode so far, and a turn after the first reads only its last sampled token and the
  new context (the slot kept the rest); the sampler's log-probs (`logprobs=True`) are the
  whole model's on the episode at its own tokens, 0 on the context, and the rows lay them as
  the trainer's token log-probs. A random model makes no calls, so the reader here takes every
  turn for a call."""
  from flax import nnx

  from nnx_zoo.common import hub

  tokenizer, _, _, path = kit
  agent = agent_for((tokenizer, chat.Template(SHORT), None, path))
  call = tool_calls.ToolCall("multiply", '{"a": 2, "b": 3}')

  class Always:
    def read(self, text):
      return tool_calls.Reading("", [call], "template")

  agent.reader = Always()
  graphdef, params = nnx.split(hub.load(path))
  model = (graphdef, params)
  # The tiny model's greedy turns rarely write <|im_end|>: end a turn at a token it writes.
  prompt = [{"role": "user", "content": "What is 2 x 3?"}]
  ids = agent.prompt_ids(prompt)
  first = engine.generate(model, np.asarray([ids]), max_new_tokens=6, rng=jax.random.key(0),
                          temperature=0.0)  # fmt: skip
  first = np.asarray(first)[0, len(ids) :]
  agent.end_id = int(first[2])
  agent.stop_ids = (agent.end_id,)
  settings = episodes.Settings(max_turns=3, max_new_tokens=6, max_episode_tokens=200,
                               temperature=0.0)  # fmt: skip
  make = episodes.engine_for(graphdef, params, settings)
  (ep,) = agent.run([(prompt, {}, jax.random.key(0))], settings, engine_for=make, logprobs=True)
  assert ep.turns >= 2, ep
  full = jax.nn.log_softmax(nnx.merge(graphdef, params)(np.asarray([ep.tokens]))[0], axis=-1)
  want = np.zeros(len(ep.tokens), np.float32)
  for p in np.flatnonzero(ep.mask):
    want[p] = full[p - 1, ep.tokens[p]]
  np.testing.assert_allclose(ep.logps, want, atol=1e-5)
  laid = episodes.rows([ep, None], len(ep.tokens) + 3)
  np.testing.assert_array_equal(laid["sampler_logps"][0, : len(ep.tokens) - 1], ep.logps[1:])
  assert not laid["sampler_logps"][1].any()
  at, reread, context_len = ep.prompt_len, ep.prompt_len, 0
  tokens, mask = np.asarray(ep.tokens), np.asarray(ep.mask)
  for turn in range(ep.turns):
    end = at
    while end < len(tokens) and mask[end]:
      end += 1
    want = np.asarray(engine.generate(model, tokens[None, :at], max_new_tokens=end - at,
                                      rng=jax.random.key(0), temperature=0.0))[0, at:]  # fmt: skip
    np.testing.assert_array_equal(tokens[at:end], want)
    at = end
    while at < len(tokens) and not mask[at]:
      at += 1
    if turn:
      reread += 1 + context_len
    context_len = at - end
  assert ep.reread_tokens == reread  # each continuation: its last token and the context


def test_zoo_chat_runs_the_tools_between_turns(tmp_path, capsys, monkeypatch):
  """`zoo chat --tools`: a template without tools is refused; with one, a turn's calls run and
  their results go back to the model, whose next turn is the answer (the reader takes the first
  turn for a call: a random model makes none)."""
  from nnx_zoo.common import cli

  (tmp_path / "m.json").write_text(json.dumps([{"role": "user", "content": "2 x 3?"}]))
  argv = ["chat", "--workdir", "tiny:llama", "--messages", str(tmp_path / "m.json"),
          "--temperature", "0", "--max-new-tokens", "4",
          "--tools", "tests.common.test_tools:multiply"]  # fmt: skip
  assert cli.main(argv) == 2
  assert "takes no tools: leave --tools out" in capsys.readouterr().err
  monkeypatch.setattr(chat, "template", lambda data_cfg: chat.Template(SHORT))
  rendered, reads = [], []
  render = chat.Template.render
  monkeypatch.setattr(
    chat.Template, "render", lambda self, m, **k: rendered.append(list(m)) or render(self, m, **k)
  )
  call = tool_calls.ToolCall("multiply", '{"a": 2, "b": 3}')

  def read(self, text):
    reads.append(text)
    return tool_calls.Reading("", [call] if len(reads) == 1 else [], "template")

  monkeypatch.setattr(tool_calls.Reader, "read", read)
  prompts, submit = [], engine.Engine.submit
  monkeypatch.setattr(
    engine.Engine, "submit", lambda e, p, *a, **k: prompts.append(list(p)) or submit(e, p, *a, **k)
  )
  capsys.readouterr()
  assert cli.main(argv) == 0
  out, err = capsys.readouterr()
  assert '[multiply({"a": 2, "b": 3}) -> 6]' in err
  assert out.rstrip("\n") == reads[1]  # the answer: the turn after the tool's result
  assert rendered[-1][-1] == {"role": "tool", "name": "multiply", "content": "6"}
  # The second turn reads the first as the model wrote it (not the template's rendering of its
  # call), then the tool's result: what a GRPO episode holds.
  first, second = prompts[-2:]
  from nnx_zoo.common.hub import tiny

  tokenizer = tokenizers.load(tokenizers.config(kind="hf", path=tiny.checkpoint("tiny:llama")))
  assert second[: len(first)] == first
  assert reads[0] in tokenizer.decode(second[len(first) :])
