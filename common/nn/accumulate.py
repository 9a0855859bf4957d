"""Gradient accumulation inside the scanned layers' backward loop (`train.micro_batches` with
`model.scan` and `model.remat="full"`).

The contract. With micro-batches, each slice's gradients are added to those of the slices before.
Differentiated as usual, the scanned layers' gradients of a slice fill a fresh [L, ...] buffer,
added to the running sum after the backward pass: two stacked fp32 gradient buffers live at once.
Inside `accumulating(params, sums, frozen)` (entered by the step around one slice's gradient), a
scan with remat="full" whose stacked parameters all have a running sum (or are frozen) instead
runs its own backward loop (`scan`): each layer's input is kept, its forward recomputed and
differentiated as the rematerialised scan does, and its parameters' gradients added into the
running sum at that layer, in place. The cotangent it returns for those parameters is then the
running sum plus this slice's gradients, and `accumulating` yields which leaves that holds for,
so the step does not add them again. The other parameters' gradients are this slice's alone.

The keys. A running sum is found by its parameter's path in the model's state (the keys of
`jax.tree_util.tree_flatten_with_path` over an `nnx.State`, e.g. ("encoder", "stacked", 0,
"attn", "q", "kernel", "value")): `accumulating` takes the parameters and their sums as trees of
the same paths, and a scan names where its stack sits in the model (`BlockStack.path`: () for
the model itself, ("encoder",) for an encoder-decoder's side, ("text",) for CLIP's text tower),
so that leaf `p` of its slot j is at path + ("stacked", j) + p. A scan some of whose leaves are at
no such path (neither trained nor frozen) runs the plain scan: the same gradients, without the
saving. The table lives in the step context's `accumulation` field while the slice runs.
"""

import contextlib
import dataclasses
import functools

import jax
import jax.numpy as jnp

from nnx_zoo.common import parallel, step_context
from nnx_zoo.common.nn import stacking

Path = tuple  # of str and int: a leaf's place in a model's state


def paths(tree) -> list[Path]:
  """The path of each leaf of `tree`, in the order of jax.tree.leaves(tree)."""
  return [
    tuple(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k))) for k in path)
    for path, _ in jax.tree_util.tree_flatten_with_path(tree)[0]
  ]


@dataclasses.dataclass
class _Accumulation:
  sums: dict  # a trained parameter's path -> its running sum
  frozen: set  # the paths of the parameters not differentiated
  consumed: set  # the paths whose sums a scan has added into


@contextlib.contextmanager
def accumulating(params, sums, frozen=None):
  """Within: scanned layers add the gradients of their parameters (`params`, the model's state
  that jax.grad differentiates) into `sums` (the running sums, a tree of the same paths) in
  their backward loop. Yields the set of indices (in jax.tree.leaves(params)) of the leaves that
  were: their cotangents include `sums`; the others' do not. `frozen`: the parameters the model
  also uses, not differentiated (the same model's state, its other leaves)."""
  keys = paths(params)
  if paths(sums) != keys:
    raise ValueError("The running sums are not a tree of the parameters' paths.")
  table = _Accumulation(
    dict(zip(keys, jax.tree.leaves(sums), strict=True)),
    set(paths(frozen)) if frozen is not None else set(),
    set(),
  )
  fused: set[int] = set()
  try:
    with step_context.entered(accumulation=table):
      yield fused
  finally:
    fused.update(i for i, key in enumerate(keys) if key in table.consumed)


def sums_of(path: Path, states) -> list | None:
  """The running sum of each leaf of `states` (the stacked slots of the stack at `path` in the
  model, slot j's leaves at path + ("stacked", j)), None for a frozen one, when every leaf is
  either a parameter being accumulated or a frozen one; None otherwise (the plain scan)."""
  active = step_context.current().accumulation
  if active is None:
    return None
  keys = [(*path, stacking.STACKED, j, *leaf) for j, s in enumerate(states) for leaf in paths(s)]
  if not all(k in active.sums or k in active.frozen for k in keys):
    return None
  active.consumed.update(k for k in keys if k in active.sums)
  return [active.sums.get(k) for k in keys]


def scan(body, x, states, sums):
  """jax.lax.scan over (r, states[r]) of body(x, r, states[r]), differentiated by `_fused_scan`
  (see the module's docstring); `sums`: each stacked leaf's running sum (`sums_of`), None for a
  frozen one."""
  leaves, treedef = jax.tree.flatten(states)
  one = [leaf[0] for leaf in leaves]  # a layer's slice, to trace the body with

  def call(x, r, layer_leaves):
    return body(x, r, jax.tree.unflatten(treedef, layer_leaves))

  call, consts = jax.closure_convert(call, x, jnp.int32(0), one)
  # What the body reads besides its input and its layer (positions, segment ids, a
  # cross-attention's source, the step's noise key): differentiated when inexact, passed
  # through otherwise.
  inexact = [jnp.issubdtype(c.dtype, jnp.inexact) for c in consts]
  diff = [c for c, d in zip(consts, inexact, strict=True) if d]
  rest = [c for c, d in zip(consts, inexact, strict=True) if not d]

  def fn(diff, rest, x, r, layer_leaves):
    it_d, it_r = iter(diff), iter(rest)
    return call(x, r, layer_leaves, *[next(it_d) if d else next(it_r) for d in inexact])

  frozen = tuple(s is None for s in sums)
  trained = [s for s in sums if s is not None]
  return _fused_scan(fn, frozen, x, leaves, trained, diff, rest)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _fused_scan(fn, frozen, x, leaves, sums, diff, rest):
  return _fused_scan_fwd(fn, frozen, x, leaves, sums, diff, rest)[0]  # the residuals unused


def _fused_scan_fwd(fn, frozen, x, leaves, sums, diff, rest):
  def step(x, xs):
    y, added = fn(diff, rest, x, *xs)
    return y, (added, x)

  y, (added, inputs) = jax.lax.scan(step, x, (jnp.arange(leaves[0].shape[0]), leaves))
  return (y, added), (inputs, leaves, sums, diff, rest)


def _fused_scan_bwd(fn, frozen, res, cts):
  inputs, leaves, sums, diff, rest = res
  ct_y, ct_added = cts
  num = inputs.shape[0]

  def back(carry, step):
    ct_x, sums, ct_diff = carry
    i, x, ct_add = step
    layer = [jax.lax.dynamic_index_in_dim(leaf, i, keepdims=False) for leaf in leaves]
    _, vjp = jax.vjp(lambda d, x, layer: fn(d, rest, x, i, layer), diff, x, layer)
    g_diff, ct_x, g_layer = vjp((ct_x, ct_add))
    g_trained = [g for g, f in zip(g_layer, frozen, strict=True) if not f]
    sums = [
      jax.lax.dynamic_update_index_in_dim(s, jax.lax.dynamic_index_in_dim(s, i) + g[None], i, 0)
      for s, g in zip(sums, g_trained, strict=True)
    ]
    ct_diff = [c + g for c, g in zip(ct_diff, g_diff, strict=True)]
    return (ct_x, sums, ct_diff), None

  steps = (jnp.arange(num), inputs, ct_added)
  carry = (ct_y, list(sums), [parallel.zeros_like(d) for d in diff])
  ct_x, sums, ct_diff = jax.lax.scan(back, carry, steps, reverse=True)[0]
  it = iter(sums)
  ct_leaves = [None if f else next(it) for f in frozen]
  return ct_x, ct_leaves, [None] * len(sums), ct_diff, [None] * len(rest)


_fused_scan.defvjp(_fused_scan_fwd, _fused_scan_bwd)
