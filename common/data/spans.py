"""T5's span corruption: spans of a token row replaced by sentinels, the decoder predicting them.

After Raffel et al. (2020) and `random_spans_noise_mask`, `noise_span_to_unique_sentinel` and
`random_spans_helper` in google-research/text-to-text-transfer-transformer's preprocessors.py:
about `noise_density` of a row's tokens, in spans of mean length `mean_span`, are each replaced
by one sentinel; the targets are the sentinels each followed by the span it replaced:

  row      a b c d e f g h
  inputs   a b <0> e f <1> h EOS         (<0> = vocab_size - 1, <1> = vocab_size - 2, ...)
  targets  <0> c d <1> g EOS

(The row starts with kept tokens and ends with a dropped span, as in T5; a row of `lengths()`
tokens fills the inputs and targets exactly, a shorter one is padded with `pad_id`, segment 0.)

The trainer's sequence-to-sequence data (kind "shakespeare_spans", `config`): the plays cut into
rows of `lengths(seq_len)[0]` tokens, corrupted anew each epoch (`train_iterator`), the held-out
ones once (`load_split`).
"""

import functools
import re

import ml_collections
import numpy as np

from nnx_zoo.common.data import kinds, pipeline, tokenizers
from nnx_zoo.common.errors import UserError


def lengths(inputs_length: int, *, noise_density: float = 0.15, mean_span: float = 3.0):
  """(tokens_length, targets_length): the longest raw row whose corrupted inputs, one EOS
  included, fit `inputs_length`, and the length of its targets (EOS included), as T5's
  `random_spans_helper` (which, unlike its own noise mask, forgets the floor of one noise token
  and one span; that matters for tiny lengths only). Both counts grow with the row, so a shorter
  row fits the same lengths."""

  def corrupted(tokens_length):  # the counts of `noise_mask`
    noise = min(max(int(round(tokens_length * noise_density)), 1), tokens_length - 1)
    spans = max(int(round(noise / mean_span)), 1)
    return tokens_length - noise + spans + 1, noise + spans + 1

  if not 0 < noise_density < 1 or mean_span < 1 or inputs_length < 2:
    raise UserError(
      f"Span corruption needs 0 < noise_density < 1 (got {noise_density}), mean_span >= 1 "
      f"(got {mean_span}) and an inputs length of at least 2 (got {inputs_length})."
    )
  tokens_length = inputs_length - 1
  while corrupted(tokens_length + 1)[0] <= inputs_length:
    tokens_length += 1
  targets_length = corrupted(tokens_length)[1]
  # T5's own adjustment: at density 0.5 keep the targets no longer than the inputs.
  if noise_density == 0.5 and targets_length > inputs_length:
    tokens_length, targets_length = tokens_length - 1, targets_length - 1
  return tokens_length, targets_length


def _segment_lengths(num_items: int, num_segments: int, rng: np.random.Generator) -> np.ndarray:
  """`num_items` cut at random into `num_segments` non-empty parts, their lengths in order."""
  first = np.zeros(num_items - 1, np.int64)
  first[: num_segments - 1] = 1
  rng.shuffle(first)
  segment_id = np.concatenate([[0], np.cumsum(first)])
  return np.bincount(segment_id, minlength=num_segments)


def noise_mask(
  length: int, rng: np.random.Generator, *, noise_density: float = 0.15, mean_span: float = 3.0
) -> np.ndarray:
  """A bool [length], True on dropped tokens: round(length * noise_density) of them (at least 1,
  at most length - 1) in round(noise / mean_span) spans (at least 1), alternating with kept
  spans, the first span kept."""
  orig_length, length = length, max(length, 2)
  num_noise = min(max(int(round(length * noise_density)), 1), length - 1)
  num_spans = max(int(round(num_noise / mean_span)), 1)
  noise_lengths = _segment_lengths(num_noise, num_spans, rng)
  kept_lengths = _segment_lengths(length - num_noise, num_spans, rng)
  interleaved = np.stack([kept_lengths, noise_lengths], axis=1).reshape(-1)
  is_noise = np.repeat(np.tile([False, True], num_spans), interleaved)
  return is_noise[:orig_length]


