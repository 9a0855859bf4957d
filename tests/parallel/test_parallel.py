"""Sharded training equals single-device training (8 fake CPU devices, in a subprocess)."""

import json
import re
import shutil
import signal
import subprocess
import time

import numpy as np
import pytest

pytestmark = [pytest.mark.multidevice, pytest.mark.slow]
MESHES = ["(2, 2, 2)", "(8, 1, 1)", "(1, 8, 1)", "(1, 4, 2)", "(1, 1, 2)"]


@pytest.fixture(scope="module")
def results(forced_devices):
  return forced_devices.worker("worker.py", "lm/shakespeare-char:smoke")


@pytest.mark.parametrize(
  "mesh",
  [
    *MESHES,
    "(2, 2, 2) micro_batches=2",
    "(2, 2, 2) scan",
    "(2, 2, 2) scan full micro_batches=2",
    "(1, 4, 2) lora",
    "(1, 4, 2) lora scan full micro_batches=2",
    "(2, 2, 2) drop_path",
    "(2, 2, 2) drop_path scan full micro_batches=2",
  ],
)
def test_loss_and_gradients_equal_single_device(results, mesh):
  """(1, 4, 2) lora: LoRA on every projection, the adapters' gradients (base frozen) against
  the same on one device. drop_path: stochastic depth at 0.5, the same draws as one device."""
  kind = next((k for k in ("lora", "drop_path") if k in mesh), None)
  ref, got = results[f"{kind} single" if kind else "single"], results[mesh]
  assert got["count"] == ref["count"]
  assert got["total"] == pytest.approx(ref["total"], rel=1e-5)
  assert got["grads"].keys() == ref["grads"].keys()
  for name, g in ref["grads"].items():
    g, h = np.asarray(g), np.asarray(got["grads"][name])
    scale = np.max(np.abs(g)) + 1e-12
    assert np.max(np.abs(h - g)) / scale < 1e-5, name


def test_scanned_layers_gather_their_weights_inside_the_loop(results):
  """Under fsdp=8 with model.scan, no layer's weight is gathered at the top level of the step
  (where XLA:CPU puts every gather of the unscanned model: bench/fsdp_gathers.py), only the
  embedding's and lm_head's; the layers' gathers run in the loop body, one layer at a time."""
  got = results["fsdp=8 scan all-gathers"]
  assert got["entry"] == got["outside blocks"]
  assert got["all"] > got["entry"]


def test_stacked_layers_are_placed_as_each_layer(results):
  """model.scan stores the layers stacked [L, ...]: the layer axis on no mesh axis, and each
  layer placed as the unscanned model places it (a norm scale [L, D] stays whole)."""
  got = results["(2, 2, 2) scan placements"]
  assert any(k.endswith("scale") for k in got) and any(k.endswith("down/kernel") for k in got)
  for name, (stacked, plain) in got.items():
    assert stacked == [None, *plain], name


def expected_spec(name: str, mesh: str) -> str:
  """What nnx_zoo.common.parallel.RULES say, written out by hand for the tiny Llama's parameters."""
  data, fsdp, tensor = eval(mesh)  # noqa: S307 (our own literal)
  f = "'fsdp'" if fsdp > 1 else "None"
  t = "'tensor'" if tensor > 1 else "None"
  if name.endswith("scale"):
    return "P(None,)"  # replicated on purpose: 1-D norm scales
  if name.endswith(("q/kernel", "k/kernel", "v/kernel", "gate/kernel", "up/kernel")):
    return f"P({f}, {t})"
  if name.endswith(("o/kernel", "down/kernel")):
    return f"P({t}, {f})"
  if name == "embed/embedding":
    return f"P({t}, {f})"
  if name == "lm_head/kernel":
    return f"P({f}, {t})"
  raise AssertionError(f"no rule written for {name}")


@pytest.mark.parametrize("mesh", MESHES)
def test_each_parameter_is_placed_as_the_rules_say(results, mesh):
  for name, (spec, _, _) in results[mesh]["placement"].items():
    assert spec == expected_spec(name, mesh), name


