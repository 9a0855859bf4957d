"""Corpus sources: the records and documents of text, JSONL, Parquet and datasets files, streamed.

A source is one file (`.jsonl`, `.jsonl.gz`, `.parquet`; any other is one text document) or one
directory written by Hugging Face datasets' `Dataset.save_to_disk`. Every reader goes file by
file, line by line or batch by batch, so memory holds one batch (or one text document), never
the corpus. Bad input
is a UserError naming the file, the line or row, and the fix.
"""

import glob
import gzip
import hashlib
import io
import json
import os
import zlib
from collections.abc import Iterator

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.ipc
import pyarrow.parquet as pq

from nnx_zoo.common.errors import UserError

# Any file of another extension is read as one text document (and refused if it is not text).
FORMATS = (".txt", ".jsonl", ".jsonl.gz", ".parquet", "a datasets save_to_disk directory")

# Rows a Parquet batch holds: the column of one batch is what sits in memory, and documents can
# be long (a 100 kB document x 1024 rows = 100 MB), so far fewer than pyarrow's 65536.
_PARQUET_BATCH_ROWS = 1024
_HASH_BLOCK = 1 << 20
_READ_BUFFER = 1 << 20


# Sources


def _is_dataset_dir(path: str) -> bool:
  return os.path.isfile(os.path.join(path, "state.json"))


def _is_dataset_dict(path: str) -> bool:
  return os.path.isfile(os.path.join(path, "dataset_dict.json"))


def _dataset_dict_error(path: str) -> UserError:
  try:
    with open(os.path.join(path, "dataset_dict.json"), encoding="utf-8") as f:
      splits = list(json.load(f)["splits"])
  except (OSError, ValueError, KeyError, TypeError):
    splits = sorted(d for d in os.listdir(path) if _is_dataset_dir(os.path.join(path, d)))
  example = os.path.join(path, splits[0] if splits else "train")
  return UserError(
    f"{path} is a datasets DatasetDict with the splits {splits}: point at one split's "
    f"directory, DIR/<split> (e.g. {example})."
  )


def _kind(source: str) -> str:
  """Which reader a source needs: txt, jsonl, jsonl.gz, parquet or dataset (a directory)."""
  if os.path.isdir(source):
    if _is_dataset_dict(source):
      raise _dataset_dict_error(source)
    if not _is_dataset_dir(source):
      raise UserError(
        f"{source} is a directory but not a datasets save_to_disk directory (it has no "
        f"state.json): point at the files in it instead, e.g. '{os.path.join(source, '*.jsonl')}'"
        f" or '{os.path.join(source, '**', '*.parquet')}'."
      )
    return "dataset"
  if not os.path.exists(source):
    raise UserError(f"{source} does not exist: check the path of the data source.")
  name = source.lower()
  for ext in (".jsonl.gz", ".jsonl", ".parquet"):
    if name.endswith(ext):
      return ext[1:]
  if name.endswith(".arrow"):
    raise UserError(
      f"{source} is read as part of the datasets save_to_disk directory that holds it: point at "
      "that directory."
    )
  return "txt"  # any other file is one text document (`.txt`, `.md`, source code, ...)


def expand(patterns: str, *, key: str = "data.train_files") -> list[str]:
  """Comma-separated paths or globs (`~` expanded, `**` recursive) -> the sources they name.

  Each pattern's matches are sorted, and the patterns keep the order given; a source matched
  twice is kept once. A glob skips plain directories (`**` matches every folder) and the files
  inside a save_to_disk directory it also matched; a directory named directly must be a
  save_to_disk directory. Every source's format is checked here, before any is read."""
  sources, seen = [], set()
  for pattern in [p.strip() for p in patterns.split(",") if p.strip()]:
    path = os.path.expanduser(pattern)
    is_glob = glob.escape(path) != path
    matched = []
    for m in sorted(glob.glob(path, recursive=True)):
      m = m.rstrip(os.sep) or m
      if os.path.isdir(m) and is_glob and not _is_dataset_dir(m):
        if _is_dataset_dict(m):  # a glob over a DatasetDict would mix its splits
          raise _dataset_dict_error(m)
        continue
      matched.append(m)
    dirs = [m + os.sep for m in matched if os.path.isdir(m)]
    matched = [m for m in matched if not any(m.startswith(d) for d in dirs)]
    for m in matched:
      _kind(m)
    if not matched:
      raise UserError(f"No data file matches {pattern!r}: check the path ({key}).")
    for m in matched:
      if os.path.abspath(m) not in seen:
        seen.add(os.path.abspath(m))
        sources.append(m)
  if not sources:
    raise UserError("No data files given: set --config.data.train_files=PATH_OR_GLOB.")
  return sources


# Text and JSONL


