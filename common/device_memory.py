"""What a compiled program needs of a device's memory, and what the device has.

A compiled program's `memory_analysis()` says what it holds at its peak: its arguments, its outputs
less those aliased to a donated argument, its temporaries and its code. The device's side is the
allocator's limit on a GPU or TPU (`memory_stats()["bytes_limit"]`), and on a CPU this host's
available memory (/proc/meminfo's MemAvailable) shared among the host's devices and processes.
`NNX_ZOO_MEMORY_BUDGET` (bytes, or with a unit: 512MiB, 2GiB) forces what one device has: a test's
hook, or a cap a user sets. The trainer (common/train/fit.py), `zoo eval` and the sampler's
programs (common/programs.py) ask `measure` before they run a program, and refuse it in one line
(`refusal`) rather than letting the allocator fail inside it.
"""

import dataclasses
import os
import re

from nnx_zoo.common.errors import UserError

GiB = 2**30
BUDGET = "NNX_ZOO_MEMORY_BUDGET"
# A candidate `train.fit=auto` takes leaves this share of the device free: the figures are the
# compiler's, and the process holds more than the step (its runtime, the data pipeline, copies).
HEADROOM = 0.10
_UNITS = {"": 1, "b": 1, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(text: str) -> int:
  """'1073741824', '1GiB', '512 MiB', '1.5GiB' -> bytes; a UserError naming the accepted forms."""
  found = re.fullmatch(r"\s*([\d.]+)\s*([A-Za-z]*)\s*", text)
  unit = found.group(2).lower() if found else ""
  if not found or unit not in _UNITS:
    raise UserError(
      f"{BUDGET}={text!r} is not a size: give bytes, or a number with KiB, MiB, GiB or TiB "
      "(e.g. 2GiB)."
    )
  try:
    return int(float(found.group(1)) * _UNITS[unit])
  except ValueError:
    raise UserError(f"{BUDGET}={text!r} is not a size: e.g. 2GiB.") from None


def gib(n: int) -> str:
  """Bytes as GiB (MiB under a tenth of one)."""
  return f"{n / GiB:.2f} GiB" if n >= GiB / 10 else f"{n / 2**20:.2f} MiB"


@dataclasses.dataclass(frozen=True)
class Budget:
  bytes: int  # what one device may hold
  where: str  # what the figure is, for the messages


def _mem_available() -> int | None:
  try:
    with open("/proc/meminfo") as f:
      for line in f:
        if line.startswith("MemAvailable:"):
          return int(line.split()[1]) * 1024
  except OSError:
    pass
  return None


def _processes_on_host() -> int:
  """The processes of this job that share this host's memory: all of them when the coordinator
  is on this host's loopback (as the multi-process tests run), else this one (one per host)."""
  import jax

  if jax.process_count() == 1:
    return 1
  try:
    from jax._src import distributed  # the address the processes joined at

    address = distributed.global_state.coordinator_address or ""
  except (ImportError, AttributeError):
    address = ""
  host = address.rpartition(":")[0]
  return jax.process_count() if host in ("127.0.0.1", "localhost", "[::1]") else 1


def budget(device=None) -> Budget | None:
  """What one device (`device`, or the first local one) has for a program: NNX_ZOO_MEMORY_BUDGET
  where set; a GPU's or TPU's allocator limit; a CPU device's share of this host's available
  memory. None where the platform says nothing (no check)."""
  import jax

  forced = os.environ.get(BUDGET, "")
  if forced:
    return Budget(parse_bytes(forced), BUDGET)
  device = device or jax.local_devices()[0]
  if device.platform == "cpu":
    available = _mem_available()
    if available is None:
      return None
    shares = len(jax.local_devices()) * _processes_on_host()
    where = "this host's available memory"
    if shares > 1:
      where += f", 1/{shares} for each of its {shares} devices"
    return Budget(available // shares, where)
  stats = device.memory_stats() or {}
  if "bytes_limit" not in stats:
    return None
  return Budget(int(stats["bytes_limit"]), f"{device.device_kind}'s memory limit")


@dataclasses.dataclass(frozen=True)
class Fit:
  """A compiled program's bytes on one device against the device's budget."""

  argument: int
  output: int  # less what is aliased to a donated argument
  temp: int
  code: int
  held: int  # of the arguments, bytes already in memory when it was measured (CPU: not free)
  budget: Budget | None

  @property
  def needed(self) -> int:
    return self.argument + self.output + self.temp + self.code

  @property
  def available(self) -> int | None:
    """What the device has for the program: the budget, plus (on a CPU, whose figure is what is
    still free) the arguments already held."""
    if self.budget is None:
      return None
    held = self.held if self.budget.where.startswith("this host") else 0
    return self.budget.bytes + held

  def fits(self, *, headroom: float = 0.0) -> bool:
    return self.available is None or self.needed <= (1 - headroom) * self.available

  def summary(self) -> str:
    """'needs 31.88 GiB (arguments ..., temporaries ...), has 19.03 GiB (where)'."""
    parts = (
      f"arguments {gib(self.argument)}, outputs {gib(self.output)}, temporaries {gib(self.temp)}"
    )
    has = "an unknown amount" if self.available is None else gib(self.available)
    where = f" ({self.budget.where})" if self.budget else ""
    return f"needs {gib(self.needed)} ({parts}), has {has}{where}"


def program_bytes(compiled) -> dict[str, int]:
  """Per device, what `compiled` holds at its peak (`memory_analysis()`): the arguments, the
  outputs not aliased to a donated argument, the temporaries and the program's code."""
  mem = compiled.memory_analysis()
  if isinstance(mem, list | tuple):  # older jax: one per program
    mem = mem[0]
  return {
    "argument": int(mem.argument_size_in_bytes),
    "output": int(mem.output_size_in_bytes - mem.alias_size_in_bytes),
    "temp": int(mem.temp_size_in_bytes),
    "code": int(mem.generated_code_size_in_bytes),
  }


_ASK = object()


def measure(compiled, *, held: int = 0, device=None, against=_ASK) -> Fit:
  """`compiled`'s bytes per device (`program_bytes`) against the device's budget (`against`: a
  Budget already read, or None for none). `held`: bytes of its arguments that are already in
  memory (on a CPU they are not in MemAvailable, yet the program needs no more room for them)."""
  against = budget(device) if against is _ASK else against
  return Fit(**program_bytes(compiled), held=held, budget=against)


def held_bytes(tree) -> int:
  """Bytes of a tree's arrays that exist already (abstract leaves count none), per device: the
  largest shard of each."""
  import jax
  import numpy as np

  total = 0
  for leaf in jax.tree.leaves(tree):
    if isinstance(leaf, jax.Array) and not isinstance(leaf, jax.core.Tracer):
      shape = leaf.sharding.shard_shape(leaf.shape)
      total += int(np.prod(shape)) * leaf.dtype.itemsize
  return total


def refusal(what: str, fit: Fit, fix: str) -> UserError:
  """The one line a program that does not fit is refused with."""
  return UserError(f"{what} does not fit: it {fit.summary()}. {fix}")
