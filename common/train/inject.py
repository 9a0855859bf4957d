"""Fault injection for tests: the faults `$NNX_ZOO_INJECT` names, fired by the training loop at the
start of a step, or inside it. Never active unless the variable is set (docs/training.md,
"Injected faults").

The variable holds comma-separated faults `KIND@STEP[:pPROC][:ARG]`:

  hang@5:p1      process 1's main thread blocks for ever before step 5 (the process stays alive,
                 its threads and JAX's heartbeats go on: what the watchdog is for)
  exit@3[:CODE]  the process exits with CODE (1 unless given) at once, nothing cleaned up
  kill@4         the process sends itself SIGKILL
  stop@4         the process sends itself SIGSTOP (a stopped process runs no watchdog)
  slow@*:p1:0.5  process 1's host sleeps 0.5 s before every step (`*`: every step): a slow host,
                 late to dispatch; while the devices have steps queued it delays no step
  stall@7:0.5    step 7 itself takes about 0.5 s longer: a loop on the device inside the compiled
                 step, after its loss, so its outputs are ready that much later whatever the
                 host does (`*`: every step; the step is compiled again, with the loop)

Without `:pPROC` a fault fires on every process. A fault at a step fires once per workdir: before
it fires, a marker `WORKDIR/injected/KIND@STEP-pPROC` is written, so the run that resumes after it
passes that step (not a stall, which only slows its step, each time it runs).
"""

import dataclasses
import os
import signal
import sys
import threading
import time

import jax
import jax.numpy as jnp

from nnx_zoo.common.errors import UserError

ENV = "NNX_ZOO_INJECT"
KINDS = ("hang", "exit", "kill", "stop", "slow", "stall")
TIMED = ("slow", "stall")  # the kinds that take seconds, and step *
FORMAT = "KIND@STEP[:pPROC][:ARG] (hang@5:p1, exit@3:1, kill@4, stop@4, slow@*:p1:0.5, stall@7:0.5)"


@dataclasses.dataclass(frozen=True)
class Fault:
  kind: str
  step: int | None  # None: every step (slow and stall only)
  process: int | None  # None: every process
  arg: float | None  # exit: the code; slow and stall: the seconds

  @property
  def name(self) -> str:
    return f"{self.kind}@{'*' if self.step is None else self.step}"


def parse(spec: str) -> list[Fault]:
  """The faults of `spec` (the variable's value); a UserError names the first that is malformed."""
  faults = []
  for item in (part.strip() for part in spec.split(",")):
    if not item:
      continue
    kind, at, rest = item.partition("@")
    fields = rest.split(":")
    if not at or kind not in KINDS or not fields[0]:
      raise UserError(f"{ENV}: {item!r} is not a fault: write {FORMAT}; kinds: {', '.join(KINDS)}.")
    step_text, process, arg = fields[0], None, None
    for field in fields[1:]:
      if field.startswith("p") and process is None and arg is None:
        process = _number(item, field[1:], int)
      elif arg is None:
        arg = _number(item, field, float)
      else:
        raise UserError(f"{ENV}: {item!r} has too many fields: write {FORMAT}.")
    if step_text == "*":
      if kind not in TIMED:
        raise UserError(
          f"{ENV}: {item!r}: only slow and stall take step *; name the step of a {kind}."
        )
      step = None
    else:
      step = _number(item, step_text, int)
    if kind in TIMED and arg is None:
      raise UserError(f"{ENV}: {item!r}: {kind} needs its seconds ({kind}@*:p1:0.5).")
    if arg is not None and kind not in ("exit", *TIMED):
      raise UserError(f"{ENV}: {item!r}: {kind} takes no argument.")
    faults.append(Fault(kind, step, process, arg))
  return faults


def _number(item: str, text: str, kind):
  try:
    value = kind(text)
  except ValueError:
    value = -1
  if value < 0:
    raise UserError(f"{ENV}: {item!r}: {text!r} is not a number >= 0: write {FORMAT}.")
  return value


