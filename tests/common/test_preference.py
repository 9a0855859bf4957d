"""The dpo task against the paper's formula in numpy (Rafailov et al., 2023, eq. 7), its
held-out metrics, a preference it learns, the reference log-probabilities `prepare` fills in,
and its refusals."""

import json

import jax
import numpy as np
import pytest
from flax import nnx

from nnx_zoo.common import experiments, models, tasks
from nnx_zoo.common.errors import UserError
from nnx_zoo.common.hub import weights
from nnx_zoo.common.nn import lora
from nnx_zoo.common.tasks import preference
from nnx_zoo.common.train import trainer


def numpy_logps(logits, tokens, weights):
  """Sum over each reply of log softmax(logits)[next token], numpy."""
  logits = logits.astype(np.float64)
  top = logits.max(-1, keepdims=True)
  logp = logits - top - np.log(np.exp(logits - top).sum(-1, keepdims=True))
  picked = np.take_along_axis(logp[:, :-1], tokens[:, 1:, None], axis=-1)[..., 0]
  return (picked * weights[:, 1:]).sum(-1)


@pytest.fixture(scope="module")
def setup():
  cfg = experiments.get_config("chat/shakespeare-dialogue-dpo:smoke", {"train.batch_size": "4"})
  data = trainer.load_data(cfg)
  batch = {k: np.array(v) for k, v in next(data.iterator).items()}
  model = models.build(cfg.model, seed=0)
  return cfg, data, batch, model


def jitted(method):
  """A task's `method(model, batch)` compiled: one program, not one per op."""
  return nnx.jit(lambda model, batch: method(model, batch))


def test_loss_and_rewards_equal_the_formula(setup):
  cfg, _, batch, model = setup
  beta = 0.25
  batch = dict(batch, reference=np.array([[-90.0, -70.0], [-50, -51], [-10, -20], [-80, -80]],
                                         np.float32))  # fmt: skip
  task = preference.DPO(beta)
  B, _, L = batch["tokens"].shape
  tokens = batch["tokens"].reshape(2 * B, L)
  logits = np.asarray(nnx.jit(lambda m, x: m(x))(model, tokens[:, :-1]))  # no packing in pairs
  logits = np.concatenate([logits, np.zeros_like(logits[:, :1])], axis=1)
  pi = numpy_logps(logits, tokens, batch["loss_weights"].reshape(2 * B, L)).reshape(B, 2)
  ref = batch["reference"].astype(np.float64)
  margin = beta * ((pi[:, 0] - ref[:, 0]) - (pi[:, 1] - ref[:, 1]))
  loss = -np.log(1 / (1 + np.exp(-margin)))
  total, count = jitted(task.loss_sums)(model, batch)
  assert float(count) == B
  np.testing.assert_allclose(float(total), loss.sum(), rtol=1e-5)
  summary = task.summary({k: float(v) for k, v in jitted(task.eval_sums)(model, batch).items()})
  np.testing.assert_allclose(summary["chosen_reward"], beta * (pi[:, 0] - ref[:, 0]).mean(),
                             rtol=1e-5, atol=1e-5)  # fmt: skip
  np.testing.assert_allclose(summary["margin"], margin.mean(), rtol=1e-5, atol=1e-5)
  assert summary["reward_accuracy"] == (margin > 0).mean()
  assert summary["preference_accuracy"] == (pi[:, 0] > pi[:, 1]).mean()


def test_a_pair_counts_only_with_a_reply_on_both_sides(setup):
  """A pair whose rejected reply was cut away (prepared data keeps it, its weights zero there)
  is out of the loss and its count, as padding is."""
  cfg, _, batch, model = setup
  batch = dict(batch, reference=np.zeros((len(batch["tokens"]), 2), np.float32))
  task = preference.DPO(0.1)
  loss_sums = jitted(task.loss_sums)
  total, count = loss_sums(model, batch)
  cut = dict(batch, loss_weights=batch["loss_weights"].copy())
  cut["loss_weights"][0, 1] = 0
  cut_total, cut_count = loss_sums(model, cut)
  assert float(cut_count) == float(count) - 1
  rest = {k: v[1:] for k, v in batch.items()}
  np.testing.assert_allclose(float(cut_total), float(loss_sums(model, rest)[0]), rtol=1e-6)


