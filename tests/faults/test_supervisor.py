"""The watchdog and `zoo run --restarts` on real processes (lm/shakespeare-char:smoke, 10 steps):
one process of two hangs, stops (SIGSTOP) or the one process is killed five times; every time the
job comes back by itself and ends with the parameters of an uninterrupted run, bit for bit. A
SIGTERM to the supervisors saves and restarts nothing; a bad config is one line and no restart.

Faults are injected through $NNX_ZOO_INJECT (common/train/inject.py); two processes run on
127.0.0.1 with one CPU device each. The module prints the time from a hang to the job resumed.
"""

import json
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import time

import numpy as np
import pytest
from flax import nnx

from nnx_zoo.common import experiments
from nnx_zoo.common.hub import weights
from nnx_zoo.common.train import watchdog

pytestmark = pytest.mark.slow

SMOKE = "lm/shakespeare-char:smoke"
STEPS = 10
WATCHDOG_S = 8
OVERRIDES = {
  "train.steps": str(STEPS),
  "train.checkpoint_every": "2",
  "train.keep_checkpoints": "2",
  "train.log_every": "1",
  "train.eval_every": "0",
  "train.watchdog_s": str(WATCHDOG_S),
  "optim.schedule": "constant",
  "optim.warmup_steps": "2",
}
SEED = int(os.environ.get("FAULT_SEED", "0"))
ZOO = shutil.which("zoo", path=os.path.dirname(sys.executable)) or shutil.which("zoo")
REPORT: list[str] = []


@pytest.fixture(scope="module", autouse=True)
def report(request, tmp_path_factory):
  Job.logs = str(tmp_path_factory.mktemp("logs"))
  yield
  capture = request.config.pluginmanager.getplugin("capturemanager")
  with capture.global_and_fixture_disabled():
    for line in REPORT:
      print(f"\n[supervisor] {line}", end="")
    print()


def free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


class Job:
  """`zoo run` as `processes` processes on 127.0.0.1 (one CPU device each), under supervisors
  when `restarts` is given; the output of each in files under `Job.logs`."""

  count, logs = 0, ""

  def __init__(self, workdir, *, processes=1, restarts=None, inject="", **overrides):
    Job.count += 1
    self.workdir = str(workdir)
    argv = [ZOO, "run", SMOKE, "--workdir", self.workdir, "--quiet"]
    overrides = {**OVERRIDES, "mesh.data": str(processes), **overrides}
    argv += [f"--config.{k}={v}" for k, v in overrides.items()]
    if restarts is not None:
      argv += ["--restarts", str(restarts)]
    if processes > 1:
      argv += ["--coordinator", f"127.0.0.1:{free_port()}", "--num-processes", str(processes)]
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    if inject:
      env["NNX_ZOO_INJECT"] = inject
    self.logs = [os.path.join(Job.logs, f"job{Job.count}-p{i}") for i in range(processes)]
    self.procs = []
    for i, log in enumerate(self.logs):
      mine = argv + (["--process-id", str(i)] if processes > 1 else [])
      with open(log + ".err", "w") as err:
        self.procs.append(subprocess.Popen(mine, stdout=subprocess.DEVNULL, stderr=err, env=env))

  def wait(self, timeout=900) -> list[int]:  # a loaded 2-core machine: minutes a start-up
    deadline = time.monotonic() + timeout
    for p in self.procs:
      try:
        p.wait(timeout=max(deadline - time.monotonic(), 1))
      except subprocess.TimeoutExpired:
        for q in self.procs:
          q.kill()
        raise AssertionError(f"no end in {timeout} s:\n{self.stderr(0)[-3000:]}") from None
    return [p.returncode for p in self.procs]

  def stderr(self, i: int) -> str:
    with open(self.logs[i] + ".err") as f:
      return f.read()


def logged(workdir) -> list[dict]:
  path = os.path.join(workdir, "metrics.jsonl")
  if not os.path.exists(path):
    return []
  with open(path) as f:
    lines = f.read().split("\n")[:-1]  # a line being written is left out
  return [r for r in map(json.loads, lines) if "split" not in r]


