"""Files written whole, writable checks, and warnings: what hub, data and train all need, below
all three (it imports nothing of the zoo but its errors)."""

import contextlib
import os
import sys

from nnx_zoo.common.errors import UserError


def cache_dir(*parts: str) -> str:
  """A directory under the zoo's cache: $NNX_ZOO_CACHE, else nnx_zoo under $XDG_CACHE_HOME or
  ~/.cache (tiny checkpoints, compiled programs)."""
  base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
  return os.path.join(os.environ.get("NNX_ZOO_CACHE") or os.path.join(base, "nnx_zoo"), *parts)


def warn(message: str):
  """One line on stderr, like the CLI's errors (no logging set-up needed)."""
  print(f"zoo: warning: {message}", file=sys.stderr, flush=True)


def check_writable(*paths: str):
  """Creates each directory and writes a probe file in it, or a UserError naming it."""
  for path in paths:
    probe = os.path.join(path, f".zoo-write-probe-{os.getpid()}")
    try:
      os.makedirs(path, exist_ok=True)
      with open(probe, "wb") as f:
        f.write(b"ok")
        f.flush()
        os.fsync(f.fileno())
      os.remove(probe)
    except OSError as e:
      raise UserError(
        f"Cannot write to {path} ({type(e).__name__}: {e.strerror or e}). Give a --workdir on "
        "a writable disk; nothing was trained."
      ) from None


def check_creatable(*paths: str):
  """That each directory exists and is writable or could be made, without making anything: the
  nearest part of the path that exists is a writable directory; else a UserError naming it, as
  `check_writable`'s (which a run calls once it may write)."""
  for path in paths:
    there = os.path.abspath(path)
    while not os.path.exists(there):
      there = os.path.dirname(there)
    if not os.path.isdir(there) or not os.access(there, os.W_OK):
      what = "not a directory" if not os.path.isdir(there) else "not writable"
      raise UserError(
        f"Cannot write to {path} ({there} is {what}). Give a --workdir on a writable disk; "
        "nothing was trained."
      )


@contextlib.contextmanager
def replacing(path: str):
  """Yields a temporary path beside `path` to write to, and renames it onto `path` once the
  write has finished: a reader (another process, a later run) sees the old file or the new one,
  never a half-written one. On an error the temporary file is removed and `path` left alone."""
  tmp = f"{path}.{os.getpid()}.tmp{os.path.splitext(path)[1]}"  # np.savez keeps a .npz name
  try:
    yield tmp
    os.replace(tmp, path)
  finally:
    if os.path.exists(tmp):
      os.remove(tmp)