def test_pairs_keep_their_reply_weights_only(setup):
  _, data, batch, _ = setup
  w = batch["loss_weights"]  # [B, 2, L]: one run of ones, the final reply, on each side
  for side in w.reshape(-1, w.shape[-1]):
    on = np.flatnonzero(side)
    assert len(on) and (np.diff(on) == 1).all()
  # Both sides share the prompt: the tokens before the replies are the same.
  first = [np.flatnonzero(w[i, 0])[0] for i in range(len(w))]
  for i, f in enumerate(first):
    np.testing.assert_array_equal(batch["tokens"][i, 0, :f], batch["tokens"][i, 1, :f])


@pytest.mark.slow
def test_reference_is_the_init_from_model_and_under_lora_the_base(tmp_path):
  """`complete` adds the init_from model's log-probabilities; under LoRA, the base's (the params
  with their adapters at zero), however far the adapters have moved."""
  sft = experiments.get_config("chat/shakespeare-dialogue:smoke", {"train.steps": "1"})
  trainer.train(sft, str(tmp_path / "sft"), progress=False)
  overrides = {"train.batch_size": "4", "init_from": str(tmp_path / "sft")}
  cfg = experiments.get_config("chat/shakespeare-dialogue-dpo:smoke", overrides)
  data = trainer.load_data(cfg)
  batch = {k: np.asarray(v) for k, v in next(data.iterator).items()}
  graphdef, params = weights.restore_params(cfg, str(tmp_path / "sft"))[:2]
  want = np.asarray(preference.sequence_logps(nnx.merge(graphdef, params), batch))
  task = tasks.of(cfg).prepare(data, cfg=cfg)
  fresh = nnx.state(models.build(cfg.model, seed=3), nnx.Param)  # not the reference
  np.testing.assert_allclose(task.complete(batch, fresh)["reference"], want, rtol=1e-5)

  lora_cfg = experiments.get_config(
    "chat/shakespeare-dialogue-dpo:smoke", {**overrides, "model.lora.rank": "4"}
  )
  task = tasks.of(lora_cfg).prepare(data, cfg=lora_cfg)
  assert task._reference._params is None  # no second copy of the base
  loaded = weights.init_from_params(lora_cfg)[1]
  adapters, base = nnx.split_state(loaded, lora.LoRAParam, ...)
  moved = nnx.merge_state(jax.tree.map(lambda x: x + 0.5, adapters), base)
  moved_logps = preference.sequence_logps(
    nnx.merge(nnx.graphdef(models.abstract(lora_cfg.model)), moved), batch
  )
  assert np.abs(np.asarray(moved_logps) - want).max() > 0.1  # the adapters do move the policy
  np.testing.assert_allclose(task.complete(batch, moved)["reference"], want, rtol=1e-5)


def test_dpo_without_init_from_is_refused(setup):
  cfg, data, _, _ = setup
  with pytest.raises(UserError, match="init_from"):
    tasks.of(cfg).prepare(data, cfg=cfg)


def test_dpo_on_chat_data_is_refused():
  with pytest.raises(UserError, match="data.format=preference"):
    tasks.of(experiments.get_config("chat/shakespeare-dialogue-dpo:smoke", {"data.format": "chat"}))


def test_identical_replies_refused(tmp_path):
  path = tmp_path / "pairs.jsonl"
  record = {"prompt": [{"role": "user", "content": "hi"}], "chosen": "same", "rejected": "same"}
  path.write_text(json.dumps(record) + "\n")
  cfg = experiments.get_config(
    "chat/shakespeare-dialogue-dpo:smoke",
    {"data.kind": "files", "data.train_files": str(path), "data.eval_plays": ""},
  )
  with pytest.raises(UserError, match="same"):
    trainer.load_data(cfg)


def test_data_show_prints_each_pair_as_its_two_rows(setup):
  from nnx_zoo.common import report

  cfg = setup[0]
  chosen, rejected = report.rows(cfg, count=2)
  start = chosen["weights"].index(1.0)  # the reply's first target
  assert chosen["inputs"][:start] == rejected["inputs"][:start]  # one prompt
  assert chosen["targets"][start:] != rejected["targets"][start:]  # two replies
  assert rejected["weights"].index(1.0) == start


def _echo_pairs(path, words):
  """Pairs on a preference a tiny model can learn: the user says a word, the chosen reply
  echoes it in lower case, the rejected one in capitals."""
  with open(path, "w") as f:
    for word in words:
      record = {
        "prompt": [{"role": "user", "content": f"echo {word}"}],
        "chosen": word,
        "rejected": word.upper(),
      }
      f.write(json.dumps(record) + "\n")


