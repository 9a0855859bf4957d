"""Running a kernel whose outputs say nothing of shard_map's varying mesh axes inside a
`jax.shard_map(..., check_vma=True)` (the trainer's step).

Under check_vma every value inside shard_map carries the mesh axes it varies over, and a
`pallas_call` must be told those of its outputs (`jax.ShapeDtypeStruct(..., manual_axis_type=)`);
one that is not told is refused. Our own kernels say it (kernels/flash_attention.py); jax's TPU
splash-attention kernel does not (jax 0.10), and its `pallas_call`s are out of reach.

`per_device(f)` calls such an `f` with its inputs cast to vary over every axis any of them varies
over, and while `f` (forward or backward) is traced, a `pallas_call` output declared without
axes is declared with those: what any elementwise primitive's rule would give, and true of a
kernel that runs on each device's own blocks with no collective of its own (the only kind this
is for). Everything else is traced and checked as usual, so the step's jaxpr is well typed
wherever it is re-traced (remat, scan). The backward pass is `f`'s own, traced inside the same
declaration; an input that varied over fewer axes gets its cotangent summed over the others (the
transpose of its cast). The casts lower to nothing: no data moves.
"""

import contextlib

import jax
from jax._src.pallas import core as _pallas_core  # where pallas_call types its outputs (jax 0.10)


def varying(*xs) -> frozenset:
  """The mesh axes any of `xs` varies over inside shard_map (empty outside)."""
  out = frozenset()
  for x in xs:
    aval = jax.typeof(x)
    out |= frozenset(getattr(aval, "vma", None) or aval.mat.varying)
  return out


def to_varying(x, axes: frozenset):
  """`x` cast to vary over `axes` too (a value that starts a sum of varying terms)."""
  missing = tuple(sorted(axes - varying(x)))
  return jax.lax.pcast(x, missing, to="varying") if missing else x


def zeros_like(x):
  """Zeros of `x`'s shape and dtype that vary over the axes `x` does (the start of a sum that
  a loop's carry adds `x`-typed terms to)."""
  return to_varying(jax.numpy.zeros_like(x), varying(x))


def sum_to(ct, axes: frozenset):
  """A cotangent summed over the axes its primal did not vary over (autodiff's transpose of
  the implicit broadcast, done by hand in a custom VJP)."""
  extra = tuple(sorted(varying(ct) - axes))
  return jax.lax.psum(ct, extra) if extra else ct


@contextlib.contextmanager
def _outputs_typed_as(like):
  """pallas_calls traced inside: an output declared without `manual_axis_type` gets `like`'s."""
  original = _pallas_core._convert_out_shape_to_aval
  mat = jax.typeof(like).mat

  def convert(out_shape):
    if isinstance(out_shape, jax.ShapeDtypeStruct) and out_shape.manual_axis_type is None:
      out_shape = jax.ShapeDtypeStruct(
        out_shape.shape, out_shape.dtype, weak_type=out_shape.weak_type, manual_axis_type=mat
      )
    return original(out_shape)

  _pallas_core._convert_out_shape_to_aval = convert
  try:
    yield
  finally:
    _pallas_core._convert_out_shape_to_aval = original


def per_device(f):
  """`f(*arrays)` (a pytree of arrays out) made callable inside a check_vma shard_map, forward
  and backward; integer inputs get no cotangent."""

  def cast(args):
    axes = varying(*args)
    return tuple(to_varying(a, axes) for a in args)

  @jax.custom_vjp
  def call(*args):
    args = cast(args)
    with _outputs_typed_as(args[0]):
      return f(*args)

  def forward(*args):
    cast_args = cast(args)
    with _outputs_typed_as(cast_args[0]):
      out, back = jax.vjp(f, *cast_args)
    return out, (back, args)

  def backward(res, ct):
    back, args = res
    with _outputs_typed_as(jax.tree.leaves(ct)[0]):  # varies as the outputs do
      cts = back(ct)
    return tuple(
      sum_to(c, varying(a)) if jax.numpy.issubdtype(a.dtype, jax.numpy.inexact) else None
      for c, a in zip(cts, args, strict=True)
    )

  call.defvjp(forward, backward)
  return call
