"""common/data/prepare.py and prepared.py: prepared shards give the rows of start-up tokenizing,
reruns redo only what changed, mixtures keep their proportions, each process reads its share,
and the iterator's state is the same on every process."""

import json
import os

import numpy as np
import pytest

from nnx_zoo.common import cli, experiments
from nnx_zoo.common.data import pipeline, prepare, prepared, tokenizers
from nnx_zoo.common.errors import UserError
from nnx_zoo.common.tasks import losses

PLAYS = dict(kind="shakespeare", train_plays="macbeth,othello,tempest", eval_plays="hamlet")


def same_rows(a: dict, b: dict):
  """Equal tokens, and segment ids equal up to their numbering (what the model reads of them)."""
  np.testing.assert_array_equal(a["tokens"], b["tokens"])
  for x, y in ((a["segment_ids"], b["segment_ids"]),):
    np.testing.assert_array_equal(x[:, 1:] != x[:, :-1], y[:, 1:] != y[:, :-1])
    np.testing.assert_array_equal(x == 0, y == 0)


def write_texts(folder, texts: dict[str, str]):
  os.makedirs(folder, exist_ok=True)
  for name, text in texts.items():
    with open(os.path.join(folder, name), "w") as f:
      f.write(text)


@pytest.fixture(scope="module")
def plays_gpt2(tmp_path_factory):
  """Four plays prepared with GPT-2's BPE (which ends each document with <|endoftext|>)."""
  cfg = pipeline.config(**PLAYS, tokenizer=tokenizers.config("gpt2"), seq_len=32)
  out = str(tmp_path_factory.mktemp("plays") / "prepared")
  result = prepare.prepare(cfg, out, workers=1, progress=False)
  assert result["prepared"] == 4 and result["unchanged"] == 0
  return cfg, out


def test_prepared_rows_equal_the_rows_tokenized_at_start_up(plays_gpt2):
  cfg, out = plays_gpt2
  tokenizer = tokenizers.load(cfg.tokenizer)
  for split, pad_last in (("train", False), ("eval", True)):
    in_memory = pipeline.load_split(cfg, split, tokenizer)
    rows = prepared.PackedRows(prepared.Split(out, split), 33, pad_last=pad_last)
    assert len(rows) == len(in_memory)
    same_rows(rows.read(np.arange(len(rows))), in_memory.packed)
  manifest = prepare.read_manifest(out)
  assert manifest["dtype"] == "uint16" and manifest["tokenizer"]["vocab_size"] == 50257
  # The training batches too: the same shuffle of the same rows.
  a = pipeline.train_iterator(pipeline.load_split(cfg, "train", tokenizer), batch_size=4, seed=3)
  rows = prepared.PackedRows(prepared.Split(out, "train"), 33, pad_last=False)
  b = prepared.train_iterator({"": rows}, {"": 1.0}, batch_size=4, seed=3)
  for _ in range(5):
    same_rows(next(a), next(b))


def test_a_run_on_prepared_data_equals_the_run_that_tokenizes_at_start_up(plays_gpt2, tmp_path):
  from nnx_zoo.common.train import trainer

  _, out = plays_gpt2
  common = {
    "data.tokenizer.kind": "gpt2",
    "data.train_plays": PLAYS["train_plays"],
    "data.eval_plays": PLAYS["eval_plays"],
    "model.vocab_size": "50257",
    "train.steps": "4",
    "train.checkpoint_every": "2",
    "train.log_every": "1",
    "train.eval_every": "4",
  }
  results = {}
  for kind, extra in (("shakespeare", {}), ("prepared", {"data.path": out, "data.workers": "2"})):
    cfg = experiments.get_config("lm/shakespeare-bpe:smoke", {**common, "data.kind": kind, **extra})
    workdir = str(tmp_path / kind)
    trainer.train(cfg, workdir, progress=False)
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
      results[kind] = [json.loads(line) for line in f]
  losses_of = {k: [(r["step"], r["loss"]) for r in v] for k, v in results.items()}
  assert losses_of["prepared"] == losses_of["shakespeare"]
  assert any(r.get("split") == "eval" for r in results["prepared"])


