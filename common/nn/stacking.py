"""The stacked layer layout of `model.scan`, and the conversions between it and one tree per layer.

Scanned, a stack stores one module per slot of its layer pattern, each parameter [repetitions,
...]; every boundary (Hugging Face key maps, LoRA, checkpoints, init_from) speaks one tree per
layer and converts here.
"""

import jax
import jax.numpy as jnp
from flax import nnx

from nnx_zoo.common import parallel
from nnx_zoo.common.errors import UserError

# The logical axis of a stacked parameter's leading dim: no mesh axis (each device holds every
# layer of its shard), each layer placed as it would be unstacked (parallel.Layout.param_spec).
LAYERS = parallel.LAYERS
# The attributes of a stack's layers: one tree per layer (`blocks.{i}`), or, scanned, one tree
# per slot of the layer pattern with every leaf [repetitions, ...] (`stacked.{j}`) and the
# layers past the last whole repetition (`rest.{k}`, layer repetitions * period + k).
BLOCKS, STACKED, REST = "blocks", "stacked", "rest"


def stacks(num_layers: int, period: int) -> int:
  """The repetitions a scanned stack stores stacked: none when there is at most one (nothing
  to scan)."""
  reps = num_layers // period
  return reps if reps > 1 else 0


def is_variable(x) -> bool:
  return isinstance(x, nnx.Variable)


def _axes(var) -> tuple:
  return tuple(getattr(var, "axes", None) or (None,) * var.ndim)


def _stack_leaf(leaves):
  """One leaf of [len(leaves), ...] from equal-shaped leaves: Variables (their `axes` gain the
  layer axis), arrays, or abstract ShapeDtypeStructs (their sharding gains an unsplit dim)."""
  first = leaves[0]
  if is_variable(first):
    value = _stack_leaf([v.get_value() for v in leaves])
    if getattr(first, "axes", None) is None:
      return first.replace(value)
    return first.replace(value, axes=(LAYERS, *_axes(first)))
  if isinstance(first, jax.ShapeDtypeStruct):
    sharding = first.sharding
    if isinstance(sharding, jax.sharding.NamedSharding):
      sharding = jax.sharding.NamedSharding(
        sharding.mesh, jax.sharding.PartitionSpec(None, *sharding.spec)
      )
    return jax.ShapeDtypeStruct((len(leaves), *first.shape), first.dtype, sharding=sharding)
  return jnp.stack(leaves)


def _index_leaf(leaf, r: int):
  """Layer r of a stacked leaf (see `_stack_leaf`)."""
  if is_variable(leaf):
    value = _index_leaf(leaf.get_value(), r)
    axes = getattr(leaf, "axes", None)
    if axes is None:
      return leaf.replace(value)
    return leaf.replace(value, axes=tuple(axes[1:]) if axes[:1] == (LAYERS,) else axes)
  if isinstance(leaf, jax.ShapeDtypeStruct):
    sharding = leaf.sharding
    if isinstance(sharding, jax.sharding.NamedSharding):
      spec = tuple(sharding.spec) + (None,) * (len(leaf.shape) - len(sharding.spec))
      sharding = jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec(*spec[1:]))
    return jax.ShapeDtypeStruct(leaf.shape[1:], leaf.dtype, sharding=sharding)
  return leaf[r]


def layer_state(state):
  """A slot's stacked state, as the state of one layer's slice in a scan body (each leaf
  already sliced by the scan): the Variables lose the layer axis of their `axes`."""

  def one(v):
    axes = getattr(v, "axes", None)
    if axes is None or axes[:1] != (LAYERS,):
      return v
    return v.replace(v.get_value(), axes=tuple(axes[1:]))

  return jax.tree.map(one, state, is_leaf=is_variable)


def stack_blocks(blocks, period: int) -> list[nnx.Module]:
  """The per-layer `blocks` (of a stack with `stacks(...)` > 0 repetitions) as one module per
  slot of the pattern, each parameter stacked over the repetitions [repetitions, ...]: the
  same values, so a scanned model from a seed is the unscanned one from that seed."""
  reps = stacks(len(blocks), period)
  graphdefs = [nnx.graphdef(b) for b in blocks[:period]]
  out = []
  for j in range(period):
    group = blocks[j : reps * period : period]
    if any(nnx.graphdef(b) != graphdefs[j] for b in group):
      raise UserError(
        "model.scan needs every repetition of the layer pattern to have the same structure; "
        "set model.scan=False."
      )
    out.append(stack_modules(group))
  return out


def stack_modules(modules) -> nnx.Module:
  """Modules of one structure as one module whose parameters are stacked [len(modules), ...]."""
  states = [nnx.state(m) for m in modules]
  state = jax.tree.map(lambda *vs: _stack_leaf(vs), *states, is_leaf=is_variable)
  return nnx.merge(nnx.graphdef(modules[0]), state)


def path_key(part: str):
  """A dotted path's part as a state's key (list indices are ints)."""
  return int(part) if part.isdigit() else part


def num_stacked(stacked) -> int:
  """The repetitions of stacked slot modules."""
  return jax.tree.leaves(nnx.state(stacked[0]))[0].shape[0]


