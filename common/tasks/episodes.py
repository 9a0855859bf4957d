"""Multi-turn episodes in which the model calls tools (common/tasks/tools.py), run on the engine
(common/engine.py): GRPO's rollouts where `grpo.tools` or `grpo.environment` is set.

An episode, for one prompt record and one key:

1. the prompt's messages (the environment's `reset(**fields)` text appended to the last one)
   rendered by the chat template with the tools' schemas and the generation prompt;
2. the model's turn sampled to its end of turn (at most `max_new_tokens`, and what is left of
   `max_episode_tokens`); its calls read in the forms chosen (common/tasks/tool_calls.py); a
   turn whose calls do not parse is a turn without calls (counted);
3. each call run within `tool_timeout_s` (an unknown tool, bad arguments, an exception or the
   time running out is the tool's message), the results appended as `tool` messages as the
   template renders them, and the next turn submitted to the engine: the slot still holds the
   episode, so only the last sampled token and the new context are read (prefix reuse);
4. the episode ends at a turn without calls, at `max_turns` turns (the last turn's calls are
   not run), or when the next turn would not fit `max_episode_tokens` (truncated, as a turn
   cut at its `max_new_tokens` is).

The episode's tokens are the prompt's, then each turn exactly as sampled (its end-of-turn token
included), then the template's and the tools' tokens between turns: what the template writes
after the assistant's end of turn, up to the next generation prompt. So for calls written in the
template's own format the episode is transformers' `apply_chat_template` of the same messages
with the same tools, token for token (but the whitespace after the last end of turn); for the
other forms it differs inside the model's own turns only. `mask` is 1 on the model's tokens: the
loss and the KL take those only.

`messages` is every message after the prompt, as TRL passes a tool episode's `completions` to
its rewards: the assistant's turns (`content`, and `tool_calls` with `arguments` as objects)
and the `tool` results.
"""

import dataclasses
import json
import math

import numpy as np

from nnx_zoo.common import engine as engine_lib
from nnx_zoo.common.errors import UserError
from nnx_zoo.common.tasks import tool_calls, tools

ENDS = ("answer", "max_turns", "length")  # why an episode ended


@dataclasses.dataclass(frozen=True)
class Settings:
  max_turns: int = 4
  max_new_tokens: int = 64  # a turn's
  max_episode_tokens: int = 512  # after the prompt: the model's and the context's
  tool_timeout_s: float = 10.0
  temperature: float = 1.0
  top_k: int = 0
  top_p: float = 1.0

  @property
  def model_token_cap(self) -> int:
    """The most model tokens an episode can hold (dr_grpo's per-completion denominator)."""
    return min(self.max_turns * self.max_new_tokens, self.max_episode_tokens)


def settings_of(s, *, greedy: bool = False) -> Settings:
  """The episode settings of a `grpo` config section (greedy: held out, temperature 0)."""
  sampling = dict(temperature=0.0) if greedy else dict(
    temperature=float(s.temperature), top_k=int(s.top_k), top_p=float(s.top_p)
  )  # fmt: skip
  return Settings(int(s.max_turns), int(s.max_new_tokens), int(s.max_episode_tokens),
                  float(s.tool_timeout_s), **sampling)  # fmt: skip


@dataclasses.dataclass
class Episode:
  tokens: list[int]
  prompt_len: int
  mask: list[int]  # 1: the model's token
  messages: list[dict] = dataclasses.field(default_factory=list)  # after the prompt
  turns: int = 0
  tool_calls: int = 0  # calls that parsed (and ran, but those of a last turn at max_turns)
  template_calls: int = 0  # of them, in the template's own format
  unparsed_turns: int = 0  # turns that tried a call and parsed none
  tool_errors: int = 0  # calls that raised, had bad arguments or named no tool
  tool_timeouts: int = 0
  context_tokens: int = 0  # the template's and the tools' between turns
  reread_tokens: int = 0  # tokens the engine read again to continue (not from its cache)
  truncated: bool = False
  end: str = ""
  environment: object = None  # the episode's instance, if any
  logps: list[float] | None = None  # with `run(logprobs=True)`: each token's under the sampler
  _turn: list[int] = dataclasses.field(default_factory=list)
  _turn_logps: list[float] = dataclasses.field(default_factory=list)

  @property
  def model_tokens(self) -> int:
    return int(sum(self.mask))


