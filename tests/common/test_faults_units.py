"""The pieces of fault tolerance one at a time (tests/faults/ runs them together on real `zoo
run` processes): the non-finite guard and train.nonfinite, SIGTERM/SIGINT handling, damaged and
unfinished checkpoints, an unwritable workdir, and bad data."""

import json
import os
import pathlib
import re
import shutil
import signal

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest
from flax import nnx

from nnx_zoo.common import cli, experiments, files, tasks
from nnx_zoo.common.data import pipeline
from nnx_zoo.common.errors import Preempted, UserError
from nnx_zoo.common.hub import checkpoint, weights
from nnx_zoo.common.tasks import losses
from nnx_zoo.common.train import faults, metrics, optim, trainer
from nnx_zoo.common.train import step as steps

TASK = tasks.get("language_model")  # the task of every batch here

SMOKE = "lm/shakespeare-char:smoke"
BASE = {
  "train.steps": "6",
  "train.checkpoint_every": "2",
  "train.log_every": "1",
  "train.keep_checkpoints": "3",
  "train.eval_every": "0",
  "optim.schedule": "constant",
  "optim.warmup_steps": "2",
}


def smoke_config(overrides: dict | None = None) -> ml_collections.ConfigDict:
  return experiments.get_config(SMOKE, {**BASE, **(overrides or {})})


def records(workdir) -> list[dict]:
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    return [json.loads(line) for line in f if line.strip()]


def last_per_step(workdir) -> dict[int, dict]:
  """The last training record of each step (a resumed run logs again what it redoes)."""
  return {r["step"]: r for r in records(workdir) if "split" not in r}


def steps_on_disk(workdir) -> list[int]:
  return sorted(int(d) for d in os.listdir(checkpoint.directory(workdir)) if d.isdigit())


def flat(tree) -> dict:
  return {k: np.asarray(v.get_value()) for k, v in nnx.to_flat_state(tree)}


def assert_trees_equal(a, b):
  a, b = jax.tree.leaves(a), jax.tree.leaves(b)
  assert len(a) == len(b)
  for x, y in zip(a, b, strict=True):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
  """An uninterrupted 6-step run (checkpoints 2, 4, 6): its workdir."""
  workdir = str(tmp_path_factory.mktemp("reference") / "run")
  trainer.train(smoke_config(), workdir, progress=False)
  return workdir


# Divergence: the guard inside the step


def test_finite_refuses_nan_or_inf_in_the_loss_or_the_gradient_norm():
  check = jax.jit(faults.finite)
  for loss, norm, ok in [
    (1.0, 2.0, True),
    (jnp.nan, 2.0, False),
    (1.0, jnp.inf, False),
    (-jnp.inf, 0.0, False),
  ]:
    assert bool(check(jnp.float32(loss), jnp.float32(norm))) is ok


@pytest.mark.slow
def test_train_step_skips_a_non_finite_update_but_counts_the_step():
  cfg = smoke_config({"optim.warmup_steps": "0"})  # a first step that moves the params
  tx = optim.optimizer(cfg.optim, cfg.train.steps)
  graphdef, state = steps.init_state(cfg, tx)
  rows = pipeline.load_split(cfg.data, "train")
  batch = next(pipeline.train_iterator(rows, batch_size=cfg.train.batch_size, seed=0))
  step = jax.jit(lambda s, b: steps.train_step(s, b, graphdef=graphdef, task=TASK, tx=tx))

  good, metrics = step(state, batch)
  assert int(metrics["skipped"]) == 0 and int(good.step) == 1
  assert any((flat(good.params)[k] != v).any() for k, v in flat(state.params).items())

  # One NaN weight makes the loss and the gradients NaN: nothing may move but the step.
  leaves, treedef = jax.tree.flatten(state.params)
  leaves[0] = leaves[0].at[(0,) * leaves[0].ndim].set(jnp.nan)
  poisoned = jax.tree.unflatten(treedef, leaves)
  bad_state = steps.TrainState(state.step, poisoned, state.opt_state, state.rng)
  after, metrics = step(bad_state, batch)
  assert int(metrics["skipped"]) == 1 and np.isnan(float(metrics["loss"]))
  assert int(after.step) == 1
  assert_trees_equal(after.params, poisoned)
  assert_trees_equal(after.opt_state, state.opt_state)


