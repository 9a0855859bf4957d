"""Position-wise feed-forward blocks, chosen by `kind`: "swiglu", "geglu" (gated) or "gelu"."""

import jax
import jax.numpy as jnp
import ml_collections
from flax import nnx

from common.errors import UserError
from common.nn.linear import Linear

ACTIVATIONS = {
  "swiglu": jax.nn.silu,
  "geglu": lambda x: jax.nn.gelu(x, approximate=True),
  "gelu": lambda x: jax.nn.gelu(x, approximate=True),  # GPT-2's "gelu_new"
  "gelu_exact": lambda x: jax.nn.gelu(x, approximate=False),  # BERT's "gelu"
  "relu": jax.nn.relu,
}
GATED = {"swiglu", "geglu"}


def config(kind: str = "swiglu", *, hidden_dim: int, use_bias: bool = False):
  return ml_collections.ConfigDict({"kind": kind, "hidden_dim": hidden_dim, "use_bias": use_bias})


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
    if cfg.kind not in ACTIVATIONS:
      raise UserError(f"Unknown MLP kind {cfg.kind!r}: use one of {sorted(ACTIVATIONS)}.")
    self.act = ACTIVATIONS[cfg.kind]
    kw = dict(use_bias=cfg.use_bias, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
    F = cfg.hidden_dim
    self.gate = Linear(dim, F, axes=("D", "F"), **kw) if cfg.kind in GATED else None
    self.up = Linear(dim, F, axes=("D", "F"), **kw)
    self.down = Linear(F, dim, axes=("F", "D"), init_std=out_init_std, **kw)

  def __call__(self, x_BTD: jax.Array) -> jax.Array:
    if self.gate is not None:
      h_BTF = self.act(self.gate(x_BTD)) * self.up(x_BTD)
    else:
      h_BTF = self.act(self.up(x_BTD))
    return self.down(h_BTF)
