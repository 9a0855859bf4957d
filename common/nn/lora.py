"""LoRA: low-rank adapters on chosen projections, with the base weights frozen.

A LoRA projection computes `x @ W + (alpha / rank) * (x @ A) @ B`, with `A` [in, rank] random and
`B` [rank, out] zero at the start, so a fresh adapter changes nothing. Which projections get one
is a config value (`model.lora.targets`: patterns on the module path, e.g. "attn.q,attn.v" or
"mlp.*"), applied to any family after it is built (`nnx_zoo.common.models.build`); the family's
`model.py` never mentions LoRA. With `model.lora.rank > 0` the trainer updates only the adapter
weights (and the parameters `model.lora.train` names, e.g. a new classifier head): the optimizer
holds no state for the rest and no gradient is computed for it. `merge` folds the adapters into
the base weights, which is what `zoo export hf` writes. `model.lora.base_quant` stores the frozen
base of the blocks' Linears quantized (QLoRA, common/nn/qlora.py); `merge` then folds the
adapters into the dequantized base.
"""

import fnmatch

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from flax import nnx

from nnx_zoo.common import parallel
from nnx_zoo.common.errors import UserError
from nnx_zoo.common.nn import keys, qlora, stacking
from nnx_zoo.common.nn.linear import Linear


class LoRAParam(nnx.Param):
  """An adapter weight: the only kind of parameter a LoRA run trains (with `lora.train`)."""


def config(
  rank: int = 0,
  alpha: float = 16.0,
  targets: str = "attn.q,attn.v",
  train: str = "",
  base_quant: str = "",
  frozen_dtype: str = "",
) -> ml_collections.ConfigDict:
  """A `model.lora` sub-config. rank=0: no adapters, every parameter trains. targets: comma-
  separated patterns matched against the end of each Linear's dotted path (`blocks.3.attn.q`);
  train: patterns of other parameters that still train (e.g. "head.*"); base_quant: "" (the
  frozen base in param_dtype), "int8", "int4" or "nf4" (QLoRA, common/nn/qlora.py);
  frozen_dtype: under base_quant, the dtype of the frozen embeddings and heads outside the
  blocks ("": bfloat16; "float32"; "param_dtype", as a run saved before the key; see
  `qlora.frozen_dtype`)."""
  return ml_collections.ConfigDict(
    {
      "rank": rank,
      "alpha": alpha,
      "targets": targets,
      "train": train,
      "base_quant": base_quant,
      "frozen_dtype": frozen_dtype,
    }
  )


def patterns(value: str) -> list[str]:
  """A config's comma-separated patterns (`model.lora.targets`, `init_reinit`...) as a list."""
  return [p.strip() for p in value.split(",") if p.strip()]


def matches(path: str, patterns: list[str]) -> bool:
  """Does a dotted path end with one of the glob patterns (`attn.q` matches `blocks.0.attn.q`)?"""
  return any(fnmatch.fnmatch(path, p) or fnmatch.fnmatch(path, "*." + p) for p in patterns)


class LoRA(nnx.Module):
  """The adapter of one projection with kernel axes `axes`: (x @ A) @ B * alpha / rank. `key`
  draws A (else the next key of `rngs`)."""

  def __init__(
    self, in_features, out_features, *, rank, alpha, axes, dtype, param_dtype, rngs, key=None
  ):
    self.scale, self.axes, self.dtype = alpha / rank, axes, dtype
    # A as a Kaiming-uniform init of a [in, rank] kernel (as PEFT); B zero.
    self.a = LoRAParam(
      nnx.initializers.kaiming_uniform()(
        rngs.params() if key is None else key, (in_features, rank), param_dtype
      ),
      axes=(axes[0], None),
    )
    self.b = LoRAParam(jnp.zeros((rank, out_features), param_dtype), axes=(None, axes[1]))

  def __call__(self, x_MD: jax.Array) -> jax.Array:
    """The adapter's addition to the projection of 2-D x (the input dim may be split over
    tensor, as the base kernel's: then x @ A is summed over it)."""
    a = parallel.gather(self.a[...], self.a.axes).astype(self.dtype)
    b = parallel.gather(self.b[...], self.b.axes).astype(self.dtype)
    h = parallel.reduce(jnp.dot(x_MD.astype(self.dtype), a), self.axes[0])
    return jnp.dot(h, b) * self.scale


def _linears(model: nnx.Module):
  for path, node in nnx.iter_graph(model):
    if isinstance(node, Linear):
      yield ".".join(map(str, path)), node


