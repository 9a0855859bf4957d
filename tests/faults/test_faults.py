"""Fault injection on real `zoo run` processes (lm/shakespeare-char:smoke, 16 steps): SIGKILL at
random steps and in the middle of an asynchronous save, SIGTERM, a damaged checkpoint, an
unwritable workdir and bad data. Whatever happens, the run completes on rerun with the losses
and parameters of an uninterrupted run, bit for bit, and never takes a half-written checkpoint.

The kill points are drawn from a seeded generator (FAULT_SEED to vary them); the module prints
how many faults it injected and how long it took.
"""

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from flax import nnx

from nnx_zoo.common import experiments
from nnx_zoo.common.hub import checkpoint, weights

pytestmark = pytest.mark.slow

SMOKE = "lm/shakespeare-char:smoke"
STEPS = 16
# A constant schedule and no evaluation: short runs whose every step is comparable.
OVERRIDES = {
  "train.steps": str(STEPS),
  "train.checkpoint_every": "2",
  "train.keep_checkpoints": "2",
  "train.log_every": "1",
  "train.eval_every": "0",
  "optim.schedule": "constant",
  "optim.warmup_steps": "2",
}
SEED = int(os.environ.get("FAULT_SEED", "0"))
TMP = ".orbax-checkpoint-tmp"
ZOO = shutil.which("zoo", path=os.path.dirname(sys.executable)) or shutil.which("zoo")

FAULTS: list[str] = []  # one line per injected fault, printed at the end


@pytest.fixture(scope="module", autouse=True)
def report(request, tmp_path_factory):
  Run.logs = str(tmp_path_factory.mktemp("logs"))
  start = time.perf_counter()
  yield
  capture = request.config.pluginmanager.getplugin("capturemanager")
  with capture.global_and_fixture_disabled():
    print(f"\n[faults] {len(FAULTS)} faults injected in {time.perf_counter() - start:.0f} s:")
    for line in FAULTS:
      print(f"[faults]   {line}")


class Run:
  """A `zoo run` subprocess on `workdir`, its output in files under `Run.logs`."""

  count, logs = 0, ""

  def __init__(self, workdir, **overrides):
    Run.count += 1
    config = {**OVERRIDES, **overrides}
    argv = [ZOO, "run", SMOKE, "--workdir", str(workdir), "--quiet"]
    argv += [f"--config.{k}={v}" for k, v in config.items()]
    self.workdir = str(workdir)
    self.log = os.path.join(Run.logs, f"run{Run.count}")
    with open(self.log + ".out", "w") as out, open(self.log + ".err", "w") as err:
      self.proc = subprocess.Popen(argv, stdout=out, stderr=err)

  def wait(self, timeout=120) -> int:
    return self.proc.wait(timeout=timeout)

  @property
  def stderr(self) -> str:
    with open(self.log + ".err") as f:
      return f.read()

  def until(self, what: str, condition, timeout=90):
    """Polls `condition()` every 2 ms; the process must still be running when it holds."""
    deadline = time.monotonic() + timeout
    while not condition():
      assert self.proc.poll() is None, f"the run ended (rc {self.proc.returncode}) before {what}"
      assert time.monotonic() < deadline, f"timed out waiting for {what}"
      time.sleep(0.002)

  def kill(self, signum=signal.SIGKILL) -> int:
    self.proc.send_signal(signum)
    return self.wait()


def logged(workdir) -> list[dict]:
  """The training lines of metrics.jsonl (a line being written is left out)."""
  path = os.path.join(workdir, "metrics.jsonl")
  if not os.path.exists(path):
    return []
  out = []
  with open(path) as f:
    for line in f:
      try:
        record = json.loads(line)
      except json.JSONDecodeError:
        break
      if "split" not in record:
        out.append(record)
  return out


def last_step(workdir) -> int:
  lines = logged(workdir)
  return lines[-1]["step"] if lines else 0


def entries(workdir) -> list[str]:
  path = checkpoint.directory(workdir)
  return sorted(os.listdir(path)) if os.path.isdir(path) else []


def finished(workdir) -> list[int]:
  return sorted(int(n) for n in entries(workdir) if n.isdigit())


