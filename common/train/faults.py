"""Fault tolerance for the trainer: stopping cleanly on SIGTERM/SIGINT and refusing non-finite
updates.

An unwritable workdir is found before any work is done by `check_writable` (common/files.py);
checkpoint integrity (unfinished saves, damaged files) lives in common/hub/checkpoint.py.
"""

import functools
import os
import signal
import sys
import threading

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from nnx_zoo.common.errors import Preempted, UserError

NONFINITE_POLICIES = ("skip", "stop")


# Preemption


class Signals:
  """While installed, SIGTERM and SIGINT set `received` instead of ending the process, so the
  trainer can finish its step and save; a second signal ends it the usual way at once.

  Installed only for the training loop (and only from the main thread, where Python allows
  it); `restore` puts the previous handlers back. The loop asks `stop_after` once per step.
  """

  HANDLED = (signal.SIGTERM, signal.SIGINT)

  def __init__(self):
    self.received: int | None = None  # by this process
    self.agreed: int | None = None  # by any process, as all of them know at the same step
    self.pending: jax.Array | None = None  # several processes: the last step's max, unread
    self.previous: dict = {}

  def install(self) -> "Signals":
    if threading.current_thread() is threading.main_thread():
      for signum in self.HANDLED:
        self.previous[signum] = signal.signal(signum, self.handle)
    return self

  def restore(self):
    for signum, handler in self.previous.items():
      # None: a handler set from C, which Python cannot reinstate; the default is closest.
      signal.signal(signum, signal.SIG_DFL if handler is None else handler)
    self.previous = {}

  def handle(self, signum, _frame):
    if self.received is not None:  # the second one: stop waiting for the checkpoint
      self.restore()
      signal.raise_signal(signum)
      return
    self.received = signum
    print(
      f"\nzoo: {signal.Signals(signum).name} received: finishing this step and saving a "
      "checkpoint (send it again to stop at once, losing the steps since the last one).",
      file=sys.stderr,
      flush=True,
    )

  def stop_after(self) -> int | None:
    """The signal that stops the run after the current step, or None: the same answer on every
    process at the same step, since the checkpoint is written by all of them together.

    One process: the signal it received. Several: a preemption notice may reach one host only,
    so each step every process adds its flag to a one-element max over all devices, dispatched
    without waiting, and reads the previous step's, which finished with the previous step: the
    loop never waits on it, and the run stops one step after the signal arrived.
    """
    if jax.process_count() == 1:
      self.agreed = self.received
      return self.agreed
    previous, self.pending = self.pending, _max_over_processes(self.received or 0)
    self.agreed = (int(previous) if previous is not None else 0) or None
    return self.agreed

  def preempted(self, step: int, directory: str) -> Preempted:
    signum = self.agreed or self.received
    name = signal.Signals(signum).name
    elsewhere = "" if self.received else " (received by another process)"
    return Preempted(
      f"stopped by {name}{elsewhere} after step {step}: its checkpoint is saved in "
      f"{os.path.join(directory, str(step))}. Rerun the same command to resume from it.",
      signum=signum,
    )


def _max_over_processes(flag: int) -> jax.Array:
  """The largest of every process's `flag`, replicated, as an array not yet waited for."""
  sharding, reduce = _flag_reduction()
  local = np.full((jax.local_device_count(),), flag, np.int32)
  return reduce(jax.make_array_from_process_local_data(sharding, local))


@functools.cache
def _flag_reduction():
  mesh = jax.sharding.Mesh(np.asarray(jax.devices()), ("all",))
  return NamedSharding(mesh, P("all")), jax.jit(jnp.max, out_shardings=NamedSharding(mesh, P()))


# Divergence


def finite(loss, grad_norm) -> jax.Array:
  """Whether a step's update may be applied: its loss and gradient norm are finite (a traced
  bool; the optimizer skips the update where it is False, common/optim.py)."""
  return jnp.isfinite(loss) & jnp.isfinite(grad_norm)


class NonFinite:
  """The steps whose update was skipped (`finite` False), and what `train.nonfinite` does then.

  "skip": the run goes on, and `take` counts the refused steps for the log line (`skipped`).
  "stop": before anything is logged or saved after such a step, a UserError names it and the last
  good checkpoint. The per-step flags stay on the device until then: no host sync per step.
  """

  def __init__(self, policy: str, ckpts):
    if policy not in NONFINITE_POLICIES:
      raise UserError(
        f"Unknown train.nonfinite {policy!r}: use 'skip' (skip the update of a batch whose loss "
        "or gradient is not finite, and count it) or 'stop' (end the run there)."
      )
    self.policy, self.ckpts = policy, ckpts
    self.pending: list[tuple[int, jax.Array]] = []  # (step, skipped flag) not yet looked at
    self.skipped = 0  # looked at, not yet taken

  def observe(self, step: int, metrics: dict):
    self.pending.append((step, metrics["skipped"]))

  def check(self):
    """Looks at the pending flags (a host sync); under "stop", a UserError if one is set."""
    flags = jax.device_get([flag for _, flag in self.pending])
    bad = [step for (step, _), flag in zip(self.pending, flags, strict=True) if int(flag)]
    self.pending = []
    if bad and self.policy == "stop":
      last = self.ckpts.latest_step()
      where = (
        f"the last good checkpoint is step {last} ({os.path.join(self.ckpts.path, str(last))})"
        if last is not None
        else "there is no checkpoint yet"
      )
      raise UserError(
        f"Step {bad[0]} has a non-finite loss or gradient (train.nonfinite='stop'): its update "
        f"was not applied and nothing after it was saved; {where}. Lower optim.lr or check the "
        "data, or set --config.train.nonfinite=skip to skip such batches."
      )
    self.skipped += len(bad)

  def take(self) -> int:
    """The number of skipped steps since the last take (after `check`)."""
    self.check()
    count, self.skipped = self.skipped, 0
    return count
