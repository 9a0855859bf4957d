"""Memory levers shared by every family: rematerialisation of each block in the backward pass.

(Gradient accumulation lives in the trainer, `train.micro_batches`; bf16 compute with fp32
master weights is `model.dtype` vs `model.param_dtype`.)
"""

import jax
from flax import nnx

from common.errors import UserError

# none: keep every activation; full: keep only each block's input and recompute the rest;
# save_dots: keep the matmul outputs (cheap to store, dear to recompute), recompute the rest.
REMAT = {
  "none": None,
  "full": jax.checkpoint_policies.nothing_saveable,
  "save_dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}


def run_blocks(blocks, x, *, cache=None, remat: str = "none", **kwargs):
  """x through each block in turn: `block(x, cache=..., **kwargs) -> (x, cache)`; returns x and
  the list of updated caches. With a cache (decoding) nothing is rematerialised."""
  if remat not in REMAT:
    raise UserError(f"Unknown model.remat {remat!r}: use one of {sorted(REMAT)}.")
  new_cache = []
  for i, block in enumerate(blocks):
    layer_cache = None if cache is None else cache[i]
    if remat == "none" or cache is not None:
      x, layer_cache = block(x, cache=layer_cache, **kwargs)
    else:
      x, layer_cache = nnx.remat(_call, policy=REMAT[remat])(block, x, kwargs)
    new_cache.append(layer_cache)
  return x, new_cache


def _call(block, x, kwargs):
  return block(x, cache=None, **kwargs)
