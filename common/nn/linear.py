"""Linear projections and token embeddings, the only places model weights are multiplied."""

import jax
import jax.numpy as jnp
from flax import nnx

from nnx_zoo.common import parallel
from nnx_zoo.common.nn import qlora, quant

Axes = tuple[str | None, ...]


def dtypes(cfg) -> dict:
  """The dtype keyword arguments every shared layer takes, from a model config."""
  return {"dtype": jnp.dtype(cfg.dtype), "param_dtype": jnp.dtype(cfg.param_dtype)}


def normal(std: float):
  return nnx.initializers.normal(stddev=std)


class Linear(nnx.Module):
  """y = x @ W (+ b), computed as one 2-D matmul whatever the leading dims of x.

  XLA:CPU computes the weight gradient of a 3-D `x @ W` about 4x slower than the 2-D form (see
  DESIGN.md), so every leading dim is flattened into one before the dot. `axes` are the logical
  names of the kernel dims (the legend in DESIGN.md), read by the sharding rules. `quant` (set
  by the stack from `model.quant`, common/nn/quant.py) multiplies in int8 or fp8. `base_quant`
  (set by `qlora.apply` from `model.lora.base_quant`) says the kernel is stored quantized, its
  codes in `kernel` and its scales in `kernel_scale`, dequantized here to `dtype`.
  """

  def __init__(
    self,
    in_features: int,
    out_features: int,
    *,
    use_bias: bool = False,
    axes: Axes = (None, None),
    init_std: float = 0.02,
    dtype=jnp.float32,
    param_dtype=jnp.float32,
    rngs: nnx.Rngs,
  ):
    self.in_features, self.out_features = in_features, out_features
    self.dtype, self.axes = dtype, axes
    self.kernel = nnx.Param(
      normal(init_std)(rngs.params(), (in_features, out_features), param_dtype), axes=axes
    )
    self.bias = (
      nnx.Param(jnp.zeros((out_features,), param_dtype), axes=axes[1:]) if use_bias else None
    )
    self.lora = nnx.data(None)  # a low-rank adapter, added by common.lora.apply if configured
    self.quant: quant.Quant | None = None  # float unless the stack quantizes this projection
    self.base_quant = ""  # the kernel in param_dtype, unless qlora.apply stores it quantized
    self.kernel_scale = nnx.data(None)

  def __call__(self, x: jax.Array) -> jax.Array:
    *lead, d = x.shape
    x = x.reshape(-1, d).astype(self.dtype)
    if self.base_quant:  # the codes and scales gathered, dequantized in the product (qlora.py)
      codes = parallel.gather(self.kernel[...], self.axes)
      scale = parallel.gather(self.kernel_scale[...], self.axes)
      y = qlora.matmul(x, codes, scale, kind=self.base_quant, dtype=self.dtype, q=self.quant)
    else:
      kernel = parallel.gather(self.kernel[...], self.axes).astype(self.dtype)
      y = jnp.dot(x, kernel) if self.quant is None else quant.dot(x, kernel, self.quant)
    y = parallel.reduce(y, self.axes[0])
    if self.lora is not None:
      y = y + self.lora(x)
    if self.bias is not None:
      y = y + self.bias[...].astype(self.dtype)  # after the reduce: added once, not per shard
    return y.reshape(*lead, y.shape[-1])


class Embedding(nnx.Module):
  """Token ids -> vectors; `attend` reuses the table as the output projection (tied weights)."""

  def __init__(
    self,
    vocab_size: int,
    dim: int,
    *,
    init_std: float = 0.02,
    dtype=jnp.float32,
    param_dtype=jnp.float32,
    rngs: nnx.Rngs,
  ):
    self.vocab_size, self.dim, self.dtype = vocab_size, dim, dtype
    self.embedding = nnx.Param(
      normal(init_std)(rngs.params(), (vocab_size, dim), param_dtype), axes=("V", "D")
    )

  def __call__(self, tokens_BT: jax.Array) -> jax.Array:
    table_VD = parallel.gather(self.embedding[...], ("V", "D"))
    if not parallel.tensor_split("V"):
      return jnp.take(table_VD, tokens_BT, axis=0).astype(self.dtype)
    # Vocab-parallel: each device looks up the ids in its slice of the table, zeros elsewhere.
    local_ids = tokens_BT - parallel.tensor_index() * table_VD.shape[0]
    here = (local_ids >= 0) & (local_ids < table_VD.shape[0])
    rows = jnp.take(table_VD, jnp.clip(local_ids, 0, table_VD.shape[0] - 1), axis=0)
    return parallel.psum_tensor(jnp.where(here[..., None], rows, 0)).astype(self.dtype)

  def attend(self, x_BTD: jax.Array) -> jax.Array:
    """Logits [B, T, V] (this device's vocab slice when the vocab is split over tensor)."""
    *lead, d = x_BTD.shape
    table_VD = parallel.gather(self.embedding[...], ("V", "D")).astype(self.dtype)
    logits = jnp.dot(x_BTD.reshape(-1, d).astype(self.dtype), table_VD.T)
    return logits.reshape(*lead, table_VD.shape[0])
