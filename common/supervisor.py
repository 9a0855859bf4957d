"""`zoo run ... --restarts N`: a supervisor that runs the trainer as a child process and runs it
again, resuming, when it fails, is killed or stops making progress (docs/parallel.md, "Keeping a
long run going").

The child is the same command line (with `--restarts=0`). Its exit decides:
  0                    the run is done: the supervisor exits 0
  2 (a user error)     never retried: the child said why in one line
  130, 143 (preempted) the run saved a checkpoint and stopped on purpose: exit with it
  anything else        (an error, a signal, the watchdog's 75) restart, up to N times
The supervisor also reads the child's progress file (common/train/watchdog.py): a child whose
watchdog thread has stopped writing (SIGSTOP, a frozen interpreter) or whose step stood still
past its own limit without its watchdog firing cannot end itself, so the supervisor writes what it
can see of it to WORKDIR/hangs/ and SIGKILLs it. SIGTERM or SIGINT to the supervisor is passed to
the child (which saves and exits) and nothing restarts after.

Restarts wait `BACKOFF_S`, doubled after each attempt that made no step, up to `BACKOFF_MAX_S`.
Each is appended to WORKDIR/events/supervisor-p{I}.jsonl with its cause and the step it resumes
from. Several hosts: each runs its own supervisor; when one child dies the others' end too (JAX's
heartbeat, or their watchdogs in a collective), every supervisor restarts its child, and the new
children meet again at the same coordinator address.
"""

import contextlib
import ctypes
import json
import os
import signal
import subprocess
import sys
import time

from nnx_zoo.common.train import watchdog

BACKOFF_S = 1.0
BACKOFF_MAX_S = 60.0
GRACE_S = 15.0  # past the child's own limit: the time its watchdog has to write its stacks and exit
POLL_S = 0.25
USER_ERROR = 2
PREEMPTED = (128 + signal.SIGTERM, 128 + signal.SIGINT)


def supervise(argv: list[str], *, workdir: str, restarts: int, process: int) -> int:
  """Runs `zoo` with `argv` (the command line given, read after it with --restarts=0) under a
  supervisor; the exit code of the run."""
  command = [sys.executable, "-m", "nnx_zoo.common.cli", *argv, "--restarts=0"]
  return Supervisor(command, workdir=workdir, restarts=restarts, process=process).run()


def process_index(flag: int | None) -> int:
  """This host's process index: --process-id, else what a launcher set (as jax reads it)."""
  if flag is not None:
    return flag
  for var in ("SLURM_PROCID", "OMPI_COMM_WORLD_RANK"):
    if os.environ.get(var, "").isdigit():
      return int(os.environ[var])
  return 0