@pytest.mark.slow
def test_dpo_learns_a_preference_the_model_can_tell(tmp_path):
  """Trained, the task does what DPO is for: from a model that prefers neither reply (one step
  of the SFT smoke), the pairs of words it never saw go to the chosen reply, by the
  reference-free preference accuracy and by the rewards."""
  rng = np.random.default_rng(0)
  words = ["".join(rng.choice(list("abcdefghijklmnopqrstuvwxyz"), 6)) for _ in range(80)]
  _echo_pairs(tmp_path / "train.jsonl", words[:64])
  _echo_pairs(tmp_path / "eval.jsonl", words[64:])
  sft = experiments.get_config("chat/shakespeare-dialogue:smoke", {"train.steps": "1"})
  trainer.train(sft, str(tmp_path / "sft"), progress=False)
  overrides = {
    "init_from": str(tmp_path / "sft"),
    "data.kind": "files",
    "data.train_files": str(tmp_path / "train.jsonl"),
    "data.eval_files": str(tmp_path / "eval.jsonl"),
    "data.eval_plays": "",
    "data.seq_len": "64",
    "optim.lr": "3e-3",
    "train.steps": "24",
    "train.batch_size": "8",
    "train.eval_every": "24",
    "train.checkpoint_every": "24",
    "train.eval_batches": "0",
  }
  cfg = experiments.get_config("chat/shakespeare-dialogue-dpo:smoke", overrides)
  data = trainer.load_data(cfg)
  graphdef, params = weights.restore_params(cfg, str(tmp_path / "sft"))[:2]
  before = trainer.evaluate(params, data, graphdef=graphdef, cfg=cfg)
  trainer.train(cfg, str(tmp_path / "dpo"), progress=False)
  with open(tmp_path / "dpo" / "metrics.jsonl") as f:
    after = [r for r in map(json.loads, f) if r.get("split") == "eval"][-1]
  assert after["pairs"] == before["pairs"] == 16
  assert before["margin"] == 0 and before["loss"] == pytest.approx(np.log(2))  # its own reference
  assert after["preference_accuracy"] == after["reward_accuracy"] == 1.0, after
  assert after["margin"] > 0 and after["loss"] < 0.5 * np.log(2), after


def test_prepared_pairs_are_the_startup_rows(tmp_path, capsys):
  """`zoo data prepare` of preference data writes each pair as its two conversations, and the
  prepared kind reads back the start-up rows (kind shakespeare, format preference) pair for
  pair, those the row's length cuts away kept with no weight where start-up drops them; a
  directory prepared as pairs is refused to a chat run."""
  from nnx_zoo.common.data import pipeline, prepare, tokenizers

  cfg = experiments.get_config(
    "chat/shakespeare-dialogue-dpo:smoke", {"data.eval_plays": "two_gentlemen_of_verona"}
  )
  prepare.prepare(cfg.data, str(tmp_path), workers=1, progress=False)
  startup = pipeline.load_split(cfg.data, "eval", tokenizers.load(cfg.data.tokenizer)).packed
  run = experiments.get_config(
    "chat/shakespeare-dialogue-dpo:smoke", {"data.kind": "prepared", "data.path": str(tmp_path)}
  )
  data = trainer.load_data(run)
  assert "have a reply cut away in seq_len + 1 = 129" in capsys.readouterr().err
  got = data.eval.read(np.arange(len(data.eval)))
  kept = (got["loss_weights"].sum(axis=2) > 0).all(axis=1)
  assert 0 < len(startup["tokens"]) == kept.sum() < len(kept)  # some cut away at 128 bytes
  for key in ("tokens", "segment_ids", "loss_weights"):
    np.testing.assert_array_equal(got[key][kept], startup[key])
  batch = next(data.iterator)
  assert batch["tokens"].shape == (run.train.batch_size, 2, run.data.seq_len + 1)

  chat_run = experiments.get_config(
    "chat/shakespeare-dialogue:smoke", {"data.kind": "prepared", "data.path": str(tmp_path)}
  )
  with pytest.raises(UserError, match="prepared as preference"):
    trainer.load_data(chat_run)
  short = experiments.get_config(
    "chat/shakespeare-dialogue-dpo:smoke",
    {"data.kind": "prepared", "data.path": str(tmp_path), "data.seq_len": "16"},
  )
  with pytest.raises(UserError, match="None of the first .* raise data.seq_len"):
    trainer.load_data(short)


