"""GRPO on several processes: each samples, scores and weighs its own prompts' groups, and the
step is the trainer's. Two processes on 127.0.0.1 (one fake CPU device each, mesh data=2) against
one process holding both devices: the same rollouts, advantages, rewards and losses, with
single turns and with episodes that call tools; a run stopped between the two updates of one
rollout (grpo.num_iterations=2) resumes bit for bit; and under `zoo run --restarts`, a process
killed there brings the job back to the unbroken run's end."""

import json
import pathlib
import shutil

import numpy as np
import pytest

pytestmark = [pytest.mark.multidevice, pytest.mark.slow]

# Trains chat/grpo:smoke with the overrides given as JSON in the workdir given; under
# --coordinator (tests/conftest.py's `hosts`) as one of several processes. Each process writes
# the rows it trained on each update (its own: tokens, advantages) to WORKDIR-pI.json.
WORKER = """
import json, sys
args = sys.argv[1:]
if "--coordinator" in args:
  from nnx_zoo.common import distributed
  get = lambda flag: args[args.index(flag) + 1]
  distributed.initialize(get("--coordinator"), int(get("--num-processes")),
                         int(get("--process-id")))
if args[2:3] == ["tools"]:  # episodes whose every turn is a call (tests/common/test_grpo_tools.py)
  import os
  sys.path.insert(0, os.path.join(os.getcwd(), "tests", "common"))
  import test_grpo_tools
  from nnx_zoo.common.tasks import episodes, tool_calls
  call = tool_calls.ToolCall("multiply", '{"a": 2, "b": 3}')
  tool_calls.Reader.read = lambda self, text: tool_calls.Reading(text, [call], "template")
  episodes.engine_for = lambda *a: lambda count, longest: test_grpo_tools.Drawn()
import jax
from nnx_zoo.common import experiments
from nnx_zoo.common.tasks import grpo
from nnx_zoo.common.train import trainer
seen, complete = [], grpo.GRPO.complete
def recording(self, batch, params):
  out = complete(self, batch, params)
  if "advantages" in out:
    seen.append({k: grpo.local_rows(out[k]).tolist() for k in ("tokens", "advantages")})
  return out
grpo.GRPO.complete = recording
cfg = experiments.get_config("chat/grpo:smoke", json.loads(args[0]))
trainer.train(cfg, args[1], progress=False)
with open(f"{args[1]}-p{jax.process_index()}.json", "w") as f:
  json.dump(seen, f)
"""

# A reward that tells completions apart (a random model's replies all miss the sums).
REWARD_PY = """
def chars(prompts, completions, **_):
  return [float(sum(map(ord, c[0]["content"])) % 5) for c in completions]
"""


def overrides(tmp_path, steps: int) -> str:
  (tmp_path / "chars.py").write_text(REWARD_PY)
  return json.dumps({
    "grpo.reward": f"{tmp_path / 'chars.py'}:chars", "grpo.scale_rewards": "batch",
    "grpo.num_iterations": "2", "mesh.data": "2", "train.steps": str(steps),
    "train.checkpoint_every": "1", "train.eval_every": "2", "optim.schedule": "constant",
    "optim.warmup_steps": "0",
  })  # fmt: skip


def lines(workdir) -> dict:
  got = [json.loads(x) for x in (workdir / "metrics.jsonl").read_text().splitlines()]
  return {(x["step"], x.get("split", "train")): x for x in got}


def rows(workdir, processes: int) -> list[dict]:
  """Each update's rows, the processes' concatenated in process order (the batch's order)."""
  parts = [json.loads(pathlib.Path(f"{workdir}-p{i}.json").read_text()) for i in range(processes)]
  return [
    {k: np.concatenate([np.asarray(p[u][k]) for p in parts]) for k in parts[0][u]}
    for u in range(len(parts[0]))
  ]


def two_processes(forced_devices, tmp_path, workdir, steps: int):
  procs = forced_devices.hosts(
    ["-c", WORKER, overrides(tmp_path, steps), str(workdir)], processes=2, devices=1
  )
  forced_devices.finish(procs)


@pytest.fixture(scope="module")
def runs(tmp_path_factory, forced_devices):
  """One process with two devices and two processes with one each: 4 updates (2 rollouts);
  and two processes stopped after update 3 (the first of rollout 2), then resumed to 4."""
  tmp = tmp_path_factory.mktemp("grpo-processes")
  one = tmp / "one"
  forced_devices.succeed(["-c", WORKER, overrides(tmp, 4), str(one)], devices=2)
  two = tmp / "two"
  two_processes(forced_devices, tmp, two, 4)
  resumed = tmp / "resumed"
  two_processes(forced_devices, tmp, resumed, 3)
  shutil.copy(f"{resumed}-p0.json", f"{resumed}-first-p0.json")
  shutil.copy(f"{resumed}-p1.json", f"{resumed}-first-p1.json")
  two_processes(forced_devices, tmp, resumed, 4)
  return {"one": one, "two": two, "resumed": resumed}


def test_two_processes_sample_train_and_evaluate_as_one(runs):
  """The processes' rows, side by side, are the one process's: the same rollouts (tokens, bit
  for bit) and advantages (the batch's std taken over both processes); the logged rewards,
  losses and gradient norms, and the held-out rewards, to 1e-5."""
  one, two = rows(runs["one"], 1), rows(runs["two"], 2)
  assert len(one) == len(two) == 4
  for a, b in zip(one, two, strict=True):
    np.testing.assert_array_equal(a["tokens"], b["tokens"])
    np.testing.assert_allclose(a["advantages"], b["advantages"], rtol=1e-5)
  assert not np.array_equal(one[0]["advantages"], 0 * one[0]["advantages"])
  want, got = lines(runs["one"]), lines(runs["two"])
  assert want.keys() == got.keys()
  for key, line in want.items():
    for k in ("loss", "grad_norm", "reward", "reward_std", "completion_length", "clip_ratio"):
      if k in line:
        assert got[key][k] == pytest.approx(line[k], rel=1e-5, abs=1e-7), (key, k)