def _sentinel_spans(tokens_T: np.ndarray, drop_T: np.ndarray, vocab_size: int) -> np.ndarray:
  """Each run of dropped tokens replaced by one sentinel: vocab_size - 1 for the first run,
  vocab_size - 2 for the next, ..."""
  previous = np.concatenate([[False], drop_T[:-1]])
  starts = drop_T & ~previous
  sentinels = vocab_size - np.cumsum(starts)
  out = np.where(starts, sentinels, tokens_T)
  return out[~(drop_T & previous)]


def corrupt(
  tokens_T: np.ndarray,
  mask_T: np.ndarray,
  *,
  vocab_size: int,
  eos_id: int | None = None,
) -> tuple[np.ndarray, np.ndarray]:
  """(inputs, targets) of a row under a noise mask, unpadded, each ending in `eos_id` if given.
  `vocab_size` is the tokenizer's, sentinels included (T5: 32,100, so <extra_id_0> = 32,099),
  not a model's padded vocab (T5's 32,128)."""
  tokens_T = np.asarray(tokens_T)
  num_spans = int(np.sum(mask_T & ~np.concatenate([[False], mask_T[:-1]])))
  if len(tokens_T) and tokens_T.max() >= vocab_size - num_spans:
    raise UserError(
      f"Token id {int(tokens_T.max())} is one of the sentinel ids (the top {num_spans} of "
      f"vocab_size={vocab_size}): span corruption needs a vocabulary with room above the "
      "tokenizer's ids, e.g. model.vocab_size = tokenizer vocab + 100 (T5's 100 extra ids)."
    )
  inputs = _sentinel_spans(tokens_T, mask_T, vocab_size)
  targets = _sentinel_spans(tokens_T, ~mask_T, vocab_size)
  if eos_id is not None:
    inputs, targets = np.append(inputs, eos_id), np.append(targets, eos_id)
  return inputs.astype(np.int32), targets.astype(np.int32)


def corrupt_row(
  tokens_T: np.ndarray,
  rng: np.random.Generator,
  *,
  vocab_size: int,
  inputs_length: int,
  noise_density: float = 0.15,
  mean_span: float = 3.0,
  eos_id: int | None = None,
  pad_id: int = 0,
) -> dict:
  """One row's {"inputs", "input_segment_ids", "targets", "target_segment_ids"}, padded to
  `inputs_length` and the targets length of `lengths()` (segment ids 1 = token, 0 = padding).
  The row may be at most `lengths(inputs_length)[0]` tokens long. A grain `random_map`
  transform as it stands (with the keywords bound)."""
  tokens_length, targets_length = lengths(
    inputs_length, noise_density=noise_density, mean_span=mean_span
  )
  tokens_T = np.asarray(tokens_T)
  if len(tokens_T) > tokens_length:
    raise UserError(
      f"A row of {len(tokens_T)} tokens is longer than the {tokens_length} whose corruption "
      f"fits inputs_length={inputs_length}: cut rows to spans.lengths(...)[0] tokens."
    )
  mask = noise_mask(len(tokens_T), rng, noise_density=noise_density, mean_span=mean_span)
  inputs, targets = corrupt(tokens_T, mask, vocab_size=vocab_size, eos_id=eos_id)
  out = {}
  for name, seq, size in (("input", inputs, inputs_length), ("target", targets, targets_length)):
    padded = np.full(size, pad_id, np.int32)
    segments = np.zeros(size, np.int32)
    if len(seq) > size:  # not for rows up to tokens_length (see `lengths`); never cut a token
      raise UserError(
        f"The corrupted {name}s of a {len(tokens_T)}-token row need {len(seq)} slots, more than "
        f"{size}: use rows of exactly spans.lengths(...)[0] tokens."
      )
    padded[: len(seq)], segments[: len(seq)] = seq, 1
    out[f"{name}s"], out[f"{name}_segment_ids"] = padded, segments
  return out


