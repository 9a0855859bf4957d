"""Data, FSDP, expert, context and tensor parallelism under `jax.shard_map`, as seen by the
shared layers.

Every parameter carries logical axis names (`axes=("D", "F")`, the legend in docs/DESIGN.md). RULES
map them to mesh axes: by default a model dim D is stored sharded over `fsdp`, and heads, MLP
features and vocab (NH, KH, F, V) are split over `tensor`. Inside the sharded train step the
shared layers call the three functions below, which are no-ops outside it, so a family's model
never knows how it is sharded:

- `gather(w, axes)`: all-gather the fsdp-sharded dims of a weight inside the layer that uses it
  (the transpose in the backward pass reduce-scatters its gradient). One layer at a time only
  with `model.scan` and a `model.remat` policy: unscanned, XLA:CPU schedules every gather at the
  start of the step and keeps the weights for the backward pass (bench/fsdp_gathers.py);
- `reduce(y, in_axis)`: psum a row-parallel projection's partial output over `tensor`;
- `vocab_offset()` / `psum_tensor`: vocab-parallel embedding lookup and cross-entropy;
- `context_split()`, `token_index`, `gather_context`: context parallelism. `mesh.context` splits
  the sequence of a language model's rows: each device of a row's context group holds
  T / context of its tokens (and so of every activation), in the balanced order of
  `context_order` (two chunks a device, one from each end, so a causal mask gives every device
  the same work); attention gathers the keys and values of the whole row over `context` and
  masks by each token's index in the row (common/nn/attention.py). Weights are stored split over
  `context` as over `fsdp` (a D dim), so the context devices do not hold copies of the state.

Gradients of replicated parameters are summed over the batch axes by shard_map's own
autodiff (varying-axis typing), which is why the step runs with `check_vma=True`.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from nnx_zoo.common import step_context
from nnx_zoo.common.errors import UserError
from nnx_zoo.common.mesh import AXES
from nnx_zoo.kernels import vma

# Logical axis -> mesh axis, or axes: a model dim D is stored sharded over `fsdp` and, in a
# weight that has no experts dim, over `expert` too (as MaxText's rules do: with expert
# parallelism the attention and embedding weights are not kept whole on every expert shard; an
# expert weight's E takes the `expert` axis, its D keeps `fsdp`). 1-D parameters named D (norm
# scales, output biases) stay replicated on purpose: they are a few KB and every device needs
# them whole.
RULES = {
  "D": ("fsdp", "expert", "context"),
  "F": "tensor",
  "NH": "tensor",
  "KH": "tensor",
  "V": "tensor",
  "E": "expert",  # an MoE layer's experts
}
# The leading dim of a stacked parameter (model.scan, common/nn/stacking.py): split over
# `pipeline` (each stage holds its layers), no mesh axis without one.
LAYERS = "L"
PIPELINE = "pipeline"
# The batch's rows are split over every axis but context and tensor (expert too: each device
# routes its own tokens); the tokens of a language model's rows over context as well.
BATCH_AXES = ("data", "fsdp", "expert")
TOKEN_AXES = (*BATCH_AXES, "context")


@dataclasses.dataclass(frozen=True)
class Layout:
  """A mesh and the rules that place parameters and batches on it."""

  mesh: jax.sharding.Mesh
  rules: dict
  # mesh.pipeline > 1 (common/nn/pipeline.py): `model.pipeline_repeats` and
  # `train.pipeline_microbatches` (0: 2 x stages); `gathered`: inside a stage, whose weights
  # were gathered before its loop, `gather` has nothing left to do.
  pipeline_repeats: int = 1
  pipeline_microbatches: int = 0
  gathered: bool = False

  @property
  def sizes(self) -> dict[str, int]:
    return dict(zip(self.mesh.axis_names, self.mesh.devices.shape, strict=True))

  def axis_of(self, logical: str | None) -> str | None:
    """The one mesh axis (of size > 1) a logical axis maps to first, or None."""
    axes = self.mesh_axes(logical)
    return axes[0] if axes else None

  def rule(self, logical: str | None) -> tuple[str, ...]:
    """The mesh axes RULES name for a logical axis, whatever their sizes."""
    rule = self.rules.get(logical) if logical else None
    return (rule,) if isinstance(rule, str) else tuple(rule or ())

  def mesh_axes(self, logical: str | None, taken=()) -> tuple[str, ...]:
    """The mesh axes (of size > 1, not in `taken`) a logical axis is split over, major first."""
    return tuple(a for a in self.rule(logical) if self.sizes[a] > 1 and a not in taken)

  def stored_sharded(self, logical: str | None) -> bool:
    """Whether a logical axis is stored split over `fsdp` and gathered whole where used (D)."""
    return "fsdp" in self.rule(logical)

  def dim_axes(self, axes) -> list[tuple[str, ...]]:
    """The mesh axes of each dim of a weight with logical `axes`: a dim whose rule names one
    mesh axis claims it first (E -> expert), the dims with several take what is left, so no
    mesh axis splits two dims."""
    single = {a: self.mesh_axes(a) for a in axes if isinstance(self.rules.get(a), str)}
    taken = {m for ms in single.values() for m in ms}
    return [single[a] if a in single else self.mesh_axes(a, taken) for a in axes]

  def param_spec(self, variable) -> P:
    axes = getattr(variable, "axes", None) or (None,) * variable.ndim
    if axes[:1] == (LAYERS,):  # stacked layers (model.scan): each layer placed as unstacked
      stages = PIPELINE if self.sizes.get(PIPELINE, 1) > 1 else None
      return P(stages, *self._spec(axes[1:], variable.ndim - 1))
    return self._spec(axes, variable.ndim)

  def _spec(self, axes, ndim: int) -> P:
    if ndim == 1 and self.stored_sharded(axes[0]):
      return P(None)
    return P(*(ms[0] if len(ms) == 1 else ms or None for ms in self.dim_axes(axes)))

  def param_specs(self, params):
    """The same tree as `params` (Variables kept, so it is a full tree, not a prefix) with a
    PartitionSpec in place of each array."""

    def spec(x):
      return x.replace(self.param_spec(x)) if isinstance(x, nnx.Variable) else self.param_spec(x)

    return jax.tree.map(spec, params, is_leaf=lambda x: isinstance(x, nnx.Variable))

  def shardings(self, specs):
    return jax.tree.map(lambda s: NamedSharding(self.mesh, s), specs)

  @property
  def batch_spec(self) -> P:
    return P(BATCH_AXES)

  @property
  def token_spec(self) -> P:
    """[B, T] arrays of a language model's rows: rows over the batch axes, tokens over context
    (in `context_order`)."""
    return P(BATCH_AXES, "context")


def placement(tree, layout: "Layout | None"):
  """The sharding of each leaf of a params (or train state) tree as the train step places it:
  on `layout`'s mesh by each parameter's axes, or with no mesh all on the default device."""
  if layout is None:
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    return jax.tree.map(lambda _: device, tree)
  return layout.shardings(layout.param_specs(tree))


def make_layout(
  sizes: dict[str, int], devices=None, *, pipeline_repeats: int = 1, pipeline_microbatches: int = 0
) -> Layout:
  devices = np.asarray(devices if devices is not None else jax.devices())
  shape = tuple(sizes.get(a, 1) for a in AXES)
  mesh = jax.sharding.Mesh(devices.reshape(shape), AXES)
  return Layout(mesh, dict(RULES), pipeline_repeats, pipeline_microbatches)


def experiment_layout(cfg, sizes: dict[str, int], devices=None) -> Layout:
  """`make_layout` with the pipeline settings of an experiment's config."""
  return make_layout(
    sizes,
    devices,
    pipeline_repeats=int(cfg.model.get("pipeline_repeats", 1)),
    pipeline_microbatches=int(cfg.train.get("pipeline_microbatches", 0)),
  )


