"""Expert parallelism: the MoE model's step on meshes with an `expert` axis equals one device's
(8 fake CPU devices, in a subprocess), a run resumes on another expert mesh, and an expert size
that does not divide the experts is refused before anything compiles."""

import json

import numpy as np
import pytest

from nnx_zoo.common import experiments, parallel
from nnx_zoo.common.errors import UserError

EXP = "lm/shakespeare-moe:smoke"  # 4 experts, top-2, 2 layers
MESHES = ["(2, 1, 4, 1)", "(1, 2, 2, 2)", "(1, 1, 4, 2)", "(2, 2, 2, 1)"]


@pytest.fixture(scope="module")
def results(forced_devices):
  return forced_devices.worker("expert_worker.py", EXP)


@pytest.mark.slow
@pytest.mark.multidevice
@pytest.mark.parametrize("mesh", [*MESHES, "(1, 2, 2, 2) scan"])
def test_loss_aux_and_gradients_equal_single_device(results, mesh):
  """(data, fsdp, expert, tensor); scan: the layers scanned (remat'd body), the all-to-alls and
  the aux losses inside the loop."""
  ref, got = results["single"], results[mesh]
  assert got["count"] == ref["count"]
  assert got["total"] == pytest.approx(ref["total"], rel=1e-5)
  assert got["aux"].keys() == ref["aux"].keys() >= {"moe_load_balance", "moe_expert_load"}
  for name, want in ref["aux"].items():
    assert got["aux"][name] == pytest.approx(want, rel=1e-5), name
  assert got["grads"].keys() == ref["grads"].keys()
  for name, g in ref["grads"].items():
    g, h = np.asarray(g), np.asarray(got["grads"][name])
    assert np.max(np.abs(h - g)) / (np.max(np.abs(g)) + 1e-12) < 1e-5, name


@pytest.mark.slow
@pytest.mark.multidevice
@pytest.mark.parametrize("mesh", MESHES)
def test_each_device_holds_its_share_of_the_experts(results, mesh):
  """E / expert experts per device; D over fsdp, F over tensor as in a dense MLP."""
  _, fsdp, expert, tensor = eval(mesh)  # noqa: S307 (our own literal)
  experts = results[mesh]["experts"]
  assert len(experts) == 6  # gate, up, down of 2 layers
  e, f, t = ("'expert'" if expert > 1 else "None"), "'fsdp'", "'tensor'"
  f, t = (f if fsdp > 1 else "None"), (t if tensor > 1 else "None")
  for name, (spec, shape) in experts.items():
    if name.endswith("down"):
      assert spec == f"P({e}, {t}, {f})", name
      assert shape == [4 // expert, 64 // tensor, 64 // fsdp], name
    else:
      assert spec == f"P({e}, {f}, {t})", name
      assert shape == [4 // expert, 64 // fsdp, 64 // tensor], name


@pytest.mark.slow
@pytest.mark.multidevice
@pytest.mark.parametrize("mesh", MESHES)
def test_weights_without_experts_are_stored_over_fsdp_and_expert(results, mesh):
  """The attention, router and embedding weights' D is split over fsdp x expert (not kept
  whole on every expert shard); 1-D norm scales stay whole."""
  _, fsdp, expert, _ = eval(mesh)  # noqa: S307 (our own literal)
  others = results[mesh]["others"]
  d_split = [a for a, n in (("fsdp", fsdp), ("expert", expert)) if n > 1]
  d_spec = repr(d_split[0]) if len(d_split) == 1 else repr(tuple(d_split))
  for name in ("blocks/0/attn/q/kernel", "blocks/0/mlp/router", "lm_head/kernel"):
    spec, shape = others[name]
    assert spec.startswith(f"P({d_spec},"), (name, spec)
    assert shape[0] == 64 // (fsdp * expert), (name, shape)
  spec, shape = others["embed/embedding"]  # [V, D]
  assert spec.endswith(f", {d_spec})"), spec
  scales = [spec for k, (spec, _) in others.items() if k.endswith("scale")]
  assert len(scales) == 5 and set(scales) == {"P(None,)"}, scales


def zoo_run(forced, workdir, devices: int, mesh: tuple[int, int, int, int], steps: int):
  data, fsdp, expert, tensor = mesh
  args = ["-m", "nnx_zoo.common.cli", "run", EXP, "--workdir", str(workdir), "--quiet"]
  args += [f"--config.mesh.data={data}", f"--config.mesh.fsdp={fsdp}"]
  args += [f"--config.mesh.expert={expert}", f"--config.mesh.tensor={tensor}"]
  args += [f"--config.train.steps={steps}", "--config.train.batch_size=8"]
  args += ["--config.train.log_every=1", "--config.train.eval_every=0"]
  # A constant rate with a short warm-up: the schedule must not depend on train.steps here.
  args += ["--config.optim.schedule=constant", "--config.optim.warmup_steps=2"]
  forced.succeed(args, devices)


def logged(workdir) -> dict[int, dict]:
  lines = [json.loads(x) for x in (workdir / "metrics.jsonl").read_text().splitlines()]
  return {x["step"]: x for x in lines if "split" not in x}


@pytest.mark.slow
@pytest.mark.multidevice
def test_saved_on_one_expert_mesh_resumes_on_another(tmp_path, forced_devices):
  """Steps 1-4 on (2, 1, 4, 1) (one expert per device), saved; 5-6 on (2, 2, 2, 1) (two per
  device): every step's loss and aux losses equal an uninterrupted one-device run's."""
  straight, moved = tmp_path / "straight", tmp_path / "moved"
  zoo_run(forced_devices, straight, 1, (1, 1, 1, 1), 6)
  zoo_run(forced_devices, moved, 8, (2, 1, 4, 1), 4)
  zoo_run(forced_devices, moved, 8, (2, 2, 2, 1), 6)
  got, want = logged(moved), logged(straight)
  assert sorted(got) == list(range(1, 7))
  for step in range(1, 7):
    for key in ("loss", "moe_load_balance", "moe_router_z"):
      assert got[step][key] == pytest.approx(want[step][key], rel=1e-5), (step, key)


def test_expert_size_that_does_not_divide_the_experts_is_refused():
  cfg = experiments.get_config(EXP, {})
  sizes = {"data": 1, "fsdp": 1, "expert": 3, "tensor": 1}
  with pytest.raises(UserError, match=r"num_experts=4 is not divisible by expert=3"):
    parallel.check_fits(cfg.model, sizes, batch_size=6)


@pytest.mark.slow
@pytest.mark.multidevice
def test_zoo_run_refuses_the_mesh_before_compiling(tmp_path, forced_devices):
  proc = forced_devices.run(
    ["-m", "nnx_zoo.common.cli", "run", EXP, "--workdir", str(tmp_path / "x")]
    + ["--config.mesh.expert=8", "--config.train.batch_size=8"]
  )
  assert proc.returncode == 2
  assert "num_experts=4 is not divisible by expert=8" in proc.stderr
  assert "Traceback" not in proc.stderr
