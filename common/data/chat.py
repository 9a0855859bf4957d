"""Chat data: conversations rendered with a chat template and tokenized whole, each token with a
loss weight (1 on the assistant's turns: their content and end-of-turn token, 0 elsewhere).

The template is a Hugging Face Jinja chat template, rendered by transformers' own renderer
(`render_jinja_template`, what `apply_chat_template` calls): the tokenizer directory's
(`chat_template.jinja`, or `chat_template` in tokenizer_config.json), or `data.chat_template`.

Which tokens are the assistant's:
- A template with `{% generation %}` marks: the tokens holding the marked characters, found as
  transformers' `return_assistant_tokens_mask` finds them (the same mask, token for token).
- A template without: each assistant turn lies between the conversation rendered up to it with
  the generation prompt and the conversation rendered through it. The ids come from encoding
  the whole conversation once; the ids of each of those two prefixes must be a prefix of them,
  else the template is refused, naming the turn (never encoded chunk by chunk: a tokenizer
  merges across the chunk boundaries differently). Whitespace the template writes after the
  end-of-turn token (ChatML's and Gemma's newline) is not the assistant's.

A conversation left with no assistant token after truncation is dropped (and counted); data
whose weights are all 0 or all 1 is refused: it would train on nothing, or on every token.
"""

import dataclasses
import functools
import re

import numpy as np

from nnx_zoo.common.data import sources
from nnx_zoo.common.errors import UserError

ROLES = ("system", "user", "assistant")
_MARKED = re.compile(r"\{%-?\s*generation\s*-?%\}")


@dataclasses.dataclass(frozen=True)
class Template:
  """A chat template with what it renders with (the tokenizer's special tokens)."""

  source: str
  special: tuple[tuple[str, str], ...] = ()  # (("bos_token", "<s>"), ...)

  @property
  def marked(self) -> bool:
    return bool(_MARKED.search(self.source))

  def render(
    self, messages: list[dict], *, add_generation_prompt: bool = False, marks=False, tools=None
  ):
    """The rendered text, and with `marks` the (start, end) characters of each marked span.
    `tools`: the tools offered (OpenAI's `tools`), for a template that reads them."""
    from transformers.utils.chat_template_utils import render_jinja_template

    try:
      texts, spans = render_jinja_template(
        [messages],
        tools=tools,
        chat_template=self.source,
        add_generation_prompt=add_generation_prompt,
        return_assistant_tokens_mask=marks,
        **dict(self.special),
      )
    except Exception as e:  # jinja's errors, and the template's own raise_exception
      raise UserError(
        f"The chat template does not render this conversation ({type(e).__name__}: {e}). Fix "
        "the template (data.chat_template) or the data."
      ) from None
    return (texts[0], spans[0]) if marks else texts[0]

  @functools.cached_property
  def end_of_turn(self) -> str:
    """What the template writes after an assistant's reply (ChatML's `<|im_end|>`): rendered
    around a placeholder reply, without the whitespace that follows it. `zoo chat` stops there."""
    probe = "\x00reply\x00"
    text = self.render([{"role": "user", "content": "hi"}, {"role": "assistant", "content": probe}])
    after = text[text.index(probe) + len(probe) :] if probe in text else ""
    return after.strip()


def template(data_cfg) -> Template:
  """The chat template of a data config: `data.chat_template` (the template, or a .jinja file),
  else the tokenizer directory's; a tokenizer with neither is refused."""
  import json
  import os

  from nnx_zoo.common.data import tokenizers

  special = tuple(sorted(tokenizers.special_tokens(data_cfg.tokenizer).items()))
  given = data_cfg.get("chat_template", "")  # a converted checkpoint's config has none
  if given:
    if given.endswith(".jinja"):
      if not os.path.isfile(given):
        raise UserError(f"data.chat_template {given!r} does not exist: give a .jinja file.")
      with open(given, encoding="utf-8") as f:
        given = f.read()
    return Template(given, special)
  directory = tokenizers.hf_directory(data_cfg.tokenizer)
  if directory:
    path = os.path.join(directory, "chat_template.jinja")
    if os.path.isfile(path):
      with open(path, encoding="utf-8") as f:
        return Template(f.read(), special)
    path = os.path.join(directory, "tokenizer_config.json")
    if os.path.isfile(path):
      with open(path, encoding="utf-8") as f:
        source = json.load(f).get("chat_template")
      if isinstance(source, list):  # named templates: the default one
        source = next((t["template"] for t in source if t.get("name") == "default"), None)
      if source:
        return Template(source, special)
  raise UserError(
    f"The {data_cfg.tokenizer.kind} tokenizer has no chat template: set "
    "--config.data.chat_template to a Jinja template (or a .jinja file), or point "
    "data.tokenizer.path at a Hugging Face tokenizer directory that has one."
  )