def test_rerun_prepares_only_new_or_changed_sources(tmp_path):
  corpus = tmp_path / "corpus"
  write_texts(corpus, {"a.txt": "first document", "b.txt": "second one", "c.txt": "third"})
  cfg = pipeline.config(kind="files", train_files=str(corpus / "*.txt"))
  out = str(tmp_path / "out")
  assert prepare.prepare(cfg, out, workers=1, progress=False)["prepared"] == 3
  again = prepare.prepare(cfg, out, workers=1, progress=False)
  assert (again["prepared"], again["unchanged"]) == (0, 3)
  write_texts(corpus, {"b.txt": "second one, changed", "d.txt": "a new fourth"})
  third = prepare.prepare(cfg, out, workers=1, progress=False)
  assert (third["prepared"], third["unchanged"]) == (2, 2)
  split = prepared.Split(out, "train")
  text = bytes(np.concatenate([t[:] for t in split.tokens]).astype(np.uint8)).decode()
  assert text == "first document" + "second one, changed" + "third" + "a new fourth"
  # A source no glob names any more leaves the directory.
  os.remove(corpus / "a.txt")
  prepare.prepare(cfg, out, workers=1, progress=False)
  assert prepared.Split(out, "train").num_documents == 3
  assert not [n for n in os.listdir(os.path.join(out, "shards")) if n.startswith("a_txt")]


def test_an_interrupted_prepare_leaves_nothing_half_taken_and_a_rerun_finishes_it(
  tmp_path, monkeypatch
):
  corpus = tmp_path / "corpus"
  write_texts(corpus, {f"{i}.txt": f"document {i} " * 50 for i in range(3)})
  cfg = pipeline.config(kind="files", train_files=str(corpus / "*.txt"))
  out = str(tmp_path / "out")
  real = prepare._ShardWriter.add
  calls = []

  def dies_on_the_second_source(self, ids, lengths):
    calls.append(1)
    if len(calls) == 2:
      raise KeyboardInterrupt  # killed while writing
    return real(self, ids, lengths)

  monkeypatch.setattr(prepare._ShardWriter, "add", dies_on_the_second_source)
  with pytest.raises(KeyboardInterrupt):
    prepare.prepare(cfg, out, workers=1, progress=False)
  shards = os.listdir(os.path.join(out, "shards"))
  assert not [n for n in shards if n.endswith(".tmp")]
  assert len([n for n in shards if n.endswith(".json")]) == 1
  with pytest.raises(
    UserError, match=r"half-written: 2 of its 3 sources .*Rerun `zoo data prepare"
  ):
    prepared.Split(out, "train")
  monkeypatch.setattr(prepare._ShardWriter, "add", real)
  result = prepare.prepare(cfg, out, workers=1, progress=False)
  assert (result["prepared"], result["unchanged"]) == (2, 1)
  assert prepared.Split(out, "train").num_documents == 3


def test_a_directory_of_another_tokenizer_is_refused(tmp_path):
  corpus = tmp_path / "corpus"
  write_texts(corpus, {"a.txt": "some text"})
  cfg = pipeline.config(kind="files", train_files=str(corpus / "*.txt"))
  out = str(tmp_path / "out")
  prepare.prepare(cfg, out, workers=1, progress=False)
  cfg.tokenizer = tokenizers.config("gpt2")
  with pytest.raises(UserError, match="prepared with another tokenizer .*give another --out"):
    prepare.prepare(cfg, out, workers=1, progress=False)
  run = experiments.get_config(
    "lm/shakespeare-bpe:smoke", {"data.kind": "prepared", "data.path": out}
  )
  with pytest.raises(UserError, match="prepared with another tokenizer"):
    prepared.check(run)
  # The model's vocabulary must hold the corpus's.
  run = experiments.get_config(
    "lm/shakespeare-char:smoke",
    {"data.kind": "prepared", "data.path": out, "model.vocab_size": "100"},
  )
  with pytest.raises(UserError, match="256-id vocabulary but model.vocab_size is 100"):
    prepared.check(run)


def test_not_a_prepared_directory(tmp_path):
  with pytest.raises(UserError, match="is not a directory: run `zoo data prepare"):
    prepared.Split(str(tmp_path / "missing"), "train")
  with pytest.raises(UserError, match="is not a prepared directory"):
    prepared.Split(str(tmp_path), "train")
  write_texts(tmp_path / "full", {"x.txt": "x"})
  cfg = pipeline.config(kind="files", train_files=str(tmp_path / "full" / "x.txt"))
  with pytest.raises(UserError, match="not empty and holds no prepared.json"):
    prepare.prepare(cfg, str(tmp_path / "full"), workers=1, progress=False)