class Agent:
  """What episodes need besides the model: the tools (functions, and an environment class whose
  instances bring their own), the chat template and tokenizer, and which call forms are read.
  `prepare` checks the template can hold an episode; `run` plays episodes on an engine."""

  def __init__(self, functions: list[tools.Tool], environment: type | None, *, forms: str):
    self.functions = functions
    self.environment = environment
    self.forms = tool_calls.parse_forms(forms)
    env_names = tools.method_names(environment) if environment is not None else []
    tools._check_names([t.name for t in functions] + env_names, "grpo.tools and environment")
    self.schemas = [t.schema for t in functions]
    if environment is not None:
      self.schemas += [tools.schema_of(getattr(environment, n), environment.__name__)
                       for n in env_names]  # fmt: skip
    if not self.schemas:
      raise UserError("An episode needs tools: set grpo.tools or an environment with methods.")

  def prepare(self, template, tokenizer):
    """Ready for this chat template and tokenizer; refuses a template that takes no tools, has
    no one-token end of turn, or cannot continue a conversation after a tool's result."""
    if not tool_calls.takes_tools(template.source):
      raise UserError(
        "The chat template takes no tools, so the model cannot be told of grpo.tools: use a "
        "checkpoint whose template does (Qwen2.5, Llama 3.1), or set data.chat_template."
      )
    end = template.end_of_turn
    end_ids = tokenizer.encode_chat(end)[0] if end else []
    if len(end_ids) != 1:
      raise UserError(
        f"The chat template's end of turn {end!r} is {len(end_ids)} tokens: an episode stops "
        "each turn at a one-token end of turn (a Hugging Face tokenizer's)."
      )
    self.template, self.tokenizer = template, tokenizer
    self.end_id = int(end_ids[0])
    self.stop_ids = engine_lib.stop_tuple((self.end_id, tokenizer.eos_id))
    self.reader = tool_calls.Reader(tool_calls.for_template(template.source), self.forms)
    # A probe: a call and its result, to refuse a template that cannot continue one now.
    probe = [{"role": "user", "content": "hi"}]
    call = {"type": "function", "function": {"name": "f", "arguments": {}}}
    probe.append({"role": "assistant", "content": "", "tool_calls": [call]})
    self.context(probe, [{"role": "tool", "name": "f", "content": "1"}])
    return self

  # rendering

  def prompt_ids(self, messages: list[dict]) -> list[int]:
    text = self.template.render(messages, add_generation_prompt=True, tools=self.schemas)
    return [int(i) for i in self.tokenizer.encode_chat(text)[0]]

  def context(self, messages: list[dict], results: list[dict]) -> list[int]:
    """The tokens between a turn's end-of-turn token and the next turn: what the template writes
    after the assistant's turn (`messages` ends with it), the `results`' messages and the
    generation prompt."""
    before = self.template.render(messages, tools=self.schemas)
    after = self.template.render(messages + results, add_generation_prompt=True,
                                 tools=self.schemas)  # fmt: skip
    head = before.rstrip()
    if not after.startswith(before) or not head.endswith(self.template.end_of_turn):
      raise UserError(
        "The chat template renders a conversation with a tool's result as other text than the "
        "conversation before it followed by more, so an episode cannot continue on it: fix the "
        "template (data.chat_template)."
      )
    text = before[len(head) :] + after[len(before) :]
    return [int(i) for i in self.tokenizer.encode_chat(text)[0]]

  # episodes

  def start(self, prompt: list[dict], fields: dict) -> tuple[list[dict], object]:
    """The prompt's messages with the environment's reset text appended, and the instance."""
    if self.environment is None:
      return prompt, None
    try:
      instance = self.environment()
      text = instance.reset(**fields)
    except Exception as e:
      name = self.environment.__name__
      raise UserError(f"The environment {name} failed to start ({type(e).__name__}: {e}).") from e
    messages = [dict(m) for m in prompt]
    if text:
      messages[-1]["content"] = f"{messages[-1]['content']}\n\n{text}"
    return messages, instance

  def run(
    self, starts, settings: Settings, *, engine_for, max_prompt: int = 0, logprobs: bool = False
  ) -> list[Episode]:
    """Episodes, one a start, each `(prompt messages, fields, key)`, played together on the
    engine `engine_for(slots, longest prompt)` gives (free slots; this loop steps it). A prompt
    longer than `max_prompt` tokens (with the tools' schemas) is refused. `logprobs`: each
    episode's `logps`, the sampler's log-probability of each model token (0 elsewhere)."""
    episodes, state = [], []
    params = lambda ep: engine_lib.SamplingParams(
      min(settings.max_new_tokens, settings.max_episode_tokens - (len(ep.tokens) - ep.prompt_len)),
      settings.temperature, settings.top_k, settings.top_p, stop_ids=self.stop_ids,
      logprobs=0 if logprobs else None,
    )  # fmt: skip
    for prompt, fields, key in starts:
      messages, instance = self.start(prompt, fields)
      ids = self.prompt_ids(messages)
      if max_prompt and len(ids) > max_prompt:
        raise UserError(
          f"A prompt with the tools' schemas is {len(ids)} tokens, more than {max_prompt} "
          "(data.seq_len): raise data.seq_len."
        )
      named = {t.name: t for t in self.functions}
      if instance is not None:
        named.update({t.name: t for t in tools.environment_tools(instance)})
      state.append((messages, named, key))
      episodes.append(Episode(ids, len(ids), [0] * len(ids), environment=instance,
                              logps=[0.0] * len(ids) if logprobs else None))  # fmt: skip
    if not episodes:
      return []
    engine = engine_for(len(episodes), max(ep.prompt_len for ep in episodes))
    pending = {}
    for i, ep in enumerate(episodes):
      pending[engine.submit(ep.tokens, params(ep), key=state[i][2])] = i
    while engine.busy:
      for out in engine.step():
        i = pending[out.rid]
        ep = episodes[i]
        ep._turn += out.tokens
        ep._turn_logps += out.logprobs or []
        if out.tokens and len(ep._turn) == len(out.tokens):  # the turn's first output
          ep.reread_tokens += out.prompt_tokens - out.cached_tokens
        if out.finish_reason is None:
          continue
        del pending[out.rid]
        nxt = self._turn_done(ep, *state[i], settings)
        if nxt is not None:
          pending[engine.submit(ep.tokens, params(ep), key=state[i][2])] = i
    for ep in episodes:
      ep._turn = []
    return episodes

  def _turn_done(self, ep: Episode, prompt, named, key, settings) -> bool | None:
    """Takes the turn just sampled into the episode; True where the episode goes on (its
    context appended), None where it ends."""
    del key
    new = ep._turn
    ep._turn = []
    ep.tokens += new
    ep.mask += [1] * len(new)
    if ep.logps is not None:
      ep.logps += ep._turn_logps
    ep._turn_logps = []
    ep.turns += 1
    stopped = bool(new) and new[-1] in self.stop_ids
    text = self.tokenizer.decode(new[:-1] if stopped else new)
    reading = self.reader.read(text)
    ep.unparsed_turns += int(reading.malformed)
    message = assistant_message(reading)
    if reading.calls:
      ep.tool_calls += len(reading.calls)
      ep.template_calls += len(reading.calls) * (reading.form == "template")
    ep.messages.append(message)
    if not stopped:  # cut at its max_new_tokens, or the episode's
      ep.truncated, ep.end = True, "length"
      return None
    if new[-1] != self.end_id or not reading.calls:  # the end token, or an answer
      ep.end = "answer"
      return None
    if ep.turns >= settings.max_turns:
      ep.end = "max_turns"
      return None
    results = []
    for c in reading.calls:
      got = tools.run(named, c.name, c.arguments, timeout_s=settings.tool_timeout_s)
      ep.tool_errors += got.status in (tools.ERROR, tools.BAD_ARGUMENTS, tools.UNKNOWN)
      ep.tool_timeouts += got.status == tools.TIMEOUT
      results.append({"role": "tool", "name": c.name, "content": got.content})
    context = self.context(prompt + ep.messages, results)
    if len(ep.tokens) - ep.prompt_len + len(context) >= settings.max_episode_tokens:
      ep.truncated, ep.end = True, "length"  # no room for the next turn
      return None
    ep.messages += results
    ep.tokens += context
    ep.mask += [0] * len(context)
    if ep.logps is not None:
      ep.logps += [0.0] * len(context)
    ep.context_tokens += len(context)
    return True


