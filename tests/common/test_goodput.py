"""common/train/goodput.py and events.py: every figure of `zoo goodput` against a timeline written
by hand (its shares counted by hand); steps timed when their outputs are ready, not when they are
dispatched; on real `zoo run` processes, a SIGKILL and a rerun, the steps done again named as lost
progress; and runs in this process, steady or with a step stalled inside."""

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time

import jax.numpy as jnp
import numpy as np
import pytest

from nnx_zoo.common import cli, experiments
from nnx_zoo.common.errors import UserError
from nnx_zoo.common.train import events, goodput, trainer
from nnx_zoo.common.train import inject as inject_env

T0 = 1_000_000.0  # the fabricated timeline's origin (seconds since the epoch)


def line(t, event, attempt, **fields):
  return {"t": T0 + t, "event": event, "process": 0, "attempt": attempt, **fields}


def step(attempt, n, start, seconds, data):
  return line(
    start + seconds, "step", attempt, step=n, start=T0 + start, seconds=seconds, data=data
  )


def write(workdir, name, lines):
  os.makedirs(os.path.join(workdir, "events"), exist_ok=True)
  with open(os.path.join(workdir, "events", name), "w") as f:
    f.writelines(json.dumps(x) + "\n" for x in lines)


# Attempt "a": the process starts at 0; devices at 10; a fresh state (restore step 0) by 12;
# step 1 from 20 to 28 (1 s of data wait, a 5 s compilation), step 2 28-30, its permanent
# checkpoint 30-31, steps 3 (0.5 s of data wait) and 4, 2 s each, to 35; killed then (a line cut
# short by the kill follows).
# Attempt "b": starts at 40; devices at 45; restores step 2 in 3 s (45-48, a 1 s compilation
# inside it, 46-47); steps 3-6 from 50, 1 s each with no waits; an evaluation of 2 s after step 6
# (54-56); the final checkpoint (56-57); ends at 58.
A = [
  line(1, "start", "a", started=T0),
  line(10, "backend", "a"),
  line(12, "restore", "a", step=0, seconds=2.0),
  line(27, "compile", "a", what="compile", name="train_step", seconds=5.0),
  step("a", 1, 20, 8, 1),  # 20-28: data 20-21, compile 22-27: compute 2 s
  step("a", 2, 28, 2, 0),  # 28-30
  line(31, "checkpoint", "a", step=2, seconds=1.0, kind="permanent"),  # 30-31
  step("a", 3, 31, 2, 0.5),  # 31-33: data 0.5
  step("a", 4, 33, 2, 0),  # 33-35, then killed
]
B = [
  line(40.5, "start", "b", started=T0 + 40),
  line(45, "backend", "b"),
  line(47, "compile", "b", what="compile", name="restore", seconds=1.0),  # 46-47
  line(48, "restore", "b", step=2, seconds=3.0),  # 45-48
  step("b", 3, 50, 1, 0),
  step("b", 4, 51, 1, 0),
  step("b", 5, 52, 1, 0),
  step("b", 6, 53, 1, 0),
  line(56, "eval", "b", step=6, seconds=2.0),  # 54-56
  line(57, "checkpoint", "b", step=6, seconds=1.0, kind="permanent"),  # 56-57
  line(58, "end", "b", how="finished"),
]


@pytest.fixture
def timeline(tmp_path):
  workdir = str(tmp_path)
  write(workdir, "p0.jsonl", A + B)
  with open(os.path.join(workdir, "events", "p0.jsonl"), "a") as f:
    f.write('{"t": 1000036.0, "event": "st')  # the kill cut this line short: left out
  restart = {"t": T0 + 39, "event": "restart", "process": 0, "attempt": 1, "cause": "killed"}
  write(workdir, "supervisor-p0.jsonl", [{**restart, "resumed_from": 2}])
  return workdir


