"""Stragglers: a process that keeps reaching its steps late (a robust score over
`train.straggler_threshold` in `train.straggler_windows` logged windows in a row).

What the processes share is not their step's wall time: the collectives in every step make every
process's step as long as the slowest one's. It is when each process dispatched each step of
the window (common/train/events.py, `Events.data_ready`, after its batch is ready): a host that
is slow at anything it does in the loop (reading data, Python, a stall) dispatches last, while
the others, having waited for it inside the previous step, dispatch as soon as that step is done.
A process's lateness at a step is its dispatch time less the earliest process's; the score
compares its mean lateness over the window with the other processes'. JAX dispatching ahead does
not spread these times over the window: each step the loop reads the previous step's preemption
flag, an all-reduce over the processes (common/train/faults.py, `Signals.stop_after`), so no host
dispatches a step before every host has dispatched the one two before it (docs/goodput.md).

The times are each host's wall clock: across hosts they differ by the clocks' offset (NTP keeps
it to milliseconds), far under the floor of the scale (`FLOOR` of a step). A slow accelerator
holds every host in the same collectives and shows in none of these times: the profiler finds it.
"""

import jax
import numpy as np
from jax.experimental import multihost_utils

from nnx_zoo.common.files import warn

MAD_SCALE = 1.4826  # the median absolute deviation of a normal distribution, in its sigmas
# The scale is at least this share of a step: with two processes, or several that are all on
# time, the MAD alone is 0 or noise, and a millisecond would score in the hundreds.
FLOOR = 0.1


def scores(late, *, floor: float) -> np.ndarray:
  """Each process's score: (its lateness - the median of the others') / max(MAD_SCALE x the
  others' median absolute deviation, `floor`). Leaving the process itself out keeps an outlier
  from widening its own yardstick (and works with two processes)."""
  late = np.asarray(late, np.float64)
  out = np.zeros(len(late))
  for i in range(len(late)):
    others = np.delete(late, i)
    if not len(others):
      continue
    median = np.median(others)
    mad = np.median(np.abs(others - median))
    out[i] = (late[i] - median) / max(MAD_SCALE * mad, floor, 1e-12)
  return out


def lateness(dispatched_PS) -> tuple[np.ndarray, float]:
  """From each process's dispatch times of the window's steps [processes, steps]: each one's
  mean lateness (seconds after the earliest process, step by step), and the window's median
  step time (between the earliest dispatches; 0 for a window of one step)."""
  t_PS = np.asarray(dispatched_PS, np.float64)
  first_S = t_PS.min(axis=0)
  step_s = float(np.median(np.diff(first_S))) if t_PS.shape[1] > 1 else 0.0
  return (t_PS - first_S).mean(axis=1), step_s


def gather_times(times) -> np.ndarray:
  """Every process's `times` (epoch seconds, as many on each), [processes, len(times)], in one
  all-gather of float32s: each as the first time (split in two float32s, as one is 128 s coarse
  at today's epoch) and offsets from it (microseconds fine over minutes)."""
  t = np.asarray(times, np.float64)
  hi = np.float32(t[0])
  lo = np.float32(t[0] - np.float64(hi))
  local = np.concatenate([[hi, lo], (t - t[0]).astype(np.float32)]).astype(np.float32)
  got = np.asarray(multihost_utils.process_allgather(local), np.float64).reshape(-1, len(local))
  return got[:, :1] + got[:, 1:2] + got[:, 2:]


class Detector:
  """Counts, per process, the windows in a row whose score exceeds `threshold`; a process is a
  straggler while its count is at least `windows`."""

  def __init__(self, *, threshold: float, windows: int):
    self.threshold, self.windows = threshold, max(int(windows), 1)
    self.streak: np.ndarray | None = None
    self.step_s = 0.0  # the last window's step time with more than one step

  def observe(self, late, *, step_s: float) -> list[int]:
    """The stragglers after this window: each process's mean lateness, and the step time the
    scale's floor is a share of (the last known one where this window cannot say)."""
    self.step_s = step_s or self.step_s
    over = scores(late, floor=FLOOR * self.step_s) > self.threshold
    if self.streak is None or len(self.streak) != len(over):
      self.streak = np.zeros(len(over), np.int64)
    self.streak = np.where(over, self.streak + 1, 0)
    return [int(i) for i in np.flatnonzero(self.streak >= self.windows)]


class Monitor:
  """The trainer's check, at each logged step: every process's dispatch times since the last
  check, shared by one all-gather of a few floats; new stragglers are named in one warning line
  (process 0), the current ones returned for metrics.jsonl."""

  def __init__(self, train_cfg, events):
    self.events = events
    self.active = jax.process_count() > 1 and train_cfg.straggler_threshold > 0
    self.detector = Detector(
      threshold=train_cfg.straggler_threshold, windows=train_cfg.straggler_windows
    )
    self.named: set[int] = set()
    self.first = True

  def check(self, step: int) -> dict:
    if not self.active:
      return {}
    window = self.events.take_window()
    if self.first:  # the compilation and the data pipeline's start, different on each host
      self.first = False
      return {}
    late, step_s = lateness(gather_times(window))
    stragglers = self.detector.observe(late, step_s=step_s)
    new = [p for p in stragglers if p not in self.named]
    self.named = set(stragglers)
    if new and jax.process_index() == 0:
      named = ", ".join(f"process {p} ({late[p]:.3f} s)" for p in new)
      warn(
        f"straggler at step {step}: {named} late to its steps on average, against a median "
        f"of {float(np.median(late)):.3f} s and a step of {self.detector.step_s:.3f} s, for "
        f"{self.detector.windows} logged windows in a row (train.straggler_*)."
      )
    return {"stragglers": stragglers} if stragglers else {}