class Supervisor:
  def __init__(self, command: list[str], *, workdir: str, restarts: int, process: int):
    self.command, self.workdir = command, os.path.abspath(workdir)
    self.restarts, self.process = restarts, process
    self.progress = watchdog.progress_path(self.workdir, process)
    self.child: subprocess.Popen | None = None
    self.stopping: int | None = None  # the signal the supervisor was asked to stop by

  def run(self) -> int:
    previous = {s: signal.signal(s, self._forward) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
      return self._loop()
    finally:
      for signum, handler in previous.items():
        signal.signal(signum, handler)

  def _loop(self) -> int:
    backoff = BACKOFF_S
    for attempt in range(self.restarts + 1):
      resumed = latest_checkpoint(self.workdir)
      code, cause = self._attempt()
      if code == 0 or code == USER_ERROR or code in PREEMPTED or self.stopping:
        return code
      if attempt == self.restarts:
        say(f"zoo: {cause}; no restart left (--restarts {self.restarts}).")
        return code
      made_steps = (self._record() or {}).get("step", 0) > resumed
      backoff = BACKOFF_S if made_steps else min(2 * backoff, BACKOFF_MAX_S)
      # Every process's watchdog fires at about the same time, and process 0's may exit a little
      # later: another process's new child must not meet the old coordinator.
      wait = backoff
      if code == watchdog.HUNG and self.process != 0:
        wait = max(backoff, watchdog.EXIT_WAIT_S + BACKOFF_S)
      now = latest_checkpoint(self.workdir)
      self._record_restart(attempt=attempt + 1, cause=cause, resumed_from=now)
      say(
        f"zoo: {cause}: restart {attempt + 1} of {self.restarts} in {wait:g} s, resuming "
        f"from step {now}."
      )
      deadline = time.monotonic() + wait
      while time.monotonic() < deadline and not self.stopping:
        time.sleep(min(POLL_S, max(deadline - time.monotonic(), 0)))
      if self.stopping:
        return code
    raise AssertionError("unreachable")

  def _attempt(self) -> tuple[int, str]:
    """Runs the child to its end; (its exit code as a shell gives it, why it ended)."""
    prctl = _prctl()  # looked up here: between fork and exec the child only calls it
    self.child = subprocess.Popen(
      self.command, process_group=0, preexec_fn=lambda: prctl and prctl(1, signal.SIGKILL)
    )
    try:
      while self.child.poll() is None:
        stall = self._stalled()
        if stall:
          self._dump(stall)
          self.child.kill()
          self.child.wait()
          return 128 + signal.SIGKILL, stall
        time.sleep(POLL_S)
    finally:
      code = self.child.returncode
      if code is None:  # the supervisor itself is being torn down: the child goes with it
        self.child.kill()
        self.child.wait()
    if code < 0:
      return 128 - code, f"signal {-code} ({_signal_name(-code)})"
    if code == watchdog.HUNG:
      return code, f"watchdog (exit {code})"
    return code, f"exit {code}"

  def _record(self) -> dict | None:
    """The child's progress record, None until this child has written one."""
    record = watchdog.read_progress(self.progress)
    return record if record and record.get("pid") == self.child.pid else None

  def _stalled(self) -> str | None:
    """Why the child cannot end itself and must be killed, or None."""
    record = self._record()
    if record is None or record["limit_s"] is None:  # none yet, or the loop has ended
      return None
    now, limit = time.time(), record["limit_s"]
    if now - record["t"] > limit:  # its watchdog thread has not run for as long as the limit
      return f"no heartbeat for {now - record['t']:.0f} s (stopped or frozen)"
    if now - record["step_t"] > limit + GRACE_S:
      return f"no progress for {now - record['step_t']:.0f} s"
    return None

  def _dump(self, cause: str):
    """What can be seen of a child that cannot dump its own stacks: its last progress record,
    its state and each thread's, from /proc, to WORKDIR/hangs/ and stderr."""
    pid = self.child.pid
    lines = [f"zoo: supervisor: process {self.process}'s child (pid {pid}): {cause}; SIGKILL."]
    lines.append(f"last progress: {json.dumps(self._record())}")
    for task in sorted(os.listdir(f"/proc/{pid}/task")) if os.path.isdir(f"/proc/{pid}") else []:
      base = f"/proc/{pid}/task/{task}"
      name, state, wchan = _read(f"{base}/comm"), _read(f"{base}/stat"), _read(f"{base}/wchan")
      state = state.rsplit(")", 1)[-1].split()[0] if state else "?"
      lines.append(f"thread {task} {name}: state {state}, waiting in {wchan or '-'}")
    text = "\n".join(lines) + "\n"
    stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime())
    folder = os.path.join(self.workdir, "hangs")
    try:
      os.makedirs(folder, exist_ok=True)
      with open(os.path.join(folder, f"p{self.process}-supervisor-{stamp}.txt"), "w") as f:
        f.write(text)
    except OSError:
      pass
    say(text.rstrip())

  def _record_restart(self, *, attempt: int, cause: str, resumed_from: int):
    record = {"t": time.time(), "event": "restart", "process": self.process, "attempt": attempt}
    record.update(cause=cause, resumed_from=resumed_from)
    folder = os.path.join(self.workdir, "events")
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, f"supervisor-p{self.process}.jsonl"), "a") as f:
      f.write(json.dumps(record) + "\n")

  def _forward(self, signum, _frame):
    """SIGTERM/SIGINT: to the child (a stopped one is woken to take it); no restart after."""
    self.stopping = signum
    if self.child is not None and self.child.poll() is None:
      self.child.send_signal(signum)
      self.child.send_signal(signal.SIGCONT)


def latest_checkpoint(workdir: str) -> int:
  """The newest finished checkpoint step in `workdir` (0: none). Orbax names a finished step by
  its number and an unfinished one `N.orbax-checkpoint-tmp...`; read without importing orbax, as
  common/hub/checkpoint.py's `directory` places them."""
  folder = os.path.join(workdir, "checkpoints")
  steps = [int(n) for n in os.listdir(folder) if n.isdigit()] if os.path.isdir(folder) else []
  return max(steps, default=0)


def _signal_name(signum: int) -> str:
  try:
    return signal.Signals(signum).name
  except ValueError:  # a real-time signal
    return f"SIGRT{signum}"


def say(text: str):
  print(text, file=sys.stderr, flush=True)


def _read(path: str) -> str:
  try:
    with open(path) as f:
      return f.read().strip()
  except OSError:
    return ""


def _prctl():
  """Linux's prctl, which the child calls before exec with PR_SET_PDEATHSIG (1): SIGKILL when the
  supervisor dies, so a supervisor killed outright leaves no trainer behind. None elsewhere."""
  with contextlib.suppress(OSError, AttributeError):
    return ctypes.CDLL(None, use_errno=True).prctl
  return None