def process_block(layout: Layout, spec: P, shape: tuple[int, ...]) -> tuple[slice, ...]:
  """The block of a global array of `shape` split as `spec` that this process's devices hold:
  what the process feeds of it (`jax.make_array_from_process_local_data`). Processes whose
  devices hold the same rows (a row split over `context` or `tensor` across hosts) get the same
  rows."""
  indices = NamedSharding(layout.mesh, spec).addressable_devices_indices_map(tuple(shape))
  block = []
  for dim, n in enumerate(shape):
    spans = {
      (i[dim].start or 0, n if i[dim].stop is None else i[dim].stop) for i in indices.values()
    }
    lo, hi = min(s for s, _ in spans), max(e for _, e in spans)
    if sum(e - s for s, e in spans) != hi - lo:
      raise ValueError(
        f"This process's devices hold pieces {sorted(spans)} of dim {dim} of an array split as "
        f"{spec} over {layout.sizes}, not one block: order the mesh's devices by process."
      )
    block.append(slice(lo, hi))
  return tuple(block)


def process_rows(layout: Layout | None, batch_size: int) -> slice | None:
  """The rows of a global batch of `batch_size` that this process's devices hold (None without
  a mesh: the one device holds them all)."""
  return None if layout is None else process_block(layout, layout.batch_spec, (batch_size,))[0]


