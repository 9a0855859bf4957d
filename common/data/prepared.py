"""Training from prepared corpora (`data.kind="prepared"`): memory-mapped token shards packed into
rows on the fly, and named mixtures of several corpora (`data.mixture`).

Start-up reads prepared.json, each source's entry and nothing else: the shards are memory maps,
so memory does not grow with the corpus. The rows are those `pipeline.pack` cuts from the same
documents (concatenated in reading order, cut every seq_len + 1 tokens, a segment id per
document, long documents continued in the next row, never dropped), but made on demand from a
row's index: a global batch is a list of row indices (shuffled by seed, as
`pipeline.shuffled_batches` shuffles rows), and each process reads only the rows of its share.
The iterator's state is the index of the next batch, the same on every process, so a run
resumes on another number of processes with the same global batches.
"""

import dataclasses
import functools
import json
import os
import zlib

import grain
import ml_collections
import numpy as np

from nnx_zoo.common import files
from nnx_zoo.common.data import kinds, pipeline, prepare, tokenizers
from nnx_zoo.common.errors import UserError


class Split:
  """One split of a prepared directory: its sources' shards as one stream of tokens, whose
  document ends are known. Reads nothing but the entries until tokens are asked for."""

  def __init__(self, path: str, split: str):
    self.path, self.split = path, split
    self.manifest = prepare.read_manifest(path)
    dtype = np.dtype(self.manifest["dtype"])
    shards = os.path.join(path, "shards")
    missing, self.tokens, self.ends, self.weights = [], [], [], []
    self.keys = []  # the key of each source with documents in this split, in reading order
    self.teacher = None  # (logps, ids) memmaps per source: `attach_teacher`
    self.formats = set()  # how its sources were read: text, chat, preference
    for source in self.manifest["sources"]:
      entry_path = os.path.join(shards, f"{source['key']}.json")
      if not os.path.exists(entry_path):
        missing.append(source["path"])
        continue
      with open(entry_path) as f:
        entry = json.load(f)
      self.formats.add(entry.get("reading", {"format": "text"})["format"])
      counts = entry["splits"].get(split)
      if counts:  # np.memmap of an empty file fails: a split with no documents has no files
        self.keys.append(source["key"])
        tokens, ends = (os.path.join(shards, counts[f"{k}_file"]) for k in ("tokens", "ends"))
        self.tokens.append(_memmap(tokens, dtype, counts["tokens"]))
        self.ends.append(_memmap(ends, np.int64, counts["documents"]))
        weights = counts.get("weights_file")  # chat data: a loss weight for every token
        self.weights.append(
          weights and _memmap(os.path.join(shards, weights), np.uint8, counts["tokens"])
        )
    if missing:
      raise UserError(
        f"{path} is half-written: {len(missing)} of its {len(self.manifest['sources'])} sources "
        f"are not prepared (the first: {missing[0]}). Rerun `zoo data prepare` with the same "
        "--out to finish it."
      )
    sizes = np.array([len(t) for t in self.tokens], np.int64)
    self.starts = np.concatenate([[0], np.cumsum(sizes)])  # each shard's first token
    doc_counts = np.array([len(e) for e in self.ends], np.int64)
    self.first_doc = np.concatenate([[0], np.cumsum(doc_counts)])  # each shard's first document
    self.num_tokens, self.num_documents = int(self.starts[-1]), int(self.first_doc[-1])
    self.weighted = any(w is not None for w in self.weights)

  def window(self, starts_R: np.ndarray, length: int) -> tuple[np.ndarray, ...]:
    """Tokens [R, length] from each of the stream positions `starts_R`, the index of the
    document each lies in (-1 past the end, where the token is 0), and their loss weights (1
    where a source has none, 0 past the end)."""
    pos = (starts_R[:, None] + np.arange(length)).ravel()
    tokens = np.zeros(pos.shape, np.int32)
    docs = np.full(pos.shape, -1, np.int64)
    weights = np.zeros(pos.shape, np.float32)
    shard = np.searchsorted(self.starts, pos, side="right") - 1
    for s in np.unique(shard):
      if s >= len(self.tokens):  # past the last token
        continue
      here = shard == s
      local = pos[here] - self.starts[s]
      tokens[here] = self.tokens[s][local]
      docs[here] = self.first_doc[s] + np.searchsorted(self.ends[s], local, side="right")
      weights[here] = 1.0 if self.weights[s] is None else self.weights[s][local]
    return (*(x.reshape(-1, length) for x in (tokens, docs, weights)),)

  def attach_teacher(self, top_k: int):
    """Memory-maps each source's teacher outputs (`write_teacher`): what `teacher_window`
    reads."""
    shards = os.path.join(self.path, "shards")
    self.teacher = []
    for key, tokens in zip(self.keys, self.tokens, strict=True):
      names = (f"{key}.{self.split}.teacher_{kind}" for kind in ("logps", "ids"))
      logps, ids = (os.path.join(shards, n) for n in names)
      self.teacher.append(
        (
          _memmap(logps, np.float32, len(tokens) * top_k).reshape(-1, top_k),
          _memmap(ids, np.uint32, len(tokens) * top_k).reshape(-1, top_k),
        )
      )

  def teacher_window(self, starts_R: np.ndarray, length: int) -> tuple[np.ndarray, np.ndarray]:
    """The teacher's top-k log-probabilities and ids [R, length, k] at the stream positions of
    `window` (zeros past the end)."""
    k = self.teacher[0][0].shape[1] if self.teacher else 0
    pos = (starts_R[:, None] + np.arange(length)).ravel()
    logps, ids = np.zeros((len(pos), k), np.float32), np.zeros((len(pos), k), np.int32)
    shard = np.searchsorted(self.starts, pos, side="right") - 1
    for s in np.unique(shard):
      if s >= len(self.tokens):
        continue
      here = shard == s
      local = pos[here] - self.starts[s]
      logps[here], ids[here] = self.teacher[s][0][local], self.teacher[s][1][local]
    return logps.reshape(-1, length, k), ids.reshape(-1, length, k)

  def document(self, d: int) -> tuple[np.ndarray, np.ndarray]:
    """The tokens and loss weights of document `d` of the split (in reading order)."""
    s = int(np.searchsorted(self.first_doc, d, side="right")) - 1
    local = d - self.first_doc[s]
    start, end = (self.ends[s][local - 1] if local else 0), self.ends[s][local]
    weights = self.weights[s]
    return self.tokens[s][start:end], (weights[start:end] if weights is not None else None)


