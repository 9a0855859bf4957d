"""common/data.py: packing, documents (Shakespeare by play, text and JSONL files), iterators."""

import json
import re

import numpy as np
import pytest

from nnx_zoo.common.data import pipeline, tokenizers
from nnx_zoo.common.errors import UserError

# Packing


def test_pack_concatenates_with_segment_ids_and_continues_long_documents():
  docs = [np.array([1, 2, 3]), np.array([4, 5]), np.array([6, 7, 8, 9, 10, 11])]
  packed = pipeline.pack(docs, 4, pad_last=False)
  # 11 tokens -> 2 full rows; the third document starts in row 0 and continues into row 1.
  np.testing.assert_array_equal(packed["tokens"], [[1, 2, 3, 4], [5, 6, 7, 8]])
  np.testing.assert_array_equal(packed["segment_ids"], [[1, 1, 1, 2], [2, 3, 3, 3]])
  assert packed["tokens"].dtype == np.int32 and packed["segment_ids"].dtype == np.int32


def test_pack_pad_last_pads_with_segment_zero():
  docs = [np.array([1, 2, 3]), np.array([4, 5]), np.array([6, 7, 8, 9, 10, 11])]
  packed = pipeline.pack(docs, 4, pad_last=True)
  np.testing.assert_array_equal(packed["tokens"], [[1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 0]])
  np.testing.assert_array_equal(packed["segment_ids"], [[1, 1, 1, 2], [2, 3, 3, 3], [3, 3, 3, 0]])
  # An exact multiple of the row length gets no padding row.
  exact = pipeline.pack([np.arange(1, 9)], 4, pad_last=True)
  assert exact["tokens"].shape == (2, 4) and (exact["segment_ids"] == 1).all()


def test_rows_have_a_stable_repr():
  packed = pipeline.pack([np.arange(12)], 4, pad_last=False)
  a, b = pipeline.Rows(packed, "files:train:3"), pipeline.Rows(dict(packed), "files:train:3")
  assert repr(a) == repr(b) == "Rows(files:train:3, 3)"
  assert "0x" not in repr(a)  # no object address: grain keys the iterator state on it
  assert len(a) == 3
  np.testing.assert_array_equal(a[1]["tokens"], [4, 5, 6, 7])


# Documents: Shakespeare, held out by play


def test_shakespeare_split_by_play():
  plays = pipeline.shakespeare_plays()
  assert len(plays) == 42 and "hamlet" in plays
  cfg = pipeline.config(kind="shakespeare", eval_plays="hamlet, twelfth_night")
  train, held_out = pipeline.documents(cfg, "train"), pipeline.documents(cfg, "eval")
  assert held_out == pipeline.read_shakespeare(["hamlet", "twelfth_night"])
  assert len(train) == len(plays) - 2
  assert not set(held_out) & set(train)  # a held-out play never reaches training
  others = [p for p in plays if p not in ("hamlet", "twelfth_night")]
  assert train == pipeline.read_shakespeare(others)


def test_shakespeare_without_held_out_plays_has_no_eval_split():
  cfg = pipeline.config(kind="shakespeare", eval_plays="")
  assert pipeline.documents(cfg, "eval") == []
  assert pipeline.load_split(cfg, "eval") is None


def test_shakespeare_unknown_play_is_a_user_error():
  cfg = pipeline.config(kind="shakespeare", eval_plays="hamlet,hamlett")
  with pytest.raises(UserError, match="hamlett"):
    pipeline.documents(cfg, "train")


def test_unknown_kind_and_keys_are_user_errors():
  with pytest.raises(UserError, match="parquet"):
    pipeline.documents(pipeline.config(kind="parquet"), "train")
  with pytest.raises(UserError, match="seq_length"):
    pipeline.config(seq_length=8)


# Documents: files


def files_cfg(train_files, eval_files="", text_field="text"):
  return pipeline.config(
    kind="files", train_files=str(train_files), eval_files=str(eval_files), text_field=text_field
  )


def test_text_files_are_one_document_each(tmp_path):
  (tmp_path / "b.txt").write_text("second\nfile\n", encoding="utf-8")
  (tmp_path / "a.txt").write_text("first file: é 世界", encoding="utf-8")
  docs = pipeline.documents(files_cfg(tmp_path / "*.txt"), "train")
  assert docs == ["first file: é 世界", "second\nfile\n"]  # sorted by path