class FakeCheckpoints:
  path = "/runs/x/checkpoints"

  def __init__(self, latest):
    self.latest = latest

  def latest_step(self):
    return self.latest


def test_nonfinite_skip_counts_and_stop_names_the_step_and_last_good_checkpoint():
  skip = faults.NonFinite("skip", FakeCheckpoints(4))
  for step, flag in [(5, 0), (6, 1), (7, 0), (8, 1)]:
    skip.observe(step, {"skipped": jnp.int32(flag)})
  skip.check()  # a save in between: counted, not lost
  skip.observe(9, {"skipped": jnp.int32(1)})
  assert skip.take() == 3 and skip.take() == 0

  stop = faults.NonFinite("stop", FakeCheckpoints(4))
  stop.observe(5, {"skipped": jnp.int32(0)})
  stop.check()
  for step in (6, 7):
    stop.observe(step, {"skipped": jnp.int32(1)})
  with pytest.raises(UserError, match=r"Step 6 .*step 4 \(/runs/x/checkpoints/4\)"):
    stop.check()
  with pytest.raises(UserError, match="no checkpoint yet"):
    none = faults.NonFinite("stop", FakeCheckpoints(None))
    none.observe(1, {"skipped": jnp.int32(1)})
    none.take()
  with pytest.raises(UserError, match="'ignore'"):
    faults.NonFinite("ignore", FakeCheckpoints(None))


def poison_step(cfg, step: int, monkeypatch):
  """Makes the loss NaN for the batch of `step` (and only it) in the runs that follow."""
  rows = pipeline.load_split(cfg.data, "train")
  batches = pipeline.train_iterator(rows, batch_size=cfg.train.batch_size, seed=cfg.seed)
  row = [next(batches) for _ in range(step)][-1]["tokens"][0]
  loss_sums = losses.loss_sums

  def poisoned(model, batch, **kw):
    total, count = loss_sums(model, batch, **kw)
    hit = jnp.all(batch["tokens"][0] == jnp.asarray(row))
    return total * jnp.where(hit, jnp.nan, 1.0), count  # NaN loss and gradients

  monkeypatch.setattr(losses, "loss_sums", poisoned)  # what the trainer's task_sums calls


@pytest.mark.slow
def test_nonfinite_skip_in_a_run(tmp_path, monkeypatch):
  overrides = {
    "train.nonfinite": "skip",
    "train.checkpoint_every": "1",
    "train.keep_checkpoints": "9",
  }
  cfg = smoke_config(overrides)
  poison_step(cfg, 3, monkeypatch)
  workdir = str(tmp_path / "run")
  trainer.train(cfg, workdir, progress=False)
  logged = last_per_step(workdir)
  assert [logged[s]["skipped"] for s in range(1, 7)] == [0, 0, 1, 0, 0, 0]
  assert np.isnan(logged[3]["loss"]) and all(np.isfinite(logged[s]["loss"]) for s in (4, 5, 6))
  # The state after step 3 is the state after step 2 (but for the step counter).
  ckpts = checkpoint.Checkpoints(workdir, read_only=True)
  try:
    abstract = steps.abstract_state(cfg, optim.optimizer(cfg.optim, cfg.train.steps))
    s2, s3, s4 = (ckpts.restore(s, abstract) for s in (2, 3, 4))
  finally:
    ckpts.close()
  assert (int(s2.step), int(s3.step)) == (2, 3)
  assert_trees_equal((s3.params, s3.opt_state), (s2.params, s2.opt_state))
  assert not all(np.array_equal(a, b) for a, b in zip(*map(jax.tree.leaves, (s3, s4)), strict=True))


