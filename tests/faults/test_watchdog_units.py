"""The pieces of `zoo run --restarts` one at a time, in-process and in seconds: the fault spec of
$NNX_ZOO_INJECT, the watchdog thread (its limit, its dump, its progress file) and the supervisor
on stand-in children (tests/faults/test_supervisor.py runs them together on real runs)."""

import functools
import json
import os
import signal
import sys
import textwrap
import threading
import time
import typing

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from nnx_zoo.common import supervisor
from nnx_zoo.common.errors import UserError
from nnx_zoo.common.train import inject, watchdog
from nnx_zoo.common.train.inject import Fault

# The supervisor forks its child (to set it to die with its parent before exec): jax, imported in
# this test process but never in a supervisor's, warns of forking beside its threads.
pytestmark = pytest.mark.filterwarnings("ignore:os.fork:RuntimeWarning")

# $NNX_ZOO_INJECT


def test_the_spec_parses_into_its_faults():
  got = inject.parse(
    "hang@5:p1, exit@3,exit@3:7,kill@4,stop@4:p0,slow@*:p1:0.5,slow@2:0.25,stall@7:p0:1.5"
  )
  assert got == [
    Fault("hang", 5, 1, None),
    Fault("exit", 3, None, None),
    Fault("exit", 3, None, 7.0),
    Fault("kill", 4, None, None),
    Fault("stop", 4, 0, None),
    Fault("slow", None, 1, 0.5),
    Fault("slow", 2, None, 0.25),
    Fault("stall", 7, 0, 1.5),
  ]
  assert inject.parse("") == []


@pytest.mark.parametrize(
  "spec, words",
  [
    ("hang", "is not a fault"),
    ("boom@3", "is not a fault"),
    ("hang@", "is not a fault"),
    ("hang@x", "'x' is not a number"),
    ("hang@-1", "'-1' is not a number"),
    ("hang@*", "only slow and stall take step *"),
    ("slow@*:p1", "slow needs its seconds"),
    ("stall@3", "stall needs its seconds"),
    ("kill@3:5", "kill takes no argument"),
    ("exit@3:p1:2:3", "too many fields"),
    ("exit@3:px", "'x' is not a number"),
  ],
)
def test_a_malformed_spec_is_one_clear_error(spec, words):
  with pytest.raises(UserError, match=words) as e:
    inject.parse(spec)
  assert inject.ENV in str(e.value)


def test_a_fault_fires_on_its_process_once_per_workdir(tmp_path, monkeypatch):
  fired, slept = [], []
  monkeypatch.setattr(inject, "fire", lambda fault, **kw: fired.append((fault.name, kw)))
  monkeypatch.setattr(inject.time, "sleep", slept.append)
  faults = inject.parse("exit@3:p1:7,kill@4,slow@*:p1:0.5,stall@2:0.5")  # a stall fires nothing
  for process in (0, 1):
    for step in range(1, 6):
      inject.Injector(faults, workdir=str(tmp_path), process=process).at(step)
  # A second run of the same workdir (a restart) passes the steps whose faults fired.
  for step in range(1, 6):
    inject.Injector(faults, workdir=str(tmp_path), process=1).at(step)
  assert fired == [("kill@4", {"step": 4, "process": 0})] + [
    ("exit@3", {"step": 3, "process": 1}),
    ("kill@4", {"step": 4, "process": 1}),
  ]
  assert slept == [0.5] * 10  # process 1's steps only, every one, in both runs
  assert sorted(os.listdir(tmp_path / "injected")) == ["exit@3-p1", "kill@4-p0", "kill@4-p1"]


def test_nothing_is_injected_unless_the_variable_is_set(tmp_path, monkeypatch):
  monkeypatch.delenv(inject.ENV, raising=False)
  injector = inject.from_env(str(tmp_path), process=0)
  assert not injector.at_step and not injector.slow
  monkeypatch.setenv(inject.ENV, "hang@2")
  assert inject.from_env(str(tmp_path), process=0).at_step == {2: [Fault("hang", 2, None, None)]}


# The watchdog


@pytest.fixture
def fast(monkeypatch):
  monkeypatch.setattr(watchdog, "TICK_S", 0.05)
  monkeypatch.setattr(watchdog, "FIRST_S", 0.5)


def stuck_here(until: threading.Event):
  """The main thread's hung line."""
  until.wait(10)


