"""Quantized training (`model.quant`): the shared Linear's matmul in int8 or fp8, through qwix.

Each quantized product scales its operands to the narrow type by their absolute maximum, taken
now (dynamic scales: nothing is kept between steps, so micro-batches, scan and remat see the
same numbers), per row of the activations and per output column of the weight; the product
accumulates in int32 (int8) or float and is scaled back to the compute dtype. With
`model.quant_backward` the two gradient products (input: g @ W^T, weight: x^T @ g) are quantized
too, the incoming gradient per channel, reusing the forward's quantized operands (qwix moves
their scales onto the gradient); without it the backward runs in the compute dtype on the
float operands. fp8 is e4m3 in the forward and e5m2 for gradients (Transformer Engine's
"hybrid" recipe: gradients need range more than precision).

Only the projections of attention and the MLP are quantized (`block.Block` marks their
Linears); embeddings, the output head, attention's score and value products, norms, MoE's router
and its experts' grouped matmuls stay in the compute dtype. Weights are stored and checkpointed
in `param_dtype` whatever the setting: it is a setting of the training, as `model.remat` is.

Under the trainer's `shard_map(check_vma=True)` both operands are cast to vary over the same
mesh axes before qwix's custom VJP (which returns cotangents typed as its inputs); the cast's
transpose sums a weight's gradient over the batch axes as autodiff does for a plain dot. Scales
are those of each device's own shard, so a mesh matches one device to quantization noise only.

Every qwix import of the zoo is in this module and in common/nn/qlora.py (QLoRA's stored base).
"""

import dataclasses

import jax
import jax.numpy as jnp
from qwix._src.core import dot_general_qt as _qt  # qwix 0.1.8 exports no direct entry point

from nnx_zoo.common import parallel
from nnx_zoo.common.errors import UserError

MODES = ("none", "int8", "fp8")
# Config keys of how a model is trained, not what it is (as memory.LEVERS): a workdir resumes
# and a checkpoint loads whatever they were.
LEVERS = ("model.quant", "model.quant_backward")
# (forward operands, gradients) of each mode.
TYPES = {
  "int8": (jnp.int8, jnp.int8),
  "fp8": (jnp.float8_e4m3fn, jnp.float8_e5m2),
}
_MATMUL = (((1,), (0,)), ((), ()))  # x_MD @ w_DF


@dataclasses.dataclass(frozen=True)
class Quant:
  """How a Linear multiplies: `mode` (int8, fp8) and whether the gradients' products are too."""

  mode: str
  backward: bool = True


def settings(cfg) -> Quant | None:
  """A model config's quantization (None for "none"); an unknown mode is a UserError."""
  mode = cfg.quant
  if mode not in MODES:
    raise UserError(f"Unknown model.quant {mode!r}: use one of {', '.join(MODES)}.")
  return None if mode == "none" else Quant(mode, bool(cfg.quant_backward))


def qt_config(q: Quant) -> _qt.DotGeneralQtConfig:
  """qwix's config of one quantized product (absmax scales per channel, computed each call)."""
  fwd, bwd = TYPES[q.mode]
  bwd = bwd if q.backward else None
  return _qt.DotGeneralQtConfig(
    lhs_qtype=fwd,
    rhs_qtype=fwd,
    dlhs_grad_qtype=bwd,
    drhs_grad_qtype=bwd,
    # A float backward needs the float operands (qwix's QtProvider does the same).
    use_original_residuals=not q.backward,
  )


def dot(x_MD: jax.Array, w_DF: jax.Array, q: Quant) -> jax.Array:
  """x_MD @ w_DF [M, F] in the compute dtype, multiplied as `q` says."""
  axes = parallel.varying(x_MD, w_DF)
  x_MD, w_DF = parallel.to_varying(x_MD, axes), parallel.to_varying(w_DF, axes)
  return _qt.dot_general_qt(x_MD, w_DF, _MATMUL, qt_config(q))