def assistant_message(reading: tool_calls.Reading) -> dict:
  """A turn as a message: its text besides the calls, and the calls (`arguments` as objects,
  as TRL passes them to rewards and chat templates render them)."""
  message = {"role": "assistant", "content": reading.content}
  if reading.calls:
    message["tool_calls"] = [
      {"type": "function", "function": {"name": c.name, "arguments": _object(c.arguments)}}
      for c in reading.calls
    ]
  return message


def engine_for(graphdef, params, settings: Settings, *, share_prefixes: bool = True):
  """`Agent.run`'s engine: a slot an episode, each as long as the longest prompt and the
  episode's tokens."""

  def make(count: int, longest_prompt: int):
    return engine_lib.Engine(
      (graphdef, params), slots=count, max_len=longest_prompt + settings.max_episode_tokens,
      prefill_chunk=1024, decode_steps=engine_lib.STATIC_DECODE_STEPS, check_memory=False,
      share_prefixes=share_prefixes,
    )  # fmt: skip

  return make


def _object(arguments: str):
  return json.loads(arguments) if arguments.strip() else {}


def environment_rewards(episodes: list[Episode]) -> np.ndarray:
  """Each episode's environment reward (`reward()` / `get_reward()`), checked finite."""
  out = np.zeros(len(episodes))
  for i, ep in enumerate(episodes):
    try:
      value = tools.environment_reward(ep.environment)
      value = math.nan if value is None else float(value)
    except Exception as e:
      name = type(ep.environment).__name__
      raise UserError(f"The environment {name}'s reward raised {type(e).__name__}: {e}") from e
    if not math.isfinite(value):
      raise UserError(
        f"The environment {type(ep.environment).__name__}'s reward is {value!r} for episode "
        f"{i}: rewards must be finite numbers."
      )
    out[i] = value
  return out