def _text(path: str) -> str:
  try:
    with open(path, encoding="utf-8") as f:
      text = f.read()
  except UnicodeDecodeError as e:
    raise UserError(
      f"{path} is not a UTF-8 text file ({e.reason} at byte {e.start}): convert it to UTF-8 "
      "(e.g. `iconv -t UTF-8`) or leave it out of the data files."
    ) from None
  if "\0" in text:  # valid UTF-8 but binary (an archive, an array, a model file)
    raise UserError(
      f"{path} is not a text file (it holds NUL bytes): a .txt source must be UTF-8 text; "
      "leave it out of the data files."
    )
  return text


# json.loads is this scanner behind two Python-level calls and a regex, which cost as much as the
# parsing on short lines: the readers call it directly (1.6x the documents/s of json.loads on
# 200-byte lines) and leave anything irregular to json.loads, which parses leading whitespace
# the same way and raises the same error otherwise.
_scan = json.JSONDecoder().scan_once
_JSON_SPACE = " \t\n\r"
_JSON_TYPES = {dict: "an object", list: "an array", str: "a string", int: "a number"}


def _json_type(value) -> str:
  """What a parsed JSON value was, in JSON's words: 'an array', 'a number', 'null', ..."""
  if value is None or type(value) is bool:
    return json.dumps(value)
  return _JSON_TYPES.get(type(value), "a number")  # float: the one type left


def _open_lines(path: str) -> io.BufferedReader:
  # A 1 MiB buffer: 1.25x the lines/s of gzip's own 8 kB one.
  if path.lower().endswith(".gz"):
    return io.BufferedReader(gzip.open(path, "rb"), _READ_BUFFER)
  return open(path, "rb", buffering=_READ_BUFFER)


def _jsonl(path: str, text_field: str) -> Iterator[tuple[int, dict]]:
  """(line number, record) for each non-blank line; each record has `text_field`."""
  scan, loads, space = _scan, json.loads, _JSON_SPACE
  n = 0
  try:
    with _open_lines(path) as f:
      # Bytes split on b"\n" only (text mode would also split on \r, \x1c, ...), decoded here
      # so that a bad byte names its line.
      for n, line in enumerate(f, 1):
        if line.isspace():
          continue
        try:
          text = line.decode("utf-8-sig" if n == 1 else "utf-8")
          try:
            record, end = scan(text, 0)
            if text[end:].strip(space):
              record = loads(text)  # raises "Extra data"
          except (StopIteration, ValueError):
            record = loads(text)
        except UnicodeDecodeError as e:
          raise UserError(
            f"{path}:{n} is not UTF-8 ({e.reason} at byte {e.start} of the line): convert the "
            "file to UTF-8."
          ) from None
        except json.JSONDecodeError as e:
          raise UserError(
            f"{path}:{n} is not JSON ({e.msg}, column {e.colno}): a .jsonl file holds one JSON "
            "object a line."
          ) from None
        if type(record) is not dict:
          raise UserError(
            f"{path}:{n} is {_json_type(record)}, not an object: a .jsonl file holds "
            "one JSON object a line."
          )
        if text_field not in record:
          keys = ", ".join(repr(k) for k in list(record)[:10])
          raise UserError(
            f"{path}:{n} has no field {text_field!r} (its fields: {keys}): set data.text_field "
            "to the field that holds the text."
          )
        yield n, record
  except (EOFError, zlib.error, gzip.BadGzipFile) as e:
    raise UserError(
      f"{path} is not a whole gzip file (line {n + 1}: {e}): compress it again with gzip."
    ) from None


# Parquet and datasets directories


def _missing_column(path: str, names: list[str], text_field: str) -> UserError:
  return UserError(
    f"{path} has no column {text_field!r} (its columns: {names}): set data.text_field to the "
    "column that holds the text."
  )


def _parquet(path: str, text_field: str, columns: list[str] | None) -> Iterator[pa.RecordBatch]:
  try:
    # pyarrow's pre-buffering reads row groups ahead without bound (133 MB held in Arrow
    # buffers for a 130 MB file, 8 MB without it and with a 1 MiB read buffer).
    with pq.ParquetFile(path, pre_buffer=False, buffer_size=_READ_BUFFER) as file:
      names = file.schema_arrow.names
      if text_field not in names:
        raise _missing_column(path, names, text_field)
      yield from file.iter_batches(batch_size=_PARQUET_BATCH_ROWS, columns=columns)
  except (pa.ArrowException, OSError) as e:
    raise UserError(
      f"{path} is not a readable Parquet file ({e}): write it again (pyarrow.parquet, pandas' "
      "to_parquet) or leave it out of the data files."
    ) from None


