"""Position-wise feed-forward layers, chosen by `kind`, with the activation a separate field.

`kind` is the extension point: "dense" (this module's MLP) or any kind registered with
`register` (common/nn/moe.py registers "moe"). `activation` picks the nonlinearity; the gated
ones ("swiglu", "geglu") have a gate projection as well as the up projection.
"""

from collections.abc import Callable

import jax
import jax.numpy as jnp
import ml_collections
from flax import nnx

from nnx_zoo.common.errors import UserError, suggest
from nnx_zoo.common.nn.linear import Linear

ACTIVATIONS: dict[str, Callable] = {
  "swiglu": jax.nn.silu,  # Llama, Mistral, Qwen
  "geglu": lambda x: jax.nn.gelu(x, approximate=True),  # Gemma's gelu_pytorch_tanh, gated
  "gelu": lambda x: jax.nn.gelu(x, approximate=True),  # GPT-2's "gelu_new"
  "gelu_exact": lambda x: jax.nn.gelu(x, approximate=False),  # BERT's "gelu"
  "relu": jax.nn.relu,  # the original T5
  "quick_gelu": lambda x: x * jax.nn.sigmoid(1.702 * x),  # CLIP
}
GATED = {"swiglu", "geglu"}

# kind -> the class built for it: __init__(cfg, dim, *, out_init_std, dtype, param_dtype, rngs)
# and __call__(x_BTD, *, mask_BT=None) -> y_BTD (mask_BT: 1 for real tokens, 0 for padding;
# what a layer with batch statistics, an MoE's router losses, weights them by).
KINDS: dict[str, type] = {}


def register(kind: str):
  """Class decorator: `mlp.kind = kind` builds this class (a new feed-forward layer lands in
  one file of common/nn/, and every family can use it by config)."""

  def add(cls):
    KINDS[kind] = cls
    return cls

  return add


def config(
  activation: str = "swiglu", *, hidden_dim: int, use_bias: bool = False
) -> ml_collections.ConfigDict:
  """A dense MLP sub-config."""
  return ml_collections.ConfigDict(
    {"kind": "dense", "activation": activation, "hidden_dim": hidden_dim, "use_bias": use_bias}
  )


def activation(name: str) -> Callable:
  if name not in ACTIVATIONS:
    raise UserError(f"Unknown MLP activation {name!r}.{suggest(name, ACTIVATIONS)}")
  return ACTIVATIONS[name]


@register("dense")
class MLP(nnx.Module):
  """Gated: down(act(gate(x)) * up(x)); plain: down(act(up(x)))."""

  def __init__(
    self,
    cfg,
    dim: int,
    *,
    out_init_std: float = 0.02,
    dtype=jnp.float32,
    param_dtype=jnp.float32,
    rngs: nnx.Rngs,
  ):
    self.act = activation(cfg.activation)
    kw = dict(use_bias=cfg.use_bias, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
    F = cfg.hidden_dim
    self.gate = Linear(dim, F, axes=("D", "F"), **kw) if cfg.activation in GATED else None
    self.up = Linear(dim, F, axes=("D", "F"), **kw)
    self.down = Linear(F, dim, axes=("F", "D"), init_std=out_init_std, **kw)

  def __call__(self, x_BTD: jax.Array, *, mask_BT: jax.Array | None = None) -> jax.Array:
    del mask_BT  # token-wise: padding changes nothing here
    if self.gate is not None:
      h_BTF = self.act(self.gate(x_BTD)) * self.up(x_BTD)
    else:
      h_BTF = self.act(self.up(x_BTD))
    return self.down(h_BTF)


def make(cfg, dim: int, **kw) -> nnx.Module:
  """The feed-forward layer of an `mlp` sub-config (`kind` picks the class)."""
  if cfg.kind not in KINDS:
    raise UserError(f"Unknown MLP kind {cfg.kind!r}.{suggest(cfg.kind, KINDS)}")
  return KINDS[cfg.kind](cfg, dim, **kw)
