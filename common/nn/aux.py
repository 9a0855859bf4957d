"""The auxiliary-loss channel: a layer adds named losses, the trainer adds them to the task loss.

A layer calls `add("moe_load_balance", value, weight=cfg.aux_coef)` in its forward pass; nothing
happens unless someone is collecting (`collect()`, the step context's `aux` sink), so evaluation
and decoding pay nothing. The
trainer collects around the loss, adds `weight * mean` of each name (the mean over the layers
that added it) to the loss it differentiates, and logs each mean by name in metrics.jsonl. A
weight of 0 logs a number without training on it (an expert load, say).

Values must not leak out of a `jax.lax.scan` or `jax.checkpoint` body as tracers: the shared
stack (`nnx_zoo.common.nn.memory.run_blocks`) collects inside each body with `collect()`, returns
what it got as an output of the body, and adds it outside with `add_collected`.
"""

import contextlib
import dataclasses

import jax
import jax.numpy as jnp

from nnx_zoo.common import step_context


@dataclasses.dataclass
class Entry:
  """What one name has received: the sum of the values, how many were added, their weight."""

  total: jax.Array
  count: jax.Array
  weight: float


def add(name: str, value: jax.Array, *, weight: float = 1.0, count=1):
  """Adds a scalar auxiliary loss under `name` (a no-op when nobody collects). `weight` is a
  Python float from the layer's config; the same name always carries the same weight."""
  entries = step_context.current().aux
  if entries is None:
    return
  value = jnp.asarray(value, jnp.float32)
  count = jnp.asarray(count, jnp.float32)
  if name in entries:
    old = entries[name]
    if old.weight != weight:
      raise ValueError(f"aux loss {name!r} added with weights {old.weight} and {weight}.")
    entries[name] = Entry(old.total + value, old.count + count, weight)
  else:
    entries[name] = Entry(value, count, weight)


@contextlib.contextmanager
def collect():
  """Within it, `add` records into the dict it yields (name -> Entry)."""
  entries: dict[str, Entry] = {}
  with step_context.entered(aux=entries):
    yield entries


def collecting() -> bool:
  return step_context.current().aux is not None


def as_arrays(entries: dict[str, Entry]) -> dict[str, tuple[jax.Array, jax.Array]]:
  """The traced part of what a body collected (its weights stay static, see `weights`)."""
  return {name: (e.total, e.count) for name, e in entries.items()}


def weights(entries: dict[str, Entry]) -> dict[str, float]:
  return {name: e.weight for name, e in entries.items()}


def add_collected(arrays: dict, weights_by_name: dict[str, float]):
  """Adds what a scan or remat body collected (`as_arrays`, summed over the scan's steps)."""
  for name, (total, count) in arrays.items():
    add(name, jnp.sum(total), weight=weights_by_name[name], count=jnp.sum(count))


def means(entries: dict[str, Entry]) -> dict[str, jax.Array]:
  """Each name's mean over the layers that added it: what is logged."""
  return {name: e.total / jnp.maximum(e.count, 1.0) for name, e in entries.items()}


def weighted_sum(entries: dict[str, Entry]) -> jax.Array:
  """sum over names of weight * mean: what the trainer adds to the mean task loss."""
  return sum(
    (e.weight * e.total / jnp.maximum(e.count, 1.0) for e in entries.values() if e.weight),
    jnp.zeros((), jnp.float32),
  )