def test_every_figure_equals_a_hand_count(timeline):
  r = goodput.summary(timeline)
  # Counted by hand from the timeline above, second by second.
  wall = 58.0  # from the first process's start (0) to the last line (58)
  by_hand = {
    "initialization": 10 + 5,  # 0-10 and 40-45
    "prep": 10 + 2,  # a: 10-20 (a restore of step 0 is a fresh state: preparation); b: 48-50
    "compile": 5 + 1,  # 22-27 in step 1, 46-47 inside the restore
    "data": 1 + 0.5,
    "checkpoint_save": 1 + 1,
    "checkpoint_restore": 3 - 1,  # 45-48 less its compilation
    "eval": 2,
    "wasted": (2 - 0.5) + 2,  # steps 3 and 4 of attempt a less their data wait: done again in b
    "downtime": 40 - 35,  # from a's last line to b's start
    "other": 58 - 57,  # b's end after its checkpoint
  }
  goodput_s = 2 + 2 + 4 * 1  # steps 1 (8 less data and compile), 2, and b's 3-6
  assert r["wall_s"] == pytest.approx(wall)
  assert r["goodput_s"] == pytest.approx(goodput_s)
  assert r["goodput"] == pytest.approx(goodput_s / wall)
  assert r["goodput_h"] == pytest.approx(goodput_s / 3600)
  assert r["badput_s"] == pytest.approx(by_hand)
  assert r["badput"] == pytest.approx({k: v / wall for k, v in by_hand.items()})
  # Every second of the wall time is counted once.
  assert goodput_s + sum(by_hand.values()) == pytest.approx(wall)
  assert r["steps"] == 6 and r["steps_redone"] == 2
  assert [(a["resumed_from"], a["steps"], a["how"]) for a in r["attempts"]] == [
    (0, 4, "killed"),
    (2, 4, "finished"),
  ]
  assert [(x["cause"], x["resumed_from"]) for x in r["restarts"]] == [("killed", 2)]


def test_step_time_deviation_is_ml_goodput_measurements(timeline):
  """The ideal step time: the mean of the kept steps' times within median + 3 MAD (steps that
  held a compilation left out); deviations from it, by numpy."""
  r = goodput.summary(timeline)["step_time"]
  times = np.array([2.0, 1, 1, 1, 1])  # step 2 of a; 3-6 of b (step 1 compiled)
  median = np.median(times)
  mad = np.median(np.abs(times - median))  # 0: step 2 is anomalous
  ideal = times[times <= median + 3 * mad].mean()
  assert r["steps"] == 5 and r["anomalous"] == 1
  assert r["ideal_s"] == pytest.approx(ideal) and r["median_s"] == median
  assert r["mean_abs_deviation_s"] == pytest.approx(np.mean(np.abs(times - ideal)))
  assert r["max_deviation_s"] == pytest.approx(2.0 - ideal)


def test_overlaps_go_to_the_first_label_listed():
  spans = [(0, 10, "other"), (2, 6, "goodput"), (3, 4, "compile"), (5, 8, "data")]
  assert goodput.split(spans) == pytest.approx(
    {**dict.fromkeys(goodput.LABELS, 0.0), "other": 4, "goodput": 2, "compile": 1, "data": 3}
  )


def test_cli_prints_the_table_and_json(timeline, capsys):
  assert cli.main(["goodput", "--workdir", timeline, "--json"]) == 0
  printed = json.loads(capsys.readouterr().out)
  assert printed["goodput_s"] == pytest.approx(8.0) and printed["steps_redone"] == 2
  assert cli.main(["goodput", "--workdir", timeline]) == 0
  table = capsys.readouterr().out
  assert (
    "13.8%" in table and "(2 steps done again)" in table and "killed, resumed from step 2" in table
  )


def test_a_workdir_without_events_is_one_line(tmp_path, capsys):
  assert cli.main(["goodput", "--workdir", str(tmp_path)]) == 2
  assert "holds no events" in capsys.readouterr().err
  with pytest.raises(UserError, match="process 3"):
    write(str(tmp_path), "p0.jsonl", A)
    goodput.summary(str(tmp_path), process=3)


class Output:
  """A step's output whose readiness the test decides (`jax.block_until_ready` calls its method)."""

  def __init__(self):
    self.ready = threading.Event()

  def block_until_ready(self):
    assert self.ready.wait(30), "never made ready"
    return self


def test_lines_wait_for_the_workdir_then_reach_the_file(tmp_path):
  """Nothing is written before `open` (a refused run leaves no events/); then every line is on
  disk as soon as it is recorded (a kill loses no step line)."""
  ev = events.Events(str(tmp_path))
  ev.record("backend")
  assert not os.path.exists(tmp_path / "events")
  ev.open()
  ev.step_start()
  ev.data_ready()
  ev.dispatched(1, {"loss": jnp.zeros(())})
  ev.wait_steps()
  ev.record("checkpoint", step=1, seconds=0.0, kind="permanent")
  lines = goodput.read(tmp_path / "events" / "p0.jsonl")
  kinds = [x["event"] for x in lines if x["event"] != "compile"]  # jnp.zeros' own
  assert kinds == ["start", "backend", "step", "checkpoint"]
  ev.close("finished")
  (start,) = [x for x in goodput.read(tmp_path / "events" / "p0.jsonl") if x["event"] == "start"]
  assert start["started"] <= start["t"] and len({start["attempt"]}) == 1