def test_jsonl_is_one_document_per_line(tmp_path):
  path = tmp_path / "d.jsonl"
  lines = [{"text": "one", "id": 1}, {"text": "two\nlines"}, {"text": "thrée"}]
  path.write_text("\n".join(json.dumps(r) for r in lines) + "\n\n", encoding="utf-8")
  (tmp_path / "e.txt").write_text("held out", encoding="utf-8")
  cfg = files_cfg(path, eval_files=tmp_path / "e.txt")
  assert pipeline.documents(cfg, "train") == ["one", "two\nlines", "thrée"]
  assert pipeline.documents(cfg, "eval") == ["held out"]
  # Comma-separated patterns are read in the order given.
  cfg = files_cfg(f"{tmp_path / 'e.txt'}, {path}")
  assert pipeline.documents(cfg, "train") == ["held out", "one", "two\nlines", "thrée"]


def test_jsonl_other_text_field(tmp_path):
  path = tmp_path / "d.jsonl"
  path.write_text('{"body": "x"}\n{"body": "y"}\n', encoding="utf-8")
  assert pipeline.documents(files_cfg(path, text_field="body"), "train") == ["x", "y"]


def test_jsonl_missing_field_names_file_and_line(tmp_path):
  path = tmp_path / "d.jsonl"
  path.write_text('{"text": "ok"}\n{"content": "no text field"}\n', encoding="utf-8")
  with pytest.raises(UserError, match=re.escape(f"{path}:2")) as e:
    pipeline.documents(files_cfg(path), "train")
  assert "'text'" in str(e.value)


def test_jsonl_bad_json_is_a_user_error(tmp_path):
  path = tmp_path / "d.jsonl"
  path.write_text('{"text": "ok"}\n{"text": \n', encoding="utf-8")
  with pytest.raises(UserError, match=re.escape(str(path))):
    pipeline.documents(files_cfg(path), "train")


def test_non_utf8_file_is_a_user_error(tmp_path):
  path = tmp_path / "latin1.txt"
  path.write_bytes("caf\xe9 na\xefve".encode("latin-1"))
  with pytest.raises(UserError, match=re.escape(str(path))) as e:
    pipeline.documents(files_cfg(path), "train")
  assert "UTF-8" in str(e.value)


def test_glob_matching_nothing_is_a_user_error(tmp_path):
  (tmp_path / "a.txt").write_text("x", encoding="utf-8")
  pattern = str(tmp_path / "*.md")
  with pytest.raises(UserError, match="No data file matches"):
    pipeline.documents(files_cfg(pattern), "train")
  with pytest.raises(UserError, match="No data files given"):
    pipeline.documents(files_cfg(""), "train")


def test_load_split_packs_tokens_of_documents(tmp_path):
  (tmp_path / "a.txt").write_text("abcdefghij", encoding="utf-8")
  (tmp_path / "b.txt").write_text("klmno", encoding="utf-8")
  cfg = files_cfg(tmp_path / "*.txt")
  cfg.seq_len = 4
  rows = pipeline.load_split(cfg, "train")
  assert repr(rows) == "Rows(files:train:4, 3)"  # 15 bytes (no EOS for bytes) -> 3 rows of 5
  np.testing.assert_array_equal(rows.packed["tokens"][0], list(b"abcde"))
  np.testing.assert_array_equal(rows.packed["segment_ids"], [[1] * 5, [1] * 5, [2] * 5])
  cfg.seq_len = 20
  with pytest.raises(UserError, match="fewer than seq_len"):
    pipeline.load_split(cfg, "train")


# Iterators


def numbered_rows(n: int, row_len: int = 5) -> pipeline.Rows:
  """n rows whose first token is the row number."""
  return pipeline.Rows(
    pipeline.pack([np.arange(n * row_len)], row_len, pad_last=False), "test:train:4"
  )


def take(it, n: int) -> list[dict]:
  return [next(it) for _ in range(n)]