@pytest.mark.slow
def test_nonfinite_stop_saves_nothing_after_the_bad_step(tmp_path, monkeypatch):
  # Logged every 10 steps, so it is the check before the step-4 save that finds step 3.
  cfg = smoke_config({"train.nonfinite": "stop", "train.log_every": "10"})
  poison_step(cfg, 3, monkeypatch)
  workdir = str(tmp_path / "run")
  with pytest.raises(UserError, match=r"Step 3 .*last good checkpoint is step 2") as e:
    trainer.train(cfg, workdir, progress=False)
  assert os.path.join(checkpoint.directory(workdir), "2") in str(e.value)
  assert steps_on_disk(workdir) == [2]
  assert not os.path.exists(os.path.join(workdir, "metrics.jsonl")) or not records(workdir)


# Preemption


def test_signals_defer_the_first_and_restore_the_previous_handlers():
  before = {s: signal.getsignal(s) for s in faults.Signals.HANDLED}
  signals = faults.Signals().install()
  try:
    signal.raise_signal(signal.SIGTERM)  # would end the process without the handler
    assert signals.received == signal.SIGTERM
    preempted = signals.preempted(7, "/runs/x/checkpoints")
    assert isinstance(preempted, Preempted) and preempted.exit_code == 143
    assert "SIGTERM after step 7" in str(preempted) and "/runs/x/checkpoints/7" in str(preempted)
    assert "Rerun" in str(preempted)
  finally:
    signals.restore()
  assert {s: signal.getsignal(s) for s in faults.Signals.HANDLED} == before


@pytest.fixture(autouse=True)
def python_sigint_handler():
  """Python's own SIGINT handler, as in a terminal: a background job (nohup, some CI runners)
  starts with SIGINT ignored, which these tests are not about."""
  before = signal.signal(signal.SIGINT, signal.default_int_handler)
  yield
  signal.signal(signal.SIGINT, before)


def test_a_second_signal_acts_at_once():
  before = signal.getsignal(signal.SIGINT)
  signals = faults.Signals().install()
  try:
    signal.raise_signal(signal.SIGINT)
    assert signals.received == signal.SIGINT
    with pytest.raises(KeyboardInterrupt):  # Python's own SIGINT handler, put back
      signal.raise_signal(signal.SIGINT)
    assert signal.getsignal(signal.SIGINT) is before
  finally:
    signals.restore()


@pytest.mark.slow
def test_sigint_saves_the_step_exits_130_and_the_rerun_loses_nothing(
  reference, tmp_path, monkeypatch, capsys
):
  workdir = str(tmp_path / "run")
  argv = ["run", SMOKE, "--workdir", workdir, "--quiet"] + [
    f"--config.{k}={v}" for k, v in BASE.items()
  ]
  write = metrics.MetricsLog.write

  def write_then_interrupt(self, step, metrics, split="train"):
    write(self, step, metrics, split)
    if step == 3:
      os.kill(os.getpid(), signal.SIGINT)

  with monkeypatch.context() as m:
    m.setattr(metrics.MetricsLog, "write", write_then_interrupt)
    assert cli.main(argv) == 130
  err = capsys.readouterr().err
  assert "SIGINT received" in err and "stopped by SIGINT after step 3" in err, err
  assert steps_on_disk(workdir) == [2, 3]  # step 3 is odd: saved because of the signal
  assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # handlers put back
  assert cli.main(argv) == 0
  assert [r["step"] for r in records(workdir)] == [1, 2, 3, 4, 5, 6]  # nothing redone
  assert {s: r["loss"] for s, r in last_per_step(workdir).items()} == {
    s: r["loss"] for s, r in last_per_step(reference).items()
  }


# Checkpoints: damaged and unfinished steps


def copy_run(reference, tmp_path) -> str:
  workdir = str(tmp_path / "copy")
  shutil.copytree(reference, workdir)
  return workdir