def _per_layer(model: nnx.Module) -> dict[str, tuple[Linear, int | None]]:
  """Each Linear by its path one tree per layer (`blocks.3.attn.q`, whatever `model.scan`
  stores), with, for a Linear whose weights are stacked over the layers, the layer's index in
  the stack; in the order of the unscanned model's Linears (nnx's: attributes sorted)."""
  stand_ins, linears = [], []
  for path, lin in _linears(model):
    kernel = lin.kernel
    stacked = (getattr(kernel, "axes", None) or (None,))[0] == parallel.LAYERS
    # What `unstack_layers` moves as it would the kernel: (which Linear, which layer) per layer.
    ids = np.empty(kernel.shape[0] if stacked else (), object)
    for r in np.ndindex(ids.shape):
      ids[r] = (len(linears), r[0] if stacked else None)
    stand_ins.append((tuple(stacking.path_key(p) for p in path.split(".")) + ("kernel",), ids))
    linears.append(lin)
  flat = nnx.to_flat_state(stacking.unstack_layers(nnx.from_flat_state(stand_ins)))
  out = {}
  for k, ids in sorted(flat, key=lambda kv: kv[0]):
    n, r = ids[()] if isinstance(ids, np.ndarray) else ids
    out[".".join(map(str, k[:-1]))] = (linears[n], r)
  return out


def apply(model: nnx.Module, cfg, *, seed: int = 0) -> nnx.Module:
  """Adds an adapter to every Linear of `model` whose path (one tree per layer: `blocks.3.attn.q`
  also where `model.scan` stores the layers stacked) matches `cfg.targets`. The adapters of a
  stacked Linear are stacked too, with the values the unscanned model's adapters get."""
  if not cfg.rank:
    return model
  if cfg.rank < 0:
    raise UserError(f"model.lora.rank={cfg.rank} must be positive (0: no LoRA).")
  targets = patterns(cfg.targets)
  linears = _per_layer(model)
  chosen = {path: lin for path, lin in linears.items() if matches(path, targets)}
  if not chosen:
    names = sorted({p.split(".", 2)[-1] if p.startswith("blocks.") else p for p in linears})
    raise UserError(
      f"model.lora.targets={cfg.targets!r} matches no projection of this model. Its "
      f"projections (per block): {', '.join(names)}."
    )
  rngs = keys.Keys(seed + 1_000_003)  # its own stream: the base weights are those without LoRA
  adapters = {}  # Linear -> its adapters, one per layer of a stacked Linear
  for lin, r in chosen.values():  # one key each, in the unscanned model's order
    adapter = LoRA(
      lin.in_features,
      lin.out_features,
      rank=cfg.rank,
      alpha=cfg.alpha,
      axes=lin.axes,
      dtype=lin.dtype,
      # Over a quantized base (QLoRA) the adapters stay fp32, whatever param_dtype is.
      param_dtype=jnp.float32 if cfg.base_quant else lin.kernel[...].dtype,
      rngs=rngs,
    )
    adapters.setdefault(id(lin), (lin, {}))[1][r] = adapter
  for lin, by_layer in adapters.values():
    if None in by_layer:
      lin.lora = by_layer[None]
    elif len(by_layer) != lin.kernel.shape[0]:
      raise UserError(
        f"model.lora.targets={cfg.targets!r} names some layers only of a projection that "
        "model.scan stores stacked over the layers: target it in every layer, or set "
        "model.scan=False."
      )
    else:
      lin.lora = stacking.stack_modules([by_layer[r] for r in sorted(by_layer)])
  return model


def trainable(cfg):
  """The nnx filter of the parameters a run trains: all of them, or with LoRA the adapters and
  what `model.lora.train` names."""
  lora = cfg.lora
  if not lora.rank:
    return nnx.Param
  also = patterns(lora.train)

  def is_trained(path, x):
    return isinstance(x, LoRAParam) or (
      isinstance(x, nnx.Param)
      and not isinstance(x, qlora.QuantizedBase)  # a quantized base never trains
      and matches(".".join(map(str, path)), also)
    )

  return is_trained


def merge(model: nnx.Module) -> nnx.Module:
  """Folds each adapter into its base kernel (W += A @ B * scale) and removes it, in place. A
  quantized base (QLoRA) is dequantized first, to the dtype of its scales (param_dtype): the
  merged kernel is that dequantized base plus the adapter's product."""
  for _, lin in _linears(model):
    if lin.base_quant:
      scale = lin.kernel_scale[...]
      base = qlora.dequantize(lin.kernel[...], scale, kind=lin.base_quant, dtype=scale.dtype)
      lin.kernel = nnx.Param(base, axes=getattr(lin.kernel, "axes", None))
      lin.kernel_scale, lin.base_quant = nnx.data(None), ""
    if lin.lora is not None:
      delta = (lin.lora.a[...] @ lin.lora.b[...]) * lin.lora.scale
      lin.kernel[...] = (lin.kernel[...] + delta).astype(lin.kernel[...].dtype)
      lin.lora = nnx.data(None)
  return model
