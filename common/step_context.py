"""What a layer may read besides its inputs while a step runs: one context, four fields.

- `layout`: the mesh layout of a sharded step (common/parallel.py: `active`, `current_layout`);
- `draws`: the step's training noise (common/nn/noise.py: `drawing`);
- `aux`: the sink of auxiliary losses (common/nn/aux.py: `collect`);
- `accumulation`: the running gradient sums the scanned layers add into (common/nn/accumulate.py:
  `accumulating`).

Each owner enters its own field for the duration of a `with` block (`entered`) and reads it with
`current()`; outside a step every field is None, and the layers compute the model as it is.
Nested blocks (a scan body's own aux sink, say) replace their field and restore it on exit.
"""

import contextlib
import contextvars
import dataclasses


@dataclasses.dataclass(frozen=True)
class StepContext:
  layout: object = None
  draws: object = None
  aux: dict | None = None
  accumulation: object = None


_OUTSIDE = StepContext()  # no step: every field None
_CURRENT: contextvars.ContextVar[StepContext | None] = contextvars.ContextVar(
  "step_context", default=None
)


def current() -> StepContext:
  return _CURRENT.get() or _OUTSIDE


@contextlib.contextmanager
def entered(**fields):
  """Within it, the named fields of the current context are `fields`' values."""
  token = _CURRENT.set(dataclasses.replace(current(), **fields))
  try:
    yield
  finally:
    _CURRENT.reset(token)