def check_fits(
  model_cfg,
  sizes: dict[str, int],
  batch_size: int,
  micro_batches: int = 1,
  seq_len: int = 0,
  eval_batch_size: int = 0,
):
  """The errors a mesh can cause, named before anything compiles (`seq_len`: the rows' length
  that `mesh.context` splits; `eval_batch_size`: the held-out batch's, 0 for the train batch's)."""
  if "attention" not in model_cfg:  # a model of several stacks (CLIP's towers): each one
    for sub in model_cfg.values():
      if hasattr(sub, "get") and "attention" in sub:
        check_fits(sub, sizes, batch_size, micro_batches, seq_len, eval_batch_size)
    return
  t = sizes["tensor"]
  row_shards = sizes["data"] * sizes["fsdp"] * sizes.get("expert", 1)
  batch_shards = row_shards * micro_batches
  att = model_cfg.attention
  problems = []
  experts = model_cfg.mlp.num_experts if model_cfg.mlp.kind == "moe" else 0
  if sizes.get("expert", 1) > 1 and experts % sizes["expert"]:
    problems.append(
      f"model.mlp.num_experts={experts} is not divisible by expert={sizes['expert']}"
      + ("" if experts else " (the model has no experts: keep mesh.expert=1)")
    )
  if att.num_heads % t:
    problems.append(f"model.attention.num_heads={att.num_heads} is not divisible by tensor={t}")
  if att.num_kv_heads % t:
    problems.append(
      f"model.attention.num_kv_heads={att.num_kv_heads} is not divisible by tensor={t}"
    )
  if model_cfg.vocab_size % t:
    problems.append(f"model.vocab_size={model_cfg.vocab_size} is not divisible by tensor={t}")
  if batch_size % batch_shards:
    problems.append(
      f"train.batch_size={batch_size} is not divisible by data x fsdp x expert x "
      f"train.micro_batches = {batch_shards}"
    )
  if eval_batch_size % row_shards:
    problems.append(
      f"train.eval_batch_size={eval_batch_size} is not divisible by data x fsdp x expert = "
      f"{row_shards} (give a multiple of it, or 0: train.batch_size)"
    )
  context = sizes.get("context", 1)
  if context > 1 and (not seq_len or seq_len % (2 * context)):
    problems.append(
      f"data.seq_len={seq_len} does not split into 2 x context = {2 * context} equal chunks"
      + ("" if seq_len else " (this data has no token rows to split: keep mesh.context=1)")
    )
  if problems:
    raise UserError(
      f"The mesh {sizes} does not fit: "
      + "; ".join(problems)
      + ". Pick mesh sizes that divide these (or pad the vocab to a multiple of tensor)."
    )


def check_experiment(cfg, sizes: dict[str, int]):
  """`check_fits` and `check_pipeline` for an experiment's config: its model, batch,
  micro-batches and row length."""
  check_fits(
    cfg.model,
    sizes,
    cfg.train.batch_size,
    cfg.train.micro_batches,
    seq_len=cfg.data.get("seq_len", 0),
    eval_batch_size=cfg.train.get("eval_batch_size", 0),
  )
  check_pipeline(cfg, sizes)


# The pipeline axis: the stacked layers in stages (placed by common/nn/pipeline.py)


def pipeline_microbatches(train_cfg, stages: int) -> int:
  """`train.pipeline_microbatches`, 0 meaning 2 x stages."""
  return int(train_cfg.get("pipeline_microbatches", 0)) or 2 * stages


