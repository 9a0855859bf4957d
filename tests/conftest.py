"""The test session's setup: one persistent XLA compilation cache for the tests and the `zoo`
processes they start (the environment is inherited), so a program compiled once (a smoke step, a
resume's step, however small) is loaded, not compiled again, by the next test or subprocess that
builds it, and by the next run. Set JAX_COMPILATION_CACHE_DIR yourself to put it elsewhere.

On a GPU, fp32 matmuls run at full precision: XLA (and Pallas Triton) run them as TF32 there by
default (errors ~6e-4 on an H200, docs/gpu.md), and the tests compare fp32 paths against fp32
references with fp32 tolerances. Set through the environment, before jax is imported, so the
`zoo` processes the tests start inherit it; a machine without jax's CUDA plugin is untouched, so
on a CPU the suite runs as it always has. Tests marked `cpu_only` check what a CPU backend does
and are skipped, saying why, on any other."""

import importlib.util
import json
import os
import pathlib
import socket
import subprocess
import sys
import tempfile

import pytest

os.environ.setdefault(
  "JAX_COMPILATION_CACHE_DIR", os.path.join(tempfile.gettempdir(), "nnx-zoo-tests-xla-cache")
)
# Every program kept, however quickly it compiled (jax keeps only those over 1 s by default): the
# tests compile hundreds of small ones, which a later run, worker or subprocess then loads (the
# quick suite's summed test time here: 700 -> 635 s on an empty cache, 413 -> 306 s on a full
# one, which takes 23 MB).
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")


def _cuda_plugin_installed() -> bool:
  return any(importlib.util.find_spec(f"jax_cuda{v}_plugin") for v in (12, 13))


if _cuda_plugin_installed() and os.environ.get("JAX_PLATFORMS", "") in ("", "cuda", "gpu"):
  os.environ.setdefault("JAX_DEFAULT_MATMUL_PRECISION", "highest")
  if "jax" in sys.modules:  # imported before this file (by a plugin): set it there too
    sys.modules["jax"].config.update(
      "jax_default_matmul_precision", os.environ["JAX_DEFAULT_MATMUL_PRECISION"]
    )


@pytest.fixture(autouse=True)
def _cpu_only(request):
  if request.node.get_closest_marker("cpu_only") is not None:
    import jax

    if jax.default_backend() != "cpu":
      pytest.skip(f"checks a CPU backend's behaviour; this is {jax.default_backend()}")


@pytest.fixture
def scanned_copy():
  """`scanned_copy(zoo, out)`: a copy at `out` of the zoo checkpoint `zoo` (a `zoo convert`
  output) whose model has `model.scan` on and whose params are stored stacked, as a scanned
  run saves them (nnx_zoo.common.nn.stacking)."""
  import shutil

  import jax.numpy as jnp
  from flax import nnx

  from nnx_zoo.common import models
  from nnx_zoo.common.hub import checkpoint, weights
  from nnx_zoo.common.nn import stacking

  def copy(zoo, out):
    zoo, out = str(zoo), str(out)
    cfg, params, meta = weights.read_zoo(zoo)
    cfg.scan = True
    params = stacking.match_layers(params, nnx.state(models.abstract(cfg), nnx.Param))
    assert "stacked" in params, "too few layers to stack"
    shutil.copytree(zoo, out, ignore=shutil.ignore_patterns("checkpoints"))
    ckpts = checkpoint.Checkpoints(out, keep=1)
    try:
      state = {"params": params, "step": jnp.zeros((), jnp.int32)}
      ckpts.save(0, state, meta={**meta, "model": cfg.to_dict()}, force=True)
      ckpts.wait()
    finally:
      ckpts.close()
    return out

  return copy


ROOT = pathlib.Path(__file__).resolve().parents[1]


class Devices:
  """Subprocesses that see N fake CPU devices. XLA reads `--xla_force_host_platform_device_count`
  once, when its CPU backend starts, so a test process that already runs JAX on one device
  cannot grow to eight: a multi-device or multi-host case runs a script (a worker beside the
  tests, or `-m nnx_zoo.common.cli`) in a fresh interpreter under `python -P` from the repository
  root. `run` runs one; `succeed` checks that it exited 0 (its stderr's tail is the failure
  message); `results` reads the last JSON line of what succeeded (the workers print their
  results so); `hosts` starts one command as several processes that meet through
  jax.distributed on 127.0.0.1, and `finish` waits for them."""

  def run(self, args: list[str], devices: int = 8, **kw) -> subprocess.CompletedProcess:
    env = {**os.environ, "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}"}
    argv = [sys.executable, "-P", *map(str, args)]
    return subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, **kw)

  def succeed(self, args: list[str], devices: int = 8) -> subprocess.CompletedProcess:
    proc = self.run(args, devices)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc

  def results(self, args: list[str], devices: int = 8) -> dict:
    return json.loads(self.succeed(args, devices).stdout.strip().splitlines()[-1])

  def worker(self, name: str, *args: str, devices: int = 8) -> dict:
    """The results of tests/parallel/NAME with ARGS."""
    return self.results([ROOT / "tests" / "parallel" / name, *args], devices)

  def hosts(self, args: list[str], processes=2, devices=4, env=None) -> list[subprocess.Popen]:
    """`args` as `processes` processes of `devices` fake devices each, on a free port."""
    with socket.socket() as s:
      s.bind(("127.0.0.1", 0))
      port = s.getsockname()[1]
    args = [*map(str, args), "--coordinator", f"127.0.0.1:{port}"]
    env = {**os.environ, **(env or {})}
    env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
    pipes = dict(stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    argv = [sys.executable, "-P", *args, "--num-processes", str(processes), "--process-id"]
    return [subprocess.Popen([*argv, str(i)], cwd=ROOT, env=env, **pipes) for i in range(processes)]

  @staticmethod
  def finish(procs: list[subprocess.Popen], code: int = 0, timeout=300) -> list[str]:
    """Each process's stderr, once all have ended with exit code `code`."""
    errs = [p.communicate(timeout=timeout)[1] for p in procs]
    # Every process's end: the first to fail is often waiting on one that failed before it.
    assert [p.returncode for p in procs] == [code] * len(procs), [err[-3000:] for err in errs]
    return errs


@pytest.fixture(scope="session")
def forced_devices() -> Devices:
  return Devices()


@pytest.fixture(scope="session")
def chunked_like_whole():
  """A check for `train.loss_chunk`: `loss(params, chunk)` with the head `chunk` tokens at a time
  gives the value and every gradient of `loss(params, 0)` (the whole logits)."""
  import jax
  import numpy as np
  from flax import nnx

  def check(loss, params, chunk: int, *, rtol: float = 1e-6):
    (want, g_want), (got, g_got) = (jax.value_and_grad(loss)(params, c) for c in (0, chunk))
    np.testing.assert_allclose(float(got), float(want), rtol=rtol)
    for (k, a), (_, b) in zip(nnx.to_flat_state(g_want), nnx.to_flat_state(g_got), strict=True):
      np.testing.assert_allclose(np.asarray(b[...]), np.asarray(a[...]), rtol=1e-4, atol=1e-6,
                                 err_msg=str(k))  # fmt: skip

  return check