class Injector:
  """This process's faults; `at(step)` fires those of `step` (the loop calls it first thing)."""

  def __init__(self, faults: list[Fault], *, workdir: str, process: int):
    self.workdir, self.process = workdir, process
    mine = [f for f in faults if f.process in (None, process)]
    self.slow = sum(f.arg for f in mine if f.kind == "slow" and f.step is None)
    self.stalls = [f for f in mine if f.kind == "stall"]
    self.at_step = {}
    for fault in mine:
      if fault.step is not None and fault.kind != "stall":
        self.at_step.setdefault(fault.step, []).append(fault)

  def step_fn(self, step_fn):
    """`step_fn` (the jitted train step), with this process's stalls inside it: after the step,
    a loop on the device as long as the stall (`spin_rate`), which the loss waits for (and comes
    out of unchanged), so the step's outputs are late by the stall while the loop dispatches on
    ahead as usual. (A host callback would not do: XLA:CPU runs a program that holds one
    synchronously, in the dispatching thread.) Without stalls, `step_fn` itself."""
    if not self.stalls:
      return step_fn
    rate = spin_rate()

    def iterations(seconds: float) -> int:
      return min(int(rate * seconds), 2**31 - 1)  # an int32 on the device (40 s and more here)

    seconds: dict[int, float] = {}
    for f in self.stalls:
      if f.step is not None:
        seconds[f.step] = seconds.get(f.step, 0.0) + f.arg
    every = iterations(sum(f.arg for f in self.stalls if f.step is None))
    at = {k: iterations(v) for k, v in seconds.items()}

    def stalled(state, batch):
      state, metrics = step_fn(state, batch)  # state.step: the step just done (1 for the first)
      n = jnp.int32(every)
      for k, n_k in at.items():
        n = n + jnp.where(state.step == k, n_k, 0).astype(jnp.int32)
      loss = metrics["loss"]
      # Started from the loss, so it runs after it; its values stay in [-1, 2], so the loss comes
      # out as it went in (NaN too), but only once the loop is done.
      spun = spin(n, jnp.full((8,), jnp.sin(loss)))
      return state, {**metrics, "loss": jnp.where(spun[0] > 2.0, jnp.nan, loss)}

    return jax.jit(stalled, donate_argnums=0)

  def at(self, step: int):
    if self.slow:
      time.sleep(self.slow)
    for fault in self.at_step.get(step, ()):
      if self._first_time(fault):
        fire(fault, step=step, process=self.process)

  def _first_time(self, fault: Fault) -> bool:
    """Writes the fault's marker; False if it was there already (it fired in an earlier run)."""
    folder = os.path.join(self.workdir, "injected")
    os.makedirs(folder, exist_ok=True)
    try:
      with open(os.path.join(folder, f"{fault.name}-p{self.process}"), "x") as f:
        f.write(f"{time.time()}\n")
    except FileExistsError:
      return False
    return True


SPUN = 2_000_000  # the iterations `spin_rate` times


def spin(n, x):
  """`n` dependent steps of a little arithmetic on the device (each x -> sin(x) + 1)."""
  return jax.lax.fori_loop(0, n, lambda _, v: jnp.sin(v) + 1.0, x)


def spin_rate() -> float:
  """`spin`'s iterations a second on the default device: the fastest of three timings, so that a
  stall is at least about as long as asked on a machine that other work slows."""
  run = jax.jit(spin)
  x = jnp.zeros((8,), jnp.float32)
  run(1, x).block_until_ready()  # compiled
  best = float("inf")
  for _ in range(3):
    t0 = time.perf_counter()
    run(SPUN, x).block_until_ready()
    best = min(best, time.perf_counter() - t0)
  return SPUN / best


def from_env(workdir: str, *, process: int) -> Injector:
  """The injector of `$NNX_ZOO_INJECT` (one that does nothing when the variable is unset)."""
  spec = os.environ.get(ENV, "")
  return Injector(parse(spec) if spec else [], workdir=workdir, process=process)


def fire(fault: Fault, *, step: int, process: int):
  print(f"\nzoo: {ENV}: {fault.name} on process {process}", file=sys.stderr, flush=True)
  if fault.kind == "hang":
    hang()
  elif fault.kind == "exit":
    os._exit(int(fault.arg if fault.arg is not None else 1))
  elif fault.kind == "kill":
    os.kill(os.getpid(), signal.SIGKILL)
  elif fault.kind == "stop":
    os.kill(os.getpid(), signal.SIGSTOP)
  elif fault.kind == "slow":
    time.sleep(fault.arg)


def hang():
  """Blocks the calling thread for ever (signal handlers still run in between)."""
  forever = threading.Event()
  while True:
    forever.wait()  # the hung line the watchdog's dump names