def test_two_processes_resume_between_the_updates_of_a_rollout(runs):
  """Stopped at update 3 (its checkpoint holds each process's rows of rollout 2 in its data
  state) and resumed: update 4 trains on those rows, and its loss is the unbroken run's, bit
  for bit."""
  straight, first = rows(runs["two"], 2), rows(f"{runs['resumed']}-first", 2)
  rest = rows(runs["resumed"], 2)
  assert len(first) == 3 and len(rest) == 1
  for a, b in zip(straight, first + rest, strict=True):
    for k in a:
      np.testing.assert_array_equal(a[k], b[k])
  want, got = lines(runs["two"]), lines(runs["resumed"])
  for step in (3, 4):
    for k in ("loss", "grad_norm", "clip_ratio"):
      assert got[(step, "train")][k] == want[(step, "train")][k], (step, k)


@pytest.fixture(scope="module")
def tool_runs(tmp_path_factory, forced_devices):
  """Episodes calling `multiply` (scripted turns, as tests/common/test_grpo_tools.py plays
  them): 2 steps on one process with two devices, and on two processes with one each."""
  import sys

  sys.path.insert(0, str(pathlib.Path(__file__).parent))
  import test_grpo_tools

  tmp = tmp_path_factory.mktemp("grpo-tools-processes")
  (tmp / "chars.py").write_text(REWARD_PY)
  settings = json.dumps(test_grpo_tools.overrides(tmp, **{
    "grpo.reward": f"{tmp / 'chars.py'}:chars", "grpo.scale_rewards": "batch",
    "mesh.data": "2", "train.steps": "2", "train.checkpoint_every": "2", "train.eval_every": "2",
  }))  # fmt: skip
  one, two = tmp / "one", tmp / "two"
  forced_devices.succeed(["-c", WORKER, settings, str(one), "tools"], devices=2)
  procs = forced_devices.hosts(["-c", WORKER, settings, str(two), "tools"], processes=2, devices=1)
  forced_devices.finish(procs)
  return one, two


def test_two_processes_play_episodes_with_tools_as_one(tool_runs):
  """Each process plays its own prompts' episodes (the tool's results in their rows): the
  rows side by side are the one process's, bit for bit, their advantages to 1e-5, and the
  logged rewards, losses, turns and calls equal."""
  one_dir, two_dir = tool_runs
  one, two = rows(one_dir, 1), rows(two_dir, 2)
  assert len(one) == len(two) == 2
  for a, b in zip(one, two, strict=True):
    np.testing.assert_array_equal(a["tokens"], b["tokens"])
    np.testing.assert_allclose(a["advantages"], b["advantages"], rtol=1e-5)
  want, got = lines(one_dir), lines(two_dir)
  assert want.keys() == got.keys()
  assert want[(1, "train")]["turns"] > 1 and want[(1, "train")]["tool_calls"] > 0
  for key, line in want.items():
    for k in ("loss", "grad_norm", "reward", "turns", "tool_calls", "context_tokens"):
      if k in line:
        assert got[key][k] == pytest.approx(line[k], rel=1e-5, abs=1e-7), (key, k)


def test_two_processes_under_restarts_end_as_the_unbroken_run(runs, forced_devices, tmp_path):
  """`zoo run --restarts 2` as two processes, process 1 killed before update 4 (the second on
  rollout 2): both supervisors restart their child, the job resumes from the last checkpoint
  written whole (update 3's, the rollout's rows in it, or, when its asynchronous save had not
  ended, update 2's) and ends with the unbroken two-process run's parameters and update-4 loss,
  bit for bit."""
  from flax import nnx

  from nnx_zoo.common import experiments
  from nnx_zoo.common.hub import weights

  settings = json.loads(overrides(tmp_path, 4))
  workdir = tmp_path / "run"
  argv = ["-m", "nnx_zoo.common.cli", "run", "chat/grpo:smoke", "--workdir", workdir, "--quiet",
          "--restarts", "2", *(f"--config.{k}={v}" for k, v in settings.items())]  # fmt: skip
  procs = forced_devices.hosts(argv, processes=2, devices=1, env={"NNX_ZOO_INJECT": "kill@4:p1"})
  forced_devices.finish(procs, timeout=600)
  logs = [(workdir / "events" / f"supervisor-p{p}.jsonl").read_text() for p in (0, 1)]
  events = [[json.loads(x) for x in log.splitlines()] for log in logs]
  assert events[1][0]["cause"] == "signal 9 (SIGKILL)", events
  assert [len(e) for e in events] == [1, 1], events
  assert events[0][0]["resumed_from"] == events[1][0]["resumed_from"] in (2, 3), events

  cfg = experiments.get_config("chat/grpo:smoke", settings)
  params = {}
  for name, where in (("straight", runs["two"]), ("restarted", workdir)):
    _, state, step = weights.restore_params(cfg, str(where))
    assert step == 4
    params[name] = {k: np.asarray(v.get_value()) for k, v in nnx.to_flat_state(state)}
  assert params["straight"].keys() == params["restarted"].keys()
  for key, want in params["straight"].items():
    np.testing.assert_array_equal(params["restarted"][key], want, err_msg=str(key))
  want, got = lines(runs["two"]), lines(workdir)
  for k in ("loss", "grad_norm", "clip_ratio"):
    assert got[(4, "train")][k] == want[(4, "train")][k], k