def damage(workdir, step: int):
  """Truncates the largest file of a step's state (the one holding the arrays)."""
  files = [
    os.path.join(d, f)
    for d, _, names in os.walk(os.path.join(checkpoint.directory(workdir), str(step), "state"))
    for f in names
  ]
  target = max(files, key=os.path.getsize)
  with open(target, "r+b") as f:
    f.truncate(os.path.getsize(target) // 2)
  return target


def abstract(cfg=None):
  cfg = cfg or smoke_config()
  return steps.abstract_state(cfg, optim.optimizer(cfg.optim, cfg.train.steps))


@pytest.mark.slow
def test_a_damaged_newest_checkpoint_is_set_aside_for_the_newest_good_one(
  reference, tmp_path, capfd
):
  workdir = copy_run(reference, tmp_path)
  damage(workdir, 6)
  ckpts = checkpoint.Checkpoints(workdir)
  try:
    state = ckpts.restore_latest(abstract())
    assert ckpts.latest_step() == 4
  finally:
    ckpts.close()
  assert int(state.step) == 4
  err = capfd.readouterr().err
  path = os.path.join(checkpoint.directory(workdir), "6")
  assert f"checkpoint {path} is damaged" in err and f"moved it to {path}.damaged" in err, err
  assert steps_on_disk(workdir) == [2, 4] and os.path.isdir(path + ".damaged")
  _, want, _ = weights.restore_params(smoke_config(), workdir)  # a fresh view agrees
  ckpts = checkpoint.Checkpoints(reference, read_only=True)
  try:
    assert_trees_equal(want, ckpts.restore(4, abstract()).params)
  finally:
    ckpts.close()


@pytest.mark.slow
def test_read_only_restore_skips_a_damaged_checkpoint_without_moving_it(reference, tmp_path, capfd):
  workdir = copy_run(reference, tmp_path)
  # restore_params reads params only: damage what every array needs (the largest file may hold
  # optimizer state alone, which it rightly does not miss).
  os.remove(os.path.join(checkpoint.directory(workdir), "6", "state", "manifest.ocdbt"))
  _, _, step = weights.restore_params(smoke_config(), workdir)
  assert step == 4
  assert "is damaged" in capfd.readouterr().err
  assert steps_on_disk(workdir) == [2, 4, 6]


@pytest.mark.slow
def test_when_no_checkpoint_restores_nothing_is_moved(reference, tmp_path):
  """A changed config fails on every step the way damage does: not damage, so kept."""
  workdir = copy_run(reference, tmp_path)
  other = abstract(smoke_config({"model.dim": "32"}))
  ckpts = checkpoint.Checkpoints(workdir)
  try:
    with pytest.raises(UserError, match="No checkpoint in .* restores") as e:
      ckpts.restore_latest(other)
  finally:
    ckpts.close()
  assert all(f"step {s}:" in str(e.value) for s in (2, 4, 6))
  assert steps_on_disk(workdir) == [2, 4, 6]
  assert not [d for d in os.listdir(checkpoint.directory(workdir)) if "damaged" in d]


@pytest.mark.slow
def test_an_unfinished_save_is_never_latest_and_is_removed_at_the_next_start(
  reference, tmp_path, capfd
):
  workdir = copy_run(reference, tmp_path)
  ckpt_dir = checkpoint.directory(workdir)
  tmp = os.path.join(ckpt_dir, "8.orbax-checkpoint-tmp")  # as a kill -9 mid-save leaves it
  shutil.copytree(os.path.join(ckpt_dir, "6"), tmp)
  ckpts, latest = checkpoint.open_latest(workdir)  # read-only: ignores it, leaves it
  ckpts.close()
  assert latest == 6 and os.path.isdir(tmp)
  ckpts = checkpoint.Checkpoints(workdir)
  ckpts.close()
  assert not os.path.exists(tmp) and steps_on_disk(workdir) == [2, 4, 6]
  assert f"removed {tmp}" in capfd.readouterr().err


# Disk (common/files.py)


def test_unwritable_workdirs_are_user_errors(tmp_path):
  a_file = tmp_path / "a_file"
  a_file.write_text("not a directory")
  for workdir in (a_file / "run", a_file, "/proc/zoo-run"):
    with pytest.raises(UserError, match=re.escape(str(workdir))):
      files.check_writable(str(workdir))
  files.check_writable(str(tmp_path / "fine"))
  assert os.listdir(tmp_path / "fine") == []  # the probe is gone


def test_replacing_shows_readers_the_old_file_until_the_new_one_is_whole(tmp_path):
  """How process 0 rewrites a workdir's config.json while the other processes of a resumed run
  read it: through a temporary file renamed into place, never by truncating the one there."""
  path = str(tmp_path / "config.json")
  with open(path, "w") as f:
    f.write("old")
  with files.replacing(path) as tmp, open(tmp, "w") as f:
    f.write("new, half")
    f.flush()
    with open(path) as reader:  # mid-write, a reader still gets the whole old file
      assert reader.read() == "old"
    f.write(" and whole")
  assert pathlib.Path(path).read_text() == "new, half and whole"
  with pytest.raises(RuntimeError), files.replacing(path) as tmp:
    with open(tmp, "w") as f:
      f.write("never finished")
    raise RuntimeError("killed mid-write")
  assert pathlib.Path(path).read_text() == "new, half and whole"
  assert os.listdir(tmp_path) == ["config.json"]  # no temporary file left behind


def test_train_refuses_an_unwritable_workdir_before_loading_anything(tmp_path, monkeypatch):
  monkeypatch.setattr(pipeline, "load_split", lambda *a, **k: pytest.fail("data was loaded"))
  (tmp_path / "a_file").write_text("")
  with pytest.raises(UserError, match="Cannot write"):
    trainer.train(smoke_config(), str(tmp_path / "a_file" / "run"), progress=False)
  os.makedirs(tmp_path / "run")
  (tmp_path / "run" / "checkpoints").write_text("")  # a file where the directory goes
  with pytest.raises(UserError, match=re.escape(str(tmp_path / "run" / "checkpoints"))):
    trainer.train(smoke_config(), str(tmp_path / "run"), progress=False)


# Bad data


def files_config(tmp_path, text: str | bytes, name: str = "train.txt", **kw):
  path = tmp_path / name
  path.write_bytes(text if isinstance(text, bytes) else text.encode())
  return pipeline.config(kind="files", train_files=str(path), seq_len=8, **kw), path


def test_a_binary_file_that_is_valid_utf8_is_refused(tmp_path):
  cfg, path = files_config(tmp_path, b"\x00\x01\x02 weights" * 10, name="model.bin")
  with pytest.raises(UserError, match=re.escape(f"{path} is not a text file")):
    pipeline.load_split(cfg, "train")


def test_long_records_split_by_default_or_refused(tmp_path):
  lines = [json.dumps({"text": t}) for t in ("short", "a record far longer than one row", "ok")]
  cfg, _ = files_config(tmp_path, "\n".join(lines), name="train.jsonl")
  assert pipeline.load_split(cfg, "train") is not None  # split: continues into the next rows
  cfg.long_records = "error"
  with pytest.raises(UserError, match=r"Document 2 of the train data \('a record far.*32 tokens"):
    pipeline.load_split(cfg, "train")
  cfg.long_records = "truncate"
  with pytest.raises(UserError, match="'truncate'"):
    pipeline.load_split(cfg, "train")


def test_eval_files_that_match_nothing_name_their_key(tmp_path):
  cfg, _ = files_config(tmp_path, "some text " * 10)
  cfg.eval_files = str(tmp_path / "missing.txt")
  with pytest.raises(UserError, match=r"data\.eval_files"):
    pipeline.load_split(cfg, "eval")


def test_a_config_json_without_checkpoints_does_not_lock_the_workdir(tmp_path):
  """A run refused for bad data leaves config.json; the corrected rerun must not be refused."""
  workdir = str(tmp_path / "run")

  def start(cfg):  # what `train` does before its first step
    trainer.check_workdir(cfg, workdir)
    trainer.write_config(cfg, workdir)

  start(smoke_config({"data.eval_plays": "hamlet"}))
  start(smoke_config())  # different data, but nothing trained yet
  os.makedirs(os.path.join(checkpoint.directory(workdir), "2"))
  with pytest.raises(UserError, match="different model or data"):
    trainer.check_workdir(smoke_config({"data.eval_plays": "hamlet"}), workdir)
  trainer.check_workdir(smoke_config({"data.long_records": "error"}), workdir)  # not a change
  trainer.check_workdir(smoke_config({"model.drop_path": "0.1"}), workdir)  # how it trains
