"""Normalisation layers, chosen by `kind`: "rms" (Llama, Qwen) or "layer" (GPT-2, BERT)."""

import jax
import jax.numpy as jnp
import ml_collections
from flax import nnx

from nnx_zoo.common.errors import UserError


class RMSNorm(nnx.Module):
  """x / rms(x) * (offset + scale). offset 0: the usual form, scale initialised to 1; offset 1:
  Gemma's `x * (1 + w)`, w initialised to 0 (so both start as the identity scale)."""

  def __init__(
    self,
    dim: int,
    *,
    eps: float = 1e-6,
    offset: float = 0.0,
    dtype=jnp.float32,
    param_dtype=jnp.float32,
  ):
    self.eps, self.offset, self.dtype = eps, offset, dtype
    self.scale = nnx.Param(jnp.full((dim,), 1.0 - offset, param_dtype), axes=("D",))

  def __call__(self, x: jax.Array) -> jax.Array:
    # Statistics in fp32 whatever the compute dtype: bf16 variance underflows.
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
    scale = self.scale[...].astype(jnp.float32)
    if self.offset:
      scale = self.offset + scale
    return (y * scale).astype(self.dtype)


class LayerNorm(nnx.Module):
  def __init__(
    self,
    dim: int,
    *,
    eps: float = 1e-5,
    use_bias: bool = True,
    affine: bool = True,
    dtype=jnp.float32,
    param_dtype=jnp.float32,
  ):
    self.eps, self.dtype = eps, dtype
    # affine=False: no scale and no bias (DiT's norms, which adaLN modulates instead).
    self.scale = nnx.Param(jnp.ones((dim,), param_dtype), axes=("D",)) if affine else None
    use_bias = use_bias and affine
    self.bias = nnx.Param(jnp.zeros((dim,), param_dtype), axes=("D",)) if use_bias else None

  def __call__(self, x: jax.Array) -> jax.Array:
    x32 = x.astype(jnp.float32)
    mean = jnp.mean(x32, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(x32 - mean), axis=-1, keepdims=True)
    y = (x32 - mean) * jax.lax.rsqrt(var + self.eps)
    if self.scale is not None:
      y = y * self.scale[...].astype(jnp.float32)
    if self.bias is not None:
      y = y + self.bias[...].astype(jnp.float32)
    return y.astype(self.dtype)


def config(
  kind: str = "rms",
  *,
  eps: float = 1e-6,
  use_bias: bool = True,
  offset: float = 0.0,
  affine: bool = True,
):
  """A norm sub-config; `use_bias` and `affine` are read by "layer" only (affine=False: neither
  scale nor bias, DiT's), `offset` by "rms" only (1.0: Gemma's x * (1 + w))."""
  cfg = ml_collections.ConfigDict({"kind": kind, "eps": eps})
  if kind == "layer":
    cfg.use_bias = use_bias
    if not affine:  # only when set, so the configs written before it read the same
      cfg.affine = False
  if kind == "rms":
    cfg.offset = offset
  return cfg


def settings(cfg) -> dict:
  """A norm config's settings other than its kind (for another norm of the same model, e.g.
  attention's QK-norm); {} for None."""
  if cfg is None:
    return {}
  return {k: v for k, v in cfg.items() if k != "kind"}


def make(cfg, dim: int, *, dtype=jnp.float32, param_dtype=jnp.float32) -> nnx.Module:
  if cfg.kind == "rms":
    return RMSNorm(dim, eps=cfg.eps, offset=cfg.offset, dtype=dtype, param_dtype=param_dtype)
  if cfg.kind == "layer":
    return LayerNorm(
      dim,
      eps=cfg.eps,
      use_bias=cfg.use_bias,
      affine=cfg.get("affine", True),  # written only when False (`config`)
      dtype=dtype,
      param_dtype=param_dtype,
    )
  raise UserError(f"Unknown norm kind {cfg.kind!r}: use 'rms' or 'layer'.")
