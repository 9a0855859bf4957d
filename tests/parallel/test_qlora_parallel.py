"""QLoRA on a mesh (data 2 x fsdp 4, 8 fake CPU devices, in a subprocess: tests/parallel/
qlora_worker.py) against one device: the loss and the adapters' gradients equal to float
tolerance; a base whose blocks of scales a mesh axis cannot split is refused in one line."""

import json
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.multidevice, pytest.mark.slow]


@pytest.fixture(scope="module")
def results():
  env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8"}
  worker = ROOT / "tests" / "parallel" / "qlora_worker.py"
  proc = subprocess.run(
    [sys.executable, "-P", str(worker)], cwd=ROOT, env=env, capture_output=True, text=True
  )
  assert proc.returncode == 0, proc.stderr[-3000:]
  return json.loads(proc.stdout.strip().splitlines()[-1])


def test_mesh_equals_one_device(results):
  single, mesh = results["single"], results["mesh"]
  assert mesh["loss"] == pytest.approx(single["loss"], rel=1e-6)
  assert single["grads"].keys() == mesh["grads"].keys() and single["grads"]
  for k, want in single["grads"].items():
    want, got = np.asarray(want), np.asarray(mesh["grads"][k])
    assert np.abs(want).max() > 0, k  # every adapter has a gradient
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5 * np.abs(want).max(), err_msg=k)


def test_blocks_a_mesh_axis_cannot_split_are_refused_in_one_line(results):
  line = results["refused"]
  assert "\n" not in line
  assert ".kernel_scale [2, " in line and "fsdp" in line and "base_quant" in line
