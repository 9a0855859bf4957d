"""The multi-host flags: all three or none; a single process needs nothing."""

import pytest

from nnx_zoo.common import distributed
from nnx_zoo.common.errors import UserError


def test_no_flags_and_no_launcher_is_a_single_process(monkeypatch):
  for var in ("SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE"):
    monkeypatch.delenv(var, raising=False)
  distributed.initialize(None, None, None)  # returns without touching jax.distributed


def test_a_single_task_launcher_is_not_a_cluster(monkeypatch):
  monkeypatch.setenv("SLURM_NTASKS", "1")
  assert not distributed._cluster_detected()
  monkeypatch.setenv("SLURM_NTASKS", "4")
  assert distributed._cluster_detected()


@pytest.mark.parametrize(
  "flags", [("127.0.0.1:1234", None, None), (None, 2, 0), ("127.0.0.1:1234", 2, None)]
)
def test_flags_go_together(flags):
  with pytest.raises(UserError, match="go together"):
    distributed.initialize(*flags)


def test_process_id_in_range():
  with pytest.raises(UserError, match="not in"):
    distributed.initialize("127.0.0.1:1234", 2, 2)
