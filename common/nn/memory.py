"""Memory levers shared by every family: rematerialisation of each block in the backward pass,
and scanning over the layers.

(Gradient accumulation lives in the trainer, `train.micro_batches`; bf16 compute with fp32
master weights is `model.dtype` vs `model.param_dtype`.)
"""

import jax
import jax.numpy as jnp
from flax import nnx

from common.errors import UserError

# none: keep every activation; full: keep only each block's input and recompute the rest;
# save_dots: keep the matmul outputs (cheap to store, dear to recompute), recompute the rest.
REMAT = {
  "none": None,
  "full": jax.checkpoint_policies.nothing_saveable,
  "save_dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}

# Config keys that change how a model is computed, not what it is (nor its parameters): a run
# resumes, and a checkpoint loads, whatever they were when it was saved (or if it predates them).
LEVERS = ("model.remat", "model.scan")


def run_blocks(blocks, x, *, cache=None, remat: str = "none", scan: bool = False, **kwargs):
  """x through each block in turn: `block(x, cache=..., **kwargs) -> (x, cache)`; returns x and
  the list of updated caches. With a cache (decoding) nothing is rematerialised or scanned.

  `scan`: one block body, compiled once and run by `jax.lax.scan` over the layers, instead of L
  copies of it. Under FSDP each layer's all-gather then sits inside the loop body; with a remat
  policy the backward pass gathers again in its loop, so about one layer's weights are gathered
  at a time (without remat the scan saves every layer's gathered weights for the backward pass,
  as the unscanned model does: bench/fsdp_gathers.py). The parameter tree is unchanged
  (`blocks.0...`, `blocks.1...`: checkpoints and Hugging Face key maps still address each
  layer), so the blocks' states are stacked at call time: this costs one stacked copy of the
  local parameter shards per call (per train step; their gradients are unstacked back), and it
  is why decoding is not scanned: it would pay that copy for every generated token.
  """
  if remat not in REMAT:
    raise UserError(f"Unknown model.remat {remat!r}: use one of {sorted(REMAT)}.")
  if scan and cache is None and len(blocks) > 1:
    return _scan_blocks(blocks, x, remat=remat, kwargs=kwargs), None
  new_cache = []
  for i, block in enumerate(blocks):
    layer_cache = None if cache is None else cache[i]
    if remat == "none" or cache is not None:
      x, layer_cache = block(x, cache=layer_cache, **kwargs)
    else:
      x = _remat_block(block, x, remat=remat, kwargs=kwargs)
    new_cache.append(layer_cache)
  return x, new_cache


def _remat_block(block, x, *, remat: str, kwargs: dict):
  # A pure function of the block's state, as in the scan body: nnx.remat writes the state back
  # into the block's Variables, which fails when some of them come from an outer trace (the
  # frozen base weights of a LoRA run).
  graphdef, state = nnx.split(block)

  def call(state, x):
    return nnx.merge(graphdef, state)(x, cache=None, **kwargs)[0]

  return jax.checkpoint(call, policy=REMAT[remat])(state, x)


def _scan_blocks(blocks, x, *, remat: str, kwargs: dict):
  splits = [nnx.split(block) for block in blocks]
  graphdef = splits[0][0]
  if any(g != graphdef for g, _ in splits[1:]):
    raise UserError(
      "model.scan needs every block to have the same structure; set model.scan=False."
    )
  # [L, ...] per leaf; inside shard_map these are the local shards, stacked on this device only.
  stacked = jax.tree.map(lambda *leaves: jnp.stack(leaves), *(state for _, state in splits))

  def body(x, state):
    x, _ = nnx.merge(graphdef, state)(x, cache=None, **kwargs)
    return x, None

  if remat != "none":
    # The scan body is the rematerialised unit, as each block is without scan. No CSE barrier
    # is needed inside a loop body (jax.checkpoint's documentation).
    body = jax.checkpoint(body, policy=REMAT[remat], prevent_cse=False)
  return jax.lax.scan(body, x, stacked)[0]
