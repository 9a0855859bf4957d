"""The run's timeline: each process appends what it does, when, to WORKDIR/events/p{I}.jsonl
(`zoo goodput` reads it back: common/train/goodput.py).

Every line is {"t": time.time(), "event", "process", "attempt", ...fields}; `attempt` is unique
to one start of the process. The events: start (with `started`, the process's own start time),
backend (JAX's devices are up), restore (step, seconds; step 0: a fresh state), compile (what,
seconds: every trace, lowering and XLA compilation JAX reports), step (step, start, seconds, data:
the seconds of it the devices waited for the batch, dispatched: when the loop handed it to JAX),
checkpoint (step, seconds, kind), eval (step, seconds), end (how: "finished", "preempted" or
"failed").

A step's time is its real one, not its dispatch's: JAX dispatches asynchronously, and the loop
runs steps ahead of the devices. A waiter thread blocks on each step's outputs (its metrics), in
the order the steps were dispatched, and writes the step's line when they are ready: the step
ran from when the loop began it or the previous step's outputs were ready, whichever is later, to
when its own were. The loop waits for the queued steps (`wait_steps`) before an evaluation or a
save, so that each bucket holds its own time and not the steps' compute queued before it.

Writing costs a json.dumps and one write(2) per line (a few microseconds: every line is flushed),
so a kill loses at most the lines being written and the steps not yet done: `zoo goodput` still
sees every step the killed attempt finished (the steps it must count as done again). The time
after an attempt's last line is downtime.
"""

import contextlib
import json
import os
import queue
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

FAILED_WAIT_S = 1.0  # how long a failed run's end waits for the steps it had queued


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
    self.queued: queue.Queue = queue.Queue()  # steps dispatched, their outputs not yet seen ready
    self.waiter: threading.Thread | None = None
    self.unrecorded = 0  # steps dispatched and not yet recorded (or given up: an error)
    self.recorded = threading.Condition()
    self.ready_t: float | None = None  # when the last recorded step's outputs were ready
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
    """Records the end. A run that failed waits for its queued steps `FAILED_WAIT_S` at most (one
    may never end: a device error, a hung collective); the lines of those still running are
    lost, their time is the attempt's end."""
    self.wait_steps(timeout=FAILED_WAIT_S if how == "failed" else None)
    if self.waiter is not None:
      self.queued.put(None)
      self.waiter = None
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

  # The loop's marks, in order: step_start, data_ready, dispatched

  def step_start(self):
    self.step_t0 = time.time()

  def data_ready(self):
    """The batch is on its way to the devices and the step is dispatched next: when, for the
    straggler check (common/train/stragglers.py), which compares the processes' times of it."""
    self.data_t1 = time.time()
    self.window.append(self.data_t1)

  def dispatched(self, step: int, outputs):
    """The step is dispatched (its call returned); `outputs`, arrays of its results that are not
    donated to the next step (its metrics), are ready when the step is done. The waiter thread
    records the step then, from `step_start` (or the previous step's end, if later) to then."""
    if self.waiter is None:
      self.waiter = threading.Thread(target=self._wait, name="zoo-events", daemon=True)
      self.waiter.start()
    with self.recorded:
      self.unrecorded += 1
    self.queued.put((step, self.step_t0, self.data_t1, time.time(), outputs))

  def wait_steps(self, timeout: float | None = None) -> bool:
    """Returns when every dispatched step is done and recorded (the loop's before an evaluation
    or a save, so that the steps queued before it are not counted in it), or after `timeout`
    seconds: whether they all are."""
    with self.recorded:
      return self.recorded.wait_for(lambda: not self.unrecorded, timeout)

  def _wait(self):
    """The waiter thread: records each dispatched step when its outputs are ready, in order.
    `block_until_ready` lets go of the GIL while it waits; the time is read when it returns, late
    by at most the interpreter's switch interval (5 ms) while the loop runs Python."""
    while True:
      item = self.queued.get()
      if item is None:
        return
      try:
        step, t0, t1, sent, outputs = item
        del item
        try:
          jax.block_until_ready(outputs)
        except Exception:  # noqa: BLE001 (the loop meets the same error on its own arrays)
          continue
        now = time.time()
        # The devices took this step up when the previous one was done (a step dispatched ahead
        # waits in their queue), or when the loop began it, if the devices were idle then.
        start = t0 if self.ready_t is None else max(t0, self.ready_t)
        self.ready_t = now
        self.record(
          "step", t=now, step=step, start=start, seconds=now - start,
          data=min(max(t1 - start, 0.0), now - start), dispatched=sent,
        )  # fmt: skip
      finally:
        with self.recorded:
          self.unrecorded -= 1
          self.recorded.notify_all()

  def take_window(self) -> list[float]:
    """The times of `data_ready` since the last call."""
    window, self.window = self.window, []
    return window