def _memmap(path: str, dtype, count: int) -> np.ndarray:
  size = os.path.getsize(path) if os.path.exists(path) else -1
  if size != count * np.dtype(dtype).itemsize:
    raise UserError(
      f"{path} holds {size} bytes where its entry says {count} values of {np.dtype(dtype).name}: "
      "the prepared directory is damaged. Delete it and prepare it again."
    )
  return np.memmap(path, dtype=dtype, mode="r")


class PackedRows:
  """A grain random-access source of rows of `row_len` tokens cut from a split's stream: row r
  is tokens [r * row_len, (r + 1) * row_len) with a segment id per document (starting at 1 in
  each row) and 0 for padding past the end (`pad_last`: the last, partial row is kept)."""

  def __init__(self, split: Split, row_len: int, *, pad_last: bool):
    self.split, self.row_len = split, row_len
    rows, rest = divmod(split.num_tokens, row_len)
    self.num_rows = rows + bool(rest and pad_last)

  def __len__(self):
    return self.num_rows

  def read(self, rows_R: np.ndarray) -> dict:
    """The rows of the indices `rows_R` as a batch {"tokens", "segment_ids"} [R, row_len], and
    where the data has loss weights (chat), "loss_weights": each token's as a target."""
    rows_R = np.asarray(rows_R, np.int64)
    tokens, docs, weights = self.split.window(rows_R * self.row_len, self.row_len)
    segments = np.where(docs >= 0, docs - docs[:, :1] + 1, 0).astype(np.int32)
    batch = {"tokens": tokens, "segment_ids": segments}
    if self.split.weighted:
      batch["loss_weights"] = weights
    if self.split.teacher is not None:  # a distill run's teacher outputs (`write_teacher`)
      batch["teacher_logps"], batch["teacher_ids"] = self.split.teacher_window(
        rows_R * self.row_len, self.row_len
      )
    return batch

  def __getitem__(self, r):
    return {k: v[0] for k, v in self.read(np.array([r])).items()}

  def __repr__(self):  # stable: grain keys the iterator state on it
    return f"PackedRows({self.split.path}:{self.split.split}, {self.row_len}, {self.num_rows})"


