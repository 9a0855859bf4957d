"""QLoRA (`model.lora.base_quant`): a LoRA run's frozen base kernels stored in int8, int4 or nf4.

With `model.lora.rank > 0` and `base_quant` set, the kernel of every Linear in the blocks is
stored quantized and dequantized inside each product to `model.dtype` (`matmul`, called by
`Linear.__call__`), a layer's kernels at a time in the forward and the backward pass. The
frozen embeddings and heads are held in bf16 (`model.lora.frozen_dtype`, `frozen_dtype`), the
norms in `param_dtype`; the adapters (fp32) and the parameters `model.lora.train` names are the
only trained ones.

Scale layout: per block of `BLOCK` (64) input rows, per output column (QLoRA's block size, along
the contracting dim), absmax scales in `param_dtype`: scale [..., in / 64, out]. Every quantized
kernel's input dim must be a multiple of 64. The codes come from qwix (`qarray.quantize`: its
rounding for int8 and int4, its NF4 table of QLoRA's appendix E for nf4) and go back through
`qarray.dequantize`. jax keeps a 4-bit array one byte per value on a CPU (`uint4.nbytes ==
size`), so the 4-bit codes are stored two to a byte (rows 2i and 2i + 1 of the kernel in the
low and high nibble of one uint8), and unpacked in the step before qwix dequantizes them: nf4's
base then takes 4.5 bits a weight with fp32 scales (0.14x fp32's bytes), int8's 8.5.

The codes and scales are `QuantizedBase` variables (an nnx.Param kind, so checkpointed, placed
and restored with the params, resumed exactly) that `lora.trainable` never selects: no gradient,
no optimizer state. Loading quantizes as it reads (`quantizer`, applied by common/hub to each
tensor as it is read), so no whole fp32 copy of the base is ever held.

On a mesh the codes and scales are placed by the kernel's axes; `check_mesh` refuses in one line
a mesh that cannot split a kernel's rows of scales.

With common/nn/quant.py, this module holds the zoo's qwix imports.
"""

import fnmatch
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from qwix._src.core import qarray  # qwix 0.1.8 exports quantize/dequantize only under _src

from nnx_zoo.common import parallel
from nnx_zoo.common.errors import UserError
from nnx_zoo.common.nn import quant, stacking

KINDS = ("", "int8", "int4", "nf4")
# `model.lora.frozen_dtype`: the frozen embeddings and heads outside the blocks under base_quant
# ("": bfloat16; "param_dtype": model.param_dtype, what a run saved before the key had).
FROZEN_DTYPES = ("", "bfloat16", "float32", "param_dtype")
BLOCK = 64  # input rows per scale
# qwix's logical type of each kind.
QTYPES = {"int8": jnp.int8, "int4": jnp.int4, "nf4": "nf4"}
PACKED = ("int4", "nf4")  # two codes a byte


class QuantizedBase(nnx.Param):
  """The codes or the scales of a frozen quantized base kernel: kept with the params
  (checkpoints, placement), never trained (`lora.trainable` leaves it out)."""


def check(lora_cfg):
  """A `model.lora` config's base_quant, checked: a known kind, and adapters to train."""
  kind = lora_cfg.base_quant
  if kind not in KINDS:
    raise UserError(
      f"Unknown model.lora.base_quant {kind!r}: use one of {', '.join(map(repr, KINDS))} "
      "('': the base in param_dtype)."
    )
  if kind and not lora_cfg.rank:
    raise UserError(
      f"model.lora.base_quant={kind!r} quantizes the frozen base of a LoRA run: set "
      "model.lora.rank > 0 (e.g. --config.model.lora.rank=8), or base_quant=''."
    )
  if lora_cfg.frozen_dtype not in FROZEN_DTYPES:
    raise UserError(
      f"Unknown model.lora.frozen_dtype {lora_cfg.frozen_dtype!r}: use one of "
      f"{', '.join(map(repr, FROZEN_DTYPES))} ('': bfloat16 under base_quant)."
    )


def frozen_dtype(lora_cfg):
  """The dtype the frozen embeddings and heads outside the blocks are stored in: under
  base_quant, bfloat16 unless `model.lora.frozen_dtype` asks for float32 (they are most of a
  QLoRA model's bytes: Qwen2.5-Coder-0.5B's untied embedding and head, 1,039 of its 1,231
  MiB in fp32); None (param_dtype, as without QLoRA) otherwise."""
  if not lora_cfg.base_quant or lora_cfg.frozen_dtype == "param_dtype":
    return None
  return jnp.dtype(lora_cfg.frozen_dtype or "bfloat16")


