"""Several hosts: JAX's multi-controller runtime, one process per host (as torchrun's flags)."""

import os

import jax

from nnx_zoo.common.errors import UserError


def initialize(coordinator: str | None, num_processes: int | None, process_id: int | None):
  """Joins the run's processes before any device is touched. With the flags: those; without
  them, JAX's own cluster detection when a launcher (Slurm's srun, Open MPI's mpirun) started
  more than one process; otherwise a single process. (Kubernetes: pass the flags.)"""
  given = [coordinator, num_processes, process_id]
  if any(x is not None for x in given) and not all(x is not None for x in given):
    raise UserError(
      "--coordinator, --num-processes and --process-id go together: give all three "
      "(e.g. --coordinator 10.0.0.1:1234 --num-processes 2 --process-id 0) or none."
    )
  if coordinator is None and not _cluster_detected():
    return
  if num_processes is not None and not 0 <= process_id < num_processes:
    raise UserError(f"--process-id {process_id} is not in [0, {num_processes}).")
  # CPU devices of different processes talk through gloo; accelerators bring their own.
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  try:
    jax.distributed.initialize(coordinator, num_processes, process_id)
  except (RuntimeError, ValueError) as e:
    raise UserError(
      f"Could not join the other processes ({e}). Check that the coordinator address is "
      "reachable from every host and that each process has its own --process-id."
    ) from None


def _cluster_detected() -> bool:
  """A launcher whose environment jax.distributed.initialize() reads by itself."""
  return any(int(os.environ.get(v, "1")) > 1 for v in ("SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE"))