def template_format_share(episodes: list[Episode]) -> np.ndarray:
  """Each episode's share of calls written in the template's own format (0 without calls)."""
  return np.asarray([ep.template_calls / ep.tool_calls if ep.tool_calls else 0.0
                     for ep in episodes])  # fmt: skip


def rows(episodes: list[Episode | None], width: int) -> dict:
  """The episodes as rows of `width` tokens (None: an empty row): tokens, segment_ids (1 over
  the episode) and model (1 on the model's tokens), [R, width]; where the episodes carry the
  sampler's log-probs, sampler_logps [R, width - 1] laid as the trainer's token log-probs are
  (token p's at p - 1)."""
  R = len(episodes)
  tokens = np.zeros((R, width), np.int32)
  segment_ids = np.zeros((R, width), np.int32)
  model = np.zeros((R, width), bool)
  logps = None
  if any(ep is not None and ep.logps is not None for ep in episodes):
    logps = np.zeros((R, width - 1), np.float32)
  for r, ep in enumerate(episodes):
    if ep is None:
      continue
    n = len(ep.tokens)
    tokens[r, :n], segment_ids[r, :n], model[r, :n] = ep.tokens, 1, ep.mask
    if logps is not None:
      logps[r, : n - 1] = ep.logps[1:]
  out = {"tokens": tokens, "segment_ids": segment_ids, "model": model}
  if logps is not None:
    out["sampler_logps"] = logps
  return out


def stats(episodes: list[Episode]) -> dict[str, np.ndarray]:
  """Per episode, what the log averages: turns, calls, unparsed turns, tool errors and
  timeouts, model and context tokens."""
  keys = ("turns", "tool_calls", "unparsed_turns", "tool_errors", "tool_timeouts",
          "context_tokens")  # fmt: skip
  out = {k: np.asarray([getattr(ep, k) for ep in episodes], np.float32) for k in keys}
  out["model_tokens"] = np.asarray([ep.model_tokens for ep in episodes], np.float32)
  return out


def transcript(ep: Episode) -> str:
  """An episode turn by turn, for `zoo data show`."""
  out = []
  for m in ep.messages:
    if m["role"] == "assistant":
      calls = "".join(
        f"\n  -> {c['function']['name']}({json.dumps(c['function']['arguments'])})"
        for c in m.get("tool_calls", [])
      )
      out.append(f"[assistant] {m['content']}{calls}")
    else:
      out.append(f"[tool {m.get('name', '')}] {m['content']}")
  return "\n".join(out)