class PairRows:
  """A grain random-access source of a preference split's pair rows: pair p is documents 2p
  (prompt + chosen) and 2p + 1 (prompt + rejected), as `zoo data prepare` wrote them, each cut to
  `row_len` tokens, laid out as `pipeline.conversation_split` lays them out at start-up
  (`pipeline.pair_plan`: one pair a row [2, row_len], or packed, planned once here from the
  documents' lengths, which the entries hold). A pair whose reply the cut leaves empty on a side
  stays, its weights zero there: the dpo task counts only pairs with a reply token on both sides
  (start-up drops them instead)."""

  def __init__(self, split: Split, row_len: int, *, pairs_per_row: str = "one"):
    self.split, self.row_len, self.pairs_per_row = split, row_len, pairs_per_row
    self.num_pairs = split.num_documents // 2
    self.plan = None  # one pair a row: row p is pair p
    if pairs_per_row != "one":
      lengths = np.concatenate([np.diff(e, prepend=0) for e in split.ends] or [np.zeros(0, int)])
      lengths = np.minimum(lengths[: 2 * self.num_pairs], row_len)
      self.plan = pipeline.pair_plan(lengths, row_len, pairs_per_row=pairs_per_row)
    self.num_rows = self.num_pairs if self.plan is None else len(self.plan)

  def __len__(self):
    return self.num_rows

  def _pairs(self, pairs) -> tuple[list, list]:
    """The ids and weights of `pairs`' conversations, chosen then rejected, cut to a row."""
    L = self.row_len
    docs = [self.split.document(2 * int(p) + side) for p in pairs for side in (0, 1)]
    return [t[:L] for t, _ in docs], [w[:L] for _, w in docs]

  def read(self, rows_R: np.ndarray) -> dict:
    """The pair rows of the indices `rows_R`: {"tokens", "segment_ids", "loss_weights"}
    [R, 2, L]."""
    if self.plan is None:
      return pipeline.pair_rows(*self._pairs(rows_R), self.row_len)
    members = [self.plan[int(r)] for r in rows_R]
    pairs = [p for row in members for p, _, _ in row]
    local, k = [], 0  # the plan of these rows, over the pairs read for them
    for row in members:
      local.append([(k + j, *sides) for j, (_, *sides) in enumerate(row)])
      k += len(row)
    return pipeline.pair_rows(*self._pairs(pairs), self.row_len, plan=local)

  def check(self, what: str, *, sample: int = 1024):
    """Warns of the pairs (of the first `sample`) whose reply the row's length cuts away on a
    side, which train on nothing; refuses a split where none of them keeps both replies."""
    n = min(self.num_pairs, sample)
    if n == 0:
      return
    _, weights = self._pairs(range(n))
    cut = sum(not (weights[2 * p].any() and weights[2 * p + 1].any()) for p in range(n))
    if cut == n:
      raise UserError(
        f"None of the first {n} pairs of {what} keeps a reply token on both sides in "
        f"seq_len + 1 = {self.row_len} tokens: raise data.seq_len."
      )
    if cut:
      of = f"{cut} of its {n} pairs" if n == self.num_pairs else f"{cut} of its first {n} pairs"
      files.warn(
        f"{of} of {what} have a reply cut away in seq_len + 1 = {self.row_len} tokens: they "
        "count for nothing (raise data.seq_len to keep them)."
      )

  def __getitem__(self, r):
    return {k: v[0] for k, v in self.read(np.array([r])).items()}

  def __repr__(self):  # stable: grain keys the iterator state on it
    layout = "" if self.plan is None else f", {self.pairs_per_row}"
    return (
      f"PairRows({self.split.path}:{self.split.split}, {self.row_len}, {self.num_rows}{layout})"
    )


