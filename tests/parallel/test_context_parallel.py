"""Context parallelism (`mesh.context`) equals one device: losses, gradients and auxiliary
losses of every decoder family on meshes mixing context with data, fsdp, expert and tensor
(8 fake CPU devices, in subprocesses), scanned and rematerialised too; a run saved on one
context size resumes on another; and what a context mesh refuses. Blocked attention
(`attention.impl="blocked"`) on meshes of data, fsdp and tensor equals one device too."""

import json
import shutil

import numpy as np
import pytest

pytestmark = [pytest.mark.multidevice, pytest.mark.slow]
FAMILIES = ["llama", "gemma2", "gemma3", "gpt2", "qwen3-moe", "llama:scan", "gemma2:ring"]
BLOCKED = ["llama:blocked", "gemma2:blocked"]


@pytest.fixture(scope="module")
def results(forced_devices):
  """Every family's results from one subprocess (one jax start-up for all)."""
  return forced_devices.worker("context_worker.py", *FAMILIES)


@pytest.fixture(scope="module")
def blocked_results(forced_devices):
  return forced_devices.worker("context_worker.py", *BLOCKED)


@pytest.mark.parametrize("name", BLOCKED)
def test_blocked_attention_on_a_mesh_equals_single_device(blocked_results, name):
  """attention.impl="blocked" (rows of 32 in blocks of 8) with the heads split over tensor and
  the rows over data and fsdp: Gemma 2's windows and soft-caps, GQA, packed segments."""
  assert_equal_single_device(blocked_results, name)


@pytest.mark.parametrize("name", FAMILIES)
def test_loss_aux_and_gradients_equal_single_device(results, name):
  """Ring: Gemma 2's sliding windows, soft-caps and GQA with the keys passed round, rows of
  1,024 tokens on 4 context devices (the queries in blocks at each step)."""
  assert_equal_single_device(results, name)


def assert_equal_single_device(results, name):
  """Every mesh's loss, auxiliary losses and gradients in `results[name]` (context_worker.py's)
  equal the single device's."""
  results = dict(results[name])
  ref = results.pop("single")
  assert len(results) >= 2
  for mesh, got in results.items():
    # Each device is fed its rows' share of tokens only (step.put_batch), never whole rows.
    data, fsdp, expert, context, _ = json.loads(mesh.replace("(", "[").replace(")", "]"))
    B, T = (2, 1024) if name.endswith(":ring") else (4, 32)
    assert got["fed"] == [[B // (data * fsdp * expert), T // context]], mesh
    assert got["count"] == ref["count"], mesh
    assert got["total"] == pytest.approx(ref["total"], rel=1e-5), mesh
    assert got["aux"].keys() == ref["aux"].keys(), mesh
    for k, v in ref["aux"].items():
      assert got["aux"][k] == pytest.approx(v, rel=1e-5), (mesh, k)
    assert got["grads"].keys() == ref["grads"].keys()
    # Relative to each gradient, or to a thousandth of the largest where a gradient is zero but
    # for rounding (a key bias: softmax ignores a constant added to all of a query's logits).
    largest = max(np.max(np.abs(np.asarray(g))) for g in ref["grads"].values())
    for p, g in ref["grads"].items():
      g, h = np.asarray(g), np.asarray(got["grads"][p])
      scale = max(np.max(np.abs(g)), 1e-3 * largest)
      assert np.max(np.abs(h - g)) / scale < 2e-5, (name, mesh, p)
  if name == "qwen3-moe":
    assert ref["aux"], "the MoE model adds its load-balancing loss"
  # The ring passes keys round with ppermute; the gathered form has none.
  permutes = next(iter(results.values()))["collectives"]["collective_permute"]
  assert (permutes > 0) == name.endswith(":ring"), permutes


def zoo_run(
  forced, workdir, *, context: int, fsdp: int, steps: int, devices: int = 8, command="run"
):
  exp = "lm/shakespeare-char:smoke"
  args = ["-m", "nnx_zoo.common.cli", command, exp, "--workdir", str(workdir)]
  args += ["--quiet"] if command == "run" else []
  args += [f"--config.mesh.context={context}", f"--config.mesh.fsdp={fsdp}"]
  args += ["--config.mesh.data=1", "--config.mesh.tensor=1", f"--config.train.steps={steps}"]
  args += ["--config.train.batch_size=8", "--config.train.log_every=1"]
  args += ["--config.optim.schedule=constant", "--config.optim.warmup_steps=2"]
  args += ["--config.train.eval_every=6"]  # held-out loss at the end of the 6-step runs
  return forced.succeed(args, devices)


def losses(workdir, split=None) -> dict[int, float]:
  lines = [json.loads(x) for x in (workdir / "metrics.jsonl").read_text().splitlines()]
  return {x["step"]: x["loss"] for x in lines if x.get("split") == split}


def test_saved_on_one_context_size_resumes_on_another(tmp_path, forced_devices):
  """6 steps on (fsdp 2, context 4) straight; 3 steps on (fsdp 2, context 4), resumed on
  (fsdp 1, context 8) and on one device for steps 4-6: the same losses, and the same held-out
  loss at step 6 (evaluated with each row split over context, or whole on one device), which
  `zoo eval` on the context mesh gives again."""
  straight = tmp_path / "straight"
  zoo_run(forced_devices, straight, context=4, fsdp=2, steps=6)
  saved = tmp_path / "saved"
  zoo_run(forced_devices, saved, context=4, fsdp=2, steps=3)
  for name, context, fsdp, devices in [("context8", 8, 1, 8), ("one", 1, 1, 1)]:
    workdir = tmp_path / name
    shutil.copytree(saved, workdir)
    zoo_run(forced_devices, workdir, context=context, fsdp=fsdp, steps=6, devices=devices)
    got, want = losses(workdir), losses(straight)
    for step in (4, 5, 6):
      assert got[step] == pytest.approx(want[step], rel=1e-5), (name, step)
    held_out = losses(workdir, "eval")[6]
    assert held_out == pytest.approx(losses(straight, "eval")[6], rel=1e-5), name
  proc = zoo_run(forced_devices, straight, context=4, fsdp=2, steps=6, command="eval")
  again = json.loads(proc.stdout.strip().splitlines()[-1])
  assert again["step"] == 6
  assert again["loss"] == pytest.approx(losses(straight, "eval")[6], rel=1e-6)


@pytest.mark.parametrize(
  "exp,args,message",
  [
    (
      "vision/vit-digits:smoke",
      ["--config.mesh.context=2", "--config.mesh.data=4"],
      "keep mesh.context=1",
    ),
    (
      "lm/shakespeare-char:smoke",
      ["--config.mesh.context=8", "--config.data.seq_len=40"],
      "data.seq_len=40 does not split into 2 x context = 16 equal chunks",
    ),
  ],
)
def test_a_context_mesh_that_does_not_fit_is_refused_before_compiling(
  tmp_path, forced_devices, exp, args, message
):
  proc = forced_devices.run(
    ["-m", "nnx_zoo.common.cli", "run", exp, "--workdir", str(tmp_path / "x"), *args]
  )
  assert proc.returncode == 2, proc.stderr[-2000:]
  assert message in proc.stderr
  assert "Traceback" not in proc.stderr