@pytest.mark.parametrize("mesh", MESHES)
def test_per_device_state_bytes_are_total_over_fsdp_times_tensor(results, mesh):
  _, fsdp, tensor = eval(mesh)  # noqa: S307
  r = results[mesh]
  sharded = r["state_bytes_total"] - r["replicated_bytes"]
  assert r["state_bytes_per_device"] == sharded // (fsdp * tensor) + r["replicated_bytes"]


def zoo_args(workdir, mesh: tuple[int, int, int], steps: int) -> list[str]:
  """`zoo run` of the smoke experiment on `mesh` (data, fsdp, tensor), logging every step."""
  data, fsdp, tensor = mesh
  args = ["-m", "nnx_zoo.common.cli", "run", "lm/shakespeare-char:smoke", "--workdir", str(workdir)]
  args += [f"--config.mesh.data={data}", f"--config.mesh.fsdp={fsdp}"]
  args += [f"--config.mesh.tensor={tensor}", f"--config.train.steps={steps}", "--quiet"]
  args += ["--config.train.batch_size=8", "--config.train.log_every=1"]
  # A constant rate with a short warm-up: the schedule must not depend on train.steps here.
  args += ["--config.optim.schedule=constant", "--config.optim.warmup_steps=2"]
  return args + ["--config.train.eval_every=0"]


def zoo_run(forced, workdir, devices: int, mesh: tuple[int, int, int], steps: int):
  forced.succeed(zoo_args(workdir, mesh, steps), devices)


STRAIGHT_STEPS = 16


@pytest.fixture(scope="module")
def straight(tmp_path_factory, forced_devices):
  """One uninterrupted (2, 2, 2) run that the resume tests compare against (the schedule is
  constant, so its first steps are those of any shorter run)."""
  workdir = tmp_path_factory.mktemp("straight")
  zoo_run(forced_devices, workdir, 8, (2, 2, 2), STRAIGHT_STEPS)
  return losses(workdir)


def losses(workdir) -> dict[int, float]:
  lines = [json.loads(x) for x in (workdir / "metrics.jsonl").read_text().splitlines()]
  return {x["step"]: x["loss"] for x in lines if "split" not in x}


def test_checkpoint_saved_on_one_mesh_resumes_on_another(tmp_path, straight, forced_devices):
  """Save on (2,2,2); resume on (1,8,1) and on one device: the continued losses equal those of
  an uninterrupted run (to float tolerance: the meshes sum in different orders)."""
  saved = tmp_path / "saved"
  zoo_run(forced_devices, saved, 8, (2, 2, 2), 4)
  for name, devices, mesh in [("fsdp8", 8, (1, 8, 1)), ("one", 1, (1, 1, 1))]:
    workdir = tmp_path / name
    shutil.copytree(saved, workdir)
    zoo_run(forced_devices, workdir, devices, mesh, 6)
    got = losses(workdir)
    for step in (5, 6):
      assert got[step] == pytest.approx(straight[step], rel=1e-5), (name, step)


@pytest.fixture
def two_processes(forced_devices):
  """`zoo run` as two processes on 127.0.0.1 with 4 fake devices each: one (data, fsdp, tensor)
  mesh, (2, 2, 2) unless given (`extra`: more arguments)."""

  def start(workdir, steps: int, mesh=(2, 2, 2), extra=()) -> list[subprocess.Popen]:
    return forced_devices.hosts(zoo_args(workdir, mesh, steps) + list(extra))

  return start


@pytest.fixture
def finish(forced_devices):
  return forced_devices.finish


def test_two_processes_match_one_process_with_the_same_global_mesh(
  tmp_path, straight, two_processes, finish
):
  """Two processes on 127.0.0.1 with 4 fake devices each form one (2, 2, 2) mesh; each feeds its
  half of every batch from its own iterator. Losses equal one process with 8 devices."""
  two = tmp_path / "two"
  finish(two_processes(two, 4))
  # Logged once (process 0), and each process saved its own data-iterator state.
  assert len(losses(two)) == 4
  assert {p.name for p in (two / "checkpoints" / "4" / "data").iterdir()} >= {
    "process_0-of-2.json",
    "process_1-of-2.json",
  }
  for step, loss in losses(two).items():
    assert loss == pytest.approx(straight[step], rel=1e-6), step


