"""The run's timeline: each process appends what it does, when, to WORKDIR/events/p{I}.jsonl
(`zoo goodput` reads it back: common/train/goodput.py).

Every line is {"t": time.time(), "event", "process", "attempt", ...fields}; `attempt` is unique
to one start of the process. The events: start (with `started`, the process's own start time),
backend (JAX's devices are up), restore (step, seconds; step 0: a fresh state), compile (what,
seconds: every trace, lowering and XLA compilation JAX reports), step (step, start, seconds, data:
the seconds of it spent waiting for the batch), checkpoint (step, seconds, kind), eval (step,
seconds), end (how: "finished", "preempted" or "failed").

Writing costs a json.dumps and one write(2) per line (a few microseconds: every line is flushed),
so a kill loses at most the line being written, and `zoo goodput` still sees every step the
killed attempt did (the steps it must count as done again). The time after an attempt's last
line is downtime.
"""

import contextlib
import json
import os
import threading
import time

import jax

# JAX's own timings of the work that turns a function into a program (jax._src.dispatch).
COMPILE_EVENTS = {
  "/jax/core/compile/jaxpr_trace_duration": "trace",
  "/jax/core/compile/jaxpr_to_mlir_module_duration": "lower",
  "/jax/core/compile/backend_compile_duration": "compile",
}


_current: "Events | None" = None  # the run's events, which JAX's compilations are recorded in
_listening = False


def _listen(events: "Events | None"):
  """Sends JAX's compilation timings to `events` from now on (None: nowhere). One listener for
  the process, registered once: a run that stops before its end leaves nothing behind."""
  global _current, _listening
  _current = events
  if not _listening:
    jax.monitoring.register_event_time_span_listener(_on_compile)
    _listening = True


def _on_compile(event: str, start: float, end: float, **kwargs):
  what = COMPILE_EVENTS.get(event)
  events = _current
  if what is not None and events is not None:
    name = kwargs.get("fun_name", "")
    events.record("compile", t=end, what=what, name=name, seconds=end - start)


def directory(workdir: str) -> str:
  return os.path.join(workdir, "events")


def process_started() -> float:
  """When this process began (Linux: /proc's start time, to 10 ms), so the interpreter's and the
  imports' time counts as start-up; elsewhere, when this module was imported."""
  try:
    with open("/proc/self/stat") as f:
      ticks = int(f.read().rsplit(")", 1)[1].split()[19])  # field 22: start time since boot
    with open("/proc/uptime") as f:
      uptime = float(f.read().split()[0])
    # Not /proc/stat's btime: it is rounded to the second.
    return time.time() - (uptime - ticks / os.sysconf("SC_CLK_TCK"))
  except (OSError, ValueError, IndexError):
    return _IMPORTED


_IMPORTED = time.time()


class Events:
  """This process's event file. Lines wait in memory until `open` (once the workdir is known
  to be the run's: a refused run writes nothing), then go to the file."""

  def __init__(self, workdir: str):
    self.path = os.path.join(directory(workdir), f"p{jax.process_index()}.jsonl")
    self.process = jax.process_index()
    self.attempt = f"{time.strftime('%Y%m%dT%H%M%S')}-{os.getpid()}"
    self.file = None
    self.pending: list[str] = []
    self.lock = threading.Lock()  # JAX reports compilations from any thread
    self.step_t0 = self.data_t1 = None
    self.window: list[float] = []  # when each step was dispatched, since `take_window`
    self.record("start", started=process_started())
    _listen(self)

  def record(self, event: str, *, t: float | None = None, **fields):
    line = json.dumps(
      {
        "t": time.time() if t is None else t,
        "event": event,
        "process": self.process,
        "attempt": self.attempt,
        **fields,
      }
    )
    with self.lock:
      if self.file is None:
        self.pending.append(line)
        return
      self.file.write(line + "\n")
      self.file.flush()

  def open(self):
    """Starts writing (the lines kept so far first)."""
    os.makedirs(os.path.dirname(self.path), exist_ok=True)
    with self.lock:
      self.file = open(self.path, "a")  # noqa: SIM115 (kept open for the run)
      self.file.writelines(line + "\n" for line in self.pending)
      self.file.flush()
      self.pending = []

  def close(self, how: str):
    self.record("end", how=how)
    _listen(None)
    with self.lock:
      if self.file is not None:
        self.file.close()
        self.file = None

  @contextlib.contextmanager
  def timed(self, event: str, **fields):
    """Records `event` with the seconds the block took (checkpoint saves, evaluations)."""
    t0 = time.time()
    yield
    self.record(event, seconds=time.time() - t0, **fields)

  # The loop's marks, in order: step_start, data_ready, step_end

  def step_start(self):
    self.step_t0 = time.time()

  def data_ready(self):
    """The batch is on its way to the devices and the step is dispatched next: when, for the
    straggler check (common/train/stragglers.py), which compares the processes' times of it."""
    self.data_t1 = time.time()
    self.window.append(self.data_t1)

  def step_end(self, step: int):
    """Records the step: from `step_start` to now, `data` of it waiting for the batch."""
    now = time.time()
    self.record(
      "step", t=now, step=step, start=self.step_t0, seconds=now - self.step_t0,
      data=self.data_t1 - self.step_t0,
    )  # fmt: skip

  def take_window(self) -> list[float]:
    """The times of `data_ready` since the last call."""
    window, self.window = self.window, []
    return window
