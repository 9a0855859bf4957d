"""Memory levers shared by every family: rematerialisation of each block in the backward pass,
and scanning over the layers.

(Gradient accumulation lives in the trainer, `train.micro_batches`, which a scan with
remat="full" joins by adding each micro-batch's gradients in its own backward loop:
common/nn/accumulate.py; bf16 compute with fp32 master weights is `model.dtype` vs
`model.param_dtype`; the stacked layout a scan reads, and its conversions:
common/nn/stacking.py.)
"""

import jax
import jax.numpy as jnp
from flax import nnx

from nnx_zoo.common.errors import UserError
from nnx_zoo.common.nn import accumulate, aux, noise, pipeline, stacking

# none: keep every activation; full: keep only each block's input and recompute the rest;
# save_dots: keep the matmul outputs (cheap to store, dear to recompute), recompute the rest.
REMAT = {
  "none": None,
  "full": jax.checkpoint_policies.nothing_saveable,
  "save_dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}

# Config keys that change how a model is computed, not what it is (nor its parameters' values): a
# run resumes, and a checkpoint loads, whatever they were when it was saved (or if it predates
# them). model.scan stores the layers stacked: checkpoints convert at restore (`stacking.relayout`).
# model.pipeline_repeats only orders the stages' work (common/nn/pipeline.py).
LEVERS = ("model.remat", "model.scan", "model.pipeline_repeats")


def run_blocks(
  blocks,
  x,
  *,
  cache=None,
  remat: str = "none",
  period: int = 1,
  per_slot: list[dict] | None = None,
  stacked=None,
  path: tuple = (),
  **kwargs,
):
  """x through each block in turn: `block(x, cache=..., **kwargs) -> (x, cache)`; returns x and
  the list of updated caches. With a cache (decoding) nothing is rematerialised or scanned.

  `period` and `per_slot`: the layers repeat a pattern of `period` kinds (Gemma 2: local, global),
  and layer i gets `per_slot[i % period]` on top of `kwargs` (its kind's position encoding).

  `stacked` (`model.scan`): the scanned layers stored stacked, one module per slot of the pattern
  whose parameters are [repetitions, ...] (`stacking.stack_blocks`); `blocks` are then the layers
  past the last whole repetition. One body, compiled once, is run by `jax.lax.scan` over the
  repetitions of the pattern (one layer when there is no pattern), reading each repetition's
  slice of the stacked parameters, instead of L copies of it. Under FSDP each layer's
  all-gather then sits inside the loop body; with a remat policy the backward pass gathers again
  in its loop, so about one repetition's weights are gathered at a time (without remat the scan
  saves every layer's gathered weights for the backward pass, as the unscanned model does:
  bench/fsdp_gathers.py). The parameters are stored stacked, so no call copies them into a stack
  (before, a call stacked the per-layer states: one stacked copy of the local parameter shards,
  their casts and their stacked gradients per step: bench/scan_growth.py). Decoding runs layer by
  layer on slices of the stacks (`stacking.layer`). `path`: where the stack sits in its model's
  state, which names its parameters' running gradient sums (common/nn/accumulate.py).

  Auxiliary losses the blocks add (common/nn/aux.py) leave a scan or remat body as its outputs.
  """
  if remat not in REMAT:
    raise UserError(f"Unknown model.remat {remat!r}: use one of {sorted(REMAT)}.")
  if stacked is None and cache is None and pipeline.active():
    raise UserError("mesh.pipeline splits the stacked layers of model.scan: set model.scan=True.")

  def layer_kwargs(i: int) -> dict:
    return kwargs if per_slot is None else {**kwargs, **per_slot[i % period]}

  # Training noise (common/nn/noise.py): one stream for this stack, each layer its own draws.
  stream = noise.stack()
  if stacked is not None:
    scanned = stacking.num_stacked(stacked) * period
    num_layers = scanned + len(blocks)
    if cache is None and pipeline.active():  # the stacked layers in stages (mesh.pipeline)
      x = pipeline.run(
        stacked,
        x,
        rest=blocks,
        # Each iteration of the schedule is rematerialised (its input kept) whatever the policy.
        policy=REMAT[remat] or REMAT["full"],
        period=period,
        per_slot=per_slot,
        stream=stream,
        kwargs=kwargs,
      )
      return x, None
    if cache is None:
      x = _scan_blocks(
        stacked,
        x,
        path=path,
        remat=remat,
        layer_kwargs=layer_kwargs,
        stream=stream,
        num_layers=num_layers,
      )
      for k, block in enumerate(blocks):
        with noise.layer(stream, scanned + k, num_layers):
          x = _remat_block(block, x, remat=remat, kwargs=layer_kwargs(scanned + k))
      return x, None
    layers = [stacking.layer(stacked, blocks, i) for i in range(num_layers)]
  else:
    layers = list(blocks)
  new_cache = []
  for i, block in enumerate(layers):
    layer_cache = None if cache is None else cache[i]
    with noise.layer(stream, i, len(layers)):
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


def _scan_blocks(
  stacked, x, *, path: tuple, remat: str, layer_kwargs, stream: int | None, num_layers: int
):
  splits = [nnx.split(slot) for slot in stacked]
  graphdefs = [g for g, _ in splits]
  # One stack per slot of the pattern, [repetitions, ...] per leaf, as stored; inside shard_map
  # these are the local shards. The scan hands the body one repetition's slice of each, and the
  # repetition's index r (layer r * period + j draws its noise as that layer).
  states = tuple(s for _, s in splits)

  def body(x, r, states):
    for j, state in enumerate(states):
      block = nnx.merge(graphdefs[j], stacking.layer_state(state))
      with noise.layer(stream, r * len(states) + j, num_layers):
        x, _ = block(x, cache=None, **layer_kwargs(j))
    return x

  body, weights = _collecting_call(body)
  sums = accumulate.sums_of(path, states) if remat == "full" else None
  if sums is not None:  # the layers add their gradients into the running sums themselves
    x, added = accumulate.scan(body, x, states, sums)
  else:
    if remat != "none":
      # The scan body is the rematerialised unit, as each block is without scan. No CSE barrier
      # is needed inside a loop body (jax.checkpoint's documentation).
      body = jax.checkpoint(body, policy=REMAT[remat], prevent_cse=False)
    reps = jnp.arange(stacking.num_stacked(stacked))
    x, added = jax.lax.scan(lambda x, xs: body(x, *xs), x, (reps, states))
  aux.add_collected(added, weights)  # summed over the repetitions
  return x
