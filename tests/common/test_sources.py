"""common/data/sources.py: documents and records of every format, bad input, expand, fingerprint."""

import gzip
import hashlib
import json
import os
import re
from pathlib import Path

import pyarrow as pa
import pyarrow.ipc
import pyarrow.parquet as pq
import pytest

from nnx_zoo.common.data import sources
from nnx_zoo.common.errors import UserError

DOCS = ["one", "two\nlines", "thrée 東京", "", "last"]


def write_jsonl(path, rows, opener=open):
  with opener(path, "wt", encoding="utf-8") as f:
    for row in rows:
      f.write(json.dumps(row, ensure_ascii=False) + "\n")
  return str(path)


def write_dataset_dir(path, columns: dict, *, shards: int = 2) -> str:
  """The layout of datasets' save_to_disk, built with pyarrow: Arrow IPC streams in shards."""
  os.makedirs(path)
  table = pa.table(columns)
  n = table.num_rows
  cuts = [n * i // shards for i in range(shards + 1)]
  names = [f"data-{i:05d}-of-{shards:05d}.arrow" for i in range(shards)]
  for name, start, stop in zip(names, cuts[:-1], cuts[1:], strict=True):
    sink = pa.OSFile(os.path.join(path, name), "wb")
    with sink, pa.ipc.new_stream(sink, table.schema) as writer:
      # Several batches a shard, as datasets writes them (1000 rows each by default).
      for batch in table.slice(start, stop - start).to_batches(max_chunksize=2):
        writer.write_batch(batch)
  state = {"_data_files": [{"filename": name} for name in names], "_split": None}
  with open(os.path.join(path, "state.json"), "w") as f:
    json.dump(state, f)
  with open(os.path.join(path, "dataset_info.json"), "w") as f:
    json.dump({"features": {k: {"dtype": "string", "_type": "Value"} for k in columns}}, f)
  return str(path)


def raises(fn, *substrings):
  """Runs fn (draining a generator) and checks the UserError names every substring."""
  with pytest.raises(UserError) as e:
    result = fn()
    if hasattr(result, "__next__"):
      list(result)
  for s in substrings:
    assert s in str(e.value), (s, str(e.value))
  return str(e.value)


# Formats


def test_txt_is_one_document(tmp_path):
  path = tmp_path / "a.txt"
  path.write_text("whole\nfile é\n", encoding="utf-8")
  assert list(sources.documents(str(path))) == ["whole\nfile é\n"]
  assert list(sources.records(str(path), text_field="body")) == [{"body": "whole\nfile é\n"}]


def test_jsonl_documents_and_records_in_order(tmp_path):
  rows = [{"text": d, "id": i} for i, d in enumerate(DOCS)]
  path = write_jsonl(tmp_path / "a.jsonl", rows)
  assert list(sources.documents(path)) == DOCS
  assert list(sources.records(path)) == rows


def test_jsonl_skips_blank_lines_and_reads_a_bom_crlf_and_spaces(tmp_path):
  path = tmp_path / "a.jsonl"
  path.write_bytes(
    b'\xef\xbb\xbf{"text": "a"}\r\n\n   \n  {"text": "b"}  \n{"body": 1, "text": "c"}'
  )
  assert list(sources.documents(str(path))) == ["a", "b", "c"]


def test_jsonl_other_text_field(tmp_path):
  path = write_jsonl(tmp_path / "a.jsonl", [{"body": "x"}, {"body": "y"}])
  assert list(sources.documents(path, text_field="body")) == ["x", "y"]


def test_jsonl_gz(tmp_path):
  rows = [{"text": d} for d in DOCS]
  path = write_jsonl(tmp_path / "a.jsonl.gz", rows, opener=gzip.open)
  assert list(sources.documents(path)) == DOCS
  assert list(sources.records(path)) == rows


def test_parquet_with_several_row_groups_reads_only_the_text_column(tmp_path):
  path = str(tmp_path / "a.parquet")
  texts = [f"document {i}" for i in range(2500)]  # more rows than one batch holds
  table = pa.table({"id": list(range(len(texts))), "text": texts})
  pq.write_table(table, path, row_group_size=700)
  assert pq.ParquetFile(path).num_row_groups == 4
  assert list(sources.documents(path)) == texts
  records = list(sources.records(path))
  assert records[:2] == [{"id": 0, "text": "document 0"}, {"id": 1, "text": "document 1"}]
  assert len(records) == len(texts)
  # A column documents() does not read may hold anything, even what no string reader could.
  pq.write_table(pa.table({"text": ["a", "b"], "blob": [b"\0\xff", None]}), path)
  assert list(sources.documents(path)) == ["a", "b"]


def test_parquet_large_and_dictionary_strings(tmp_path):
  path = str(tmp_path / "a.parquet")
  pq.write_table(pa.table({"text": pa.array(["x", "y"], pa.large_string())}), path)
  assert list(sources.documents(path)) == ["x", "y"]
  pq.write_table(pa.table({"text": pa.array(["x", "y", "x"]).dictionary_encode()}), path)
  assert list(sources.documents(path)) == ["x", "y", "x"]


def test_dataset_dir_built_with_pyarrow(tmp_path):
  path = write_dataset_dir(tmp_path / "ds", {"text": DOCS, "lang": ["en"] * len(DOCS)})
  assert list(sources.documents(path)) == DOCS
  assert list(sources.records(path))[2] == {"text": "thrée 東京", "lang": "en"}


def test_dataset_dir_reads_files_in_state_json_order(tmp_path):
  path = write_dataset_dir(tmp_path / "ds", {"text": ["a", "b", "c", "d"]}, shards=2)
  state_path = os.path.join(path, "state.json")
  with open(state_path) as f:
    state = json.load(f)
  state["_data_files"].reverse()
  with open(state_path, "w") as f:
    json.dump(state, f)
  assert list(sources.documents(path)) == ["c", "d", "a", "b"]


def test_dataset_dir_written_by_datasets(tmp_path):
  datasets = pytest.importorskip("datasets")
  texts = [f"row {i} {d}" for i, d in enumerate(DOCS * 3)]
  ds = datasets.Dataset.from_dict({"text": texts, "n": list(range(len(texts)))})
  ds.save_to_disk(str(tmp_path / "ds"), num_shards=3)
  path = str(tmp_path / "ds")
  assert len([f for f in os.listdir(path) if f.endswith(".arrow")]) == 3
  assert list(sources.documents(path)) == texts
  assert list(sources.records(path))[4] == {"text": texts[4], "n": 4}
  assert sources.expand(str(tmp_path / "**")) == [path]
  datasets.DatasetDict({"train": ds, "test": ds}).save_to_disk(str(tmp_path / "dd"))
  raises(lambda: sources.documents(str(tmp_path / "dd")), "train", "test", "DIR/<split>")
  assert list(sources.documents(str(tmp_path / "dd" / "test"))) == texts


# Bad input


def test_txt_with_nul_bytes_or_not_utf8(tmp_path):
  path = tmp_path / "a.txt"
  path.write_bytes(b"abc\0def")
  raises(lambda: sources.documents(str(path)), str(path), "not a text file")
  path.write_bytes("caf\xe9".encode("latin-1"))
  raises(lambda: sources.documents(str(path)), str(path), "UTF-8")


def test_jsonl_bad_line_names_file_and_line(tmp_path):
  path = tmp_path / "a.jsonl"
  path.write_text('{"text": "ok"}\n\n{"text": \n', encoding="utf-8")
  raises(lambda: sources.documents(str(path)), f"{path}:3", "not JSON")
  path.write_text('{"text": "ok"} trailing\n', encoding="utf-8")
  raises(lambda: sources.documents(str(path)), f"{path}:1", "Extra data")
  path.write_text('{"text": "ok"}\n["text"]\n', encoding="utf-8")
  raises(lambda: sources.records(str(path)), f"{path}:2", "an array, not an object")
  path.write_bytes(b'{"text": "ok"}\n{"text": "caf\xe9"}\n')
  raises(lambda: sources.documents(str(path)), f"{path}:2", "UTF-8")


def test_jsonl_missing_field_names_file_line_field_and_key(tmp_path):
  path = write_jsonl(tmp_path / "a.jsonl", [{"text": "ok"}, {"content": "x"}])
  message = raises(lambda: sources.documents(path), f"{path}:2", "'text'", "data.text_field")
  assert "'content'" in message  # the fields it does have
  raises(lambda: sources.records(path), f"{path}:2", "'text'")


def test_non_string_text_names_file_and_record(tmp_path):
  path = write_jsonl(tmp_path / "a.jsonl", [{"text": "ok"}, {"text": None}])
  raises(lambda: sources.documents(path), f"{path}:2", "'text' is null, not a string")
  path = write_jsonl(tmp_path / "b.jsonl", [{"text": 5}])
  raises(lambda: sources.documents(path), f"{path}:1", "a number")
  parquet = str(tmp_path / "a.parquet")
  pq.write_table(pa.table({"text": ["a", "b", None]}), parquet)
  raises(lambda: sources.documents(parquet), parquet, "row 2", "null")
  pq.write_table(pa.table({"text": [1, 2]}), parquet)
  raises(lambda: sources.documents(parquet), parquet, "row 0", "int64", "data.text_field")


def test_jsonl_gz_truncated_or_not_gzip(tmp_path):
  rows = [{"text": os.urandom(1000).hex()} for _ in range(20)]
  good = write_jsonl(tmp_path / "a.jsonl.gz", rows, opener=gzip.open)
  path = tmp_path / "b.jsonl.gz"
  data = Path(good).read_bytes()
  path.write_bytes(data[: len(data) // 2])
  raises(lambda: sources.documents(str(path)), str(path), "gzip")
  path.write_text('{"text": "plain"}\n', encoding="utf-8")
  raises(lambda: sources.documents(str(path)), str(path), "gzip")


def test_parquet_without_the_column_names_its_columns(tmp_path):
  path = str(tmp_path / "a.parquet")
  pq.write_table(pa.table({"body": ["a"], "id": [1]}), path)
  message = raises(lambda: sources.documents(path), path, "'text'", "data.text_field")
  assert "['body', 'id']" in message
  raises(lambda: sources.records(path), path, "'body'")


def test_not_a_parquet_file(tmp_path):
  path = tmp_path / "a.parquet"
  path.write_text("not parquet", encoding="utf-8")
  raises(lambda: sources.documents(str(path)), str(path), "Parquet")


def test_dataset_dir_without_the_column_or_a_data_file(tmp_path):
  path = write_dataset_dir(tmp_path / "ds", {"body": ["a", "b"], "id": ["1", "2"]})
  message = raises(lambda: sources.documents(path), path, "'text'", "data.text_field")
  assert "['body', 'id']" in message
  os.remove(os.path.join(path, "data-00001-of-00002.arrow"))
  raises(lambda: sources.documents(path, text_field="body"), "data-00001-of-00002.arrow")


def test_dataset_dict_names_its_splits(tmp_path):
  root = tmp_path / "dd"
  for split in ("train", "validation"):
    write_dataset_dir(root / split, {"text": [split]})
  (root / "dataset_dict.json").write_text('{"splits": ["train", "validation"]}')
  message = raises(lambda: sources.documents(str(root)), str(root), "DIR/<split>")
  assert "'train'" in message and "'validation'" in message
  raises(lambda: sources.expand(str(root)), "DIR/<split>")
  raises(lambda: sources.expand(str(tmp_path / "*")), "DIR/<split>")  # a glob would mix them
  assert list(sources.documents(str(root / "validation"))) == ["validation"]


def test_other_extensions_are_text_documents_and_arrow_files_name_their_directory(tmp_path):
  path = tmp_path / "notes.md"
  path.write_text("# a heading\nsome text\n", encoding="utf-8")
  assert sources.expand(str(tmp_path / "*.md")) == [str(path)]
  assert list(sources.documents(str(path))) == ["# a heading\nsome text\n"]
  binary = tmp_path / "archive.gz"
  binary.write_bytes(b"\x1f\x8b\x08\x00\x00binary")
  raises(lambda: list(sources.documents(str(binary))), str(binary))
  arrow = write_dataset_dir(tmp_path / "ds", {"text": ["a"]}, shards=1)
  raises(lambda: sources.records(os.path.join(arrow, "data-00000-of-00001.arrow")), "directory")


def test_plain_directory_named_directly(tmp_path):
  (tmp_path / "d").mkdir()
  raises(lambda: sources.expand(str(tmp_path / "d")), "not a datasets save_to_disk directory")
  raises(lambda: sources.documents(str(tmp_path / "d")), "save_to_disk")


# expand


def touch(path, text="x"):
  os.makedirs(os.path.dirname(path), exist_ok=True)
  with open(path, "w", encoding="utf-8") as f:
    f.write(text)
  return str(path)


def test_expand_globs_comma_lists_and_recursion(tmp_path):
  b, a = touch(tmp_path / "b.txt"), touch(tmp_path / "a.txt")
  deep = touch(tmp_path / "sub" / "deeper" / "c.jsonl")
  p = touch(tmp_path / "sub" / "d.parquet")
  assert sources.expand(str(tmp_path / "*.txt")) == [a, b]
  # Patterns keep their order; each one's matches are sorted; a source is kept once.
  assert sources.expand(f"{b}, {tmp_path / '*.txt'}") == [b, a]
  # ** descends, and skips the plain folders it matches.
  assert sources.expand(str(tmp_path / "**")) == [a, b, p, deep]
  assert sources.expand(str(tmp_path / "**" / "*.jsonl")) == [deep]
  ds = write_dataset_dir(tmp_path / "sub" / "ds", {"text": ["a"]})
  assert sources.expand(str(tmp_path / "sub" / "**")) == [p, deep, ds]  # not the ds's files
  assert sources.expand(ds + os.sep) == [ds]


def test_expand_expands_home(tmp_path, monkeypatch):
  monkeypatch.setenv("HOME", str(tmp_path))
  a = touch(tmp_path / "corpus" / "a.txt")
  assert sources.expand("~/corpus/*.txt") == [a]


def test_expand_nothing_matched_or_given(tmp_path):
  touch(tmp_path / "a.txt")
  pattern = str(tmp_path / "*.jsonl")
  with pytest.raises(UserError, match=re.escape(f"No data file matches {pattern!r}")) as e:
    sources.expand(f"{tmp_path / 'a.txt'},{pattern}", key="data.eval_files")
  assert "(data.eval_files)" in str(e.value)
  with pytest.raises(UserError, match="No data files given"):
    sources.expand(" , ")


# fingerprint


def test_fingerprint_follows_content(tmp_path):
  a = touch(tmp_path / "a.jsonl", '{"text": "x"}\n')
  b = touch(tmp_path / "b.jsonl", '{"text": "x"}\n')
  fa, fb = sources.fingerprint(a), sources.fingerprint(b)
  assert fa["sha256"] == fb["sha256"] == hashlib.sha256(b'{"text": "x"}\n').hexdigest()
  assert fa["path"] == os.path.abspath(a) and fa["bytes"] == 14
  assert fa["mtime_ns"] == os.stat(a).st_mtime_ns
  assert sources.stat(a) == {k: fa[k] for k in ("path", "bytes", "mtime_ns")}
  touch(a, '{"text": "y"}\n')  # same size
  assert sources.fingerprint(a)["sha256"] != fb["sha256"]


def test_fingerprint_streams_in_blocks(tmp_path, monkeypatch):
  monkeypatch.setattr(sources, "_HASH_BLOCK", 7)
  data = os.urandom(100)
  path = tmp_path / "a.parquet"
  path.write_bytes(data)
  assert sources.fingerprint(str(path))["sha256"] == hashlib.sha256(data).hexdigest()


def test_fingerprint_of_a_dataset_dir_covers_its_data_files_in_order(tmp_path):
  one = write_dataset_dir(tmp_path / "one", {"text": ["a", "b", "c"]})
  two = write_dataset_dir(tmp_path / "two", {"text": ["a", "b", "c"]})
  f1, f2 = sources.fingerprint(one), sources.fingerprint(two)
  assert f1["sha256"] == f2["sha256"] and f1["path"] != f2["path"]
  files = [os.path.join(one, f"data-0000{i}-of-00002.arrow") for i in range(2)]
  whole = hashlib.sha256(b"".join(Path(f).read_bytes() for f in files)).hexdigest()
  assert f1["sha256"] == whole
  assert f1["bytes"] == sum(os.path.getsize(f) for f in files)
  assert f1["mtime_ns"] == max(os.stat(f).st_mtime_ns for f in files)
  assert sources.stat(one)["bytes"] == f1["bytes"]
  three = write_dataset_dir(tmp_path / "three", {"text": ["a", "b", "C"]})
  assert sources.fingerprint(three)["sha256"] != f1["sha256"]
