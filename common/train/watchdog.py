"""The hang watchdog: a thread in every training process that ends the process, with every thread's
stack written down, when the step has not advanced for `train.watchdog_s`; and the progress file
it keeps for a supervisor outside the process (common/supervisor.py).

A process whose main thread is stuck (a read that never returns, a deadlock, a collective whose
peer is gone while JAX's heartbeats go on) never fails by itself; this thread sees the step stand
still, writes `WORKDIR/hangs/p{I}-step{S}-{time}.txt` (and the same to stderr) and leaves with
exit code `HUNG` (75, sysexits' EX_TEMPFAIL: "try again"), so a supervisor or a cluster scheduler
restarts it. Stdlib only: the supervisor imports it without jax.

The limit (`limit_s`): `train.watchdog_s` seconds between two steps when > 0; 0 turns the
watchdog (and the progress file) off; -1 (the default) scales with the run, `AUTO_FACTOR` times
the slowest step seen in the last ~`WINDOW` steps (the first step excluded: it compiles), at
least `AUTO_MIN_S`; until a step after the first has been measured, at least `FIRST_FACTOR`
times the first step (a GRPO step that samples for minutes takes about as long as its first,
compilation aside: the next step must not be taken as hung for it). The watchdog starts with
the training loop; until its first `warmup_steps` steps have ended (the first compiles the
step; the trainer passes `train.log_every`, as jax dispatches steps ahead of the device and the
loop first waits for them all at the first logged step, so a slow step's time is only seen
from there) and while it evaluates (which compiles its own program), `FIRST_S` more are
allowed.
"""

import contextlib
import faulthandler
import json
import os
import socket
import sys
import threading
import time

from nnx_zoo.common.errors import UserError

HUNG = 75  # the exit code of a process the watchdog ended
AUTO = -1  # train.watchdog_s's default: the limit scales with the measured step time
AUTO_MIN_S = 300.0
AUTO_FACTOR = 10.0
FIRST_FACTOR = 2.0  # the second step's limit: at least this times the first step's time
FIRST_S = 600.0  # allowed on top of the limit for start-up and the first step, and evaluation
WINDOW = 100  # steps over which the slowest one sets the automatic limit
TICK_S = 1.0  # how often the thread looks, and rewrites the progress file
# With several processes, one's exit ends the others at once (their collectives fail on the
# closed connection; process 0's takes JAX's coordination service with it), before their own
# watchdogs, whose limits run out at about the same time, have written where they stand: each
# waits this long between its dump and its exit.
EXIT_WAIT_S = 5.0


def progress_path(workdir: str, process: int) -> str:
  return os.path.join(workdir, "progress", f"p{process}")


def read_progress(path: str) -> dict | None:
  """The progress file's record (None while there is none, or one being replaced)."""
  try:
    with open(path) as f:
      return json.loads(f.read())
  except (OSError, ValueError):
    return None


