"""QLoRA on a mesh (data 2 x fsdp 4, 8 fake CPU devices, in a subprocess: tests/parallel/
qlora_worker.py) against one device: the loss and the adapters' gradients equal to float
tolerance; a base whose blocks of scales a mesh axis cannot split is refused in one line."""

import numpy as np
import pytest

pytestmark = [pytest.mark.multidevice, pytest.mark.slow]


@pytest.fixture(scope="module")
def results(forced_devices):
  return forced_devices.worker("qlora_worker.py")


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
