"""When a temporary checkpoint is due (`train.checkpoint_minutes`): decided on process 0's clock
and shared, so every process saves at the same step."""

import time

import jax
import numpy as np
from jax.experimental import multihost_utils


class CheckpointClock:
  """Due when `minutes` have passed since the last save (`Checkpoints.saved_at`, of either kind).

  One process asks its clock every step. Several ask every `every` steps (log_every, where the
  loop waits for the step's metrics anyway): process 0's answer is broadcast to the others (one
  small collective), so a save is at most `every` steps late and the loop never syncs each step.
  """

  def __init__(self, minutes: float, *, every: int, ckpts):
    self.seconds, self.every, self.ckpts = 60.0 * minutes, every, ckpts

  def due(self, step: int) -> bool:
    if not self.seconds:
      return False
    late = time.monotonic() - self.ckpts.saved_at >= self.seconds
    if jax.process_count() == 1:
      return late
    if step % self.every:
      return False
    return bool(multihost_utils.broadcast_one_to_all(np.int32(late)))