class Watchdog:
  """`beat(step)` from the training loop after each step; `allowing()` around work that may
  compile (evaluation); `stop()` at the end. `limit_s` 0: nothing is watched or written.

  The main thread only stores the step and a time; the thread does the rest. `on_hang` is what
  ends the process (os._exit(HUNG)); tests pass their own."""

  def __init__(
    self,
    limit_s: float,
    *,
    workdir: str,
    process: int,
    processes: int = 1,
    warmup_steps: int = 1,
    on_hang=None,
  ):
    if limit_s < 0 and limit_s != AUTO:
      raise UserError(
        f"train.watchdog_s={limit_s:g}: give the seconds without a step after which a process "
        "is taken as hung, 0 (no watchdog) or -1 (scaled to the step time)."
      )
    self.setting, self.workdir, self.process = float(limit_s), workdir, process
    self.wait_s = EXIT_WAIT_S if processes > 1 else 0.0
    self.on_hang = on_hang or (lambda: os._exit(HUNG))
    self.step, self.steps_seen, self.warmup_steps = 0, 0, max(1, warmup_steps)
    self.last = time.monotonic()  # when the step last advanced (or start-up began)
    self.extra = FIRST_S  # until the first step has ended
    self.slowest, self.slowest_before = 0.0, 0.0  # this window's slowest step, the last one's
    self.first = 0.0  # the first step's time (compilation included)
    self.done = threading.Event()
    self.thread = None
    self.fired: str | None = None  # the dump's path, once it fired

  @property
  def on(self) -> bool:
    return self.setting != 0

  def start(self) -> "Watchdog":
    """Starts watching (the start-up allowance counts from now)."""
    self.last = time.monotonic()
    if self.on:
      self.thread = threading.Thread(target=self._watch, name="zoo-watchdog", daemon=True)
      self.thread.start()
    return self

  def beat(self, step: int):
    """The loop has finished `step`."""
    now = time.monotonic()
    if self.steps_seen:  # the first step (compilation) sets no limit
      self.slowest = max(self.slowest, now - self.last)
      if self.steps_seen % WINDOW == 0:
        self.slowest_before, self.slowest = self.slowest, 0.0
    else:
      self.first = now - self.last
    self.steps_seen += 1
    self.step, self.last = step, now
    self.extra = FIRST_S if self.steps_seen < self.warmup_steps else 0.0

  @contextlib.contextmanager
  def allowing(self, seconds: float | None = None):
    """Work inside the block gets `seconds` (FIRST_S) more; the time after it counts from its
    end."""
    self.extra = FIRST_S if seconds is None else seconds
    try:
      yield
    finally:
      self.last, self.extra = time.monotonic(), 0.0

  def limit_s(self) -> float:
    """The seconds without a new step after which the process is taken as hung, now."""
    if self.setting > 0:
      base = self.setting
    else:
      measured = max(self.slowest, self.slowest_before)
      base = max(AUTO_MIN_S, AUTO_FACTOR * measured)
      if self.steps_seen == 1:  # only the first step has ended: it bounds the next one
        base = max(base, FIRST_FACTOR * self.first)
    return base + self.extra

  def stop(self):
    self.done.set()
    if self.thread is not None and self.thread is not threading.current_thread():
      self.thread.join()

  def _watch(self):
    path = progress_path(self.workdir, self.process)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    while not self.done.wait(TICK_S):
      limit, last, step = self.limit_s(), self.last, self.step
      stood = time.monotonic() - last
      self._write_progress(path, step=step, stood=stood, limit=limit)
      if stood > limit:
        self.fired = self._dump(step=step, stood=stood, limit=limit)
        time.sleep(self.wait_s)
        self.on_hang()
        return
    # The loop has ended (its last save and the process's exit are not watched): say so, or the
    # supervisor would take the silence for a stopped process.
    self._write_progress(path, step=self.step, stood=time.monotonic() - self.last, limit=None)

  def _write_progress(self, path: str, *, step: int, stood: float, limit: float | None):
    """{pid, process, step, step_t (wall time of its end), t (now), limit_s}: the supervisor
    reads `t` to see the process run and `step_t` to see it advance; `limit_s` None once the
    watchdog has stopped."""
    now = time.time()
    record = {"pid": os.getpid(), "process": self.process, "step": step}
    record.update(step_t=now - stood, t=now, limit_s=limit)
    tmp = f"{path}.tmp"
    try:
      with open(tmp, "w") as f:
        f.write(json.dumps(record))
      os.replace(tmp, path)
    except OSError:
      pass  # a full or vanished disk is not the hang this thread looks for

  def _dump(self, *, step: int, stood: float, limit: float) -> str:
    """Every thread's stack, to WORKDIR/hangs/ and to stderr; the file's path."""
    stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime())
    head = (
      f"zoo: watchdog: process {self.process} (pid {os.getpid()} on {socket.gethostname()}) "
      f"made no step for {stood:.0f} s (limit {limit:.0f} s, train.watchdog_s): last step "
      f"{step}, at {stamp} UTC; every thread's stack follows, then exit {HUNG}"
      f"{f' in {self.wait_s:g} s' if self.wait_s else ''}.\n"
    )
    folder = os.path.join(self.workdir, "hangs")
    path = os.path.join(folder, f"p{self.process}-step{step}-{stamp}.txt")
    try:
      os.makedirs(folder, exist_ok=True)
      with open(path, "w") as f:
        f.write(head)
        f.flush()
        faulthandler.dump_traceback(f, all_threads=True)
    except OSError as e:
      head += f"(could not write {path}: {e})\n"
    sys.stderr.write("\n" + head)
    sys.stderr.flush()
    faulthandler.dump_traceback(sys.stderr, all_threads=True)
    return path