def rows(split: Split, row_len: int, *, fmt: str, pad_last: bool, pairs_per_row: str = "one"):
  """A split's rows for a run reading `data.format=fmt`: its pairs for preference data (laid
  out `pairs_per_row`), packed rows otherwise; a directory prepared one way and read the other
  is refused."""
  if split.formats and (fmt == "preference") != (split.formats == {"preference"}):
    prepared = ", ".join(sorted(split.formats))
    raise UserError(
      f"{split.path} was prepared as {prepared} data, and this run reads data.format={fmt!r}: "
      "prepare it again with this experiment, or set data.format to what it holds."
    )
  if fmt == "preference":
    pairs = PairRows(split, row_len, pairs_per_row=pairs_per_row)
    pairs.check(f"{split.path}'s {split.split} split")
    return pairs
  return PackedRows(split, row_len, pad_last=pad_last)


# Mixtures


@dataclasses.dataclass(frozen=True)
class Component:
  name: str
  path: str
  weight: float


def components(cfg) -> list[Component]:
  """data.mixture ("NAME=DIR@WEIGHT,..."; a weight of 1 where none is given), or data.path as
  the one component."""
  if not cfg.mixture:
    if not cfg.path:
      raise UserError(
        "data.kind='prepared' reads a prepared directory: set --config.data.path=DIR (made by "
        "`zoo data prepare EXP --out DIR`) or --config.data.mixture=NAME=DIR@WEIGHT,..."
      )
    return [Component("", cfg.path, 1.0)]
  if cfg.path:
    raise UserError("Set data.path (one corpus) or data.mixture (several), not both.")
  parts, names = [], set()
  for spec in [s.strip() for s in cfg.mixture.split(",") if s.strip()]:
    name, eq, rest = spec.partition("=")
    path, at, weight = rest.rpartition("@") if "@" in rest else (rest, "", "1")
    name, path = name.strip(), path.strip()
    if not eq or not name or not path:
      raise UserError(
        f"data.mixture component {spec!r} needs a name and a path: write NAME=DIR@WEIGHT "
        "(e.g. web=prepared/web@0.7,code=prepared/code@0.3)."
      )
    try:
      w = float(weight)
    except ValueError:
      w = float("nan")
    if not w > 0:
      raise UserError(
        f"data.mixture component {name!r} has weight {weight!r}: weights must be positive "
        "numbers (they are normalised to sum to 1)."
      )
    if name in names:
      raise UserError(f"data.mixture names the component {name!r} twice.")
    names.add(name)
    parts.append(Component(name, path, w))
  if not parts:
    raise UserError("data.mixture is set but names no component: write NAME=DIR@WEIGHT,...")
  return parts


def reweighted(old: str, new: str) -> bool:
  """Whether the mixture `new` is `old` with other weights only (same names and directories):
  a run resumes with it. From the resumed step on, batches are drawn in the new proportions;
  each component's rows still come in its own shuffled order, but where that order is resumed
  follows the new weights, so within the epoch some of a component's rows come twice and others
  not at all (a warning says so)."""
  if not old or not new or old == new:
    return False
  parse = lambda spec: components(ml_collections.ConfigDict({"mixture": spec, "path": ""}))
  before, after = parse(old), parse(new)
  if [(c.name, c.path) for c in before] != [(c.name, c.path) for c in after]:
    return False
  files.warn(
    f"data.mixture's weights changed ({', '.join(f'{c.name} {c.weight:g}' for c in before)} -> "
    f"{', '.join(f'{c.name} {c.weight:g}' for c in after)}): the batches from here on are drawn "
    "in the new proportions, and within this epoch some rows of a component may come twice and "
    "others not at all."
  )
  return True


