"""Memory levers shared by every family: rematerialisation of each block in the backward pass,
and scanning over the layers.

(Gradient accumulation lives in the trainer, `train.micro_batches`; bf16 compute with fp32
master weights is `model.dtype` vs `model.param_dtype`.)
"""

import jax
import jax.numpy as jnp
from flax import nnx

from nnx_zoo.common.errors import UserError
from nnx_zoo.common.nn import aux

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


def run_blocks(
  blocks,
  x,
  *,
  cache=None,
  remat: str = "none",
  scan: bool = False,
  period: int = 1,
  per_slot: list[dict] | None = None,
  **kwargs,
):
  """x through each block in turn: `block(x, cache=..., **kwargs) -> (x, cache)`; returns x and
  the list of updated caches. With a cache (decoding) nothing is rematerialised or scanned.

  `period` and `per_slot`: the layers repeat a pattern of `period` kinds (Gemma 2: local, global),
  and layer i gets `per_slot[i % period]` on top of `kwargs` (its kind's position encoding).

  `scan`: one body, compiled once and run by `jax.lax.scan` over the repetitions of the pattern
  (one layer when there is no pattern; layers past the last whole repetition run after it),
  instead of L copies of it. Under FSDP each layer's all-gather then sits inside the loop body;
  with a remat policy the backward pass gathers again in its loop, so about one repetition's
  weights are gathered at a time (without remat the scan saves every layer's gathered weights
  for the backward pass, as the unscanned model does: bench/fsdp_gathers.py). The parameter tree
  is unchanged (`blocks.0...`, `blocks.1...`: checkpoints and Hugging Face key maps still address
  each layer), so the blocks' states are stacked at call time: this costs one stacked copy of
  the local parameter shards per call (per train step; their gradients are unstacked back), and
  it is why decoding is not scanned: it would pay that copy for every generated token.

  Auxiliary losses the blocks add (common/nn/aux.py) leave a scan or remat body as its outputs.
  """
  if remat not in REMAT:
    raise UserError(f"Unknown model.remat {remat!r}: use one of {sorted(REMAT)}.")

  def layer_kwargs(i: int) -> dict:
    return kwargs if per_slot is None else {**kwargs, **per_slot[i % period]}

  reps = len(blocks) // period
  if scan and cache is None and reps > 1:
    scanned = reps * period
    x = _scan_blocks(blocks[:scanned], x, period=period, remat=remat, layer_kwargs=layer_kwargs)
    for i in range(scanned, len(blocks)):
      x = _remat_block(blocks[i], x, remat=remat, kwargs=layer_kwargs(i))
    return x, None
  new_cache = []
  for i, block in enumerate(blocks):
    layer_cache = None if cache is None else cache[i]
    if remat == "none" or cache is not None:
      x, layer_cache = block(x, cache=layer_cache, **layer_kwargs(i))
    else:
      x = _remat_block(block, x, remat=remat, kwargs=layer_kwargs(i))
    new_cache.append(layer_cache)
  return x, new_cache


def _collecting_call(fn):
  """fn(...) -> (x, what it added to the aux channel as arrays), with the names' weights kept
  aside: the traced values leave the body as outputs, never as leaked tracers."""
  weights = {}

  def call(*args):
    with aux.collect() as entries:
      x = fn(*args)
    weights.update(aux.weights(entries))
    return x, aux.as_arrays(entries)

  return call, weights


def _remat_block(block, x, *, remat: str, kwargs: dict):
  # A pure function of the block's state, as in the scan body: nnx.remat writes the state back
  # into the block's Variables, which fails when some of them come from an outer trace (the
  # frozen base weights of a LoRA run).
  graphdef, state = nnx.split(block)

  def call(state, x):
    return nnx.merge(graphdef, state)(x, cache=None, **kwargs)[0]

  call, weights = _collecting_call(call)
  if remat != "none":
    call = jax.checkpoint(call, policy=REMAT[remat])
  x, added = call(state, x)
  aux.add_collected(added, weights)
  return x


def _scan_blocks(blocks, x, *, period: int, remat: str, layer_kwargs):
  splits = [nnx.split(block) for block in blocks]
  graphdefs = [splits[j][0] for j in range(period)]
  if any(g != graphdefs[i % period] for i, (g, _) in enumerate(splits)):
    raise UserError(
      "model.scan needs every repetition of the layer pattern to have the same structure; set "
      "model.scan=False."
    )
  # One stack per slot of the pattern, [repetitions, ...] per leaf; inside shard_map these are
  # the local shards, stacked on this device only.
  stacked = tuple(
    jax.tree.map(lambda *leaves: jnp.stack(leaves), *(s for _, s in splits[j::period]))
    for j in range(period)
  )

  def body(x, states):
    for j, state in enumerate(states):
      x, _ = nnx.merge(graphdefs[j], state)(x, cache=None, **layer_kwargs(j))
    return x

  body, weights = _collecting_call(body)
  if remat != "none":
    # The scan body is the rematerialised unit, as each block is without scan. No CSE barrier
    # is needed inside a loop body (jax.checkpoint's documentation).
    body = jax.checkpoint(body, policy=REMAT[remat], prevent_cse=False)
  x, added = jax.lax.scan(body, x, stacked)
  aux.add_collected(added, weights)  # summed over the repetitions
  return x