def test_eval_fraction_holds_out_whole_documents_the_same_way_every_time(tmp_path):
  docs = [f"document number {i}." for i in range(400)]
  path = tmp_path / "docs.jsonl"
  path.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
  cfg = pipeline.config(kind="files", train_files=str(path), eval_fraction=0.25)

  def texts(out, split):
    s = prepared.Split(out, split)
    tokens = np.concatenate([t[:] for t in s.tokens]).astype(np.uint8)
    ends = np.concatenate([e[:] for e in s.ends])
    return [bytes(d).decode() for d in np.split(tokens, ends[:-1])]

  outs = [str(tmp_path / f"out{i}") for i in range(2)]
  for out in outs:
    prepare.prepare(cfg, out, workers=1, progress=False)
  train, held_out = texts(outs[0], "train"), texts(outs[0], "eval")
  assert (texts(outs[1], "train"), texts(outs[1], "eval")) == (train, held_out)
  assert not set(train) & set(held_out) and sorted(train + held_out) == sorted(docs)
  assert 0.18 < len(held_out) / len(docs) < 0.32


def corpus_of(tmp_path, name: str, char: str, docs: int = 50, length=lambda i: 20 + i) -> str:
  """A prepared corpus of `docs` documents of `char` repeated, a fifth of them held out."""
  lines = [json.dumps({"text": char * length(i)}) + "\n" for i in range(docs)]
  write_texts(tmp_path / name, {"docs.jsonl": "".join(lines)})
  cfg = pipeline.config(kind="files", train_files=str(tmp_path / name / "*"), eval_fraction=0.2)
  out = str(tmp_path / f"{name}-prepared")
  prepare.prepare(cfg, out, workers=1, progress=False)
  return out


def test_a_mixture_draws_its_components_in_proportion(tmp_path):
  a, b = corpus_of(tmp_path, "a", "a"), corpus_of(tmp_path, "b", "b")
  cfg = pipeline.config(kind="prepared", mixture=f"left={a}@0.7, right={b}@0.3", seq_len=7)
  parts = prepared.components(cfg)
  assert [(p.name, p.weight) for p in parts] == [("left", 0.7), ("right", 0.3)]
  rows = {
    p.name: prepared.PackedRows(prepared.Split(p.path, "train"), 8, pad_last=False) for p in parts
  }
  it = prepared.train_iterator(rows, {p.name: p.weight for p in parts}, batch_size=100, seed=0)
  tokens = np.concatenate([next(it)["tokens"] for _ in range(100)])  # 10,000 rows
  left = (tokens == ord("a")).any(axis=1)
  assert not ((tokens == ord("b")).any(axis=1) & left).any()  # a row is of one component
  assert abs(left.mean() - 0.7) < 0.01


@pytest.mark.parametrize(
  ("mixture", "message"),
  [
    ("left=a@0", "weights must be positive"),
    ("left=a@-1", "weights must be positive"),
    ("left=a@x", "weights must be positive"),
    ("left=@0.5", "needs a name and a path"),
    ("=dir@0.5", "needs a name and a path"),
    ("a=x@1,a=y@1", "names the component 'a' twice"),
  ],
)
def test_bad_mixtures_are_refused(mixture, message):
  with pytest.raises(UserError, match=message):
    prepared.components(pipeline.config(kind="prepared", mixture=mixture))


def test_each_process_reads_only_the_rows_of_its_share(tmp_path, monkeypatch):
  # Documents of 3-7 tokens in rows of 64: the rows of a batch hold different documents.
  out = corpus_of(tmp_path, "c", "c", docs=8000, length=lambda i: 3 + i % 5)
  rows = prepared.PackedRows(prepared.Split(out, "train"), 64, pad_last=False)
  read = {}  # process -> the documents it read
  real = prepared.Split.window

  def counting(self, starts, length):
    tokens, docs, weights = real(self, starts, length)
    read[reader].update(docs.ravel().tolist())
    return tokens, docs, weights

  monkeypatch.setattr(prepared.Split, "window", counting)
  for reader, share in ((0, slice(0, 4)), (1, slice(4, 8)), ("all", None)):
    read[reader] = set()
    it = prepared.train_iterator({"": rows}, {"": 1.0}, batch_size=8, seed=1, share=share)
    for _ in range(20):
      next(it)
  total = len(read["all"])
  for process in (0, 1):
    assert abs(len(read[process]) / total - 0.5) < 0.05, (len(read[process]), total)