def is_frozen_table(path: tuple, var, train: str = "") -> bool:
  """Whether the parameter at `path` is a frozen embedding or head outside the blocks: a float
  nnx.Param (not an adapter, not a quantized base) of 2 dims or more, in no layer, that
  `train` (model.lora.train's comma-separated patterns, as `lora.matches` reads them) does not
  name."""
  dotted = ".".join(map(str, path))
  named = [p.strip() for p in train.split(",") if p.strip()]
  return (
    type(var) is nnx.Param
    and len(var.shape) >= 2
    and jnp.issubdtype(var.dtype, jnp.floating)
    and not stacking.in_layer(path)
    and not any(fnmatch.fnmatch(dotted, p) or fnmatch.fnmatch(dotted, "*." + p) for p in named)
  )


def is_kernel(path: tuple) -> bool:
  """Whether the parameter at `path` (one tree per layer, or stacked) is the kernel of a Linear
  in the blocks: what base_quant quantizes."""
  return bool(path) and path[-1] == "kernel" and stacking.in_layer(path)


@functools.partial(jax.jit, static_argnames="kind")
def quantize(w: jax.Array, *, kind: str) -> tuple[jax.Array, jax.Array]:
  """A kernel [..., in, out] as (codes, scale): codes int8 [..., in, out] for int8, uint8
  [..., in / 2, out] (two 4-bit codes a byte) for int4 and nf4; scale [..., in / BLOCK, out]
  in w's dtype."""
  axis = w.ndim - 2  # the input (contracting) dim: blocks of BLOCK rows
  q = qarray.quantize_api(
    w,
    QTYPES[kind],
    channelwise_axes=[a for a in range(w.ndim) if a != axis],
    tiled_axes={axis: BLOCK},
  )
  codes = q.qvalue
  if kind in PACKED:
    nibbles = codes.astype(jnp.uint8) & 0xF  # int4 as its two's-complement nibble
    codes = nibbles[..., 0::2, :] | (nibbles[..., 1::2, :] << 4)
  return codes, q.scale


def dequantize(codes: jax.Array, scale: jax.Array, *, kind: str, dtype) -> jax.Array:
  """The kernel [..., in, out] in `dtype` of `quantize`'s codes and scale."""
  if kind in PACKED:
    *lead, half, out = codes.shape
    codes = jnp.stack([codes & 0xF, codes >> 4], axis=-2).reshape(*lead, 2 * half, out)
    if kind == "int4":  # the nibble back to its signed value
      codes = (codes.astype(jnp.int8) ^ 8) - 8
  q = qarray.QArray(codes, scale.astype(dtype), None, QTYPES[kind])
  return qarray.dequantize(q)


# A quantized kernel dequantized a layer at a time. Left to autodiff, `x @ dequantize(codes)`
# saves each layer's dequantized kernel for the backward pass (its input gradient needs it), so
# the step holds every layer's kernel in the compute dtype at once, LoRA's memory. A
# `jax.checkpoint` around the product does not help, nor does an optimization barrier: XLA:CPU
# strips barriers before it schedules (its cse_barrier_expander), and a dequantization that
# depends on nothing but the params is scheduled early, every layer's at the start (measured;
# docs/limits.md). Here the product's backward keeps the codes and scales (the params, already
# held), not the kernel, and dequantizes again, as bitsandbytes does; and each dequantization
# depends on its product's input (forward) or the output's gradient (backward) through an exact
# factor of 1 that no compiler can fold (`_after`), so no schedule can compute it before that
# exists: one layer's dequantized kernels are alive at a time, in training, evaluation and
# decoding alike, whatever the stack (scanned or not, with or without remat).


def matmul(x_MD: jax.Array, codes: jax.Array, scale: jax.Array, *, kind: str, dtype, q=None):
  """x_MD @ the kernel `dequantize(codes, scale)` in `dtype` [M, F] (multiplied as model.quant's
  `q` says, common/nn/quant.py, where not None), the kernel dequantized only once x (forward)
  or the output's gradient (backward) exists. Under a check_vma shard_map the three are cast to vary
  over the same axes (the casts' transposes sum x's gradient over the others)."""
  axes = parallel.varying(x_MD, codes, scale)
  x_MD, codes, scale = (parallel.to_varying(a, axes) for a in (x_MD, codes, scale))
  return _late(x_MD, codes, scale, kind, jnp.dtype(dtype), q)


_INTS = {2: jnp.int16, 4: jnp.int32, 8: jnp.int64}


def _after(x: jax.Array, codes: jax.Array) -> jax.Array:
  """`codes` times 1, a 1 computed from x's first value (its bits b, odd: (b | 1) / (b | 1) in
  integers, exactly 1 whatever b is, yet not a constant a compiler can fold): the same codes,
  but a data dependency on x of everything computed from them (the code book's lookup too)."""
  if not x.size:
    return codes
  bits = jax.lax.bitcast_convert_type(x.reshape(-1)[0], _INTS[x.dtype.itemsize]) | 1
  return codes * jax.lax.div(bits, bits).astype(codes.dtype)


