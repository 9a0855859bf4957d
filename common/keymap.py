"""The vocabulary a family's `params.py` names its Hugging Face weights with: one `Rule` per HF
tensor (copied, transposed or split into zoo parameters, and back), and the config.json
translations several families share (RoPE parameters, layer-type patterns)."""

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp

from nnx_zoo.common.errors import UserError
from nnx_zoo.common.nn.patch import conv1d_from_kernel, conv_from_kernel, kernel_from_conv

# Key maps


@dataclasses.dataclass(frozen=True)
class Rule:
  """One HF tensor <-> the zoo parameters `zoo` (dotted paths). `to_zoo(x) -> tuple` and
  `to_hf(*xs) -> x` are jnp functions, inverse to each other, so that shapes are checked by
  tracing them abstractly before any tensor is read. `hf` may be a tuple of names (an MoE
  layer's per-expert tensors stacked into one parameter): then `to_zoo(*xs)` takes them all
  and `to_hf` returns a tuple."""

  hf: str | tuple[str, ...]
  zoo: tuple[str, ...]
  to_zoo: Callable
  to_hf: Callable


def hf_names(rule: Rule) -> tuple[str, ...]:
  return rule.hf if isinstance(rule.hf, tuple) else (rule.hf,)


def copy(hf: str, zoo: str) -> Rule:
  return Rule(hf, (zoo,), lambda x: (x,), lambda x: x)


def transpose(hf: str, zoo: str) -> Rule:
  """A torch Linear weight is [out, in]; our Linear kernel is [in, out]."""
  return Rule(hf, (zoo,), lambda x: (x.T,), lambda x: x.T)


def split(hf: str, zoo: tuple[str, ...]) -> Rule:
  """A fused tensor (GPT-2's c_attn) cut into equal parts along its last dim."""
  n = len(zoo)
  return Rule(
    hf, zoo, lambda x: tuple(jnp.split(x, n, axis=-1)), lambda *xs: jnp.concatenate(xs, axis=-1)
  )


def squeeze(hf: str, zoo: str, *, lead: int) -> Rule:
  """An HF tensor with `lead` leading dims of size 1 (ViT's cls_token [1, 1, D]) as the zoo
  parameter without them."""
  return Rule(
    hf, (zoo,), lambda x: (x.reshape(x.shape[lead:]),), lambda x: x.reshape((1,) * lead + x.shape)
  )


def patch_conv(hf: str, zoo: str, *, patch: int) -> Rule:
  """A patch embedding's Conv2d weight [D, C, p, p] as `PatchEmbed`'s kernel [C * p * p, D]."""
  return Rule(
    hf,
    (zoo,),
    lambda w: (kernel_from_conv(w),),
    lambda k: conv_from_kernel(k, patch=patch),
  )


def conv1d(hf: str, zoo: str, *, width: int) -> list[Rule]:
  """A torch Conv1d `hf` (.weight [D, C, w], .bias) as one convolution of a `ConvStem`, the
  Linear `zoo` (.kernel [C * w, D], .bias)."""
  return [
    Rule(
      f"{hf}.weight",
      (f"{zoo}.kernel",),
      lambda w: (kernel_from_conv(w),),
      lambda k: conv1d_from_kernel(k, width=width),
    ),
    copy(f"{hf}.bias", f"{zoo}.bias"),
  ]


def fixed(hf: str, value: Callable, *, what: str) -> Rule:
  """An HF tensor that is no zoo parameter because the zoo computes it (a fixed sinusoidal
  table, `value()`): written on export; on import checked to hold that value, and dropped."""

  def check(x):
    want = value()
    if x.shape != want.shape or not jnp.allclose(x.astype(jnp.float32), want, atol=1e-4):
      raise UserError(f"{hf} is not {what}, which the zoo computes instead of storing.")
    return ()

  return Rule(hf, (), check, value)


