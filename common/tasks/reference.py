"""The frozen model a policy is trained against (the dpo task's reference, the grpo task's KL
anchor): the `init_from` weights, placed on the mesh as the params are; or, under LoRA training
adapters only, the params themselves with every adapter at zero (a fresh adapter changes
nothing), so the base is never held twice."""

import jax
import jax.numpy as jnp
from flax import nnx

from nnx_zoo.common.hub import weights
from nnx_zoo.common.nn import lora


class Reference:
  def __init__(self, cfg, layout=None):
    self._params = None  # the model's graphdef is the policy's
    if not (cfg.model.lora.rank and not cfg.model.lora.train):
      _, self._params = weights.init_from_params(cfg, layout)

  def params(self, policy_params: nnx.State) -> nnx.State:
    """The reference's params, given the policy's (what `Task.complete` receives)."""
    if self._params is not None:
      return self._params
    adapters, base = nnx.split_state(policy_params, lora.LoRAParam, ...)
    return nnx.merge_state(jax.tree.map(jnp.zeros_like, adapters), base)
