"""Mesh sizes from config: -1 takes the rest; sizes that do not fit the devices are refused."""

import ml_collections
import pytest

from common import mesh
from common.errors import UserError


def cfg(data, fsdp, tensor):
  return ml_collections.ConfigDict({"data": data, "fsdp": fsdp, "tensor": tensor})


@pytest.mark.parametrize(
  "sizes, devices, want",
  [
    ((1, 1, 1), 1, (1, 1, 1)),
    ((1, -1, 1), 1, (1, 1, 1)),
    ((2, -1, 2), 8, (2, 2, 2)),
    ((-1, 1, 1), 8, (8, 1, 1)),
    ((1, 4, 2), 8, (1, 4, 2)),
  ],
)
def test_resolve(sizes, devices, want):
  assert tuple(mesh.resolve(cfg(*sizes), devices).values()) == want


@pytest.mark.parametrize(
  "sizes, devices, words",
  [
    ((2, 2, 1), 8, "needs 4 devices but 8"),
    ((3, -1, 1), 8, "does not divide the 8 devices"),
    ((-1, -1, 1), 8, "at most one may be -1"),
    ((0, 1, 1), 1, "positive size"),
  ],
)
def test_resolve_errors_name_the_problem(sizes, devices, words):
  with pytest.raises(UserError, match=words):
    mesh.resolve(cfg(*sizes), devices)