def _kernel(after, codes, scale, kind, dtype):
  """The kernel of codes and scale, dequantized once `after` exists (`_after`)."""
  return dequantize(_after(after, codes), scale, kind=kind, dtype=dtype)


def _product(x_MD, kernel, q):
  return jnp.dot(x_MD, kernel) if q is None else quant.dot(x_MD, kernel, q)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _late(x_MD, codes, scale, kind, dtype, q):
  return _product(x_MD, _kernel(x_MD, codes, scale, kind, dtype), q)


def _late_fwd(x_MD, codes, scale, kind, dtype, q):
  y = _late(x_MD, codes, scale, kind, dtype, q)
  # A plain dot's input gradient needs only the kernel; model.quant's product needs x too.
  return y, (codes, scale, None if q is None else x_MD, x_MD[:0])


def _late_bwd(kind, dtype, q, res, g_MF):
  codes, scale, x_MD, x_type = res
  kernel = _kernel(g_MF, codes, scale, kind, dtype)
  if x_MD is None:
    dx = jnp.dot(g_MF, kernel.T)
  else:
    dx = jax.vjp(lambda x: _product(x, kernel, q), x_MD)[1](g_MF)[0]
  return parallel.sum_to(dx.astype(x_type.dtype), parallel.varying(x_type)), None, None


_late.defvjp(_late_fwd, _late_bwd)


def _block_linears(model: nnx.Module, layer: str | None = None):
  """The Linears in the blocks of `model` whose kernel is not yet stored quantized, by path;
  `layer`: `model` is itself one layer (every Linear of it counts), at that path."""
  # A Linear is the node with a `base_quant` (common/nn/linear.py, which imports this module).
  for path, node in nnx.iter_graph(model):
    if isinstance(getattr(node, "base_quant", None), str) and not node.base_quant:
      if layer is not None:
        yield ".".join(map(str, (layer, *path))), node
      elif is_kernel((*path, "kernel")):
        yield ".".join(map(str, path)), node


def apply(model: nnx.Module, lora_cfg) -> nnx.Module:
  """Stores the kernel of every Linear in the blocks of `model` quantized as
  `lora_cfg.base_quant` says (checked, with every kernel's shape, before any is changed), and
  the frozen embeddings and heads (`is_frozen_table`) in `frozen_dtype`."""
  check(lora_cfg)
  store(model, lora_cfg.base_quant)
  dtype = frozen_dtype(lora_cfg)
  if dtype is not None:
    tables = [
      (path, var.replace(var.get_value().astype(dtype)))
      for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param))
      if is_frozen_table(path, var, lora_cfg.train) and var.dtype != dtype
    ]
    if tables:
      nnx.update(model, nnx.from_flat_state(tables))
  return model


def store(
  model: nnx.Module, kind: str, *, key: str = "model.lora.base_quant", layer: str | None = None
) -> nnx.Module:
  """Stores the kernel of every Linear in the blocks of `model` quantized as `kind` ("": as it
  is), with no adapters asked for: `apply`'s body, a frozen model's (a distillation teacher,
  whose setting `key` names in errors), and each layer's as the stack builds it (`layer`: its
  path; `model` is that one layer), so a fresh init never holds the fp32 kernels of more than
  one layer. A kernel already stored quantized is left as it is."""
  if not kind:
    return model
  linears = list(_block_linears(model, layer))
  for path, lin in linears:
    shape = lin.kernel.shape
    if shape[-2] % BLOCK:
      raise UserError(
        f"{key}={kind!r} quantizes in blocks of {BLOCK} input rows: "
        f"{path}.kernel {list(shape)} has {shape[-2]} (not a multiple of {BLOCK}). Use "
        f"{key}='' for this model."
      )
  for _, lin in linears:
    codes, scale = quantize(lin.kernel[...], kind=kind)
    axes = getattr(lin.kernel, "axes", None)
    lin.kernel = QuantizedBase(codes, axes=axes)
    lin.kernel_scale = QuantizedBase(scale, axes=axes)
    lin.base_quant = kind
  return model