def _seed(seed: int, name: str) -> int:
  """A component's shuffle seed: the run's for a single corpus, else one of its own."""
  if not name:
    return seed
  return int(np.random.SeedSequence([seed, zlib.crc32(name.encode())]).generate_state(1)[0])


def train_iterator(
  parts: dict[str, PackedRows],
  weights: dict[str, float],
  *,
  batch_size: int,
  seed: int,
  share: slice | None = None,
  workers: int = 0,
) -> grain.DatasetIterator:
  """Endless global batches of rows, drawn from the components in proportion to their weights
  (each shuffled by its own seed, reshuffled each epoch); this process reads its share only."""
  names = list(parts)
  for name, rows in parts.items():
    if len(rows) == 0:
      raise UserError(
        f"The prepared training data{f' of {name!r}' if name else ''} has fewer than a row of "
        f"{rows.row_len} tokens: prepare more text or lower data.seq_len."
      )
  streams = [
    grain.MapDataset.range(len(parts[n]))
    .shuffle(seed=_seed(seed, n))
    .repeat()
    .map(functools.partial(lambda c, r: (c, r), c))
    for c, n in enumerate(names)
  ]
  ds = (
    streams[0] if len(streams) == 1 else grain.MapDataset.mix(streams, [weights[n] for n in names])
  )
  ds = ds.batch(batch_size, drop_remainder=True)
  share = pipeline.process_slice(batch_size, share)
  ds = ds.map(functools.partial(_read_share, parts=[parts[n] for n in names], share=share))
  # data.workers threads read the next batches ahead (NumPy's gathers release the GIL); none
  # reads in the trainer's thread. Explicit either way: grain's default reads 500 ahead.
  options = grain.ReadOptions(num_threads=workers, prefetch_buffer_size=2 * workers)
  return iter(ds.to_iter_dataset(options))


def _read_share(batch, *, parts: list[PackedRows], share: slice) -> dict:
  component_R, rows_R = (np.asarray(x)[share] for x in batch)
  if len(parts) == 1:
    return parts[0].read(rows_R)
  # Every batch has the same keys: where some component weighs its tokens (chat beside plain
  # text), the others' tokens weigh 1.
  weighted = any(p.split.weighted for p in parts)
  out = None
  for c in np.unique(component_R):
    here = component_R == c
    part = parts[c].read(rows_R[here])
    if weighted and "loss_weights" not in part:
      part["loss_weights"] = (part["segment_ids"] != 0).astype(np.float32)
    if out is None:
      out = {k: np.zeros((len(rows_R), *v.shape[1:]), v.dtype) for k, v in part.items()}
    for k, v in part.items():
      out[k][here] = v
  return out


def eval_batches(eval_rows, *, batch_size: int, max_batches: int = 0, share=None):
  """The held-out rows in order, the last batch padded with segment 0 (out of the loss); this
  process reads its share only."""
  share = pipeline.process_slice(batch_size, share)
  starts = range(0, len(eval_rows), batch_size)
  if max_batches:
    starts = list(starts)[:max_batches]
  for start in starts:
    index = np.arange(start, start + batch_size)[share]
    batch = eval_rows.read(np.minimum(index, len(eval_rows) - 1))
    past = index >= len(eval_rows)  # padding rows: nothing counts
    for k in batch:
      batch[k][past] = 0
    yield batch


# The data kind