def tied(rules: list[Rule]) -> Rule:
  """One zoo parameter stored as equal copies under several HF names, each given by a rule of
  the same zoo parameter (diffusers' DiT keeps a copy of the timestep and class embedders in
  every block; its converted checkpoints hold the same tensors in each): read from the first,
  refused unless every copy equals it, and written to all."""
  (zoo,) = {r.zoo for r in rules}
  names = tuple(r.hf for r in rules)

  def to_zoo(*xs):
    first = rules[0].to_zoo(xs[0])
    concrete = not any(isinstance(x, jax.core.Tracer) for x in xs)
    if concrete and any(not bool(jnp.array_equal(x, xs[0])) for x in xs[1:]):
      raise UserError(
        f"{', '.join(names)} differ: the zoo keeps one copy of them ({', '.join(zoo)}), so only "
        "checkpoints whose copies are equal (as diffusers' converted DiT checkpoints) convert."
      )
    return first

  return Rule(names, zoo, to_zoo, lambda *z: tuple(r.to_hf(*z) for r in rules))


def stack_transposed(hf: tuple[str, ...], zoo: str) -> Rule:
  """Per-expert torch Linear weights [out, in] (one per name) as one [E, in, out] parameter."""
  n = len(hf)
  return Rule(
    tuple(hf),
    (zoo,),
    lambda *xs: (jnp.stack([x.T for x in xs]),),
    lambda w: tuple(w[e].T for e in range(n)),
  )


def experts_transposed(hf: str, zoo: str) -> Rule:
  """A fused per-expert tensor [E, out, in] (transformers' in-memory MoE layout) as [E, in, out]."""
  return Rule(hf, (zoo,), lambda x: (x.transpose(0, 2, 1),), lambda w: w.transpose(0, 2, 1))


def experts_gate_up(hf: str, zoo: tuple[str, str]) -> Rule:
  """A fused [E, 2F, D] gate-and-up tensor (gate rows first) as two [E, D, F] parameters."""
  return Rule(
    hf,
    zoo,
    lambda x: tuple(p.transpose(0, 2, 1) for p in jnp.split(x, 2, axis=1)),
    lambda g, u: jnp.concatenate([g.transpose(0, 2, 1), u.transpose(0, 2, 1)], axis=1),
  )


def linear(hf: str, zoo: str, *, bias: bool) -> list[Rule]:
  """A torch Linear `hf` (.weight, .bias) as our Linear `zoo` (.kernel, .bias)."""
  return [transpose(f"{hf}.weight", f"{zoo}.kernel")] + (
    [copy(f"{hf}.bias", f"{zoo}.bias")] if bias else []
  )


def attention(hf: str, zoo: str, att) -> list[Rule]:
  """A Llama-style attention (`{hf}.q_proj` ... `o_proj`, QK-norm `q_norm`/`k_norm`) as the
  shared Attention `zoo` with config `att` (its biases and QK-norm say which tensors exist)."""
  r = []
  for x in "qkv":
    bias = att.qkv_bias and (x != "k" or att.key_bias)
    r += linear(f"{hf}.{x}_proj", f"{zoo}.{x}", bias=bias)
  r += linear(f"{hf}.o_proj", f"{zoo}.o", bias=att.out_bias)
  if att.qk_norm != "none":
    r += [copy(f"{hf}.q_norm.weight", f"{zoo}.q_norm.scale")]
    r += [copy(f"{hf}.k_norm.weight", f"{zoo}.k_norm.scale")]
  return r


def gated_mlp(hf: str, zoo: str, *, bias: bool) -> list[Rule]:
  """A gated MLP (`{hf}.gate_proj`, `up_proj`, `down_proj`) as the shared dense MLP `zoo`."""
  r = []
  for theirs, ours in (("gate_proj", "gate"), ("up_proj", "up"), ("down_proj", "down")):
    r += linear(f"{hf}.{theirs}", f"{zoo}.{ours}", bias=bias)
  return r


def plain_transformer_activation(cfg, activations: dict, name: str) -> str:
  """HF's activation name for a GPT-2 or BERT model (learned positions, LayerNorm, plain
  multi-head attention, a dense MLP): a UserError for a config HF's class cannot express."""
  act = {ours: theirs for theirs, ours in reversed(activations.items())}.get(cfg.mlp.activation)
  att = cfg.attention
  if (
    act is None
    or cfg.mlp.kind != "dense"
    or cfg.position.kind != "learned"
    or cfg.norm.kind != "layer"
    or att.num_kv_heads != att.num_heads
    or att.window
    or att.qk_norm != "none"
  ):
    raise UserError(f"This model has settings HF's {name} does not have: export it as its family.")
  return act


