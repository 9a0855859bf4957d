"""train.checkpoint_minutes: temporary checkpoints kept until the next permanent one (orbax's
preservation policy, common/hub/checkpoint.py), the clock that makes them due
(common/train/wallclock.py), and on a real `zoo run`: a SIGKILL loses at most about N minutes, and
the rerun resumes from the temporary step to the losses and weights of an uninterrupted run."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from nnx_zoo.common import experiments
from nnx_zoo.common.hub import checkpoint, weights
from nnx_zoo.common.train import wallclock


def steps_on_disk(workdir) -> list[int]:
  return sorted(int(n) for n in os.listdir(checkpoint.directory(workdir)) if n.isdigit())


def test_temporary_steps_live_until_the_next_permanent_one(tmp_path):
  """keep=2: permanent steps 2, 4, 6, 8 and temporary 3, 5, 7. A temporary step is the latest
  while it is the newest, never pushes a permanent one out, and goes when a newer permanent one
  is complete; a reopened workdir knows its temporary steps from their meta."""
  workdir = str(tmp_path)
  state = {"w": jnp.ones(3)}
  expected = {
    2: [2],
    3: [2, 3],
    4: [2, 4],
    5: [2, 4, 5],
    6: [4, 6],
    7: [4, 6, 7],
  }
  ckpts = checkpoint.Checkpoints(workdir, keep=2)
  for step, kept in expected.items():
    ckpts.save(step, state, meta={"family": "x"}, temporary=step % 2 == 1)
    ckpts.wait()
    assert steps_on_disk(workdir) == kept, step
    assert ckpts.latest_step() == step
  ckpts.close()
  # A new attempt (a rerun): step 7 is still known as temporary.
  ckpts = checkpoint.Checkpoints(workdir, keep=2)
  assert ckpts.temporary == {7}
  ckpts.save(8, state, meta={"family": "x"})
  ckpts.wait()
  assert steps_on_disk(workdir) == [6, 8]
  assert ckpts.meta(8) == {"family": "x"}
  ckpts.close()


def test_the_clock_is_due_after_the_minutes_since_the_last_save(monkeypatch):
  class Saved:
    saved_at = 100.0

  now = [100.0]
  monkeypatch.setattr(wallclock.time, "monotonic", lambda: now[0])
  clock = wallclock.CheckpointClock(0.5, every=10, ckpts=Saved)
  off = wallclock.CheckpointClock(0.0, every=10, ckpts=Saved)
  now[0] = 129.9
  assert not clock.due(3)
  now[0] = 130.0
  assert clock.due(3) and not off.due(3)  # one process: asked at any step


# On a real `zoo run`

SMOKE = "lm/shakespeare-char:smoke"
STEPS = 60
OVERRIDES = {
  "train.steps": str(STEPS),
  "train.checkpoint_every": "1000",  # no permanent step but the last: only the minutes save
  "train.keep_checkpoints": "2",
  "train.log_every": "1",
  "train.eval_every": "0",
  "optim.schedule": "constant",
  "optim.warmup_steps": "2",
}
MINUTES = 0.005  # 0.3 s
ZOO = shutil.which("zoo", path=os.path.dirname(sys.executable)) or shutil.which("zoo")


def zoo_run(workdir, **overrides) -> subprocess.Popen:
  argv = [ZOO, "run", SMOKE, "--workdir", str(workdir), "--quiet"]
  argv += [f"--config.{k}={v}" for k, v in {**OVERRIDES, **overrides}.items()]
  return subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def losses(workdir) -> dict[int, float]:
  out = {}
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    for line in f:
      try:
        record = json.loads(line)
      except json.JSONDecodeError:
        break
      out[record["step"]] = record["loss"]
  return out


def events_of(workdir) -> list[dict]:
  out = []
  with open(os.path.join(workdir, "events", "p0.jsonl")) as f:
    for line in f:
      try:
        out.append(json.loads(line))
      except json.JSONDecodeError:
        break
  return out


def params(workdir) -> dict:
  _, state, step = weights.restore_params(experiments.get_config(SMOKE, OVERRIDES), workdir)
  assert step == STEPS
  return {k: np.asarray(v.get_value()) for k, v in nnx.to_flat_state(state)}


@pytest.mark.slow
def test_a_kill_loses_at_most_about_the_minutes_and_the_rerun_resumes_exactly(tmp_path):
  """Each step sleeps 50 ms (a patched step start), so 60 steps take over 3 s, and a temporary
  checkpoint lands every 0.3 s. SIGKILL after step 40 (2 s of steps): the newest complete step
  is a temporary one, saved no more than 0.3 s plus a step and a save before the kill (the save
  after it may not be complete); the rerun resumes from it and ends with an uninterrupted run's
  losses and weights, bit for bit."""
  reference = tmp_path / "reference"
  proc = zoo_run(reference)
  assert proc.wait(timeout=180) == 0, proc.stderr.read()[-3000:]

  workdir = tmp_path / "run"
  proc = slow_run(workdir, **{"train.checkpoint_minutes": str(MINUTES)})
  deadline = time.monotonic() + 180
  while not os.path.exists(workdir / "metrics.jsonl") or max(losses(workdir), default=0) < 40:
    assert proc.poll() is None, proc.stderr.read()[-3000:]
    assert time.monotonic() < deadline
    time.sleep(0.002)
  proc.send_signal(signal.SIGKILL)
  proc.wait()
  killed_at = time.time()
  saves = [x for x in events_of(workdir) if x["event"] == "checkpoint"]
  assert len(saves) >= 4 and all(x["kind"] == "temporary" for x in saves), saves
  latest = checkpoint.Checkpoints(str(workdir), read_only=True)
  newest = latest.latest_step()
  latest.close()
  assert newest in [x["step"] for x in saves]
  # Lost: from the newest complete step's save to the kill, at most the minutes, a step (the
  # check is after each step), the next save and the kill's latency: not the 2 s since the start.
  saved_at = next(x["t"] for x in saves if x["step"] == newest)
  assert killed_at - saved_at <= 60 * MINUTES + 1.0, (killed_at - saved_at, saves)
  assert steps_on_disk(workdir)[-1] == newest

  proc = zoo_run(workdir, **{"train.checkpoint_minutes": str(MINUTES)})
  assert proc.wait(timeout=180) == 0, proc.stderr.read()[-3000:]
  restore = [x for x in events_of(workdir) if x["event"] == "restore"][-1]
  assert restore["step"] == newest
  assert losses(workdir) == losses(reference)
  got, want = params(workdir), params(reference)
  assert got.keys() == want.keys()
  for k in want:
    np.testing.assert_array_equal(got[k], want[k], err_msg=str(k))
  assert steps_on_disk(workdir) == [STEPS]  # the temporary steps went with the last save


SLOWED = """
import sys, time
from nnx_zoo.common.train import events
start = events.Events.step_start
def step_start(self):
  time.sleep(0.05)
  start(self)
events.Events.step_start = step_start
from nnx_zoo.common import cli
sys.exit(cli.main(sys.argv[1:]))
"""


def slow_run(workdir, **overrides) -> subprocess.Popen:
  argv = [sys.executable, "-c", SLOWED, "run", SMOKE, "--workdir", str(workdir), "--quiet"]
  argv += [f"--config.{k}={v}" for k, v in {**OVERRIDES, **overrides}.items()]
  return subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
