"""common/train/stragglers.py: the robust score against numpy's median and MAD, the detector on
fabricated windows of step times, and two `zoo run` processes, one slowed (needs the fault
injection hook, common/train/inject.py)."""

import json
import os

import ml_collections
import numpy as np
import pytest

from nnx_zoo.common.train import settings, stragglers


def by_numpy(late, i, floor) -> float:
  others = np.delete(np.asarray(late, float), i)
  median = np.median(others)
  mad = np.median(np.abs(others - median))
  return (late[i] - median) / max(1.4826 * mad, floor)


@pytest.mark.parametrize(
  "late",
  [[0.0, 0.01, 0.002, 0.0, 0.3], [0.5, 0.0], [0.1, 0.12, 0.08, 0.11, 0.09, 0.1, 0.5, 0.105]],
)
def test_scores_are_the_median_and_mad_of_the_others(late):
  got = stragglers.scores(late, floor=0.01)
  assert got == pytest.approx([by_numpy(late, i, 0.01) for i in range(len(late))])


def test_lateness_is_after_the_earliest_process_step_by_step():
  # Three processes, four steps 1 s apart; process 2 dispatches 0.3 s late, process 1 is first
  # at steps 0-1 and process 0 at steps 2-3.
  t_PS = np.array([[0.1, 1.1, 2.0, 3.0], [0.0, 1.0, 2.1, 3.1], [0.3, 1.3, 2.3, 3.3]]) + 1.8e9
  late, step_s = stragglers.lateness(t_PS)
  assert late == pytest.approx([0.05, 0.05, 0.3]) and step_s == pytest.approx(1.0)
  assert stragglers.lateness(t_PS[:, :1])[1] == 0.0


def test_gathered_times_keep_microseconds_at_todays_epoch():
  times = 1.8e9 + np.array([0.0, 0.123456, 61.5])
  assert stragglers.gather_times(times) == pytest.approx(times[None], abs=2e-5, rel=0)


def test_only_the_late_process_is_named_after_enough_windows():
  rng = np.random.default_rng(0)
  detector = stragglers.Detector(threshold=3.0, windows=3)
  named = []
  for window in range(8):
    late = np.abs(0.003 * rng.standard_normal(6))  # six processes within a few ms
    if window >= 2:
      late[4] += 0.05  # process 4 half a step late from the third window on
    if window == 0:
      late[1] += 0.05  # process 1 in one window only: a blip
    named.append(detector.observe(late, step_s=0.1))
  assert named == [[], [], [], [], [4], [4], [4], [4]]


def test_a_recovered_process_is_no_longer_named():
  detector = stragglers.Detector(threshold=3.0, windows=2)
  late, even = [0.0, 0.2], [0.0, 0.0]
  got = [detector.observe(t, step_s=0.1) for t in (late, late, late, even, late)]
  assert got == [[], [1], [1], [], []]


def test_two_processes_name_the_late_one_only():
  """With two processes the MAD says nothing (each is compared with the other), and lateness
  under threshold x 10% of a step is noise; a one-step window keeps the last step time."""
  detector = stragglers.Detector(threshold=3.0, windows=1)
  assert detector.observe([0.0, 0.5], step_s=1.0) == [1]
  assert detector.observe([0.5, 0.0], step_s=0.0) == [0]  # step time from the last window
  assert detector.observe([0.0, 0.25], step_s=1.0) == []


def test_one_process_checks_nothing():
  cfg = ml_collections.ConfigDict(settings.TRAIN)
  assert stragglers.Monitor(cfg, events=None).check(10) == {}


# Two processes on 127.0.0.1 (tests/conftest.py's `forced_devices.hosts`)


def two_processes(forced, workdir, steps: int, *, slow: bool = False, extra=()) -> list[str]:
  """`zoo run` of the smoke experiment as two processes of 4 fake devices each, one (2, 2, 2)
  mesh, process 1 slowed by 0.3 s a step if `slow` (NNX_ZOO_INJECT); their stderr, once both
  have ended with 0."""
  env = {"NNX_ZOO_INJECT": "slow@*:p1:0.3"} if slow else {}
  args = ["-m", "nnx_zoo.common.cli", "run", "lm/shakespeare-char:smoke"]
  args += ["--workdir", str(workdir), "--quiet", f"--config.train.steps={steps}"]
  args += ["--config.mesh.data=2", "--config.mesh.fsdp=2", "--config.mesh.tensor=2"]
  args += ["--config.train.batch_size=8", "--config.train.eval_every=0", *extra]
  return forced.finish(forced.hosts(args, env=env))


def straggler_lines(err: str) -> list[str]:
  return [line for line in err.splitlines() if "straggler" in line]


@pytest.mark.slow
def test_two_even_processes_name_nobody_and_save_temporary_steps_together(tmp_path, forced_devices):
  """No process slowed: the checks run (an all-gather every logged step) and name nobody; and
  train.checkpoint_minutes' temporary saves, decided on process 0's clock, are taken by both
  processes at the same steps."""
  workdir = tmp_path / "run"
  errs = two_processes(
    forced_devices,
    workdir,
    12,
    extra=[
      "--config.train.log_every=2",
      # The default 3 windows in a row: one window alone can be late on a loaded machine (a CI
      # run named process 0 once, 0.21 s against the median's 0.10 s).
      "--config.train.straggler_windows=3",
      "--config.train.checkpoint_every=100",
      "--config.train.checkpoint_minutes=0.001",
    ],
  )
  assert not straggler_lines(errs[0]) and not straggler_lines(errs[1])
  saved = []
  for p in (0, 1):
    with open(workdir / "events" / f"p{p}.jsonl") as f:
      lines = [json.loads(x) for x in f]
    saved.append([(x["step"], x["kind"]) for x in lines if x["event"] == "checkpoint"])
  assert saved[0] == saved[1] and saved[0][-1] == (12, "permanent"), saved
  temporary = [s for s, kind in saved[0] if kind == "temporary"]
  assert temporary and all(s % 2 == 0 for s in temporary), saved  # asked at logged steps
  # Each temporary step went when the permanent one landed.
  assert sorted(os.listdir(workdir / "checkpoints")) == ["12"]


@pytest.mark.slow
def test_the_slowed_process_and_only_it_is_named(tmp_path, forced_devices):
  """Process 1 slowed by 0.3 s a step (NNX_ZOO_INJECT=slow@*:p1:0.3, common/train/inject.py):
  process 0 names it, and nobody else, in one warning line, and metrics.jsonl carries
  `stragglers: [1]` from then on."""
  workdir = tmp_path / "run"
  errs = two_processes(
    forced_devices,
    workdir,
    12,
    slow=True,
    extra=["--config.train.log_every=2", "--config.train.straggler_windows=2"],
  )
  warnings = straggler_lines(errs[0])
  assert len(warnings) == 1 and "process 1 (" in warnings[0], errs[0][-3000:]
  assert "process 0 (" not in warnings[0] and not straggler_lines(errs[1])
  with open(workdir / "metrics.jsonl") as f:
    named = [r.get("stragglers") for r in map(json.loads, f) if "split" not in r]
  assert [1] in named and all(n in (None, [1]) for n in named), named