def corrupt_rows(rows_RT: np.ndarray, *, seed: int, **kw) -> dict:
  """`corrupt_row` over rows [R, T], row r drawing from the generator of (seed, r): the same
  rows and seed give the same corruption, whatever else is drawn. Arrays [R, length]."""
  out = [corrupt_row(row, np.random.default_rng([seed, r]), **kw) for r, row in enumerate(rows_RT)]
  return {k: np.stack([o[k] for o in out]) for k in out[0]}


# The trainer's data: span-corrupted Shakespeare

KINDS = ("shakespeare_spans",)


def config(**kw) -> ml_collections.ConfigDict:
  """A data sub-config of span corruption: the plays split as kind "shakespeare" splits them
  (`eval_plays` held out), `seq_len` the encoder's inputs length, T5's `noise_density` and
  `mean_span`, and `extra_ids` sentinel ids above the tokenizer's (the model's vocab_size needs
  the tokenizer's ids plus these; T5's tokenizer has its 100 inside: 0 there)."""
  cfg = {
    "kind": "shakespeare_spans",
    "eval_plays": "",
    "train_plays": "",  # "": every play not held out
    "tokenizer": tokenizers.config("bytes"),
    "seq_len": 128,
    "noise_density": 0.15,
    "mean_span": 3.0,
    "extra_ids": 100,
  }
  unknown = set(kw) - set(cfg)
  if unknown:
    raise UserError(f"Unknown data keys {sorted(unknown)}; known: {sorted(cfg)}.")
  cfg.update(kw)
  return ml_collections.ConfigDict(cfg)


def vocab_size(cfg, tokenizer) -> int:
  """The ids the data uses: the tokenizer's and the sentinels above them (the top one first)."""
  return tokenizer.vocab_size + cfg.extra_ids


def corrupter(cfg, tokenizer):
  """row, rng -> `corrupt_row`'s dict, with the data config's settings."""
  return functools.partial(
    corrupt_row,
    vocab_size=vocab_size(cfg, tokenizer),
    inputs_length=cfg.seq_len,
    noise_density=cfg.noise_density,
    mean_span=cfg.mean_span,
    eos_id=tokenizer.eos_id,
  )


def load_split(cfg, split: str, tokenizer) -> pipeline.Rows | None:
  """The rows of `split`: train, raw token rows {"tokens": [R, lengths(seq_len)[0]]} (corrupted
  by `train_iterator`); eval, corrupted here once with a fixed seed, so every evaluation scores
  the same pairs. The plays' tokens are concatenated and cut, as T5 cuts its corpus. None when
  nothing is held out."""
  plays = ml_collections.ConfigDict({**cfg.to_dict(), "kind": "shakespeare"})
  docs = pipeline.documents(plays, split)
  if not docs:
    return None
  tokens = np.concatenate([tokenizer.encode(d) for d in docs]).astype(np.int32)
  length, _ = lengths(cfg.seq_len, noise_density=cfg.noise_density, mean_span=cfg.mean_span)
  num_rows = len(tokens) // length
  if num_rows == 0:
    raise UserError(
      f"The {split} plays have fewer than the {length} tokens of one row: lower data.seq_len."
    )
  rows = tokens[: num_rows * length].reshape(num_rows, length)
  name = f"{cfg.kind}:{split}:{cfg.seq_len}"
  if split == "train":
    return pipeline.Rows({"tokens": rows}, name)
  corrupt = corrupter(cfg, tokenizer)
  pairs = [corrupt(row, np.random.default_rng([0, r])) for r, row in enumerate(rows)]
  return pipeline.Rows({k: np.stack([p[k] for p in pairs]) for k in pairs[0]}, name)