def latest(workdir) -> int | None:
  """The step orbax itself takes as the latest (read-only: it changes nothing)."""
  ckpts = checkpoint.Checkpoints(workdir, read_only=True)
  try:
    return ckpts.latest_step()
  finally:
    ckpts.close()


def losses(workdir) -> dict[int, float]:
  """The last logged loss of each step: a resumed run logs again the steps it redoes."""
  return {r["step"]: r["loss"] for r in logged(workdir)}


def params(workdir) -> dict:
  _, state, step = weights.restore_params(experiments.get_config(SMOKE, OVERRIDES), workdir)
  assert step == STEPS
  return {k: np.asarray(v.get_value()) for k, v in nnx.to_flat_state(state)}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
  """An uninterrupted run."""
  workdir = tmp_path_factory.mktemp("reference") / "run"
  run = Run(workdir)
  assert run.wait() == 0, run.stderr
  assert list(losses(workdir)) == list(range(1, STEPS + 1))
  return str(workdir)


def test_kills_preemption_and_damage_lose_nothing(reference, tmp_path):
  rng = random.Random(SEED)
  workdir = str(tmp_path / "run")

  # 1. SIGKILL at a random step.
  run = Run(workdir)
  k = rng.randint(2, 5)
  run.until(f"step {k}", lambda: last_step(workdir) >= k)
  assert run.kill() == -signal.SIGKILL
  FAULTS.append(f"SIGKILL after step {last_step(workdir)} was logged")

  # 2. SIGKILL in the middle of the asynchronous save two saves after the resumed step: the
  # steps before it stay, garbage collection (keep 2) having removed nothing for it yet.
  resumed = latest(workdir) or 0
  target = max(8, resumed + 4)
  prefix = f"{target}{TMP}"
  run = Run(workdir)
  run.until(
    f"the save of step {target}", lambda: any(n.startswith(prefix) for n in entries(workdir))
  )
  time.sleep(rng.uniform(0.0, 0.04))
  assert run.kill() == -signal.SIGKILL
  left = [n for n in entries(workdir) if n.startswith(prefix)]
  assert left, f"step {target} was finished before the kill landed: not a kill during a save"
  assert finished(workdir) == [target - 4, target - 2], entries(workdir)
  assert latest(workdir) == target - 2
  FAULTS.append(f"SIGKILL during the save of step {target} (left {left[0]})")

  # 3. SIGTERM at a random step: that step is saved, the exit says so, and nothing is lost.
  run = Run(workdir)
  k = rng.randint(target + 1, target + 2)
  run.until(f"step {k}", lambda: last_step(workdir) >= k)
  assert run.kill(signal.SIGTERM) == 128 + signal.SIGTERM, run.stderr
  stopped = last_step(workdir)
  assert f"stopped by SIGTERM after step {stopped}" in run.stderr, run.stderr
  assert "Rerun the same command to resume" in run.stderr
  assert f"removed {checkpoint.directory(workdir)}/{left[0]}" in run.stderr
  assert latest(workdir) == stopped and not [n for n in entries(workdir) if TMP in n]
  FAULTS.append(f"SIGTERM during step {stopped}")

  # 4. The rerun starts right after the SIGTERM's step; SIGKILL it at a random later step.
  lines_before = len(logged(workdir))
  run = Run(workdir)
  run.until("a new step", lambda: len(logged(workdir)) > lines_before)
  assert logged(workdir)[lines_before]["step"] == stopped + 1  # no step lost
  k = rng.randint(stopped + 2, max(stopped + 2, STEPS - 3))
  run.until(f"step {k}", lambda: last_step(workdir) >= k)
  assert run.kill() == -signal.SIGKILL
  FAULTS.append(f"SIGKILL after step {last_step(workdir)} was logged")

  # 5. Damage the newest checkpoint; the rerun sets it aside, resumes from the one before and
  # completes.
  newest = latest(workdir)
  state_dir = os.path.join(checkpoint.directory(workdir), str(newest), "state")
  files = [os.path.join(d, f) for d, _, names in os.walk(state_dir) for f in names]
  target = max(files, key=os.path.getsize)
  with open(target, "r+b") as f:
    f.truncate(os.path.getsize(target) // 2)
  FAULTS.append(f"truncated {os.path.relpath(target, workdir)}")
  run = Run(workdir)
  assert run.wait() == 0, run.stderr
  damaged = os.path.join(checkpoint.directory(workdir), str(newest))
  assert f"checkpoint {damaged} is damaged" in run.stderr, run.stderr
  assert os.path.isdir(damaged + ".damaged")

  # The result: every step's loss and the final parameters of the uninterrupted run.
  assert losses(workdir) == losses(reference)
  want, got = params(reference), params(workdir)
  assert got.keys() == want.keys()
  for key in want:
    np.testing.assert_array_equal(got[key], want[key], err_msg=str(key))
  assert latest(workdir) == STEPS
  assert not [n for n in entries(workdir) if TMP in n]


# Bad input: one clear error each (exit code 2, no traceback), before any step runs.


def bad_inputs(tmp_path) -> dict[str, tuple[dict, str, list[str]]]:
  """name -> (overrides, workdir, words the error must contain)."""
  text = tmp_path / "ok.txt"
  text.write_text("To be, or not to be, that is the question. " * 40)
  empty = tmp_path / "empty.txt"
  empty.write_text("")
  binary = tmp_path / "weights.bin"
  binary.write_bytes(bytes(range(256)) * 8)  # not UTF-8
  nul = tmp_path / "array.npy"
  nul.write_bytes(b"\x00\x00\x00 looks like text " * 40)  # UTF-8, but binary
  records = tmp_path / "records.jsonl"
  records.write_text(json.dumps({"text": "short"}) + "\n" + json.dumps({"text": "long " * 20}))
  tokenizer = tmp_path / "tokenizer.json"
  tokenizer.write_text('{"version": "1.0", "model": ')  # cut short
  a_file = tmp_path / "a_file"
  a_file.write_text("")

  def files(path, **kw):
    return {"data.kind": "files", "data.train_files": str(path), "data.eval_plays": "", **kw}

  ok = files(text)
  return {
    "missing data path": (files(tmp_path / "nope" / "*.txt"), "w1", ["nope", "data.train_files"]),
    "empty data path": (files(""), "w2", ["No data files given"]),
    "empty data file": (files(empty), "w3", ["empty"]),
    "binary data file": (files(binary), "w4", [str(binary), "not a UTF-8 text file"]),
    "NUL bytes in data": (files(nul), "w5", [str(nul), "not a text file"]),
    "record longer than a row": (
      files(records, **{"data.long_records": "error", "data.seq_len": "16"}),
      "w6",
      ["Document 2", "data.long_records"],
    ),
    "tokenizer file that does not load": (
      {**ok, "data.tokenizer.kind": "hf", "data.tokenizer.path": str(tokenizer)},
      "w7",
      [str(tokenizer), "does not load"],
    ),
    "workdir under a file": (ok, str(a_file / "run"), [str(a_file / "run"), "Cannot write"]),
    "workdir under /proc": (ok, "/proc/zoo-fault-test/run", ["/proc/zoo-fault-test", "Cannot"]),
  }


def test_bad_input_is_one_clear_error_before_any_step(tmp_path):
  cases = bad_inputs(tmp_path)
  runs = {}
  for name, (overrides, workdir, _) in cases.items():
    workdir = workdir if os.path.isabs(workdir) else str(tmp_path / workdir)
    runs[name] = Run(workdir, **overrides)  # all at once: each ends during start-up
  for name, (_, _, words) in cases.items():
    run = runs[name]
    code, err = run.wait(), run.stderr
    FAULTS.append(f"bad input: {name}")
    assert code == 2, f"{name}: exit code {code}\n{err}"
    assert "Traceback" not in err, f"{name}:\n{err}"
    message = [line for line in err.splitlines() if line.startswith("zoo: error:")]
    assert message, f"{name}:\n{err}"
    for word in words:
      assert word in err, f"{name}: {word!r} not in:\n{err}"
    assert not logged(run.workdir), f"{name}: a step ran"
    assert not finished(run.workdir), f"{name}: a checkpoint was written"