def quantizer(want: dict, kind: str):
  """What loading applies to each parameter as it is read, for a model whose params (one tree
  per layer, flat: path -> Variable) are `want`: (path, Variable) -> [(path, Variable)], the
  kernel of a Linear in the blocks replaced by its codes and scale, a frozen embedding or head
  cast to `want`'s dtype (`frozen_dtype`: no fp32 copy of it is held past its read), anything
  else as it is. Its `targets`: the paths it quantizes; its `casts`: those it casts."""
  targets = {k for k, v in want.items() if isinstance(v, QuantizedBase) and k[-1] == "kernel"}
  casts = {k: v.dtype for k, v in want.items() if is_frozen_table(k, v)}
  # Compiled now for each kernel shape, before any weight is held: XLA's compilation takes
  # hundreds of MiB for a moment (measured on Qwen2.5-0.5B), which would otherwise come on top of
  # the weights read so far.
  for shape, dtype in {
    (_fp32_shape(want[k]), want[(*k[:-1], "kernel_scale")].dtype) for k in targets
  }:
    quantize(jnp.zeros(shape, dtype), kind=kind)

  def one(path: tuple, var):
    if path in casts and var.dtype != casts[path]:
      return [(path, var.replace(jnp.asarray(var[...], casts[path])))]
    if path not in targets:
      return [(path, var)]
    codes, scale = quantize(jnp.asarray(var[...]), kind=kind)
    axes = getattr(var, "axes", None)
    return [
      (path, QuantizedBase(codes, axes=axes)),
      ((*path[:-1], "kernel_scale"), QuantizedBase(scale, axes=axes)),
    ]

  one.targets, one.casts = targets, set(casts)
  return one


def _fp32_shape(var) -> tuple[int, ...]:
  """The kernel shape [..., in, out] of a quantized kernel's codes (two rows a byte if packed)."""
  *lead, rows, out = var.shape
  return (*lead, rows * (2 if var.dtype == jnp.uint8 else 1), out)


def weights(path: tuple, var) -> int:
  """The model weights a parameter holds: a quantized kernel's as many as its fp32 kernel had
  (two a byte where packed), its scales none (they are the kernel's), anything else its size."""
  if not isinstance(var, QuantizedBase):
    return int(var.size)
  if path[-1] != "kernel":
    return 0
  return int(var.size) * (2 if var.dtype == jnp.uint8 else 1)


def base_bytes(params) -> tuple[int, int]:
  """(bytes of the quantized base kernels with their scales, bytes the same kernels take in
  fp32): the saving `base_quant` gives."""
  quantized, fp32 = 0, 0
  for path, var in nnx.to_flat_state(params):
    if isinstance(var, QuantizedBase):
      x = var.get_value()  # an array, or abstract (its bytes from its shape)
      quantized += int(np.prod(x.shape)) * jnp.dtype(x.dtype).itemsize
      if path[-1] == "kernel":
        packed = 2 if x.dtype == jnp.uint8 else 1
        fp32 += int(np.prod(x.shape)) * packed * 4
  return quantized, fp32


def parts(params, *, dtype, train: str = "") -> dict[str, int]:
  """What a QLoRA model's params (`params`: a state, arrays or abstract) hold, in bytes: `base`,
  the blocks' quantized kernels with their scales; `tables`, the frozen embeddings and heads
  (`is_frozen_table`, `train` as model.lora.train); `layer`, the largest layer's kernels
  dequantized to the compute `dtype`, what a step holds of the base beyond its codes at a time
  (`matmul`)."""
  base, tables, layers = 0, 0, {}
  for path, var in nnx.to_flat_state(stacking.unstack_layers(params)):
    x = var.get_value()
    size = int(np.prod(x.shape)) * jnp.dtype(x.dtype).itemsize
    if isinstance(var, QuantizedBase):
      base += size
      key = stacking.layer_of(path)
      layers[key] = layers.get(key, 0) + weights(path, var) * jnp.dtype(dtype).itemsize
    elif is_frozen_table(path, var, train):
      tables += size
  return {"base": base, "tables": tables, "layer": max(layers.values(), default=0)}


def check_mesh(params, layout) -> None:
  """That `layout`'s mesh can split every quantized kernel's codes and scales as the kernel's
  axes ask (a scale has a row per 64 input rows, so fewer rows than the kernel); else a
  UserError naming the first that it cannot, and the fix."""
  if layout is None:
    return
  for path, var in nnx.to_flat_state(params):
    if not isinstance(var, QuantizedBase):
      continue
    spec = layout.param_spec(var)
    for dim, axes in zip(var.shape, spec, strict=False):
      axes = (axes,) if isinstance(axes, str) else tuple(axes or ())
      split = int(np.prod([layout.sizes.get(a, 1) for a in axes]))
      if dim % split:
        name = ".".join(map(str, path))
        raise UserError(
          f"model.lora.base_quant: {name} {list(var.shape)} (a quantized base kernel's "
          f"{'scales' if path[-1] == 'kernel_scale' else 'codes'}, a row per {BLOCK} input rows "
          f"for scales) cannot be split {split} ways over mesh axes {'x'.join(axes)}: use a "
          f"mesh whose {'x'.join(axes)} size divides {dim}, or model.lora.base_quant=''."
        )