def restarts(workdir, process: int) -> list[dict]:
  path = os.path.join(workdir, "events", f"supervisor-p{process}.jsonl")
  if not os.path.exists(path):
    return []
  with open(path) as f:
    return [json.loads(line) for line in f]


def read(path) -> str:
  with open(path) as f:
    return f.read()


def params(workdir) -> dict:
  _, state, step = weights.restore_params(experiments.get_config(SMOKE, OVERRIDES), workdir)
  assert step == STEPS
  return {k: np.asarray(v.get_value()) for k, v in nnx.to_flat_state(state)}


def assert_equal_params(workdir, reference):
  want, got = params(reference), params(workdir)
  assert got.keys() == want.keys()
  for key in want:
    np.testing.assert_array_equal(got[key], want[key], err_msg=str(key))


@pytest.fixture(scope="module")
def reference_one(tmp_path_factory):
  """An uninterrupted run of one process."""
  workdir = tmp_path_factory.mktemp("one") / "run"
  job = Job(workdir)
  assert job.wait() == [0], job.stderr(0)[-3000:]
  return str(workdir)


@pytest.fixture(scope="module")
def reference_two(tmp_path_factory):
  """An uninterrupted run of two processes."""
  workdir = tmp_path_factory.mktemp("two") / "run"
  job = Job(workdir, processes=2)
  assert job.wait() == [0, 0], job.stderr(0)[-3000:] + job.stderr(1)[-3000:]
  return str(workdir)


def test_a_hang_fires_both_watchdogs_and_the_restarted_job_ends_equal(tmp_path, reference_two):
  """Process 1's main thread hangs before step 5 (its heartbeats go on, so JAX sees nothing):
  both watchdogs fire within watchdog_s and a few seconds, their dumps name the hung line, and
  under --restarts 2 both supervisors restart and the job ends as an uninterrupted one."""
  workdir = str(tmp_path / "run")
  job = Job(workdir, processes=2, restarts=2, inject="hang@5:p1")
  # When the job is back: after the restart, a line of the step after the checkpoint it resumed
  # from (one step of both processes together).
  resumed_at, lines = None, None
  deadline = time.monotonic() + 900
  while any(p.poll() is None for p in job.procs) and time.monotonic() < deadline:
    events = restarts(workdir, 0) and restarts(workdir, 1)
    if events and lines is None:
      lines = len(logged(workdir))
    if events and resumed_at is None:
      after = logged(workdir)[lines:]
      if after and after[0]["step"] == events[0]["resumed_from"] + 1:
        resumed_at = time.time()
    time.sleep(0.05)
  assert job.wait() == [0, 0], job.stderr(0)[-3000:] + job.stderr(1)[-3000:]

  hung_at = os.path.getmtime(os.path.join(workdir, "injected", "hang@5-p1"))
  dumps = {
    p: [n for n in os.listdir(os.path.join(workdir, "hangs")) if n.startswith(f"p{p}-")]
    for p in (0, 1)
  }
  for p in (0, 1):
    assert len(dumps[p]) == 1, dumps
    path = os.path.join(workdir, "hangs", dumps[p][0])
    fired = os.path.getmtime(path) - hung_at
    assert fired < WATCHDOG_S + 6, (p, fired)
    text = read(path)
    assert f"process {p} " in text and "made no step" in text
    assert "trainer.py" in text  # the loop's line it stands on
    if p == 1:
      assert re.search(r'inject\.py", line \d+ in hang', text), text
    REPORT.append(f"hang: process {p}'s watchdog fired {fired:.1f} s after the hang")
    assert "watchdog: process" in job.stderr(p)  # and the log says so too
  for p in (0, 1):
    (event,) = restarts(workdir, p)
    assert event["attempt"] == 1 and event["process"] == p
    assert event["resumed_from"] == 4
  # The hung process leaves by its watchdog's exit, or (when the coordinator, process 0, has
  # left first after its own dump) by JAX's abort: the dumps above are written either way.
  causes = (f"watchdog (exit {watchdog.HUNG})", "signal 6 (SIGABRT)")
  assert restarts(workdir, 1)[0]["cause"] in causes
  assert resumed_at is not None
  last_restart = max(restarts(workdir, p)[0]["t"] for p in (0, 1)) - hung_at
  REPORT.append(f"hang: the last supervisor restarted its child {last_restart:.1f} s after it")
  REPORT.append(
    f"hang: {resumed_at - hung_at:.1f} s from the hang to the job resumed (its first step "
    f"logged after the restart; watchdog_s {WATCHDOG_S})"
  )
  assert_equal_params(workdir, reference_two)