def first_tokens(batches) -> list[int]:
  return [int(t) // 5 for b in batches for t in b["tokens"][:, 0]]


def test_train_iterator_batch_shape():
  it = pipeline.train_iterator(numbered_rows(10), batch_size=2, seed=0)
  batch = next(it)
  assert set(batch) == {"tokens", "segment_ids"}
  assert batch["tokens"].shape == batch["segment_ids"].shape == (2, 5)  # [B, seq_len + 1]


def test_train_iterator_state_resumes_to_identical_batches():
  rows = numbered_rows(10)
  it = pipeline.train_iterator(rows, batch_size=2, seed=3)
  take(it, 3)
  state = json.loads(json.dumps(it.get_state()))  # as a checkpoint stores it
  expected = take(it, 6)  # crosses into the second epoch
  resumed = pipeline.train_iterator(rows, batch_size=2, seed=3)
  resumed.set_state(state)
  for want, got in zip(expected, take(resumed, 6), strict=True):
    for k in want:
      np.testing.assert_array_equal(got[k], want[k])


def test_train_iterator_seeds_and_epochs():
  rows = numbered_rows(12)
  a = take(pipeline.train_iterator(rows, batch_size=3, seed=0), 8)
  b = take(pipeline.train_iterator(rows, batch_size=3, seed=1), 8)
  assert first_tokens(a) != first_tokens(b)
  # Each epoch (4 batches of 3) visits every row exactly once, reshuffled between epochs.
  first, second = first_tokens(a[:4]), first_tokens(a[4:])
  assert sorted(first) == sorted(second) == list(range(12))
  assert first != second
  assert first != list(range(12))  # shuffled at all


def test_train_iterator_fewer_rows_than_batch_is_a_user_error():
  with pytest.raises(UserError, match="batch_size=8"):
    pipeline.train_iterator(numbered_rows(5), batch_size=8, seed=0)


def test_eval_batches_cover_all_rows_in_order_last_padded():
  rows = pipeline.Rows(pipeline.pack([np.arange(1, 36)], 5, pad_last=True), "test:eval:4")  # 7 rows
  batches = list(pipeline.eval_batches(rows, batch_size=3))
  assert [b["tokens"].shape for b in batches] == [(3, 5)] * 3
  tokens = np.concatenate([b["tokens"] for b in batches])
  segments = np.concatenate([b["segment_ids"] for b in batches])
  np.testing.assert_array_equal(tokens[:7], rows.packed["tokens"])
  np.testing.assert_array_equal(segments[:7], rows.packed["segment_ids"])
  assert (tokens[7:] == 0).all() and (segments[7:] == 0).all()  # padding: masked from the loss
  assert len(list(pipeline.eval_batches(rows, batch_size=3, max_batches=2))) == 2


# Plays chosen for training, held out by position, and labelled lines


def test_train_plays_and_eval_fraction_split_each_play_at_a_line():
  cfg = pipeline.config(kind="shakespeare", train_plays="hamlet", eval_fraction=0.1)
  (train,), (held,) = pipeline.documents(cfg, "train"), pipeline.documents(cfg, "eval")
  (whole,) = pipeline.read_shakespeare(["hamlet"])
  assert train + held == whole and train.endswith("\n")
  assert 0.08 < len(held) / len(whole) < 0.12


def test_eval_fraction_and_eval_plays_together_are_a_user_error():
  cfg = pipeline.config(kind="shakespeare", eval_plays="hamlet", eval_fraction=0.1)
  with pytest.raises(UserError, match="only one"):
    pipeline.documents(cfg, "train")
  with pytest.raises(UserError, match="Did you mean: hamlet"):
    pipeline.documents(pipeline.config(kind="shakespeare", train_plays="hamelt"), "train")


GENRE_EVAL = "twelfth_night,hamlet,henry_v"


def test_genre_lines_are_balanced_and_from_held_out_plays_only():
  cfg = pipeline.config(kind="shakespeare_genre", eval_plays=GENRE_EVAL)
  lines, labels = pipeline.genre_lines(cfg, "eval")
  assert np.bincount(labels).tolist() == [len(lines) // 3] * 3
  assert labels[:30].min() != labels[:30].max()  # shuffled: a prefix holds several genres
  texts = {p: pipeline.read_shakespeare([p])[0] for p in GENRE_EVAL.split(",")}
  for line, label in list(zip(lines, labels, strict=True))[:200]:
    play = next(p for p, t in texts.items() if line in t)
    assert pipeline.GENRES[label] == pipeline.GENRE_OF[play]
  train, _ = pipeline.genre_lines(cfg, "train")
  assert not set(train[:2000]) & set(pipeline.play_lines(texts["hamlet"]))


def test_genre_lines_need_every_genre_held_out():
  cfg = pipeline.config(kind="shakespeare_genre", eval_plays="hamlet,othello")
  with pytest.raises(UserError, match="no comedy or history"):
    pipeline.genre_lines(cfg, "eval")


def test_play_lines_drop_headings_speakers_and_directions():
  text = (
    "Front matter here is dropped\nACT I.\nSCENE 1. A room in the castle of Elsinore.\nHor.\n"
    "[Enter the Ghost and all the guards.]\nBut soft, behold! lo, where it comes again!\n"
  )
  assert pipeline.play_lines(text) == ["But soft, behold! lo, where it comes again!"]


def test_labelled_rows_pad_and_eval_batches_pad_labels():
  lines, labels = ["to be or not", "a b"], np.array([2, 0], np.int32)
  rows = pipeline.Rows(
    pipeline.labelled_rows(lines, labels, tokenizers.load(tokenizers.config()), 6), "x"
  )
  assert rows.packed["segment_ids"].tolist() == [[1] * 6, [1, 1, 1, 0, 0, 0]]
  (batch,) = pipeline.eval_batches(rows, batch_size=4)
  assert batch["labels"].tolist() == [2, 0, 0, 0] and batch["segment_ids"][2:].sum() == 0
