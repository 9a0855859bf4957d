"""QLoRA (`model.lora.base_quant`): a LoRA run's frozen base kernels stored in int8, int4 or nf4.

With `model.lora.rank > 0` and `base_quant` set, the kernel of every Linear in the blocks is
stored quantized and dequantized inside the step to `model.dtype` (`Linear.__call__`). The
embeddings, the output head and the norms stay in `param_dtype`; the adapters (fp32) and the
parameters `model.lora.train` names are the only trained ones.

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

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from qwix._src.core import qarray  # qwix 0.1.8 exports quantize/dequantize only under _src

from nnx_zoo.common.errors import UserError
from nnx_zoo.common.nn import stacking

KINDS = ("", "int8", "int4", "nf4")
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


def _block_linears(model: nnx.Module):
  # A Linear is the node with a `base_quant` (common/nn/linear.py, which imports this module).
  for path, node in nnx.iter_graph(model):
    if isinstance(getattr(node, "base_quant", None), str) and is_kernel((*path, "kernel")):
      yield ".".join(map(str, path)), node


def apply(model: nnx.Module, lora_cfg) -> nnx.Module:
  """Stores the kernel of every Linear in the blocks of `model` quantized as
  `lora_cfg.base_quant` says (checked, with every kernel's shape, before any is changed)."""
  check(lora_cfg)
  return store(model, lora_cfg.base_quant)


def store(model: nnx.Module, kind: str, *, key: str = "model.lora.base_quant") -> nnx.Module:
  """Stores the kernel of every Linear in the blocks of `model` quantized as `kind` ("": as it
  is), with no adapters asked for: `apply`'s body, and a frozen model's (a distillation teacher,
  whose setting `key` names in errors)."""
  if not kind:
    return model
  linears = list(_block_linears(model))
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
  kernel of a Linear in the blocks replaced by its codes and scale, anything else as it is.
  Its `targets`: the paths it quantizes."""
  targets = {k for k, v in want.items() if isinstance(v, QuantizedBase) and k[-1] == "kernel"}
  # Compiled now for each kernel shape, before any weight is held: XLA's compilation takes
  # hundreds of MiB for a moment (measured on Qwen2.5-0.5B), which would otherwise come on top of
  # the weights read so far.
  for shape, dtype in {
    (_fp32_shape(want[k]), want[(*k[:-1], "kernel_scale")].dtype) for k in targets
  }:
    quantize(jnp.zeros(shape, dtype), kind=kind)

  def one(path: tuple, var):
    if path not in targets:
      return [(path, var)]
    codes, scale = quantize(jnp.asarray(var[...]), kind=kind)
    axes = getattr(var, "axes", None)
    return [
      (path, QuantizedBase(codes, axes=axes)),
      ((*path[:-1], "kernel_scale"), QuantizedBase(scale, axes=axes)),
    ]

  one.targets = targets
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