def test_a_step_is_timed_from_the_previous_ones_end_to_its_outputs_ready(tmp_path):
  """Steps dispatched ahead (as JAX does: the call returns at once) are recorded when their
  outputs are ready: each from the previous step's end (or its own start, if later) to its own,
  whenever it was dispatched; its data wait is only what the devices waited for its batch."""
  ev = events.Events(str(tmp_path))
  ev.open()
  outs = {n: Output() for n in (1, 2, 3)}
  for n in (1, 2):  # both dispatched at once; step 1 is done 0.2 s later, step 2 0.3 s after it
    ev.step_start()
    ev.data_ready()
    ev.dispatched(n, {"loss": outs[n]})
  time.sleep(0.2)
  outs[1].ready.set()
  time.sleep(0.3)
  outs[2].ready.set()
  ev.wait_steps()
  # Step 3 begins with the devices idle and waits 0.1 s for its batch.
  ev.step_start()
  time.sleep(0.1)
  ev.data_ready()
  ev.dispatched(3, {"loss": outs[3]})
  outs[3].ready.set()
  ev.close("finished")
  one, two, three = [
    x for x in goodput.read(tmp_path / "events" / "p0.jsonl") if x["event"] == "step"
  ]
  assert [x["step"] for x in (one, two, three)] == [1, 2, 3]
  for x in (one, two, three):  # seconds: from start to when the outputs were ready
    assert x["start"] + x["seconds"] == pytest.approx(x["t"], abs=1e-6)
    assert x["dispatched"] <= x["t"]
  assert one["seconds"] >= 0.2 and two["seconds"] >= 0.3
  # One's data wait is two calls apart (under 0.2 s, its compute, even on a loaded machine); two's
  # batch came while one ran.
  assert one["data"] < 0.2 and two["data"] == 0.0
  assert two["start"] == one["t"] and two["dispatched"] < one["t"]  # queued behind step 1
  assert three["start"] >= two["t"] and 0.1 <= three["data"] <= three["seconds"]
  # Half a second of compute: the dispatch times (both within microseconds) said ~0.
  assert one["seconds"] + two["seconds"] >= 0.5


def test_a_failed_run_does_not_wait_for_a_step_that_never_ends(tmp_path):
  ev = events.Events(str(tmp_path))
  ev.open()
  ev.step_start()
  ev.data_ready()
  ev.dispatched(1, {"loss": Output()})  # never ready (a hung collective, a device error)
  t0 = time.monotonic()
  ev.close("failed")
  assert time.monotonic() - t0 < 5
  kinds = [x["event"] for x in goodput.read(tmp_path / "events" / "p0.jsonl")]
  assert kinds == ["start", "end"]


def test_the_straggler_window_holds_each_steps_dispatch_time(tmp_path):
  ev = events.Events(str(tmp_path))
  before = time.time()
  for n in (1, 2):
    ev.step_start()
    ev.data_ready()
    ev.dispatched(n, {"loss": jnp.zeros(())})
  window = ev.take_window()
  assert len(window) == 2 and before <= window[0] <= window[1] <= time.time()
  assert ev.take_window() == []
  ev.close("finished")
  events._listen(None)


# On real `zoo run` processes

SMOKE = "lm/shakespeare-char:smoke"
OVERRIDES = {
  "train.steps": "24",
  "train.checkpoint_every": "4",
  "train.keep_checkpoints": "2",
  "train.log_every": "1",
  "train.eval_every": "0",
  "optim.schedule": "constant",
  "optim.warmup_steps": "2",
}
ZOO = shutil.which("zoo", path=os.path.dirname(sys.executable)) or shutil.which("zoo")


def zoo_run(workdir, **overrides) -> subprocess.Popen:
  argv = [ZOO, "run", SMOKE, "--workdir", str(workdir), "--quiet"]
  argv += [f"--config.{k}={v}" for k, v in {**OVERRIDES, **overrides}.items()]
  return subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def logged_steps(workdir) -> list[int]:
  path = os.path.join(workdir, "metrics.jsonl")
  if not os.path.exists(path):
    return []
  out = []
  with open(path) as f:
    for text in f:
      try:
        out.append(json.loads(text)["step"])
      except (json.JSONDecodeError, KeyError):
        break
  return out