def test_the_iterator_state_is_the_global_batch_so_any_process_count_resumes_it(tmp_path):
  out = corpus_of(tmp_path, "d", "d", docs=100)
  rows = {"": prepared.PackedRows(prepared.Split(out, "train"), 16, pad_last=False)}

  def iterator(share=None):
    return prepared.train_iterator(rows, {"": 1.0}, batch_size=8, seed=2, share=share)

  whole = iterator()
  batches = [next(whole) for _ in range(6)]
  half = iterator(slice(4, 8))
  for _ in range(3):
    next(half)
  state = half.get_state()
  for share in (None, slice(0, 4)):
    resumed = iterator(share)
    resumed.set_state(state)
    for want in batches[3:]:
      got = next(resumed)
      np.testing.assert_array_equal(got["tokens"], want["tokens"][share or slice(None)])


def test_data_show_prints_the_rows_the_trainer_sees(plays_gpt2, capsys):
  _, out = plays_gpt2
  overrides = [
    "--config.data.kind=prepared",
    f"--config.data.path={out}",
    "--config.data.tokenizer.kind=gpt2",
  ]
  assert (
    cli.main(["data", "show", "lm/shakespeare-bpe:smoke", "--json", "--rows", "3", *overrides]) == 0
  )
  found = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
  assert len(found) == 3
  assert set(found[0]) == {"inputs", "targets", "weights", "segment_ids", "positions"}
  cfg = experiments.get_config(
    "lm/shakespeare-bpe:smoke",
    {"data.kind": "prepared", "data.path": out, "data.tokenizer.kind": "gpt2"},
  )
  first = prepared.load(cfg, train=True, batch_size=cfg.train.batch_size, share=None).iterator
  want = losses.next_token_rows(next(first))
  for i in range(2):
    for key in found[0]:
      np.testing.assert_array_equal(found[i][key], want[key][i])
  assert cli.main(["data", "show", "lm/shakespeare-bpe:smoke", "--split", "eval", *overrides]) == 0
  assert "──── segment" in capsys.readouterr().out


def test_data_prepare_command_and_its_errors(tmp_path, capsys):
  missing = ["data", "prepare", "lm/shakespeare-char:smoke", "--out", str(tmp_path / "o")]
  assert cli.main([*missing, "--config.data.kind=files", "--config.data.train_files=nothing*"]) == 2
  assert "No data file matches 'nothing*'" in capsys.readouterr().err
  write_texts(tmp_path / "c", {"a.txt": "hello there " * 100})
  ok = [*missing, "--config.data.kind=files", f"--config.data.train_files={tmp_path / 'c'}/*"]
  assert cli.main([*ok, "--workers", "1", "--quiet"]) == 0
  result = json.loads(capsys.readouterr().out)
  assert (result["prepared"], result["tokens"]) == (1, 1200)


RECIPES = [
  "lm/llama3-8b",
  "lm/llama2-7b",
  "lm/mistral-7b",
  "lm/qwen3-0.6b",
  "lm/qwen3-30b-a3b",
  "lm/gemma2-2b",
  "lm/gemma3-1b",
  "lm/mixtral-8x7b",
]


@pytest.mark.parametrize("name", RECIPES)
def test_every_pretraining_recipe_documents_prepare_then_run(name):
  doc = experiments.load_module(name).__doc__
  assert f"zoo data prepare {name} --out prepared/" in doc
  assert f"zoo run {name} " in doc and "--config.data.kind=prepared" in doc


def test_a_recipe_prepared_then_run_as_its_docstring_says(tmp_path, capsys):
  """lm/llama3-8b's two commands, in its smoke form, on one play."""
  out, workdir = str(tmp_path / "prepared"), str(tmp_path / "run")
  data = ["--config.data.train_plays=tempest", "--config.data.eval_plays=macbeth"]
  prep = ["data", "prepare", "lm/llama3-8b:smoke", "--out", out, "--workers", "1", "--quiet"]
  assert cli.main([*prep, *data]) == 0
  assert json.loads(capsys.readouterr().out)["prepared"] == 2
  run = ["run", "lm/llama3-8b:smoke", "--workdir", workdir, "--quiet", *data]
  assert cli.main([*run, "--config.data.kind=prepared", f"--config.data.path={out}"]) == 0
  last = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
  assert np.isfinite(last["loss"]) and np.isfinite(last["eval_loss"])