def test_the_watchdog_dumps_every_stack_when_the_step_stands_still(tmp_path, fast, capfd):
  fired = threading.Event()
  dog = watchdog.Watchdog(0.5, workdir=str(tmp_path), process=3, on_hang=fired.set).start()
  try:
    for step in range(1, 6):  # steps faster than the limit: nothing fires
      time.sleep(0.1)
      dog.beat(step)
    assert not fired.is_set()
    start = time.monotonic()
    stuck_here(fired)
    waited = time.monotonic() - start
  finally:
    dog.stop()
  assert fired.is_set() and 0.5 <= waited < 1.5, waited
  (name,) = os.listdir(tmp_path / "hangs")
  assert name.startswith("p3-step5-") and dog.fired == str(tmp_path / "hangs" / name)
  text = (tmp_path / "hangs" / name).read_text()
  assert "process 3 " in text and "last step 5" in text and f"exit {watchdog.HUNG}" in text
  assert "in stuck_here" in text and "test_watchdog_units.py" in text
  assert "in stuck_here" in capfd.readouterr().err  # the log has it too


def test_start_up_and_evaluation_get_their_allowance(tmp_path, fast):
  fired = threading.Event()
  dog = watchdog.Watchdog(0.3, workdir=str(tmp_path), process=0, on_hang=fired.set).start()
  try:
    assert dog.limit_s() == pytest.approx(0.8)  # before the first step: FIRST_S more
    time.sleep(0.6)  # start-up and the first step, compiling, past the limit but within it
    dog.beat(1)
    assert dog.limit_s() == pytest.approx(0.3)
    with dog.allowing():
      time.sleep(0.6)  # evaluating
    time.sleep(0.15)
    dog.beat(2)
    assert not fired.is_set()
    fired.wait(2)
  finally:
    dog.stop()
  assert fired.is_set() and "step2" in dog.fired


def test_the_allowance_lasts_until_the_first_logged_step(tmp_path):
  # jax dispatches steps ahead; the loop first waits for them at its first logged step, so the
  # steps before it are no measure of a step's time (a distillation run under load waited 300 s
  # there for five queued steps and was taken as hung).
  dog = watchdog.Watchdog(watchdog.AUTO, workdir=str(tmp_path), process=0, warmup_steps=3)
  for step in (1, 2):
    dog.beat(step)
    assert dog.limit_s() == watchdog.AUTO_MIN_S + watchdog.FIRST_S
  dog.last -= 400.0  # the first logged step waited for the steps queued before it
  dog.beat(3)
  assert dog.limit_s() == pytest.approx(watchdog.AUTO_FACTOR * 400.0, rel=1e-3)


def test_the_automatic_limit_follows_the_slowest_recent_step(tmp_path):
  dog = watchdog.Watchdog(watchdog.AUTO, workdir=str(tmp_path), process=0)
  assert dog.limit_s() == watchdog.AUTO_MIN_S + watchdog.FIRST_S
  dog.last -= 100  # the first step (compiling) sets no limit of its own
  dog.beat(1)
  assert dog.limit_s() == watchdog.AUTO_MIN_S
  dog.last -= 40.0
  dog.beat(2)
  assert dog.limit_s() == pytest.approx(watchdog.AUTO_FACTOR * 40.0, rel=1e-3)
  for step in range(3, 3 + 2 * watchdog.WINDOW):  # two windows of fast steps forget it
    dog.beat(step)
  assert dog.limit_s() == watchdog.AUTO_MIN_S


def test_the_second_step_may_take_as_long_as_the_first(tmp_path):
  # A GRPO step that samples for minutes (an agentic one: 4 minutes here) is that long from
  # the first step on; the second, with nothing measured yet, was taken as hung at 300 s.
  dog = watchdog.Watchdog(watchdog.AUTO, workdir=str(tmp_path), process=0)
  dog.last -= 500.0
  dog.beat(1)
  assert dog.limit_s() == pytest.approx(watchdog.FIRST_FACTOR * 500.0, rel=1e-3)
  dog.last -= 20.0  # a measured step sets the limit from then on, the first forgotten
  dog.beat(2)
  assert dog.limit_s() == watchdog.AUTO_MIN_S


def test_the_progress_file_says_the_step_and_that_the_process_runs(tmp_path, fast):
  dog = watchdog.Watchdog(60, workdir=str(tmp_path), process=1).start()
  try:
    dog.beat(7)
    time.sleep(0.3)
    record = watchdog.read_progress(watchdog.progress_path(str(tmp_path), 1))
  finally:
    dog.stop()
  assert record["pid"] == os.getpid() and record["step"] == 7 and record["limit_s"] == 60
  assert 0 <= time.time() - record["t"] < 0.3 and record["step_t"] <= record["t"]
  # Stopped (the loop has ended): the supervisor is told to stop watching.
  assert watchdog.read_progress(watchdog.progress_path(str(tmp_path), 1))["limit_s"] is None