# Packed pairs (data.pairs_per_row="packed"): several whole pairs a pair row


def _random_pairs(rng, vocab: int, count: int, *, low: int = 6, high: int = 40):
  """Pairs of conversations of random tokens and lengths, each side's last tokens its reply."""
  ids, weights = [], []
  for _ in range(count):
    prompt = rng.integers(1, vocab, rng.integers(3, low))
    for _side in range(2):
      reply = rng.integers(1, vocab, rng.integers(2, high - low))
      ids.append(np.concatenate([prompt, reply]).astype(np.int32))
      weights.append(np.r_[np.zeros(len(prompt)), np.ones(len(reply))].astype(np.uint8))
  return ids, weights


@pytest.fixture(scope="module")
def packed_pairs(setup):
  """Ten short random pairs as pair rows of one pair each and packed, at the smoke's seq_len."""
  from nnx_zoo.common.data import pipeline

  cfg, _, _, model = setup
  L = cfg.data.seq_len + 1
  ids, weights = _random_pairs(np.random.default_rng(1), cfg.model.vocab_size, 10)
  one = pipeline.pair_rows(ids, weights, L)
  packed = pipeline.pair_rows(ids, weights, L, pairs_per_row="packed")
  plan = pipeline.pair_plan([len(x) for x in ids], L, pairs_per_row="packed")
  return ids, weights, one, packed, plan


def test_pair_plan_keeps_pairs_whole_and_rows_within_length():
  from nnx_zoo.common.data import pipeline

  rng = np.random.default_rng(0)
  lengths = rng.integers(1, 65, (200, 2))
  plan = pipeline.pair_plan(lengths, 64, pairs_per_row="packed")
  assert sorted(p for row in plan for p, _, _ in row) == list(range(200))  # each once, in a row
  for row in plan:
    used = np.zeros(2, int)
    for p, chosen, rejected in row:
      used[chosen] += lengths[p, 0]
      used[rejected] += lengths[p, 1]
    assert (used <= 64).all()
  assert len(plan) < 200 * 0.75  # packed at all
  one = pipeline.pair_plan(lengths, 64)
  assert one == [[(p, 0, 1)] for p in range(200)]  # the layout before packing
  with pytest.raises(UserError, match="pairs_per_row"):
    pipeline.pair_plan(lengths, 64, pairs_per_row="tight")


def test_packed_logps_equal_each_pair_alone(setup, packed_pairs):
  """Each pair's chosen and rejected log-probabilities from packed rows equal those of each
  conversation run alone through the model (numpy's log-softmax), and the one-pair-a-row
  layout's, to float tolerance; an empty slot is 0."""
  (
    _,
    _,
    model,
  ) = setup[1:]
  ids, weights, one, packed, plan = packed_pairs
  assert len(packed["tokens"]) < len(one["tokens"]) == 10
  # Each conversation alone in a row of its own (padding after it), one forward pass.
  L = one["tokens"].shape[-1]
  tokens = np.zeros((len(ids), L), np.int32)
  for i, t in enumerate(ids):
    tokens[i, : len(t)] = t
  logits = np.asarray(nnx.jit(lambda m, x: m(x))(model, tokens[:, :-1]))
  logits = np.concatenate([logits, np.zeros_like(logits[:, :1])], axis=1)
  w = np.zeros((len(ids), L), np.float32)
  for i, x in enumerate(weights):
    w[i, : len(x)] = x
  alone = numpy_logps(logits, tokens, w).reshape(-1, 2)
  rows_one = jitted(preference.sequence_logps)(model, one)
  np.testing.assert_allclose(np.asarray(rows_one), alone, rtol=1e-5, atol=1e-4)
  logps = nnx.jit(lambda m, b: preference.sequence_logps(m, b, packed=True))(model, packed)
  logps = np.asarray(logps)  # [R, P, 2]
  assert logps.shape == (len(plan), packed["tokens"].shape[-1], 2)
  filled = np.zeros(logps.shape[:2], bool)
  for r, row in enumerate(plan):
    for k, (p, _, _) in enumerate(row):
      np.testing.assert_allclose(logps[r, k], alone[p], rtol=1e-5, atol=1e-4)
      filled[r, k] = True
  assert (logps[~filled] == 0).all()


