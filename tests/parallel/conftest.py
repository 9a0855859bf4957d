"""What every multi-device test here shares: a subprocess that sees N fake CPU devices.

XLA reads `--xla_force_host_platform_device_count` once, when its CPU backend starts, so a test
process that already runs JAX on one device cannot grow to eight: each case runs a script (a
worker beside these tests, or `-m nnx_zoo.common.cli`) in a fresh interpreter, and the workers
print their results as one JSON line at the end of stdout."""

import json
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]


class Devices:
  """`run` a command line under `python -P` from the repository root; `succeed` runs it and
  checks that it exited 0 (its stderr's tail is the failure message); `results` reads the last
  JSON line of what succeeded."""

  def run(self, args: list[str], devices: int = 8, **kw) -> subprocess.CompletedProcess:
    env = {**os.environ, "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}"}
    return subprocess.run(
      [sys.executable, "-P", *map(str, args)], cwd=ROOT, env=env, capture_output=True, text=True,
      **kw,
    )  # fmt: skip

  def succeed(self, args: list[str], devices: int = 8) -> subprocess.CompletedProcess:
    proc = self.run(args, devices)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc

  def results(self, args: list[str], devices: int = 8) -> dict:
    return json.loads(self.succeed(args, devices).stdout.strip().splitlines()[-1])

  def worker(self, name: str, *args: str, devices: int = 8) -> dict:
    """The results of tests/parallel/NAME with ARGS."""
    return self.results([ROOT / "tests" / "parallel" / name, *args], devices)


@pytest.fixture(scope="session")
def forced_devices() -> Devices:
  return Devices()