def layer(stacked, rest, i: int) -> nnx.Module:
  """Layer i of a stack stored stacked (slot modules `stacked`, then `rest`), as one block: a
  view on slice i of the stacks (what decoding runs)."""
  period = len(stacked)
  scanned = num_stacked(stacked) * period
  if i >= scanned:
    return rest[i - scanned]
  graphdef, state = nnx.split(stacked[i % period])
  state = jax.tree.map(lambda v: _index_leaf(v, i // period), state, is_leaf=is_variable)
  return nnx.merge(graphdef, state)


# One tree per layer is what every boundary speaks (Hugging Face key maps, LoRA targets,
# checkpoints of either setting, init_from): these convert a state (nnx.State of Variables,
# arrays or ShapeDtypeStructs) between that and the stacked layout, stack by stack (a model may
# have several: an encoder-decoder's two sides, CLIP's towers).


def _split_path(path: tuple):
  """(stack prefix, BLOCKS/STACKED/REST, index, rest of the path), or None for a parameter of
  no stack's layers."""
  for k in range(len(path) - 1):
    if path[k] in (BLOCKS, STACKED, REST) and isinstance(path[k + 1], int):
      return path[:k], path[k], path[k + 1], path[k + 2 :]
  return None


def in_layer(path: tuple) -> bool:
  """Whether `path` (a state's, ints as ints) is inside one of a stack's layers, whatever the
  layout: `blocks`, or with model.scan `stacked` and `rest`."""
  return _split_path(path) is not None


def layer_of(path: tuple) -> tuple | None:
  """(stack prefix, the layer's index) of a path one tree per layer (`unstack_layers`' naming),
  or None for a parameter of no stack's layers."""
  split = _split_path(path)
  return None if split is None else split[:1] + split[2:3]


def layouts(paths) -> dict[tuple, int]:
  """The stacks that key `paths` (tuples; a state's, or a checkpoint's) store stacked: stack
  prefix -> the period of its pattern (the slots of `stacked`)."""
  out = {}
  for path in paths:
    split = _split_path(tuple(path))
    if split is not None and split[1] == STACKED:
      out[split[0]] = max(out.get(split[0], 0), split[2] + 1)
  return out


def _flat(state) -> list:
  return list(nnx.to_flat_state(state if isinstance(state, nnx.State) else nnx.State(state)))


def unstack_layers(state) -> nnx.State:
  """`state` with every stack's layers one tree per layer (`blocks.{i}...`): the canonical
  naming. A state already so is returned as it is."""
  flat = _flat(state)
  if not layouts(k for k, _ in flat):
    return state if isinstance(state, nnx.State) else nnx.State(state)
  reps = {}
  for path, v in flat:
    split = _split_path(path)
    if split is not None and split[1] == STACKED:
      reps[split[0]] = v.shape[0]
  periods = layouts(k for k, _ in flat)
  out = []
  for path, v in flat:
    split = _split_path(path)
    if split is None or split[1] == BLOCKS:
      out.append((path, v))
      continue
    prefix, kind, index, tail = split
    scanned = reps[prefix] * periods[prefix]
    if kind == REST:
      out.append(((*prefix, BLOCKS, scanned + index, *tail), v))
    else:
      for r in range(reps[prefix]):
        layer_path = (*prefix, BLOCKS, r * periods[prefix] + index, *tail)
        out.append((layer_path, _index_leaf(v, r)))
  return nnx.from_flat_state(out)


def stack_layers(state, periods: dict[tuple, int]) -> nnx.State:
  """`state` (any layout) with the stacks of `periods` (prefix -> period, as `layouts` gives)
  stacked, and the others one tree per layer."""
  flat = _flat(unstack_layers(state))
  counts = {}
  for path, _ in flat:
    split = _split_path(path)
    if split is not None and split[0] in periods:
      counts[split[0]] = max(counts.get(split[0], 0), split[2] + 1)
  out, groups = [], {}
  for path, v in flat:
    split = _split_path(path)
    reps = stacks(counts.get(split[0], 0), periods.get(split[0], 1)) if split else 0
    if not reps:
      out.append((path, v))
      continue
    prefix, _, i, tail = split
    period = periods[prefix]
    if i >= reps * period:
      out.append(((*prefix, REST, i - reps * period, *tail), v))
    else:
      key = (*prefix, STACKED, i % period, *tail)
      groups.setdefault(key, {})[i // period] = v
  for key, by_rep in groups.items():
    out.append((key, _stack_leaf([by_rep[r] for r in sorted(by_rep)])))
  return nnx.from_flat_state(out)


def match_layers(state, like) -> nnx.State:
  """`state` in the layout of `like` (a state or model of the same model, either layout)."""
  if isinstance(like, nnx.Module):
    like = nnx.state(like)
  return stack_layers(state, layouts(k for k, _ in _flat(like)))


def relayout(tree, periods: dict[tuple, int]):
  """Every nnx.State in `tree` (a train state: the params and the optimizer's moments) with
  the stacks of `periods` stacked (`stack_layers`)."""
  return jax.tree.map(
    lambda x: stack_layers(x, periods) if isinstance(x, nnx.State) else x,
    tree,
    is_leaf=lambda x: isinstance(x, nnx.State),
  )
