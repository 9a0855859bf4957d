"""Memory levers shared by every family: rematerialisation of each block in the backward pass,
and scanning over the layers.

(Gradient accumulation lives in the trainer, `train.micro_batches`, which a scan with
remat="full" joins by adding each micro-batch's gradients in its own backward loop:
common/nn/accumulate.py; bf16 compute with fp32 master weights is `model.dtype` vs
`model.param_dtype`.)
"""

import jax
import jax.numpy as jnp
from flax import nnx

from nnx_zoo.common import parallel
from nnx_zoo.common.errors import UserError
from nnx_zoo.common.nn import accumulate, aux, noise

# none: keep every activation; full: keep only each block's input and recompute the rest;
# save_dots: keep the matmul outputs (cheap to store, dear to recompute), recompute the rest.
REMAT = {
  "none": None,
  "full": jax.checkpoint_policies.nothing_saveable,
  "save_dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}

# Config keys that change how a model is computed, not what it is (nor its parameters' values): a
# run resumes, and a checkpoint loads, whatever they were when it was saved (or if it predates
# them). model.scan stores the layers stacked: checkpoints convert at restore (`relayout`).
LEVERS = ("model.remat", "model.scan")


def run_blocks(
  blocks,
  x,
  *,
  cache=None,
  remat: str = "none",
  period: int = 1,
  per_slot: list[dict] | None = None,
  stacked=None,
  **kwargs,
):
  """x through each block in turn: `block(x, cache=..., **kwargs) -> (x, cache)`; returns x and
  the list of updated caches. With a cache (decoding) nothing is rematerialised or scanned.

  `period` and `per_slot`: the layers repeat a pattern of `period` kinds (Gemma 2: local, global),
  and layer i gets `per_slot[i % period]` on top of `kwargs` (its kind's position encoding).

  `stacked` (`model.scan`): the scanned layers stored stacked, one module per slot of the pattern
  whose parameters are [repetitions, ...] (`stack_blocks`); `blocks` are then the layers past
  the last whole repetition. One body, compiled once, is run by `jax.lax.scan` over the
  repetitions of the pattern (one layer when there is no pattern), reading each repetition's
  slice of the stacked parameters, instead of L copies of it. Under FSDP each layer's
  all-gather then sits inside the loop body; with a remat policy the backward pass gathers again
  in its loop, so about one repetition's weights are gathered at a time (without remat the scan
  saves every layer's gathered weights for the backward pass, as the unscanned model does:
  bench/fsdp_gathers.py). The parameters are stored stacked, so no call copies them into a stack
  (before, a call stacked the per-layer states: one stacked copy of the local parameter shards,
  their casts and their stacked gradients per step: bench/scan_growth.py). Decoding runs layer by
  layer on slices of the stacks (`layer`).

  Auxiliary losses the blocks add (common/nn/aux.py) leave a scan or remat body as its outputs.
  """
  if remat not in REMAT:
    raise UserError(f"Unknown model.remat {remat!r}: use one of {sorted(REMAT)}.")

  def layer_kwargs(i: int) -> dict:
    return kwargs if per_slot is None else {**kwargs, **per_slot[i % period]}

  # Training noise (common/nn/noise.py): one stream for this stack, each layer its own draws.
  stream = noise.stack()
  if stacked is not None:
    scanned = num_stacked(stacked) * period
    num_layers = scanned + len(blocks)
    if cache is None:
      x = _scan_blocks(
        stacked, x, remat=remat, layer_kwargs=layer_kwargs, stream=stream, num_layers=num_layers
      )
      for k, block in enumerate(blocks):
        with noise.layer(stream, scanned + k, num_layers):
          x = _remat_block(block, x, remat=remat, kwargs=layer_kwargs(scanned + k))
      return x, None
    layers = [layer(stacked, blocks, i) for i in range(num_layers)]
  else:
    layers = list(blocks)
  new_cache = []
  for i, block in enumerate(layers):
    layer_cache = None if cache is None else cache[i]
    with noise.layer(stream, i, len(layers)):
      if remat == "none" or cache is not None:
        x, layer_cache = block(x, cache=layer_cache, **layer_kwargs(i))
      else:
        x = _remat_block(block, x, remat=remat, kwargs=layer_kwargs(i))
    new_cache.append(layer_cache)
  return x, new_cache


# Stacked layers: what `model.scan` stores, and the conversions to and from one tree per layer.

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


def _layer_state(state):
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


def _collecting_call(fn):
  """fn(...) -> (x, what it added to the aux channel as arrays), with the names' weights kept
  aside: the traced values leave the body as outputs, never as leaked tracers."""
  weights = {}

  def call(*args):
    with aux.collect() as entries:
      x = fn(*args)
    weights.update(aux.weights(entries))
    return x, aux.as_arrays(entries)

  return call, weights


def _remat_block(block, x, *, remat: str, kwargs: dict):
  # A pure function of the block's state, as in the scan body: nnx.remat writes the state back
  # into the block's Variables, which fails when some of them come from an outer trace (the
  # frozen base weights of a LoRA run).
  graphdef, state = nnx.split(block)

  def call(state, x):
    return nnx.merge(graphdef, state)(x, cache=None, **kwargs)[0]

  call, weights = _collecting_call(call)
  if remat != "none":
    call = jax.checkpoint(call, policy=REMAT[remat])
  x, added = call(state, x)
  aux.add_collected(added, weights)
  return x


def _scan_blocks(stacked, x, *, remat: str, layer_kwargs, stream: int | None, num_layers: int):
  splits = [nnx.split(slot) for slot in stacked]
  graphdefs = [g for g, _ in splits]
  # One stack per slot of the pattern, [repetitions, ...] per leaf, as stored; inside shard_map
  # these are the local shards. The scan hands the body one repetition's slice of each, and the
  # repetition's index r (layer r * period + j draws its noise as that layer).
  states = tuple(s for _, s in splits)

  def body(x, r, states):
    for j, state in enumerate(states):
      block = nnx.merge(graphdefs[j], _layer_state(state))
      with noise.layer(stream, r * len(states) + j, num_layers):
        x, _ = block(x, cache=None, **layer_kwargs(j))
    return x

  body, weights = _collecting_call(body)
  sums = accumulate.sums_of(states) if remat == "full" else None
  if sums is not None:  # the layers add their gradients into the running sums themselves
    x, added = accumulate.scan(body, x, states, sums)
  else:
    if remat != "none":
      # The scan body is the rematerialised unit, as each block is without scan. No CSE barrier
      # is needed inside a loop body (jax.checkpoint's documentation).
      body = jax.checkpoint(body, policy=REMAT[remat], prevent_cse=False)
    reps = jnp.arange(num_stacked(stacked))
    x, added = jax.lax.scan(lambda x, xs: body(x, *xs), x, (reps, states))
  aux.add_collected(added, weights)  # summed over the repetitions
  return x
