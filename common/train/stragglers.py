"""Stragglers: a process whose own time per step stays far above the other processes' (a robust
score over `train.straggler_threshold` in `train.straggler_windows` windows in a row).

A process's own time is a step's wall time less the time its host waited for the devices
(common/train/events.py, `Events.step_end`): with collectives in every step, all processes'
steps take as long as the slowest one's, but only the slow one spends that time itself (reading
data, in Python, or stalled). A slow accelerator holds every host in the same collectives and so
shows in none of these times: the profiler finds that one.
"""

import jax
import numpy as np
from jax.experimental import multihost_utils

from nnx_zoo.common.files import warn

MAD_SCALE = 1.4826  # the median absolute deviation of a normal distribution, in its sigmas
# The scale is at least this share of the others' median: with two processes, or several with
# near-equal times, the MAD alone is 0 or noise, and a 1% difference would score in the hundreds.
FLOOR = 0.1


def scores(times) -> np.ndarray:
  """Each process's score: (its time - the median of the others') / max(MAD_SCALE x the others'
  median absolute deviation, FLOOR x the others' median). Leaving the process itself out keeps
  an outlier from widening its own yardstick (and works with two processes)."""
  times = np.asarray(times, np.float64)
  out = np.zeros(len(times))
  for i in range(len(times)):
    others = np.delete(times, i)
    if not len(others):
      continue
    median = np.median(others)
    mad = np.median(np.abs(others - median))
    scale = max(MAD_SCALE * mad, FLOOR * median, 1e-9)
    out[i] = (times[i] - median) / scale
  return out


class Detector:
  """Counts, per process, the windows in a row whose score exceeds `threshold`; a process is a
  straggler while its count is at least `windows`."""

  def __init__(self, *, threshold: float, windows: int):
    self.threshold, self.windows = threshold, max(int(windows), 1)
    self.streak: np.ndarray | None = None

  def observe(self, times) -> list[int]:
    """The stragglers after this window of per-process times."""
    over = scores(times) > self.threshold
    if self.streak is None or len(self.streak) != len(over):
      self.streak = np.zeros(len(over), np.int64)
    self.streak = np.where(over, self.streak + 1, 0)
    return [int(i) for i in np.flatnonzero(self.streak >= self.windows)]


class Monitor:
  """The trainer's check, at each logged step: every process's mean own time per step since the
  last check, shared by one all-gather of a float; new stragglers are named in one warning line
  (process 0), and the current ones returned for metrics.jsonl."""

  def __init__(self, train_cfg, events):
    self.events = events
    self.active = jax.process_count() > 1 and train_cfg.straggler_threshold > 0
    self.detector = Detector(
      threshold=train_cfg.straggler_threshold, windows=train_cfg.straggler_windows
    )
    self.named: set[int] = set()

  def check(self, step: int) -> dict:
    if not self.active:
      return {}
    window = self.events.take_window()
    mine = float(np.mean(window)) if window else 0.0
    times = np.asarray(multihost_utils.process_allgather(np.float32(mine))).reshape(-1)
    self.events.busy()  # waiting here for the others is not this process's own time
    stragglers = self.detector.observe(times)
    new = [p for p in stragglers if p not in self.named]
    self.named = set(stragglers)
    if new and jax.process_index() == 0:
      median = float(np.median(times))
      named = ", ".join(f"process {p} ({times[p]:.3f} s)" for p in new)
      warn(
        f"straggler at step {step}: {named} against a median of {median:.3f} s of own time "
        f"per step, for {self.detector.windows} logged windows in a row (train.straggler_*)."
      )
    return {"stragglers": stragglers} if stragglers else {}