def test_off_watches_and_writes_nothing_and_a_negative_limit_is_refused(tmp_path, fast):
  dog = watchdog.Watchdog(0, workdir=str(tmp_path), process=0).start()
  dog.beat(1)
  time.sleep(0.2)
  dog.stop()
  assert dog.thread is None and not os.listdir(tmp_path)
  with pytest.raises(UserError, match=r"train.watchdog_s=-5: .* 0 \(no watchdog\)"):
    watchdog.Watchdog(-5, workdir=str(tmp_path), process=0)


# The supervisor, on stand-in children


@pytest.fixture
def quick(monkeypatch):
  monkeypatch.setattr(supervisor, "BACKOFF_S", 0.01)
  monkeypatch.setattr(supervisor, "POLL_S", 0.02)
  monkeypatch.setattr(watchdog, "EXIT_WAIT_S", 0.0)


def child(script: str, workdir) -> list[str]:
  """A child that runs `script` with ATTEMPT (0, 1, ...: counted in workdir) and PROGRESS set."""
  head = f"""
    import json, os, signal, sys, time
    WORKDIR = {str(workdir)!r}
    PROGRESS = {watchdog.progress_path(str(workdir), 0)!r}
    os.makedirs(WORKDIR, exist_ok=True)
    with open(os.path.join(WORKDIR, "attempts"), "a") as f:
      f.write("x")
    ATTEMPT = len(open(os.path.join(WORKDIR, "attempts")).read()) - 1
  """
  return [sys.executable, "-c", textwrap.dedent(head) + textwrap.dedent(script)]


def run(script, workdir, restarts) -> int:
  return supervisor.Supervisor(
    child(script, workdir), workdir=str(workdir), restarts=restarts, process=0
  ).run()


def restarts(workdir) -> list[dict]:
  path = workdir / "events" / "supervisor-p0.jsonl"
  return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def test_failures_are_restarted_and_recorded(tmp_path, quick):
  # Fails twice (an error, then a SIGKILL), with checkpoint 4 on disk at the second.
  script = """
    if ATTEMPT == 1:
      os.makedirs(os.path.join(WORKDIR, "checkpoints", "4"))
      os.makedirs(os.path.join(WORKDIR, "checkpoints", "6.orbax-checkpoint-tmp-1"))
      os.kill(os.getpid(), signal.SIGKILL)
    sys.exit(3 if ATTEMPT == 0 else 0)
  """
  assert run(script, tmp_path, restarts=2) == 0
  events = restarts(tmp_path)
  assert [(e["attempt"], e["cause"], e["resumed_from"]) for e in events] == [
    (1, "exit 3", 0),
    (2, "signal 9 (SIGKILL)", 4),
  ]
  assert all(e["event"] == "restart" and e["process"] == 0 for e in events)


def test_a_user_error_and_a_preemption_are_never_restarted(tmp_path, quick):
  assert run("sys.exit(2)", tmp_path / "a", restarts=3) == 2
  assert run("sys.exit(143)", tmp_path / "b", restarts=3) == 143
  assert not restarts(tmp_path / "a") and not restarts(tmp_path / "b")


def test_the_restarts_run_out(tmp_path, quick, capfd):
  assert run(f"sys.exit({watchdog.HUNG})", tmp_path, restarts=2) == watchdog.HUNG
  assert [e["cause"] for e in restarts(tmp_path)] == [f"watchdog (exit {watchdog.HUNG})"] * 2
  assert "no restart left (--restarts 2)" in capfd.readouterr().err


def test_a_child_that_cannot_end_itself_is_dumped_and_killed(tmp_path, quick):
  # Writes one progress record and then neither runs its watchdog nor advances: as if stopped.
  script = """
    os.makedirs(os.path.dirname(PROGRESS), exist_ok=True)
    now = time.time()
    record = dict(pid=os.getpid(), process=0, step=3, step_t=now, t=now, limit_s=0.3)
    open(PROGRESS, "w").write(json.dumps(record))
    time.sleep(60)
  """
  start = time.monotonic()
  assert run(script, tmp_path, restarts=0) == 128 + signal.SIGKILL
  assert time.monotonic() - start < 10
  (name,) = os.listdir(tmp_path / "hangs")
  text = (tmp_path / "hangs" / name).read_text()
  assert name.startswith("p0-supervisor-") and "no heartbeat for" in text
  assert '"step": 3' in text and "state S" in text  # its last progress, its threads' states