def test_packed_loss_equals_one_pair_a_row(setup, packed_pairs):
  """The dpo loss and held-out sums of a batch of pairs are the same packed as one pair a row
  (and the paper's formula on each pair's own log-probabilities): every pair counts once."""
  model = setup[3]
  _, _, one, packed, plan = packed_pairs
  rng = np.random.default_rng(2)
  reference = rng.normal(-60, 10, (10, 2)).astype(np.float32)
  packed_reference = np.zeros((len(plan), packed["tokens"].shape[-1], 2), np.float32)
  for r, row in enumerate(plan):
    for k, (p, _, _) in enumerate(row):
      packed_reference[r, k] = reference[p]
  plain, tight = preference.DPO(0.5), preference.DPO(0.5, packed=True)
  want = jitted(plain.eval_sums)(model, dict(one, reference=reference))
  got = jitted(tight.eval_sums)(model, dict(packed, reference=packed_reference))
  assert float(got["count"]) == float(want["count"]) == 10
  for key in want:
    np.testing.assert_allclose(float(got[key]), float(want[key]), rtol=1e-5, atol=1e-4)
  pi = np.asarray(jitted(preference.sequence_logps)(model, one))
  margin = 0.5 * ((pi[:, 0] - reference[:, 0]) - (pi[:, 1] - reference[:, 1]))
  total, count = jitted(tight.loss_sums)(model, dict(packed, reference=packed_reference))
  np.testing.assert_allclose(float(total), np.log1p(np.exp(-margin)).sum(), rtol=1e-5)


def test_a_chunked_head_gives_the_same_loss_and_gradients(setup, chunked_like_whole):
  """train.loss_chunk (the head 7 tokens at a time, chunks straddling rows and the padded end):
  the dpo loss and every parameter's gradient are those of the whole logits, and so are the
  reference's log-probabilities (`sequence_logps`, which `complete` runs)."""
  _, _, batch, model = setup
  graphdef, params = nnx.split(model, nnx.Param)
  whole = np.asarray(jitted(preference.sequence_logps)(model, batch))
  chunked = nnx.jit(lambda m, b: preference.sequence_logps(m, b, loss_chunk=7))(model, batch)
  np.testing.assert_allclose(np.asarray(chunked), whole, rtol=1e-6)
  rng = np.random.default_rng(4)  # a reference near the policy: margins on both sides of 0
  batch = dict(batch, reference=(whole + rng.uniform(-3, 3, whole.shape)).astype(np.float32))
  task = preference.DPO(0.5)

  def loss(params, chunk):
    return task.loss_sums(nnx.merge(graphdef, params), batch, loss_chunk=chunk)[0]

  chunked_like_whole(loss, params, 7)


def test_packed_pair_rows_train_batches_resume_exactly(tmp_path):
  """Start-up packs short pairs several a row (fewer rows, every pair kept once, each
  conversation whole), and the training iterator restored from its state gives the same
  batches."""
  from nnx_zoo.common.data import pipeline, tokenizers

  rng = np.random.default_rng(0)
  words = ["".join(rng.choice(list("abcdefghijklmnopqrstuvwxyz"), 6)) for _ in range(40)]
  _echo_pairs(tmp_path / "train.jsonl", words)
  over = {"data.kind": "files", "data.train_files": str(tmp_path / "train.jsonl")}
  over.update({"data.eval_plays": "", "train.batch_size": "2"})
  cfg = experiments.get_config("chat/shakespeare-dialogue-dpo:smoke", over)
  packed_cfg = experiments.get_config(
    "chat/shakespeare-dialogue-dpo:smoke", {**over, "data.pairs_per_row": "packed"}
  )
  tokenizer = tokenizers.load(cfg.data.tokenizer)
  one = pipeline.load_split(cfg.data, "train", tokenizer).packed
  packed = pipeline.load_split(packed_cfg.data, "train", tokenizer).packed
  assert len(packed["tokens"]) < len(one["tokens"]) == 40

  def conversations(rows):
    out = []
    L = rows["tokens"].shape[-1]
    for t, s in zip(rows["tokens"].reshape(-1, L), rows["segment_ids"].reshape(-1, L), strict=True):
      out += [tuple(t[s == k]) for k in np.unique(s[s > 0])]
    return sorted(out)

  assert conversations(packed) == conversations(one)
  data = trainer.load_data(packed_cfg)
  for _ in range(2):
    next(data.iterator)
  state = data.iterator.get_state()
  want = [next(data.iterator) for _ in range(3)]
  again = trainer.load_data(packed_cfg)
  again.iterator.set_state(state)
  for batch in want:
    got = next(again.iterator)
    for key in batch:
      np.testing.assert_array_equal(got[key], batch[key])


