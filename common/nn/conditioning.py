"""Conditioning a stack on a diffusion timestep and a class, and adaLN-Zero modulation by it
(DiT, Peebles and Xie 2023).

- `timestep_features`: a timestep's sinusoidal features (cosines first, then sines);
- `TimestepEmbed`: those features through Linear -> SiLU -> Linear;
- `ClassEmbed`: a table of class vectors with one more row, the null class, which
  classifier-free guidance uses for the unconditional prediction (its id is `num_classes`);
- `Conditioning`: the sum of both, c [B, D], what every modulated layer reads;
- `Modulation`: SiLU -> Linear(D, n * D), initialised to zero (the "Zero" of adaLN-Zero: every
  modulated block starts as the identity), cut into n vectors [B, D] (shift, scale, gate, ...);
  `modulate(x, shift, scale)` = x * (1 + scale) + shift per row.

The shared Block uses `Modulation` when `model.modulation = "adaln_zero"` (common/nn/
transformer.py), the `Denoiser` stack (common/nn/denoiser.py) the rest.
"""

import math

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from flax import nnx

from nnx_zoo.common import parallel
from nnx_zoo.common.errors import UserError
from nnx_zoo.common.nn.linear import Linear, normal

MODULATIONS = ("none", "adaln_zero")


def config(
  *,
  num_classes: int,
  frequency_dim: int = 256,
  max_period: float = 10_000.0,
  freq_shift: float = 0.0,
) -> ml_collections.ConfigDict:
  """A conditioning sub-config: `num_classes` real classes (plus the null class), timestep
  features of `frequency_dim` with frequencies exp(-log(max_period) * i / (half - freq_shift)),
  i < half = frequency_dim / 2 (freq_shift 0: the DiT paper's; 1: diffusers' DiT)."""
  return ml_collections.ConfigDict(
    {
      "kind": "timestep_class",
      "num_classes": num_classes,
      "frequency_dim": frequency_dim,
      "max_period": max_period,
      "freq_shift": freq_shift,
    }
  )


def timestep_features(
  t_B: jax.Array, dim: int, *, max_period: float = 10_000.0, freq_shift: float = 0.0
) -> jax.Array:
  """[B] timesteps (any real values) -> [B, dim] features: cos(t * f_i) then sin(t * f_i)."""
  half = dim // 2
  # Frequencies computed in float64 on the host (correctly rounded to float32): torch's and XLA's
  # float32 exp each miss by an ulp here and there, and at t ~ 1000 one ulp of a frequency moves
  # a feature by ~6e-5, the float32 limit of t * f.
  freqs = np.exp(-math.log(max_period) * np.arange(half) / (half - freq_shift)).astype(np.float32)
  args_BF = t_B.astype(jnp.float32)[:, None] * freqs[None, :]
  out = jnp.concatenate([jnp.cos(args_BF), jnp.sin(args_BF)], axis=-1)
  return jnp.pad(out, ((0, 0), (0, dim % 2)))  # an odd dim: one zero column, as diffusers'


class TimestepEmbed(nnx.Module):
  """t [B] -> sinusoidal features [B, F] -> Linear -> SiLU -> Linear -> [B, D]."""

  def __init__(
    self, cfg, dim: int, *, init_std: float, dtype=jnp.float32, param_dtype=jnp.float32, rngs
  ):
    self.frequency_dim, self.max_period = cfg.frequency_dim, cfg.max_period
    self.freq_shift = cfg.freq_shift
    kw = dict(use_bias=True, init_std=init_std, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
    self.fc1 = Linear(cfg.frequency_dim, dim, axes=(None, "D"), **kw)
    self.fc2 = Linear(dim, dim, axes=("D", None), **kw)

  def __call__(self, t_B: jax.Array) -> jax.Array:
    f_BF = timestep_features(
      t_B, self.frequency_dim, max_period=self.max_period, freq_shift=self.freq_shift
    )
    return self.fc2(jax.nn.silu(self.fc1(f_BF.astype(self.fc1.dtype))))


class ClassEmbed(nnx.Module):
  """labels [B] in 0..num_classes (num_classes: the null class) -> [B, D]. A table of its own,
  not the token `Embedding`: a few classes plus one (11 rows) do not split over `tensor` as a
  vocabulary does, so only D is sharded (as learned positions)."""

  def __init__(
    self,
    num_classes: int,
    dim: int,
    *,
    init_std: float,
    rngs,
    dtype=jnp.float32,
    param_dtype=jnp.float32,
  ):
    self.num_classes, self.dtype = num_classes, dtype
    self.embedding = nnx.Param(
      normal(init_std)(rngs.params(), (num_classes + 1, dim), param_dtype), axes=(None, "D")
    )

  @property
  def null_id(self) -> int:
    return self.num_classes

  def __call__(self, labels_B: jax.Array) -> jax.Array:
    table = parallel.gather(self.embedding[...], (None, "D"))
    return jnp.take(table, labels_B, axis=0).astype(self.dtype)


class Conditioning(nnx.Module):
  """(timesteps [B], labels [B]) -> c [B, D] = TimestepEmbed(t) + ClassEmbed(label)."""

  def __init__(self, cfg, dim: int, *, init_std: float, rngs, **dt):
    if cfg.kind != "timestep_class":
      raise UserError(f"Unknown conditioning kind {cfg.kind!r}: use 'timestep_class'.")
    self.timestep = TimestepEmbed(cfg, dim, init_std=init_std, rngs=rngs, **dt)
    self.label = ClassEmbed(cfg.num_classes, dim, init_std=init_std, rngs=rngs, **dt)

  def __call__(self, t_B: jax.Array, labels_B: jax.Array) -> jax.Array:
    return self.timestep(t_B) + self.label(labels_B)


class Modulation(nnx.Module):
  """c [B, D] -> `n` vectors [B, D] from SiLU -> Linear(D, n * D), zero at initialisation."""

  def __init__(self, dim: int, n: int, *, dtype=jnp.float32, param_dtype=jnp.float32, rngs):
    self.n = n
    self.proj = Linear(
      dim,
      n * dim,
      use_bias=True,
      axes=("D", None),
      init_std=0.0,  # adaLN-Zero: shifts, scales and gates start at 0
      dtype=dtype,
      param_dtype=param_dtype,
      rngs=rngs,
    )

  def __call__(self, c_BD: jax.Array) -> tuple[jax.Array, ...]:
    return tuple(jnp.split(self.proj(jax.nn.silu(c_BD)), self.n, axis=-1))


def modulate(x_BTD: jax.Array, shift_BD: jax.Array, scale_BD: jax.Array) -> jax.Array:
  return x_BTD * (1 + scale_BD[:, None, :]) + shift_BD[:, None, :]
