"""The test session's setup: one persistent XLA compilation cache for the tests and the `zoo`
processes they start (the environment is inherited), so a program compiled once (a smoke step, a
resume's step) is loaded, not compiled again, by the next test or subprocess that builds it. Set
JAX_COMPILATION_CACHE_DIR yourself to put it elsewhere."""

import os
import tempfile

os.environ.setdefault(
  "JAX_COMPILATION_CACHE_DIR", os.path.join(tempfile.gettempdir(), "nnx-zoo-tests-xla-cache")
)