def test_restoring_far_into_a_run_reads_only_the_batch_asked_for(tmp_path, monkeypatch):
  """The iterator jumps to any batch by its index: restoring at step 10^12 reads one batch."""
  out = corpus_of(tmp_path, "e", "e", docs=60)
  rows = {"": prepared.PackedRows(prepared.Split(out, "train"), 16, pad_last=False)}
  it = prepared.train_iterator(rows, {"": 1.0}, batch_size=4, seed=0)
  calls = []
  real = prepared.PackedRows.read
  monkeypatch.setattr(prepared.PackedRows, "read", lambda self, r: calls.append(1) or real(self, r))
  it.set_state({"next_index": 10**12})
  batch = next(it)
  assert batch["tokens"].shape == (4, 16) and len(calls) == 1
  assert it.get_state() == {"next_index": 10**12 + 1}


def test_hosts_prepare_their_shares_into_one_directory(tmp_path):
  """Two hosts (`--num-processes 2 --process-id I`) each prepare every other source into the
  same directory; the reader takes the union, equal to what one host prepares."""
  write_texts(tmp_path / "c", {f"{i}.txt": f"text of file {i}. " * (i + 1) for i in range(5)})
  cfg = pipeline.config(kind="files", train_files=str(tmp_path / "c" / "*.txt"))
  shared, alone = str(tmp_path / "shared"), str(tmp_path / "alone")
  first = prepare.prepare(cfg, shared, workers=1, num_processes=2, process_id=0, progress=False)
  with pytest.raises(UserError, match="half-written: 2 of its 5 sources"):
    prepared.Split(shared, "train")
  second = prepare.prepare(cfg, shared, workers=1, num_processes=2, process_id=1, progress=False)
  assert (first["prepared"], second["prepared"]) == (3, 2)
  prepare.prepare(cfg, alone, workers=1, progress=False)
  a, b = prepared.Split(shared, "train"), prepared.Split(alone, "train")
  rows = np.arange(a.num_tokens // 8)
  same_rows(
    prepared.PackedRows(a, 8, pad_last=False).read(rows),
    prepared.PackedRows(b, 8, pad_last=False).read(rows),
  )


def test_loss_weights_travel_with_their_tokens_through_packing(tmp_path):
  """A weighted prepared corpus (what chat data writes: 1 on the tokens that carry loss): the
  rows carry each token's weight wherever packing puts it, a document split over two rows
  included, and the next-token weights are the segment rule times them."""
  out = str(tmp_path / "weighted")
  shards = os.path.join(out, "shards")
  os.makedirs(shards)
  ids = np.arange(1, 31, dtype=np.int64)  # three documents of 10 tokens
  weights = (ids % 3 == 0).astype(np.uint8)  # a pattern that no row boundary lines up with
  writer = prepare._ShardWriter(shards, "w", "train", np.dtype(np.uint8), weighted=True)
  writer.add(ids, np.array([10, 10, 10]), weights)
  entry = {"source": {}, "rule": {}, "text_field": "text", "splits": {"train": writer.close()}}
  with open(os.path.join(shards, "w.json"), "w") as f:
    json.dump(entry, f)
  manifest = {
    "format": prepare.FORMAT,
    "tokenizer": {},
    "dtype": "uint8",
    "sources": [{"key": "w", "path": "w"}],
  }
  with open(os.path.join(out, prepare.MANIFEST), "w") as f:
    json.dump(manifest, f)
  rows = prepared.PackedRows(prepared.Split(out, "train"), 7, pad_last=True)
  batch = rows.read(np.arange(len(rows)))
  flat = batch["tokens"].ravel()[:30]
  np.testing.assert_array_equal(flat, ids)
  np.testing.assert_array_equal(batch["loss_weights"].ravel()[:30], weights)
  assert not batch["loss_weights"].ravel()[30:].any()  # padding carries no loss
  rows_next = losses.next_token_rows(batch)
  plain = losses.next_token_rows({k: batch[k] for k in ("tokens", "segment_ids")})
  np.testing.assert_array_equal(
    rows_next["weights"], plain["weights"] * batch["loss_weights"][:, 1:]
  )
  assert 0 < rows_next["weights"].sum() < plain["weights"].sum()