def check(cfg):
  """The prepared corpora were tokenized by this experiment's tokenizer, within the model's
  vocabulary."""
  want = None
  for part in components(cfg.data):
    manifest = prepare.read_manifest(part.path)
    have = manifest["tokenizer"]
    if want is None:
      want = tokenizers.identity(cfg.data.tokenizer)
    if have != want:
      raise UserError(
        f"{part.path} was prepared with another tokenizer ({prepare._describe(have)}) than "
        f"data.tokenizer ({prepare._describe(want)}): prepare it again with this experiment, or "
        "set data.tokenizer to the one it was prepared with."
      )
    kinds.check_vocab(cfg, have["vocab_size"], f"{part.path} holds ids of a {{ids}}-id vocabulary")


def load(cfg, *, train: bool, batch_size: int, share: slice | None) -> kinds.Data:
  parts = components(cfg.data)
  row_len, fmt = cfg.data.seq_len + 1, cfg.data.get("format", "text")
  layout = dict(fmt=fmt, pairs_per_row=cfg.data.get("pairs_per_row", "one"))
  top_k = cfg.distill.top_k if reads_teacher(cfg) else 0

  def split_of(path, split):
    opened = Split(path, split)
    if top_k:
      opened.attach_teacher(top_k)
    return opened

  iterator = None
  if train:
    train_rows = {
      p.name: rows(split_of(p.path, "train"), row_len, pad_last=False, **layout) for p in parts
    }
    iterator = train_iterator(
      train_rows,
      {p.name: p.weight for p in parts},
      batch_size=batch_size,
      seed=cfg.seed,
      share=share,
      workers=cfg.data.workers,
    )
  held_out = {
    p.name: rows(split_of(p.path, "eval"), row_len, pad_last=True, **layout) for p in parts
  }
  held_out = {name: rows for name, rows in held_out.items() if len(rows)}
  if not held_out:
    held_out = None
  elif list(held_out) == [""]:
    held_out = held_out[""]
  return kinds.Data(iterator, held_out, eval_batches, cfg.data.seq_len)


# Teacher outputs (the distill task): each prepared token's top-k teacher log-probabilities


def _teacher_entry(shards: str, key: str) -> dict | None:
  path = os.path.join(shards, f"{key}.teacher.json")
  if not os.path.exists(path):
    return None
  with open(path) as f:
    return json.load(f)


def _source_sha(shards: str, key: str) -> str:
  with open(os.path.join(shards, f"{key}.json")) as f:
    return json.load(f)["source"]["sha256"]


def reads_teacher(cfg) -> bool:
  """Whether a run of `cfg` reads its teacher's outputs from its prepared data (`data.kind=
  "prepared"`, a distill run with distill.top_k, every source's outputs written for its rows'
  length and top_k); a directory with none: False (the teacher runs in the step); with some,
  or others: a UserError naming the fix."""
  if cfg.data.kind != "prepared" or "distill" not in cfg or not cfg.distill.top_k:
    return False
  from nnx_zoo.common.hub import weights

  row_len, top_k = cfg.data.seq_len + 1, int(cfg.distill.top_k)
  teacher = os.path.abspath(weights.locate(cfg.distill.teacher))
  found = set()
  for part in components(cfg.data):
    manifest = prepare.read_manifest(part.path)
    shards = os.path.join(part.path, "shards")
    for source in manifest["sources"]:
      entry = _teacher_entry(shards, source["key"])
      if entry is None:
        found.add(None)
        continue
      # Another teacher's, or outputs of tokens prepared again since: not this run's.
      same = entry["teacher"]["path"] == teacher and entry["source"] == _source_sha(
        shards, source["key"]
      )
      found.add((entry["row_len"], entry["top_k"], same))
  if found == {None}:
    return False
  if found != {(row_len, top_k, True)}:
    have = ", ".join(
      "none"
      if f is None
      else f"rows of {f[0]} tokens, top {f[1]}"
      + ("" if f[2] else ", of another teacher or older tokens")
      for f in sorted(found, key=str)
    )
    raise UserError(
      f"The prepared data's teacher outputs ({have}) are not all this run's (its teacher's, for "
      f"rows of seq_len + 1 = {row_len} tokens and distill.top_k={top_k}): rerun `zoo data "
      "prepare` with this experiment's settings."
    )
  return True