# Shared translations of config.json fields


# HF rope_type -> the scaling fields we read (ours <- HF's).
ROPE_FIELDS = {
  "default": {},
  "linear": {"factor": "factor"},
  "llama3": {
    "factor": "factor",
    "low_freq_factor": "low_freq_factor",
    "high_freq_factor": "high_freq_factor",
    "original_max_len": "original_max_position_embeddings",
  },
  "yarn": {
    "factor": "factor",
    "original_max_len": "original_max_position_embeddings",
    "beta_fast": "beta_fast",
    "beta_slow": "beta_slow",
  },
}


def rope_from_hf(hf: dict, params: dict | None = None) -> tuple[float, dict]:
  """RoPE theta and our scaling config (the kwargs of `position.rope_scaling`) from a
  config.json's `rope_parameters` (transformers 5) or `rope_theta` + `rope_scaling` (4.x); or
  from `params`, one layer type's entry of a per-type `rope_parameters` (Gemma 3)."""
  if params is None:
    params = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
  params = dict(params)
  theta = params.pop("rope_theta", None) or hf.get("rope_theta") or 10_000.0
  kind = params.pop("rope_type", params.pop("type", "default"))
  if kind not in ROPE_FIELDS:
    raise UserError(f"RoPE type {kind!r} is not supported: use one of {sorted(ROPE_FIELDS)}.")
  if kind in ("llama3", "yarn"):
    params.setdefault("original_max_position_embeddings", hf.get("max_position_embeddings"))
  if kind == "yarn" and params.get("factor") is None:
    params["factor"] = hf["max_position_embeddings"] / params["original_max_position_embeddings"]
  scaling = {"kind": "none" if kind == "default" else kind}
  for ours, theirs in ROPE_FIELDS[kind].items():
    if params.get(theirs) is not None:
      scaling[ours] = params.pop(theirs)
  # Fields at their no-op values are fine; any other changes the frequencies.
  unused = {
    k: v
    for k, v in params.items()
    if v is not None
    and not (k == "partial_rotary_factor" and v == 1.0)
    and not (k == "truncate" and v is True)
  }
  if unused:
    raise UserError(f"RoPE fields {unused} ({kind}) are not supported.")
  return float(theta), scaling


def rope_to_hf(position_cfg) -> dict:
  """`rope_parameters` (rope_type, its scaling fields and rope_theta) of a RoPE position config."""
  scaling = position_cfg.scaling.to_dict()
  kind = scaling.pop("kind")
  rope = {"rope_type": "default" if kind == "none" else kind}
  for ours, theirs in ROPE_FIELDS[rope["rope_type"]].items():
    rope[theirs] = scaling[ours]
  return {"rope_theta": position_cfg.theta, **rope}


def require(hf: dict, keys, model_type: str):
  """A UserError naming the fields a config.json lacks."""
  missing = [k for k in keys if k not in hf]
  if missing:
    raise UserError(f"config.json ({model_type}) lacks {missing}.")


def layer_period(types: list) -> int:
  """The shortest period p with types[i] == types[i % p] for every layer (HF's `layer_types`
  as a repeating pattern; len(types) if it has none)."""
  n = len(types)
  return next(p for p in range(1, n + 1) if all(types[i] == types[i % p] for i in range(n)))


def forced_tokens(generation: dict) -> list[int | None]:
  """The tokens generation_config.json's `forced_decoder_ids` ([[position, id], ...]) force
  after the decoder's start token, in order from position 1 until a position is missing; None
  where the id is left to the model (Whisper's language, which transformers detects)."""
  forced = dict(generation.get("forced_decoder_ids") or [])
  tokens = []
  while len(tokens) + 1 in forced:
    tokens.append(forced[len(tokens) + 1])
  return tokens