def train_iterator(rows: pipeline.Rows, *, batch_size: int, seed: int, corrupt, share=None):
  """Endless shuffled global batches of corrupted rows, this process's share of each: a row's
  corruption is drawn from (seed, its index in the endless stream), so each epoch masks other
  spans, and a resumed run (grain's iterator state) sees the same ones."""
  if len(rows) < batch_size:
    raise UserError(
      f"The training data has {len(rows)} rows, fewer than train.batch_size={batch_size}: "
      "give more text or lower the batch size."
    )
  draw = lambda row, rng: corrupt(row["tokens"], rng)
  # draw_seed=seed, as before the shared pipeline: the spans of runs written earlier stay theirs.
  return pipeline.shuffled_batches(
    rows, batch_size=batch_size, seed=seed, draw=draw, draw_seed=seed, share=share
  )


# Prompts with sentinels: `zoo generate` on a seq2seq workdir

SENTINEL = re.compile(r"<extra_id_(\d+)>")


def encode_prompt(text: str, tokenizer, vocab_size: int, extra_ids: int) -> np.ndarray:
  """Text with T5's sentinel markers (`<extra_id_0>` = vocab_size - 1, ...) as ids; when the
  sentinels are the data's own (extra_ids > 0), the markers are read here, else the tokenizer
  knows them (T5's)."""
  if not extra_ids:
    return tokenizer.encode(text)
  pieces = SENTINEL.split(text)  # text, number, text, number, ..., text
  ids = []
  for i, piece in enumerate(pieces):
    if i % 2:
      if int(piece) >= extra_ids:
        raise UserError(f"<extra_id_{piece}> is beyond the data's {extra_ids} sentinels.")
      ids.append(np.asarray([vocab_size - 1 - int(piece)], np.int32))
    elif piece:
      ids.append(tokenizer.encode(piece))
  return np.concatenate(ids).astype(np.int32) if ids else np.zeros(0, np.int32)


def decode_output(ids, tokenizer, vocab_size: int, extra_ids: int) -> str:
  """Ids as text, the data's own sentinel ids written as their markers."""
  if not extra_ids:
    return tokenizer.decode(ids)
  out, run = [], []
  for i in (int(i) for i in ids):
    if i >= vocab_size - extra_ids:
      out += [tokenizer.decode(run), f"<extra_id_{vocab_size - 1 - i}>"]
      run = []
    else:
      run.append(i)
  return "".join(out + [tokenizer.decode(run)])


def has_sentinels(text: str) -> bool:
  return SENTINEL.search(text) is not None


# The trainer's data kind (common/data/kinds.py)


def check(cfg):
  """The model's vocabulary holds the tokenizer's ids and the sentinels above them."""
  tokenizer = tokenizers.load(cfg.data.tokenizer)
  ids = vocab_size(cfg.data, tokenizer)
  what = (
    f"The data uses {{ids}} ids (the tokenizer's {tokenizer.vocab_size} and "
    f"data.extra_ids={cfg.data.extra_ids} sentinels)"
  )
  kinds.check_vocab(cfg, ids, what)


def load(cfg, *, train: bool, batch_size: int, share: slice | None) -> kinds.Data:
  """Rows corrupted anew each epoch to train on, the held-out pairs corrupted once."""
  tokenizer = tokenizers.load(cfg.data.tokenizer)
  iterator = None
  if train:
    iterator = train_iterator(
      load_split(cfg.data, "train", tokenizer),
      batch_size=batch_size,
      seed=cfg.seed,
      corrupt=corrupter(cfg.data, tokenizer),
      share=share,
    )
  held_out = load_split(cfg.data, "eval", tokenizer)
  return kinds.Data(iterator, held_out, pipeline.eval_batches, cfg.data.seq_len)


for _kind in KINDS:
  kinds.register(kinds.Kind(_kind, load, check))