def kill_after(proc, workdir, k: int, saved: int):
  """SIGKILL once step `k` is logged and the checkpoint of step `saved` is complete."""
  deadline = time.monotonic() + 120
  done = os.path.join(workdir, "checkpoints", str(saved))
  while not logged_steps(workdir) or logged_steps(workdir)[-1] < k or not os.path.isdir(done):
    assert proc.poll() is None, proc.stderr.read()[-3000:]
    assert time.monotonic() < deadline, "no step in time"
    time.sleep(0.002)
  proc.send_signal(signal.SIGKILL)
  proc.wait()


@pytest.mark.slow
def test_a_killed_and_rerun_run_names_the_steps_done_again(tmp_path):
  """SIGKILL after step 6 or later, once the checkpoint of step 4 is complete, and rerun by
  hand: the steps logged twice in metrics.jsonl are the steps goodput counts as done again,
  and its lost progress is those steps' time in the killed attempt (less their data wait)."""
  workdir = str(tmp_path / "run")
  kill_after(zoo_run(workdir), workdir, 6, saved=4)
  proc = zoo_run(workdir)
  assert proc.wait(timeout=120) == 0, proc.stderr.read()[-3000:]
  seen = logged_steps(workdir)
  repeated = sorted(s for s in set(seen) if seen.count(s) > 1)
  r = goodput.summary(workdir)
  resumed = r["attempts"][1]["resumed_from"]
  assert resumed == 4 and repeated[0] == 5 and r["steps"] == 24
  assert sorted(set(seen)) == list(range(1, 25)) and r["attempts"][0]["how"] == "killed"
  first, _ = goodput.attempts(goodput.read(os.path.join(workdir, "events", "p0.jsonl")))
  redone = [x for x in first if x["event"] == "step" and x["step"] > resumed]
  # The events hold every step the killed attempt logged (the loop waits for a step's events
  # line before it writes its metrics line), and the one after if the kill landed between them.
  assert [x["step"] for x in redone] in (repeated, repeated + [repeated[-1] + 1])
  assert r["steps_redone"] == len(redone)
  lost = sum(x["seconds"] - x["data"] for x in redone)
  assert r["badput_s"]["wasted"] == pytest.approx(lost, rel=1e-6)
  total = r["goodput_s"] + sum(r["badput_s"].values())
  assert total == pytest.approx(r["wall_s"], rel=1e-9)
  # Process 0 wrote the summary to TensorBoard at the end of the second attempt.
  scalars = tensorboard_scalars(tmp_path / "run" / "tensorboard")
  assert scalars["goodput/goodput"] == pytest.approx(r["goodput"], rel=0.05)
  assert scalars["goodput/badput/wasted"] == pytest.approx(r["badput"]["wasted"], rel=0.05)


def tensorboard_scalars(path) -> dict:
  """The last value of each scalar in a TensorBoard directory (its TFRecord files read as
  tensorboardX writes them: length, crc, an Event, crc)."""
  import struct

  from tensorboardX.proto import event_pb2

  out = {}
  for name in sorted(os.listdir(path)):
    with open(os.path.join(path, name), "rb") as f:
      data = f.read()
    i = 0
    while i + 12 <= len(data):
      (n,) = struct.unpack("<Q", data[i : i + 8])
      event = event_pb2.Event.FromString(data[i + 12 : i + 12 + n])
      i += 12 + n + 4
      for v in event.summary.value:
        out[v.tag] = v.simple_value
  return out


# Trained in this process: step times that are the steps' own

TIMED = {  # big enough that a step's compute, not its dispatch, sets its time
  "train.steps": "24",
  "train.log_every": "8",
  "train.eval_every": "0",
  "train.checkpoint_every": "100",
  "train.batch_size": "16",
  "data.seq_len": "64",
}


# Longer steps than TIMED's: the machine's hiccups (other work on its 2 cores) stand out less.
STEADY = {"train.steps": "30", "train.log_every": "15", "data.seq_len": "128"}