def check_pipeline(cfg, sizes: dict[str, int]):
  """A UserError for a pipeline the config cannot run: one line naming the counts and what to
  choose instead."""
  stages = sizes.get("pipeline", 1)
  if stages == 1:
    return
  m = cfg.model
  if "attention" not in m:
    raise UserError(
      f"mesh.pipeline={stages} splits one stack of layers: this model has several (its "
      f"{', '.join(k for k in m if hasattr(m[k], 'get') and 'attention' in m[k])}); set "
      "mesh.pipeline=1."
    )
  if "num_decoder_layers" in m:
    raise UserError(
      f"mesh.pipeline={stages} is refused for an encoder-decoder (two stacks, the decoder "
      "reading the encoder's output in every layer): set mesh.pipeline=1."
    )
  if sizes.get("context", 1) > 1:
    raise UserError(
      f"mesh.pipeline={stages} with mesh.context={sizes['context']} is refused (the stages "
      "would pass each row's token shards around both rings): set one of them to 1."
    )
  if not m.get("scan", False):
    raise UserError(
      f"mesh.pipeline={stages} splits the stacked layers of model.scan: set model.scan=True."
    )
  repeats = int(m.get("pipeline_repeats", 1))
  if repeats < 1:
    raise UserError(f"model.pipeline_repeats={repeats}: give a positive number of repeats.")
  period = len(m.get("layer_pattern", ())) or 1
  layers = m.num_layers
  reps = layers // period
  chunks = stages * repeats
  if layers % period or reps % chunks:
    fits = [s for s in range(2, reps // repeats + 1) if (reps // repeats) % s == 0]
    fits = fits if reps % repeats == 0 else []
    unit = period * chunks
    lower, upper = layers // unit * unit, -(-layers // unit) * unit
    nearest = sorted({n for n in (lower, upper) if n > 0})
    pattern = f" ({reps} repetitions of its {period}-layer pattern)" if period > 1 else ""
    raise UserError(
      f"mesh.pipeline={stages} x model.pipeline_repeats={repeats} = {chunks} chunks do not "
      f"split model.num_layers={layers}{pattern} evenly: choose mesh.pipeline from "
      f"{fits or 'none'} at this model.pipeline_repeats, or model.num_layers from {nearest}."
    )
  micro = pipeline_microbatches(cfg.train, stages)
  if micro < stages:
    raise UserError(
      f"train.pipeline_microbatches={micro} is fewer than mesh.pipeline={stages} stages: the "
      f"circular schedule needs at least one micro-batch a stage; set it to {stages} or more "
      f"(0: 2 x stages = {2 * stages})."
    )
  rows = cfg.train.batch_size // (
    sizes["data"] * sizes["fsdp"] * sizes.get("expert", 1) * cfg.train.micro_batches
  )
  if rows % micro:
    raise UserError(
      f"Each device's {rows} rows of a step (train.batch_size={cfg.train.batch_size} over data "
      f"x fsdp x expert x train.micro_batches) do not split into train.pipeline_microbatches="
      f"{micro}: choose a number of micro-batches that divides {rows}."
    )


# What the shared layers call. Outside a sharded step there is no layout and all are no-ops.


def active(layout: Layout | None):
  """Within it, the shared layers compute as a device of `layout` (the step context's)."""
  return step_context.entered(layout=layout)


def current_layout() -> Layout | None:
  """The layout of the sharded step being traced; None outside one."""
  return step_context.current().layout


def token_sum(tree):
  """The global sums of per-device sums over tokens (each array of `tree`): psum over the axes
  the batch's tokens are split over (the batch axes, and context where the rows are split:
  an array varies over those)."""
  return jax.tree.map(lambda x: jax.lax.psum(x, _token_axes_of(x)), tree)


def token_mean(tree):
  """`token_sum`'s means over the devices (each holding as many tokens)."""
  return jax.tree.map(lambda x: jax.lax.pmean(x, _token_axes_of(x)), tree)


def _token_axes_of(x) -> tuple[str, ...]:
  """TOKEN_AXES but context when `x` does not vary over it (images, or rows not split: each
  context device then computed the same value, and summing would count it context times)."""
  return tuple(a for a in TOKEN_AXES if a != "context" or a in varying(x))


def context_order(length: int, context: int) -> np.ndarray:
  """The order a row's `length` tokens are laid out in over `context` devices: cut into
  2 x context chunks, device c holds chunk c and chunk 2 x context - 1 - c, so under a causal
  mask each device has as many (query, key) pairs to compute as any other. Identity for one."""
  if context == 1:
    return np.arange(length)
  if length % (2 * context):
    raise UserError(
      f"A row of {length} tokens does not split into 2 x mesh.context = {2 * context} equal "
      f"chunks: set data.seq_len to a multiple of {2 * context}, or another mesh.context."
    )
  chunks = np.arange(length).reshape(2 * context, -1)
  return np.concatenate([np.concatenate([chunks[c], chunks[-1 - c]]) for c in range(context)])


def context_split() -> bool:
  """Whether the sharded step being traced splits the tokens of its rows over `context`."""
  layout = current_layout()
  return layout is not None and layout.sizes.get("context", 1) > 1


def token_index(local_length: int) -> jax.Array:
  """The index in its row of each of this device's `local_length` tokens [local_length]: its
  own slice of `context_order` (0..T-1 when the tokens are not split)."""
  if not context_split():
    return jnp.arange(local_length)
  context = current_layout().sizes["context"]
  order = jnp.asarray(context_order(local_length * context, context).reshape(context, -1))
  return order[jax.lax.axis_index("context")]


def row_index(local_length: int) -> jax.Array:
  """The index in its row of each token of the whole row as `gather_context` assembles it
  (`context_order` itself: a constant, no collective needed)."""
  context = context_size()
  return jnp.asarray(context_order(local_length * context, context))


def context_size() -> int:
  layout = current_layout()
  return 1 if layout is None else layout.sizes.get("context", 1)


def ring_shift(tree):
  """Each device's arrays to the next device of its context ring (the last to the first)."""
  n = context_size()
  return jax.tree.map(
    lambda x: jax.lax.ppermute(x, "context", [(i, (i + 1) % n) for i in range(n)]), tree
  )


def gather_context(x: jax.Array, axis: int = 1) -> jax.Array:
  """The whole row of a token-split array (in `context_order`; a no-op when not split)."""
  if not context_split():
    return x
  return jax.lax.all_gather(x, "context", axis=axis, tiled=True)


def gather(w: jax.Array, axes) -> jax.Array:
  """The whole of each fsdp-sharded dim of weight `w` (over `fsdp`, and `expert` where the
  weight has no experts dim); tensor-split dims and an expert weight's experts stay local."""
  layout = current_layout()
  if layout is None or w.ndim == 1 or layout.gathered:
    return w
  for dim, (name, split) in enumerate(zip(axes, layout.dim_axes(axes), strict=True)):
    if split and layout.stored_sharded(name):
      w = jax.lax.all_gather(w, split if len(split) > 1 else split[0], axis=dim, tiled=True)
  return w


def reduce(y: jax.Array, in_axis: str | None) -> jax.Array:
  """Sums a projection's partial outputs when its input dim is split over `tensor`."""
  layout = current_layout()
  if layout is None or layout.axis_of(in_axis) != "tensor":
    return y
  return jax.lax.psum(y, "tensor")


def tensor_split(name: str | None) -> bool:
  layout = current_layout()
  return layout is not None and layout.axis_of(name) == "tensor"


def tensor_index() -> jax.Array:
  return jax.lax.axis_index("tensor")


def psum_tensor(x: jax.Array) -> jax.Array:
  return jax.lax.psum(x, "tensor")


def pmax_tensor(x: jax.Array) -> jax.Array:
  return jax.lax.pmax(x, "tensor")


def local_heads(x_BN___: jax.Array, axis: int = 1) -> jax.Array:
  """This device's slice of a per-head array computed for all heads (e.g. ALiBi's bias)."""
  if not tensor_split("NH"):
    return x_BN___
  n_local = x_BN___.shape[axis] // current_layout().sizes["tensor"]
  return jax.lax.dynamic_slice_in_dim(x_BN___, tensor_index() * n_local, n_local, axis=axis)


def cross_entropy(logits_BTV: jax.Array, targets_BT: jax.Array) -> jax.Array:
  """Per-token cross-entropy [B, T]; with the vocab split over `tensor`, each device holds
  logits for its slice of the vocab and the softmax is assembled with two small collectives,
  never materialising the full [B, T, V] on one device."""
  logits = logits_BTV.astype(jnp.float32)
  if not tensor_split("V"):
    lse = jax.nn.logsumexp(logits, axis=-1)
    return lse - jnp.take_along_axis(logits, targets_BT[..., None], axis=-1)[..., 0]
  v_local = logits.shape[-1]
  local_targets = targets_BT - tensor_index() * v_local
  here = (local_targets >= 0) & (local_targets < v_local)
  m = jax.lax.stop_gradient(pmax_tensor(jnp.max(jax.lax.stop_gradient(logits), axis=-1)))
  sumexp = psum_tensor(jnp.sum(jnp.exp(logits - m[..., None]), axis=-1))
  picked = jnp.take_along_axis(logits, jnp.clip(local_targets, 0, v_local - 1)[..., None], -1)
  target_logit = psum_tensor(jnp.where(here, picked[..., 0], 0.0))
  return jnp.log(sumexp) + m - target_logit


# Varying-axis types by hand, for custom VJPs under shard_map(check_vma=True) (the chunked loss,
# the MoE grouped matmul, kernels/vma.py): what autodiff does for the implicit broadcasts, done
# explicitly. Defined beside the kernels, which import nothing of common/.
varying, to_varying, zeros_like, sum_to = vma.varying, vma.to_varying, vma.zeros_like, vma.sum_to
