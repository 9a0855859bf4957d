"""The language model task: next-token cross-entropy over packed rows of documents; `zoo
generate` continues a prompt."""

import itertools

import jax
import numpy as np

from nnx_zoo.common import tasks
from nnx_zoo.common.errors import UserError
from nnx_zoo.common.tasks import losses


class LanguageModel(tasks.Task):
  name = "language_model"
  decoder = True

  def loss_sums(self, model, batch, *, loss_chunk=0):
    return losses.loss_sums(model, batch, loss_chunk=loss_chunk)

  def summary(self, sums):
    count = max(sums["count"], 1.0)
    loss = sums["total"] / count
    return {"loss": loss, "perplexity": float(np.exp(min(loss, 50.0))), "targets": int(count)}

  def batch_shapes(self, cfg):
    return tasks.token_rows(cfg.train.batch_size, cfg.data.seq_len + 1)

  def context_rows(self, batch):
    return losses.next_token_rows(batch)

  def generate(self, args, cfg):
    from nnx_zoo.common import engine
    from nnx_zoo.common.data import spans, tokenizers
    from nnx_zoo.common.hub import weights

    check_prompt(args, cfg)
    if spans.has_sentinels(args.prompt):
      raise UserError(
        f"The prompt has T5 sentinels (<extra_id_N>), which {cfg.model.family}, a decoder-only "
        "model, does not read: give plain text, or the --workdir of an encoder-decoder run."
      )
    tokenizer = tokenizers.load(cfg.data.tokenizer)
    prompt = tokenizer.encode(args.prompt)
    if len(prompt) == 0:
      raise UserError("The prompt is empty: give --prompt TEXT.")
    graphdef, params, _ = weights.restore_params(cfg, args.workdir)
    out = engine.generate((graphdef, params), prompt[None], **sampling_options(args))
    print(tokenizer.decode(out[0].tolist()))