def test_a_stopped_child_is_killed_by_its_supervisor_and_ends_equal(tmp_path, reference_two):
  """SIGSTOP on process 1 before step 5: it cannot run its own watchdog, so its supervisor sees
  its heartbeat stop, writes what it can see and kills it; process 0 ends by JAX's heartbeat or
  its watchdog; both restart and the job ends as an uninterrupted one."""
  workdir = str(tmp_path / "run")
  job = Job(workdir, processes=2, restarts=2, inject="stop@5:p1")
  assert job.wait() == [0, 0], job.stderr(0)[-3000:] + job.stderr(1)[-3000:]
  seen = [n for n in os.listdir(os.path.join(workdir, "hangs")) if n.startswith("p1-supervisor")]
  assert len(seen) == 1
  text = read(os.path.join(workdir, "hangs", seen[0]))
  assert "no heartbeat" in text and "state T" in text, text
  (event,) = restarts(workdir, 1)
  assert event["cause"].startswith("no heartbeat")
  REPORT.append(f"stop: process 0 restarted after {restarts(workdir, 0)[0]['cause']}")
  assert_equal_params(workdir, reference_two)


def test_five_kills_at_random_steps_end_equal(tmp_path, reference_one):
  rng = random.Random(SEED)
  steps = sorted(rng.sample(range(2, STEPS + 1), 5))
  workdir = str(tmp_path / "run")
  job = Job(workdir, restarts=5, inject=",".join(f"kill@{s}" for s in steps))
  assert job.wait() == [0], job.stderr(0)[-3000:]
  events = restarts(workdir, 0)
  assert [e["cause"] for e in events] == ["signal 9 (SIGKILL)"] * 5
  assert [e["attempt"] for e in events] == [1, 2, 3, 4, 5]
  REPORT.append(f"kills at steps {steps}: resumed from {[e['resumed_from'] for e in events]}")
  assert_equal_params(workdir, reference_one)


def test_sigterm_to_the_supervisors_saves_and_restarts_nothing(tmp_path):
  workdir = str(tmp_path / "run")
  job = Job(workdir, processes=2, restarts=2, **{"train.steps": "1000"})
  deadline = time.monotonic() + 600
  while len(logged(workdir)) < 3:
    assert all(p.poll() is None for p in job.procs), job.stderr(0)[-3000:]
    assert time.monotonic() < deadline, "no step 3 in time"
    time.sleep(0.01)
  for p in job.procs:
    p.send_signal(signal.SIGTERM)
  assert job.wait() == [128 + signal.SIGTERM] * 2, job.stderr(0)[-3000:]
  stopped = [re.search(r"stopped by SIGTERM.* after step (\d+)", job.stderr(i)) for i in (0, 1)]
  assert all(stopped), job.stderr(0)[-3000:]
  step = int(stopped[0][1])
  assert os.path.isdir(os.path.join(workdir, "checkpoints", str(step)))
  assert not restarts(workdir, 0) and not restarts(workdir, 1)
  assert "restart" not in job.stderr(0) + job.stderr(1)


def test_a_bad_config_under_restarts_is_one_line_and_no_restart(tmp_path):
  workdir = str(tmp_path / "run")
  job = Job(workdir, restarts=3, **{"train.watchdog_s": "-5"})
  assert job.wait() == [2]
  err = job.stderr(0)
  assert err.count("zoo: error:") == 1 and "train.watchdog_s=-5" in err, err
  assert "Traceback" not in err and "restart" not in err, err
  assert not os.path.exists(workdir)