def test_prepared_packed_pairs_are_the_startup_rows(tmp_path):
  """The prepared kind packs a preference split's pairs as start-up does, row for row."""
  from nnx_zoo.common.data import pipeline, prepare, prepared, tokenizers

  rng = np.random.default_rng(0)
  words = ["".join(rng.choice(list("abcdefghijklmnopqrstuvwxyz"), 6)) for _ in range(30)]
  _echo_pairs(tmp_path / "train.jsonl", words[:24])
  _echo_pairs(tmp_path / "eval.jsonl", words[24:])
  over = {"data.kind": "files", "data.train_files": str(tmp_path / "train.jsonl")}
  over.update({"data.eval_files": str(tmp_path / "eval.jsonl"), "data.eval_plays": ""})
  over.update({"data.pairs_per_row": "packed", "train.batch_size": "2"})
  cfg = experiments.get_config("chat/shakespeare-dialogue-dpo:smoke", over)
  prepare.prepare(cfg.data, str(tmp_path / "prepared"), workers=1, progress=False)
  tokenizer = tokenizers.load(cfg.data.tokenizer)
  run = experiments.get_config(
    "chat/shakespeare-dialogue-dpo:smoke",
    {**over, "data.kind": "prepared", "data.path": str(tmp_path / "prepared")},
  )
  data = trainer.load_data(run)
  train = prepared.PairRows(
    prepared.Split(str(tmp_path / "prepared"), "train"), 129, pairs_per_row="packed"
  )
  for split, rows in (("train", train), ("eval", data.eval)):
    startup = pipeline.load_split(cfg.data, split, tokenizer).packed
    got = rows.read(np.arange(len(rows)))
    assert len(startup["tokens"]) < (24 if split == "train" else 6)  # packed at all
    for key in ("tokens", "segment_ids", "loss_weights"):
      np.testing.assert_array_equal(got[key], startup[key])


@pytest.mark.slow
def test_packed_pairs_train_and_resume_exactly(tmp_path, monkeypatch):
  """A LoRA dpo run on packed pairs trains (the reference per pair slot, the held-out sums),
  and killed in step 3 (after the step-2 checkpoint) and rerun, it logs the losses of a run
  straight through, bit for bit."""
  from nnx_zoo.common.train import metrics

  rng = np.random.default_rng(0)
  words = ["".join(rng.choice(list("abcdefghijklmnopqrstuvwxyz"), 6)) for _ in range(40)]
  _echo_pairs(tmp_path / "train.jsonl", words[:32])
  _echo_pairs(tmp_path / "eval.jsonl", words[32:])
  over = {"data.kind": "files", "data.train_files": str(tmp_path / "train.jsonl")}
  over.update({"data.eval_files": str(tmp_path / "eval.jsonl"), "data.rejected": ""})
  over.update({"data.pairs_per_row": "packed", "train.checkpoint_every": "2"})
  cfg = experiments.get_config("chat/smollm2-shakespeare-dpo:smoke", over)

  def logged(workdir):
    with open(tmp_path / workdir / "metrics.jsonl") as f:
      return [r for r in map(json.loads, f)]

  trainer.train(cfg, str(tmp_path / "straight"), progress=False)
  write = metrics.MetricsLog.write

  def crashing_write(self, step, values, split="train"):
    if step == 3:
      raise KeyboardInterrupt
    write(self, step, values, split)

  with monkeypatch.context() as m:
    m.setattr(metrics.MetricsLog, "write", crashing_write)
    with pytest.raises(KeyboardInterrupt):
      trainer.train(cfg, str(tmp_path / "resumed"), progress=False)
  trainer.train(cfg, str(tmp_path / "resumed"), progress=False)
  train = lambda rs: {r["step"]: r["loss"] for r in rs if r.get("split") != "eval"}  # noqa: E731
  assert train(logged("resumed")) == train(logged("straight"))
  held_out = [r for r in logged("straight") if r.get("split") == "eval"][-1]
  assert held_out["pairs"] == 8 and np.isfinite(held_out["loss"])