def write_teacher(
  out: str,
  *,
  row_len: int,
  top_k: int,
  teacher: dict,
  logps,
  batch_size: int,
  num_processes: int = 1,
  process_id: int = 0,
  progress: bool = True,
) -> dict:
  """Writes, beside each of this host's sources' tokens (`process_id` of `num_processes`, as
  `zoo data prepare` shares them), its teacher's top-k log-probabilities and ids of every token
  as the packed rows of `row_len` tokens give them: `logps(batch)` of rows {"tokens",
  "segment_ids"} [R, row_len] -> ([R, row_len, k] float32, ids). Files:

    shards/KEY.SPLIT.teacher_logps  float32 [tokens, k]: log-probability of each id
    shards/KEY.SPLIT.teacher_ids    uint32  [tokens, k]: the ids, most likely first
    shards/KEY.teacher.json         written last: the teacher, row_len, top_k, the source's hash

  A rerun skips the sources whose entry matches; every host's tokens must be prepared first (a
  row may cross into the next source)."""
  from tqdm import tqdm

  manifest = prepare.read_manifest(out)
  shards = os.path.join(out, "shards")
  splits = {s: Split(out, s) for s in prepare.SPLITS}
  mine = [s["key"] for s in manifest["sources"][process_id::num_processes]]
  todo = []
  for key in mine:
    want = {
      "teacher": teacher,
      "row_len": row_len,
      "top_k": top_k,
      "source": _source_sha(shards, key),
    }
    want = json.loads(json.dumps(want))  # as read back (tuples as lists)
    if _teacher_entry(shards, key) != want:
      todo.append((key, want))
  total = sum(
    len(sp.tokens[sp.keys.index(key)])
    for key, _ in todo
    for sp in splits.values()
    if key in sp.keys
  )
  bar = tqdm(total=total, unit="tok", unit_scale=True, disable=not progress, desc="teacher")
  written = 0
  try:
    for key, want in todo:
      for name, sp in splits.items():
        if key not in sp.keys:
          continue
        i = sp.keys.index(key)
        start, end = int(sp.starts[i]), int(sp.starts[i + 1])
        packed = PackedRows(sp, row_len, pad_last=True)
        paths = {k: os.path.join(shards, f"{key}.{name}.teacher_{k}") for k in ("logps", "ids")}
        with open(paths["logps"] + ".tmp", "wb") as fl, open(paths["ids"] + ".tmp", "wb") as fi:
          first, last = start // row_len, -(-end // row_len)
          for r in range(first, last, batch_size):
            index = np.arange(r, r + batch_size)
            batch = packed.read(np.minimum(index, last - 1))
            lp, ids = logps({k: batch[k] for k in ("tokens", "segment_ids")})
            pos = (index[:, None] * row_len + np.arange(row_len)).ravel()
            keep = (pos >= start) & (pos < end) & (np.repeat(index, row_len) < last)
            lp, ids = lp.reshape(-1, top_k)[keep], ids.reshape(-1, top_k)[keep]
            lp.astype(np.float32).tofile(fl)
            ids.astype(np.uint32).tofile(fi)
            bar.update(int(keep.sum()))
        for p in paths.values():
          os.replace(p + ".tmp", p)
        written += end - start
      with files.replacing(os.path.join(shards, f"{key}.teacher.json")) as tmp, open(tmp, "w") as f:
        json.dump(want, f, indent=1)
  finally:
    bar.close()
  return {"teacher_sources": len(todo), "teacher_tokens": written, "teacher_top_k": top_k}


kinds.register(kinds.Kind("prepared", load, check))