def check_messages(messages, where: str) -> list[dict]:
  """The messages of a record, checked: a list of {role, content} with known roles."""
  if not isinstance(messages, list) or not messages:
    raise UserError(f"{where}: the messages are not a non-empty list of {{role, content}}.")
  for i, m in enumerate(messages):
    if not isinstance(m, dict) or not isinstance(m.get("content"), str):
      raise UserError(f"{where}: message {i} has no text 'content': give each a string.")
    if m.get("role") not in ROLES:
      raise UserError(
        f"{where}: message {i} has role {m.get('role')!r}: use one of {', '.join(ROLES)}."
      )
  return [{"role": m["role"], "content": m["content"]} for m in messages]


def _is_prefix(part: np.ndarray, whole: np.ndarray) -> bool:
  return len(part) <= len(whole) and np.array_equal(whole[: len(part)], part)


def encode(template: Template, tokenizer, messages: list[dict], *, where: str = "a conversation"):
  """(ids [T] int32, weights [T] uint8) of one conversation, whole (see the module docstring)."""
  if template.marked:
    text, spans = template.render(messages, marks=True)
    ids, char_to_token = tokenizer.encode_chat(text)
    if char_to_token is None:
      raise UserError(
        f"The {type(tokenizer).__name__} has no character offsets, which a template with "
        "{% generation %} marks needs: use one without marks, or a Hugging Face tokenizer."
      )
    weights = np.zeros(len(ids), np.uint8)
    for start, end in spans:  # as transformers' return_assistant_tokens_mask
      first, last = char_to_token(start), char_to_token(end - 1)
      if first is None:
        break
      weights[first : len(ids) if last is None else last + 1] = 1
    return ids, weights
  text = template.render(messages)
  ids, _ = tokenizer.encode_chat(text)
  weights = np.zeros(len(ids), np.uint8)
  for i, m in enumerate(messages):
    if m["role"] != "assistant":
      continue
    bounds = []
    for part in (
      template.render(messages[:i], add_generation_prompt=True),
      template.render(messages[: i + 1]),
    ):
      part_ids, _ = tokenizer.encode_chat(part)
      if not (text.startswith(part) and _is_prefix(part_ids, ids)):
        raise UserError(
          f"{where}: the chat template renders the conversation up to message {i} (the "
          "assistant's) as other tokens than the start of the whole conversation, so its turn "
          "cannot be found: add {% generation %} marks to the template."
        )
      bounds.append(len(part_ids))
    start, end = bounds
    while end > start and not tokenizer.token_text(ids[end - 1]).strip():
      end -= 1  # whitespace after the end-of-turn token
    weights[start:end] = 1
  return ids, weights


def final_turn(weights: np.ndarray) -> np.ndarray:
  """The weights of the last assistant turn only (the last run of ones): a preference pair's
  reply, after a prompt that may hold earlier assistant turns."""
  on = np.flatnonzero(weights)
  if len(on) == 0:
    return weights
  start = on[-1]
  while start > 0 and weights[start - 1]:
    start -= 1
  out = np.zeros_like(weights)
  out[start : on[-1] + 1] = 1
  return out


PREFERENCE_KEYS = ("prompt", "chosen", "rejected")


def file_records(path: str, *, fmt: str, messages_field: str):
  """Each record of a chat or preference source, in order: a chat record's messages (its
  `messages_field`), a preference record whole."""
  if fmt == "preference":
    return sources.records(path, text_field="prompt")
  return (r[messages_field] for r in sources.records(path, text_field=messages_field))


