"""The dpo task sharded equals one device (8 fake CPU devices, in a subprocess): each pair's two
replies stay on one device, the loss and every gradient equal over data, fsdp and tensor."""

import json
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.multidevice, pytest.mark.slow]
MESHES = ["(8, 1, 1)", "(2, 4, 1)", "(2, 2, 2)"]


@pytest.fixture(scope="module")
def results():
  env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8"}
  proc = subprocess.run(
    [sys.executable, "-P", str(ROOT / "tests" / "parallel" / "preference_worker.py")],
    cwd=ROOT,
    env=env,
    capture_output=True,
    text=True,
  )
  assert proc.returncode == 0, proc.stderr[-3000:]
  return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("mesh", MESHES)
def test_dpo_loss_and_gradients_equal_single_device(results, mesh):
  ref, got = results["single"], results[mesh]
  assert got["count"] == ref["count"] == 14  # 16 pairs, 2 of them padding
  assert got["total"] == pytest.approx(ref["total"], rel=1e-5)
  floor = 1e-3 * max(np.max(np.abs(np.asarray(g))) for g in ref["grads"].values())
  for name, g in ref["grads"].items():
    g, h = np.asarray(g), np.asarray(got["grads"][name])
    assert np.max(np.abs(h - g)) / max(np.max(np.abs(g)), floor) < 1e-5, name