def test_a_child_whose_step_stands_still_past_its_limit_is_killed(tmp_path, quick, monkeypatch):
  monkeypatch.setattr(supervisor, "GRACE_S", 0.2)
  # Its heartbeat goes on, its step does not, and its own watchdog does not fire.
  script = """
    os.makedirs(os.path.dirname(PROGRESS), exist_ok=True)
    start = time.time()
    while True:
      record = dict(pid=os.getpid(), process=0, step=3, step_t=start, t=time.time(), limit_s=0.3)
      open(PROGRESS + ".tmp", "w").write(json.dumps(record))
      os.replace(PROGRESS + ".tmp", PROGRESS)
      time.sleep(0.02)
  """
  assert run(script, tmp_path, restarts=0) == 128 + signal.SIGKILL
  (name,) = os.listdir(tmp_path / "hangs")
  assert "no progress for" in (tmp_path / "hangs" / name).read_text()


def test_a_child_whose_loop_has_ended_is_not_watched(tmp_path, quick):
  # Its watchdog has stopped (limit_s None): its silence while it saves and exits is no stall.
  script = """
    os.makedirs(os.path.dirname(PROGRESS), exist_ok=True)
    record = dict(pid=os.getpid(), process=0, step=3, step_t=0, t=0, limit_s=None)
    open(PROGRESS, "w").write(json.dumps(record))
    time.sleep(1)
  """
  assert run(script, tmp_path, restarts=0) == 0


def test_sigterm_goes_to_the_child_and_nothing_restarts(tmp_path, quick):
  # The child stands for the trainer: SIGTERM saves and exits 143 (common/train/faults.py).
  script = """
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    open(os.path.join(WORKDIR, "ready"), "w").close()
    time.sleep(60)
  """

  def terminate():
    while not (tmp_path / "ready").exists():
      time.sleep(0.01)
    os.kill(os.getpid(), signal.SIGTERM)  # to the supervisor, which runs in this process

  threading.Thread(target=terminate, daemon=True).start()
  assert run(script, tmp_path, restarts=3) == 143
  assert not restarts(tmp_path)
  assert signal.getsignal(signal.SIGTERM) is not supervisor.Supervisor._forward  # restored


def test_the_process_index_and_the_last_checkpoint(tmp_path, monkeypatch):
  monkeypatch.delenv("SLURM_PROCID", raising=False)
  monkeypatch.delenv("OMPI_COMM_WORLD_RANK", raising=False)
  assert supervisor.process_index(None) == 0
  monkeypatch.setenv("SLURM_PROCID", "3")
  assert supervisor.process_index(None) == 3 and supervisor.process_index(1) == 1
  assert supervisor.latest_checkpoint(str(tmp_path)) == 0
  for name in ("2", "10", "12.orbax-checkpoint-tmp-5", "8.damaged"):
    (tmp_path / "checkpoints" / name).mkdir(parents=True)
  assert supervisor.latest_checkpoint(str(tmp_path)) == 10


class ToyState(typing.NamedTuple):
  step: jax.Array
  x: jax.Array


def test_a_stall_slows_its_step_inside_and_changes_no_output(tmp_path):
  """stall@2: the step's outputs are late by about the stall, the other steps' are not, and every
  output is the unstalled step's, bit for bit; without a stall the step is the same function."""

  @functools.partial(jax.jit, donate_argnums=0)
  def step_fn(state, batch):
    x = jnp.tanh(state.x * batch)
    return ToyState(state.step + 1, x), {"loss": jnp.sum(x**2), "skipped": jnp.int32(0)}

  plain = inject.Injector([], workdir=str(tmp_path), process=0)
  assert plain.step_fn(step_fn) is step_fn
  stalled = inject.Injector(inject.parse("stall@2:0.4"), workdir=str(tmp_path), process=0)
  stalled_fn = stalled.step_fn(step_fn)
  states = [ToyState(jnp.int32(0), jnp.linspace(-1.0, 1.0, 16)) for _ in range(2)]
  for n in range(1, 4):
    batch = jnp.float32(1.0 + n / 10)
    t0 = time.perf_counter()
    states[1], got = jax.block_until_ready(stalled_fn(states[1], batch))
    seconds = time.perf_counter() - t0
    states[0], want = step_fn(states[0], batch)
    assert int(states[1].step) == n and got.keys() == want.keys()
    pairs = zip(jax.tree.leaves((states[1], got)), jax.tree.leaves((states[0], want)), strict=True)
    for a, b in pairs:
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    if n == 2:
      assert seconds >= 0.2, seconds
    elif n == 3:  # (step 1 compiles)
      assert seconds < 0.2, seconds