def chat(args, cfg):
  """`zoo chat`: the model's answer to a conversation (`--messages FILE.json`), or turn after
  turn from standard input; each prompt rendered with the run's chat template and the
  generation prompt, each answer cut at the template's end of turn (or the end token)."""
  import json
  import sys
  from concurrent import futures

  from nnx_zoo.common import engine, tasks
  from nnx_zoo.common.data import chat as chat_data
  from nnx_zoo.common.data import tokenizers
  from nnx_zoo.common.hub import weights

  tasks.decoder_task(cfg, "zoo chat", args.workdir)
  template = chat_data.template(cfg.data)
  tokenizer = tokenizers.load(cfg.data.tokenizer)
  toolset, schemas = {}, None
  if getattr(args, "tools", None):
    from nnx_zoo.common.tasks import episodes, tool_calls
    from nnx_zoo.common.tasks import tools as tools_lib

    if not tool_calls.takes_tools(template.source):
      raise UserError(f"The chat template of {args.workdir} takes no tools: leave --tools out.")
    toolset = {t.name: t for t in tools_lib.load_tools(args.tools, what="--tools")}
    schemas = [t.schema for t in toolset.values()]
  options = sampling_options(args)
  rng = options.pop("rng")
  messages = [{"role": "system", "content": args.system}] if args.system else []
  if args.messages is not None:
    try:
      with open(args.messages, encoding="utf-8") as f:
        given = json.load(f)
    except (OSError, ValueError) as e:
      raise UserError(f"--messages {args.messages!r} is not a JSON file of messages: {e}") from None
    if isinstance(given, dict):
      given = given.get(cfg.data.messages_field, given.get("messages"))
    messages += chat_data.check_messages(given, args.messages)

  # One worker restores the weights, then builds the engine (one slot: each turn's prompt begins
  # with the last turn's, which the slot still holds) and readies its programs for the first
  # prompt's length (from the persistent cache, common/programs.py): in turn-by-turn chat, while
  # the first line is typed.
  with futures.ThreadPoolExecutor(1, thread_name_prefix="load") as worker:
    restored = worker.submit(weights.restore_params, cfg, args.workdir)
    # Decoding stops at the end of the turn: the end token, or the template's end-of-turn tag
    # where it is one token (ChatML's <|im_end|>).
    end_ids = tokenizer.encode_chat(template.end_of_turn)[0] if template.end_of_turn else []
    stop_ids = (tokenizer.eos_id, *(end_ids if len(end_ids) == 1 else ()))
    params = engine.SamplingParams(
      options["max_new_tokens"], options["temperature"], options["top_k"], options["top_p"],
      stop_ids=engine.stop_tuple(stop_ids),
    )  # fmt: skip

    def encode(messages):
      text = template.render(messages, add_generation_prompt=True, tools=schemas)
      return tokenizer.encode_chat(text)[0]

    def ready(prompt_len):
      graphdef, weights_, _ = restored.result()
      eng = engine.Engine((graphdef, weights_), slots=1, max_len=CHAT_MAX_LEN)
      eng.prepare(prompt_len, params.max_tokens, truncate=params.truncates)
      return eng

    first = messages if args.messages is not None else [*messages, {"role": "user", "content": ""}]
    readied = worker.submit(ready, len(encode(first)))

    def sample(prompt, rng) -> list[int]:
      """The turn's new tokens (its stop token included)."""
      eng = readied.result()  # raises what the restore raised
      # The key `generate` gives its one row, so a turn's reply is what it was before the engine.
      eng.submit(prompt, params, key=jax.random.split(rng, 1)[0])
      return eng.run().popitem()[1] if eng.busy else []

    def answer(messages, rng):
      new = sample(encode(messages), rng)
      if tokenizer.eos_id is not None and tokenizer.eos_id in new:
        new = new[: new.index(tokenizer.eos_id)]
      text = tokenizer.decode(new)
      end = template.end_of_turn
      return text.split(end)[0] if end else text

    agent = None
    if toolset:  # the conversation kept as tokens: the model's turns exactly as it wrote them
      agent = episodes.Agent(list(toolset.values()), None, forms=",".join(tool_calls.FORMS))
      agent.prepare(template, tokenizer)
    convo: list[int] = []  # with --tools: the tokens of messages[:shown], as the model read them
    shown = 0

    def reply(messages, rng):
      """The model's answer; with --tools, its calls run between its turns (each call and its
      result on stderr, appended to `messages`) until a turn makes none (at most MAX_TOOL_TURNS).
      Its turns stay as it wrote them (a call as bare JSON too), the template's and the tools'
      tokens between them, as GRPO's episodes are played: a model trained on its episodes
      reads the same here (the template's rendering of its calls is another text)."""
      nonlocal shown
      if agent is None:
        return answer(messages, rng)
      # What the conversation added since the model's last turn (all of it, at the start).
      convo.extend(agent.context(messages[:shown], messages[shown:]) if convo else encode(messages))
      for turn in range(MAX_TOOL_TURNS):
        new = sample(convo, jax.random.fold_in(rng, turn) if turn else rng)
        convo.extend(new)
        stopped = bool(new) and new[-1] in params.stop_ids
        text = tokenizer.decode(new[:-1] if stopped else new)
        reading = agent.reader.read(text)
        if not stopped:  # cut at --max-new-tokens: closed as the template closes a turn
          convo.append(agent.end_id)
        if not reading.calls:
          messages.append({"role": "assistant", "content": text})
          shown = len(messages)
          return text
        messages.append(episodes.assistant_message(reading))
        results = []
        for c in reading.calls:
          got = tools_lib.run(toolset, c.name, c.arguments, timeout_s=TOOL_TIMEOUT_S)
          print(f"[{c.name}({c.arguments}) -> {got.content}]", file=sys.stderr, flush=True)
          results.append({"role": "tool", "name": c.name, "content": got.content})
        convo.extend(agent.context(messages, results))
        messages.extend(results)
        shown = len(messages)
      return text

    if args.messages is not None:
      print(reply(messages, rng))
      return
    print("(an empty line or end of input ends the conversation)", file=sys.stderr)
    for turn in itertools.count():
      print("> ", end="", file=sys.stderr, flush=True)
      line = sys.stdin.readline()
      if not line.strip():
        return
      messages.append({"role": "user", "content": line.rstrip("\n")})
      said = reply(messages, jax.random.fold_in(rng, turn))
      print(said, flush=True)
      if agent is None:  # (with tools, reply keeps the messages it played)
        messages.append({"role": "assistant", "content": said})


CHAT_MAX_LEN = 4096  # the longest conversation `zoo chat` holds (its cache grows as it goes)
MAX_TOOL_TURNS = 8  # `zoo chat --tools`: the model's turns for one answer, calls between them
TOOL_TIMEOUT_S = 30.0  # a call's time limit there


def sampling_options(args) -> dict:
  """`zoo generate`'s sampling arguments for a text prompt (temperature 0.8 unless given)."""
  return {
    "max_new_tokens": args.max_new_tokens,
    "rng": jax.random.key(args.seed),
    "temperature": 0.8 if args.temperature is None else args.temperature,
    "top_k": args.top_k,
    "top_p": args.top_p,
  }


def check_prompt(args, cfg):
  """The arguments of a text model's `zoo generate`: a prompt, and no speech model's."""
  if args.audio is not None:
    raise UserError(
      f"--audio needs a speech model (an encoder-decoder of log-mel frames, e.g. Whisper); "
      f"{args.workdir} holds a {cfg.model.family} model: give it --prompt TEXT."
    )
  if args.language is not None or args.task is not None:
    raise UserError("--language and --task choose a speech model's prompt: give them with --audio.")
  if args.prompt is None:
    raise UserError(f"{cfg.model.family} is a language model: give --prompt TEXT.")


tasks.register(LanguageModel())
