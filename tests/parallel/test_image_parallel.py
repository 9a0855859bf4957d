"""The tasks whose rows are whole examples, sharded, equal one device (8 fake CPU devices, in a
subprocess): ViT's classification loss, CLIP's contrastive loss, whose negatives are the global
batch however it is split over data and fsdp (and the towers' heads and MLPs over tensor), DiT's
denoising loss (its class table of 11 rows sharded over D only), and DPO's loss, each pair's two
replies on one device."""

import numpy as np
import pytest

pytestmark = [pytest.mark.multidevice, pytest.mark.slow]
MESHES = ["(8, 1, 1)", "(2, 4, 1)", "(2, 2, 2)"]
EXPERIMENTS = [
  "vision/vit-digits:smoke",
  "vision/clip-digits:smoke",
  "diffusion/dit-digits:smoke",
  "chat/shakespeare-dialogue-dpo:smoke",  # each pair's two replies on one device
]


@pytest.fixture(scope="module", params=EXPERIMENTS)
def results(request, forced_devices):
  return forced_devices.worker("image_worker.py", request.param)


@pytest.mark.parametrize("mesh", MESHES)
def test_loss_and_gradients_equal_single_device(results, mesh):
  ref, got = results["single"], results[mesh]
  assert got["count"] == ref["count"] == 13  # 16 rows (or pairs), 3 of them padding
  assert got["total"] == pytest.approx(ref["total"], rel=1e-5)
  assert got["grads"].keys() == ref["grads"].keys()
  # A floor for each parameter: the key bias's gradient is zero but for rounding (softmax
  # ignores a shift), so it is compared at the scale of the whole gradient.
  floor = 1e-3 * max(np.max(np.abs(np.asarray(g))) for g in ref["grads"].values())
  for name, g in ref["grads"].items():
    g, h = np.asarray(g), np.asarray(got["grads"][name])
    scale = max(np.max(np.abs(g)), floor)
    assert np.max(np.abs(h - g)) / scale < 1e-5, name
