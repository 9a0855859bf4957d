"""Traced programs kept across processes, beside JAX's persistent compilation cache.

The persistent cache keeps compiled programs, but it is keyed by the traced program: every
process still traces the model in Python before it can look one up (SmolLM2's sampler: about
2 s of a `zoo chat` start-up). `load(name, fn, args)` keeps the trace too: the first process
traces `jax.jit(fn)` once, saves it with `jax.export` into an `exported/` folder of the
compilation cache, and later processes load it (no Python tracing) and compile it, their
compilation then read from the persistent cache. `load` readies a program before its first
call (its arguments may be abstract); `run(name, fn, args)` runs it.

A saved program is found by a key of everything its trace depends on: `name` and `static` (the
caller's static arguments: a model's graph), the arguments' tree, shapes and dtypes, the zoo's
own source files (any edit makes new keys), the versions of jax, jaxlib and flax, and the
devices. With no persistent cache (`NNX_ZOO_COMPILATION_CACHE=off`, or a process that set none)
nothing is saved: `fn` is compiled in the process. Either way, the compiled program's memory is
compared with the device's before it runs (common/device_memory.py), and one that does not fit is
refused in one line. Arguments are arrays only, or for `load` their shapes (typed PRNG keys as
their key data), on one device.
"""

import functools
import hashlib
import os
import pathlib
import re

import jax

from nnx_zoo.common import device_memory, files

FOLDER = "exported"
_loaded: dict[str, "jax.stages.Compiled"] = {}  # path -> its program, compiled


def directory() -> str | None:
  """Where programs are kept: `exported/` in the persistent compilation cache; None without one."""
  where = jax.config.jax_compilation_cache_dir
  return os.path.join(where, FOLDER) if where else None


@functools.cache
def source_digest() -> str:
  """A digest of the zoo's Python sources (common/, zoo/, kernels/): a program traced from other
  code is another program."""
  root = pathlib.Path(__file__).resolve().parents[1]
  digest = hashlib.sha256()
  for folder in ("common", "zoo", "kernels"):
    for path in sorted((root / folder).rglob("*.py")):
      digest.update(str(path.relative_to(root)).encode())
      digest.update(path.read_bytes())
  return digest.hexdigest()


def key(name: str, static, args) -> str:
  """The key of `name` traced with `static` on arguments shaped as `args`."""
  import flax
  import jaxlib

  parts = [
    name,
    re.sub(r" at 0x[0-9a-f]+", "", repr(static)),  # a function's repr holds its address
    str(jax.tree.structure(args)),
    str([(x.shape, str(x.dtype)) for x in jax.tree.leaves(args)]),
    source_digest(),
    jax.__version__,
    jaxlib.__version__,
    flax.__version__,
    str([d.device_kind for d in jax.devices()]),
  ]
  return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:32]


def load(name: str, fn, args: tuple, *, static, donate: tuple[int, ...] = ()):
  """`fn` ready to run on arguments shaped as `args` (arrays or `jax.ShapeDtypeStruct`s: a
  program can be readied before its arguments exist, e.g. while the weights are restored):
  traced at most once across processes (see the module's docstring) and compiled, or read from
  the persistent cache. `fn` is jax-traceable (it calls jitted functions); `static` is what it
  closes over that shapes its trace (its repr goes into the key). Without a persistent cache,
  `jax.jit(fn)` compiled in this process. Its memory is checked first (`check`); on several
  devices `fn` as it is, unchecked. `donate`: the arguments whose buffers the program may reuse
  for its outputs (the engine's KV cache, updated in place)."""
  if len(jax.devices()) != 1:
    return jax.jit(fn, donate_argnums=donate) if donate else fn  # jit's own cache is enough
  folder = directory()
  if folder is None:
    # No persistent cache: compiled here, in this process only, so that its memory is checked
    # before it runs (`check`).
    where = f"{name}-{key(name, static, args)}"
    if where not in _loaded:
      shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), args)
      compiled = jax.jit(fn, donate_argnums=donate).lower(*shapes).compile()
      _loaded[where] = check(name, compiled, args)
    return _loaded[where]
  path = os.path.join(folder, f"{name}-{key(name, static, args)}.bin")
  if path in _loaded:
    return _loaded[path]
  exported = None
  if os.path.exists(path):
    try:
      with open(path, "rb") as f:
        exported = jax.export.deserialize(bytearray(f.read()))
    except Exception as e:  # damaged, or written by another jax: traced again below
      files.warn(f"{path} does not load ({type(e).__name__}); tracing the program again.")
  if exported is None:
    exported = jax.export.export(jax.jit(fn))(*args)
    os.makedirs(folder, exist_ok=True)
    with files.replacing(path) as tmp, open(tmp, "wb") as f:
      f.write(exported.serialize())
  shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), args)
  compiled = jax.jit(exported.call, donate_argnums=donate).lower(*shapes).compile()
  _loaded[path] = check(name, compiled, args)
  return _loaded[path]


def check(name: str, compiled, args):
  """`compiled`, once its memory is found to fit the device (common/device_memory.py: the
  arguments given as arrays are held already); else a one-line UserError."""
  fit = device_memory.measure(compiled, held=device_memory.held_bytes(args))
  if not fit.fits():
    raise device_memory.refusal(
      f"The {name} program",
      fit,
      "Ask for fewer prompts or new tokens, or use a device with more memory.",
    )
  return compiled


def run(name: str, fn, args: tuple, *, static):
  """`fn(*args)`, its program readied by `load`."""
  return load(name, fn, args, static=static)(*args)
