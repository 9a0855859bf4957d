"""Grouped matmul on TPU: jax's own megablox Pallas kernels (`gmm` forward and input gradient,
`tgmm` weight gradient), for the mixture-of-experts layer.

Why not `jax.lax.ragged_dot` on TPU: XLA:TPU compiles its forward as a native grouped matmul, but
the weight gradient (a ragged contracting dimension) as a dense matmul over every group: G times
the work. Measured by AOT compilation for v5e:2x2 (8,192 rows of 1,024 into 2,048, 64 groups,
bf16): forward and backward cost 2,235 GFLOP against the 103 the three matmuls need; megablox's
kernels run only each row's own group, in either direction.

On the CPU the kernels run in Pallas interpret mode (`interpret=True`): slow, but it is the same
kernel, so the numerics are tested there (tests/kernels/test_tpu_gmm.py). Under `jax.shard_map`
each device calls it on its own rows and experts (it has no collective);
`nnx_zoo.kernels.vma.per_device` gives its outputs the mesh axes they vary over.
"""

import jax
import jax.numpy as jnp

from nnx_zoo.kernels import vma
from nnx_zoo.kernels.tpu_attention import target_platform

# Rows and columns per tile, at most: each row tile reads its group's whole [k, n] weight, so
# small row tiles re-read the weights often (MaxText's default tiles; megablox's own, 128 rows,
# read them 4x as often). Capped by the problem: rows to a multiple of 8; k and n share one size
# (the backward pass swaps them), a multiple of the TPU's 128 lanes no larger than either.
TILE_ROWS, TILE_COLS = 512, 1024


def gmm(x_RD, w_EDF, sizes_E, *, interpret: bool | None = None) -> jax.Array:
  """y[r] = x[r] @ w[e] for the rows r of group e, the groups back to back from row 0 in the
  order of `sizes_E` ([E] int32, summing to at most R); rows past the groups are 0. Differentiable
  in x and w (megablox's VJP: `gmm` for dx, `tgmm` for dw). interpret None: Pallas interpret
  mode when compiling for anything but a TPU."""
  from jax.experimental.pallas.ops.tpu import megablox

  if interpret is None:
    interpret = target_platform() != "tpu"
  R, D = x_RD.shape
  F = w_EDF.shape[2]
  tm = min(TILE_ROWS, -(-R // 8) * 8)
  tkn = min(TILE_COLS, max(128, min(D, F) // 128 * 128))
  tiling = (tm, tkn, tkn)
  pad = -R % tm

  def run(x_RD, w_EDF, sizes_E):
    # Rows past the last group are never written by the kernel, in the output or (backward) in
    # dx: whatever the buffer held. Selecting them out here does both (a select's transpose
    # selects the cotangent the same way).
    real_R = (jnp.arange(R + pad) < jnp.sum(sizes_E))[:, None]
    x_RD = jnp.pad(x_RD, ((0, pad), (0, 0))) if pad else x_RD
    x_RD = jnp.where(real_R, x_RD, 0)
    # The first group's index, typed to vary as the inputs do: megablox would make an
    # invariant one, which its interpret mode then mixes with varying values.
    offset = vma.to_varying(jnp.zeros((), jnp.int32), vma.varying(sizes_E))
    y_RF = megablox.gmm(x_RD, w_EDF, sizes_E, x_RD.dtype, tiling, offset, None, False, interpret)
    return jnp.where(real_R, y_RF, 0)[:R]

  return vma.per_device(run)(x_RD, w_EDF, sizes_E.astype(jnp.int32))