def trained(workdir, monkeypatch, inject="", **overrides) -> tuple[dict, list[dict], list[dict]]:
  """Trains the smoke experiment with TIMED (and `overrides`) in this process: its goodput, its
  logged lines, and its events."""
  if inject:
    monkeypatch.setenv(inject_env.ENV, inject)
  else:
    monkeypatch.delenv(inject_env.ENV, raising=False)
  cfg = experiments.get_config(SMOKE, {**TIMED, **overrides})
  trainer.train(cfg, str(workdir), progress=False)
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    logged = [json.loads(x) for x in f]
  lines = goodput.read(os.path.join(workdir, "events", "p0.jsonl"))
  return goodput.summary(str(workdir)), logged, lines


@pytest.mark.slow
def test_a_steady_runs_ideal_step_time_is_the_one_its_tokens_per_s_implies(
  tmp_path, monkeypatch, capsys
):
  """The ideal step time is what the trainer's own throughput says a step takes (not the
  dispatch's millisecond or two), few steps are anomalous, and the logged steps (where the loop
  waits for the metrics, and the dispatch times put every step queued before) are not; `zoo
  goodput --json` and TensorBoard carry these figures."""
  r, logged, lines = trained(tmp_path / "run", monkeypatch, **STEADY)
  tokens = int(TIMED["train.batch_size"]) * int(STEADY["data.seq_len"])
  implied = np.median([tokens / x["tokens_per_s"] for x in logged[1:]])  # after the first window
  st = r["step_time"]
  assert st["steps"] >= 29  # (30 in this process, which compiled the step before the loop)
  # Other work on the machine only adds to the wall time tokens_per_s divides (hiccups, a
  # slower second window), so the ideal may fall below it, not far above.
  assert 0.6 * implied <= st["ideal_s"] <= 1.25 * implied, (st, implied)
  # Anomalous here: the first step (the program's first run), the one after the logged step
  # (the devices idle while the loop logs and dispatches it), and the machine's hiccups.
  assert st["anomalous"] <= st["steps"] // 3, st  # a third: this 2-core machine is shared
  seconds = {x["step"]: x["seconds"] for x in lines if x["event"] == "step"}
  assert seconds[15] < 2 * st["ideal_s"] and seconds[30] < 2 * st["ideal_s"], (seconds, st)
  assert cli.main(["goodput", "--workdir", str(tmp_path / "run"), "--json"]) == 0
  assert json.loads(capsys.readouterr().out)["step_time"] == st
  scalars = tensorboard_scalars(tmp_path / "run" / "tensorboard")
  assert scalars["goodput/step_time_ideal_s"] == pytest.approx(st["ideal_s"], rel=1e-6)
  deviation = st["mean_abs_deviation_s"]
  assert scalars["goodput/step_time_mean_abs_deviation_s"] == pytest.approx(deviation, rel=1e-6)


@pytest.mark.slow
def test_a_step_stalled_inside_is_the_slow_one_not_its_eval_save_or_logged_step(
  tmp_path, monkeypatch
):
  """Steps 12 and 20 stalled 1 s inside the compiled step (NNX_ZOO_INJECT=stall@...:1, a loop on
  the device): they are the slow ones, the anomalous ones, and neither the evaluation at step 12
  nor the save at step 20 (both waiting for the steps queued before them) nor the next logged
  step (16, where the loop waits for the metrics) holds a stall. Nor do the steps dispatched
  while a stall ran, as JAX dispatches ahead."""
  stall = 1.0
  r, _, lines = trained(
    tmp_path / "run",
    monkeypatch,
    inject=f"stall@12:{stall},stall@20:{stall}",
    **{"train.eval_every": "12", "train.eval_batches": "2", "train.checkpoint_every": "20"},
  )
  steps = {x["step"]: x["seconds"] for x in lines if x["event"] == "step"}
  assert steps[12] >= stall / 2 and steps[20] >= stall / 2, steps
  assert all(s < stall / 4 for n, s in steps.items() if n not in (1, 12, 20)), steps  # 1 compiles
  assert r["step_time"]["anomalous"] >= 2
  assert r["step_time"]["max_deviation_s"] == pytest.approx(
    max(steps[12], steps[20]) - r["step_time"]["ideal_s"]
  )
  # Each holds its own work only: under half the stall it would hold waiting for the step.
  (save,) = [x["seconds"] for x in lines if x["event"] == "checkpoint" and x["step"] == 20]
  assert save < steps[20] / 2 and r["badput_s"]["eval"] < steps[12] / 2, r["badput_s"]