def test_two_processes_that_split_each_row_over_context_match_one_process(
  tmp_path, straight, two_processes, finish
):
  """mesh.context=8 over two processes of 4 devices: both read the same rows of every batch
  (`parallel.process_rows`), and each feeds its devices their share of every row's tokens
  (`step.put_batch`). Losses equal the one-process (2, 2, 2) run's."""
  two = tmp_path / "two"
  finish(two_processes(two, 4, mesh=(1, 1, 1), extra=["--config.mesh.context=8"]))
  assert len(losses(two)) == 4
  for step, loss in losses(two).items():
    assert loss == pytest.approx(straight[step], rel=1e-5), step


def test_a_run_saved_by_two_processes_resumes_on_one_and_the_reverse(
  tmp_path, straight, forced_devices, two_processes, finish
):
  """On a prepared copy of the smoke run's plays: two processes, each reading only its rows,
  save step 4 and one process resumes it to step 6; one process's step 4 resumes on two. Every
  loss equals the uninterrupted run's, which tokenized the plays at start-up: the checkpointed
  iterator state is the next global batch, whatever the number of processes."""
  prepared = tmp_path / "prepared"
  prep = ["-m", "nnx_zoo.common.cli", "data", "prepare", "lm/shakespeare-char:smoke"]
  forced_devices.succeed([*prep, "--out", str(prepared), "--workers", "1", "--quiet"], 1)
  data = ["--config.data.kind=prepared", f"--config.data.path={prepared}"]
  for first, then in (("two", "one"), ("one", "two")):
    workdir = tmp_path / f"{first}-then-{then}"
    for processes, steps in ((first, 4), (then, 6)):
      if processes == "two":
        finish(two_processes(workdir, steps, extra=data))
      else:
        forced_devices.succeed(zoo_args(workdir, (2, 2, 2), steps) + data)
    got = losses(workdir)
    assert sorted(got) == list(range(1, 7)), (first, got)
    for step, loss in got.items():
      assert loss == pytest.approx(straight[step], rel=1e-5), (first, step)


def test_sigterm_to_one_process_stops_both_at_the_same_step(
  tmp_path, straight, two_processes, finish
):
  """A preemption notice may reach one host only: SIGTERM to process 1 alone. Both processes
  stop after the same step, save it together and exit 143; rerun, they continue with the
  losses of an uninterrupted run."""
  steps = STRAIGHT_STEPS
  two = tmp_path / "two"
  procs = two_processes(two, steps)
  deadline = time.monotonic() + 240
  while logged_steps(two) < 2:
    assert all(p.poll() is None for p in procs), "a process ended before step 2"
    assert time.monotonic() < deadline, "no step 2 in time"
    time.sleep(0.002)
  procs[1].send_signal(signal.SIGTERM)
  errs = finish(procs, 128 + signal.SIGTERM)
  stopped = [re.search(r"stopped by SIGTERM.* after step (\d+)", err) for err in errs]
  assert all(stopped), [err[-2000:] for err in errs]
  step = int(stopped[0][1])
  assert int(stopped[1][1]) == step < steps
  assert "received by another process" in errs[0] and "received by another" not in errs[1]
  assert {p.name for p in (two / "checkpoints" / str(step) / "data").iterdir()} >= {
    "process_0-of-2.json",
    "process_1-of-2.json",
  }
  finish(two_processes(two, steps))
  got = losses(two)
  assert sorted(got) == list(range(1, steps + 1))
  for s in range(1, steps + 1):
    assert got[s] == pytest.approx(straight[s], rel=1e-6), s


def logged_steps(workdir) -> int:
  """How many lines metrics.jsonl holds (complete ones) while a run writes it."""
  path = workdir / "metrics.jsonl"
  return path.read_text().count("\n") if path.exists() else 0


def test_mesh_that_does_not_fit_is_refused_before_compiling(tmp_path, forced_devices):
  proc = forced_devices.run(
    [
      "-m",
      "nnx_zoo.common.cli",
      "run",
      "lm/shakespeare-char:smoke",
      "--workdir",
      str(tmp_path / "x"),
    ]
    + ["--config.mesh.tensor=8", "--config.mesh.data=1", "--config.mesh.fsdp=1"]
  )
  assert proc.returncode == 2
  assert "num_kv_heads=2 is not divisible by tensor=8" in proc.stderr
  assert "Traceback" not in proc.stderr