def _reply(value, where: str, key: str) -> list[dict]:
  """A preference record's `chosen` or `rejected`: a string, an assistant message, or a list
  of messages (the reply's turns)."""
  if isinstance(value, str):
    value = [{"role": "assistant", "content": value}]
  elif isinstance(value, dict):
    value = [value]
  return check_messages(value, f"{where} ({key})")


def encode_pair(template, tokenizer, record, where: str) -> list[tuple[np.ndarray, np.ndarray]]:
  """A preference record's two conversations (prompt + chosen, prompt + rejected), encoded whole:
  [(ids, weights)] chosen first, the weights on the final reply only."""
  if not isinstance(record, dict) or not all(k in record for k in PREFERENCE_KEYS):
    raise UserError(
      f"{where}: a preference record needs {', '.join(PREFERENCE_KEYS)} (the prompt's "
      "messages and the two replies)."
    )
  prompt = check_messages(record["prompt"], f"{where} (prompt)")
  chosen, rejected = (_reply(record[k], where, k) for k in ("chosen", "rejected"))
  if chosen == rejected:
    raise UserError(
      f"{where}: the chosen and rejected replies are the same, so the pair prefers nothing: "
      "drop it or fix the data."
    )
  pair = [encode(template, tokenizer, prompt + reply, where=where)
          for reply in (chosen, rejected)]  # fmt: skip
  return [(ids, final_turn(weights)) for ids, weights in pair]


@dataclasses.dataclass
class Encoded:
  """Conversations tokenized: each one's ids and weights, and how many were dropped."""

  ids: list[np.ndarray]
  weights: list[np.ndarray]
  dropped: int = 0
  truncated: int = 0


def encode_all(template, tokenizer, conversations, *, max_len: int, what: str) -> Encoded:
  """Every conversation of `conversations` ((where, messages) pairs) encoded and cut to
  `max_len` tokens; those left with no assistant token dropped. Data whose weights are all 0 or
  all 1 is refused."""
  out = Encoded([], [])
  for where, messages in conversations:
    ids, weights = encode(template, tokenizer, messages, where=where)
    if len(ids) > max_len:
      ids, weights = ids[:max_len], weights[:max_len]
      out.truncated += 1
    if not weights.any():
      out.dropped += 1
      continue
    out.ids.append(ids)
    out.weights.append(weights)
  check_weights(out.weights, what)
  return out


def check_weights(weights: list[np.ndarray], what: str):
  """Refuses chat data that would train on no token, or on every token."""
  total = sum(len(w) for w in weights)
  on = sum(int(w.sum()) for w in weights)
  if on == 0:
    raise UserError(
      f"The {what} has no assistant token to train on (no conversation with an assistant "
      "turn, or every one cut away by data.seq_len): check the roles, or raise data.seq_len."
    )
  if on == total:
    raise UserError(
      f"Every token of the {what} is an assistant token, so the loss would cover the prompts "
      "too: the template must write the user's turns (check data.chat_template)."
    )


def pack(ids: list[np.ndarray], weights: list[np.ndarray], row_len: int, *, window=16) -> dict:
  """Conversations (each at most `row_len` tokens) packed whole into rows, in order, each into
  the first of the last `window` rows with room for it (else a new row):
  {"tokens", "segment_ids", "loss_weights"} [R, row_len]; a conversation never continues into
  the next row (its turns would lose their context), the rest of a row is padding."""
  rows, free = [], []
  for i, t in enumerate(ids):
    for r in range(max(len(free) - window, 0), len(free)):
      if free[r] >= len(t):
        break
    else:
      r = len(rows)
      rows.append([])
      free.append(row_len)
    rows[r].append(i)
    free[r] -= len(t)
  tokens = np.zeros((len(rows), row_len), np.int32)
  segments = np.zeros((len(rows), row_len), np.int32)
  loss_weights = np.zeros((len(rows), row_len), np.float32)
  for r, members in enumerate(rows):
    at = 0
    for s, i in enumerate(members):
      n = len(ids[i])
      tokens[r, at : at + n], segments[r, at : at + n] = ids[i], s + 1
      loss_weights[r, at : at + n] = weights[i]
      at += n
  return {"tokens": tokens, "segment_ids": segments, "loss_weights": loss_weights}