def _arrow_files(path: str) -> list[str]:
  """The data files of a save_to_disk directory, in state.json's order."""
  state = os.path.join(path, "state.json")
  try:
    with open(state, encoding="utf-8") as f:
      files = [os.path.join(path, d["filename"]) for d in json.load(f)["_data_files"]]
  except (ValueError, KeyError, TypeError) as e:
    raise UserError(
      f"{state} does not list the data files (_data_files with filename: {type(e).__name__} "
      f"{e}): write the directory again with datasets' Dataset.save_to_disk."
    ) from None
  missing = [os.path.basename(f) for f in files if not os.path.isfile(f)]
  if missing:
    raise UserError(
      f"{path} lacks data files its state.json lists: {missing}: copy the whole directory, or "
      "write it again with datasets' Dataset.save_to_disk."
    )
  return files


def _dataset(path: str, text_field: str, columns: list[str] | None) -> Iterator[pa.RecordBatch]:
  for file in _arrow_files(path):
    try:
      # Read, not memory-mapped: a map's pages count in the process's memory until the file is
      # closed (386 MB for a 400 MB shard, 14 MB read batch by batch, at the same speed).
      with pa.OSFile(file) as source, pyarrow.ipc.open_stream(source) as reader:
        names = reader.schema.names
        if text_field not in names:
          raise _missing_column(path, names, text_field)
        for batch in reader:
          yield batch if columns is None else batch.select(columns)
    except (pa.ArrowException, OSError) as e:
      raise UserError(
        f"{file} is not an Arrow IPC stream ({e}): write the directory again with datasets' "
        "Dataset.save_to_disk."
      ) from None


def _batches(
  source: str, kind: str, text_field: str, columns: list[str] | None
) -> Iterator[pa.RecordBatch]:
  read = _parquet if kind == "parquet" else _dataset
  return read(source, text_field, columns)


def _is_text(t: pa.DataType) -> bool:
  return pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_string_view(t)


# Records and documents


def records(source: str, *, text_field: str = "text") -> Iterator[dict]:
  """Every record of a source as a dict, in order: a `.txt` file is one `{text_field: text}`,
  a JSONL line its object, a Parquet or datasets row its columns. Every record must have
  `text_field` (the chat and preference readers name their own: `messages`, `prompt`)."""
  kind = _kind(source)
  if kind == "txt":
    yield {text_field: _text(source)}
  elif kind in ("jsonl", "jsonl.gz"):
    for _, record in _jsonl(source, text_field):
      yield record
  else:
    for batch in _batches(source, kind, text_field, None):
      yield from batch.to_pylist()


def documents(source: str, *, text_field: str = "text") -> Iterator[str]:
  """The text of each record of a source, in order; Parquet and datasets sources read only the
  `text_field` column."""
  kind = _kind(source)
  if kind == "txt":
    yield _text(source)
    return
  if kind in ("jsonl", "jsonl.gz"):
    for n, record in _jsonl(source, text_field):
      text = record[text_field]
      if type(text) is not str:
        raise UserError(
          f"{source}:{n}: {text_field!r} is {_json_type(text)}, not a string: set "
          "data.text_field to the field that holds the text."
        )
      yield text
    return
  row = 0  # counted from 0, as datasets' ds[i] and pandas' iloc count
  for batch in _batches(source, kind, text_field, [text_field]):
    column = batch.column(0)
    if pa.types.is_dictionary(column.type) and _is_text(column.type.value_type):
      column = column.dictionary_decode()
    if not _is_text(column.type):
      raise UserError(
        f"{source} row {row}: column {text_field!r} holds {column.type}, not strings: set "
        "data.text_field to the column that holds the text."
      )
    if column.null_count:
      at = row + pc.index(column.is_null(), True).as_py()
      raise UserError(
        f"{source} row {at}: {text_field!r} is null, not a string: drop the rows without text."
      )
    yield from column.to_pylist()
    row += len(column)


# Fingerprints


def _data_files(source: str) -> list[str]:
  return _arrow_files(source) if _kind(source) == "dataset" else [source]


def stat(source: str) -> dict:
  """`fingerprint` without the hash, from the file system alone: the cheap first look at whether
  a source changed (its absolute path, size in bytes and newest modification time)."""
  size, mtime_ns = 0, 0
  for file in _data_files(source):
    st = os.stat(file)
    size, mtime_ns = size + st.st_size, max(mtime_ns, st.st_mtime_ns)
  return {"path": os.path.abspath(source), "bytes": size, "mtime_ns": mtime_ns}


def fingerprint(source: str) -> dict:
  """What tells whether a source changed since it was prepared: `stat`'s path, size and newest
  modification time, and the SHA-256 of its content (of a directory's data files, in order; of
  a file, what `sha256sum` prints)."""
  digest = hashlib.sha256()
  buffer = bytearray(_HASH_BLOCK)
  view = memoryview(buffer)
  for file in _data_files(source):
    with open(file, "rb") as f:
      while n := f.readinto(buffer):
        digest.update(view[:n])
  return {**stat(source), "sha256": digest.hexdigest()}
