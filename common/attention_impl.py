"""Which attention implementation runs a call: one table of what each implementation cannot take,
read by the dispatcher when a layer is traced (common/nn/attention_dispatch.py), by `zoo show`
(common/nn/attention_report.py), by `zoo plan` (common/plan.py) and by the GPU mesh rules
(common/mesh.py).

`attention.impl` names how the softmax(q k^T) v core runs: "xla" (common/nn/attention_ref.py,
the reference), "blocked" (common/nn/attention_blocked.py: query blocks, an online softmax over
key blocks, the blocks recomputed in the backward pass, so no [N, T, S] scores are kept; any
platform, named by a user or by `train.fit`, never by "auto"), "flash" (the Pallas kernel in
kernels/flash_attention.py, Pallas interpret mode on CPU; on TPU jax's splash attention,
kernels/tpu_attention.py) or "cudnn" (`jax.nn.dot_product_attention(implementation="cudnn")`,
GPU only). Where a rule refuses the
asked one, the layer runs its FALLBACK ("xla") and logs the reason once.

"auto" (the default) is resolved when the layer is traced, for the platform the step compiles
for (the mesh's devices, as `moe.impl="auto"`; a TPU slice's under `zoo plan`): the first of
AUTO's candidates for that platform that no rule refuses, else "xla". GPU: "cudnn" where cuDNN's
fused attention takes the call, else "flash" where the kernel passed on an H200, else "xla";
TPU: "flash" (splash); CPU: "xla", the fastest there (bench/attention.py). The choice is logged
once. Some rules bind "auto" only: jax's own checks of the cuDNN call (an explicit "cudnn" meets
jax's error instead) and the cases where the flash kernel failed on an H200.

Under `mesh.context`, `attention.context_impl` picks how a device's queries meet the rest of
their row: "gather" (the row's keys gathered, `attention_ref.attend_gathered`) or "ring"
(common/nn/attention_ring.py), which falls back to "gather" where a logit bias would have to
travel round the ring.

`runs` is a pure function of a call's facts (`Call`); `choose` is `runs` with the choice logged
once per process (it runs at trace time, not per step).
"""

import dataclasses
import logging
import re
from collections.abc import Callable

import jax.numpy as jnp

IMPLS = ("auto", "xla", "blocked", "flash", "cudnn")
CONTEXT_IMPLS = ("gather", "ring")
# What "auto" tries on each platform, best first ("xla" where none takes the call).
AUTO = {"gpu": ("cudnn", "flash"), "tpu": ("flash",)}
# What runs where a rule refuses an implementation.
FALLBACK = {"blocked": "xla", "flash": "xla", "cudnn": "xla", "ring": "gather"}

# cuDNN's fused attention (jax's checks, jax._src.cudnn.fused_attention_stablehlo): bf16/fp16, a
# head dim that is a multiple of 8 and at most 128, or 256 from Hopper on (told by the device
# kind's name: "auto" may resolve for GPUs it cannot query), and even lengths when training with
# a bias (a segment mask reaches cuDNN as a bias too).
CUDNN_DTYPES = ("bfloat16", "float16")
HOPPER_OR_LATER = re.compile(r"(^|[-\s])g?(h[128]00|b[123]00)")
# The layer's flash-kernel block (flash_attention's default block_q and block_k).
FLASH_BLOCK = 128
# Where a call's keys come from, when they are not its queries' own tokens whole on this device:
# the kernels take only those.
FOREIGN_KEYS = {
  "cache": "decoding with a KV cache",
  "context": "mesh.context splits the row's keys over devices",
  "source": "cross-attention's keys are another sequence",
}

logger = logging.getLogger(__name__)
_logged: set[tuple[str, str]] = set()


@dataclasses.dataclass(frozen=True)
class Call:
  """The facts of one attention call that decide which implementation can run it, all known
  when the layer is traced. `head_dim` and `seq_len` 0 are unknown: only rules that bind "auto"
  read them."""

  platform: str  # the platform compiled for: "cpu", "gpu" or "tpu"
  dtype: str  # the queries' dtype (any form jnp.dtype takes; kept as its name)
  head_dim: int = 0
  seq_len: int = 0  # the queries (and, for a row's own keys, the keys)
  keys: str = "own"  # "own" (the queries' own tokens), or one of FOREIGN_KEYS
  bias: bool = False  # a logit bias (ALiBi, T5's relative positions)
  segments: bool = False  # segment ids given (packed rows): a mask beside causality and window
  softcap: bool = False
  bidirectional_window: bool = False
  device_kind: str = ""  # "NVIDIA H200", or a hardware name; "" if unknown
  pipelined: bool = False  # inside a stage of mesh.pipeline (common/nn/pipeline.py)

  def __post_init__(self):
    object.__setattr__(self, "dtype", jnp.dtype(self.dtype).name)

  @property
  def cudnn_max_head_dim(self) -> int:
    return 256 if HOPPER_OR_LATER.search(self.device_kind.lower()) else 128

  @property
  def flash_kernel(self) -> str:  # what "flash" runs here
    return "splash" if self.platform == "tpu" else "flash"


@dataclasses.dataclass(frozen=True)
class Rule:
  """`impls` cannot take a call where `refuses(call)`, for `reason(call)`; `auto_only`: the rule
  keeps "auto" from picking them, and an explicit choice still runs."""

  impls: tuple[str, ...]
  refuses: Callable[[Call], bool]
  reason: Callable[[Call], str]
  auto_only: bool = False


# The table, in the order the reasons are told (the first that applies is the one logged).
RULES = (
  # "blocked" skips the key blocks the rules mask by the row's static indices (a cache's are
  # traced), and a prefill or cross-attention call keeps no scores for a backward pass anyway.
  Rule(("blocked", "flash", "cudnn"), lambda c: c.keys != "own", lambda c: FOREIGN_KEYS[c.keys]),
  Rule(
    ("flash",),
    lambda c: c.bias,
    lambda c: f"the {c.flash_kernel} kernel adds no logit bias (ALiBi)",
  ),
  Rule(
    ("cudnn",),
    lambda c: c.platform != "gpu",
    lambda c: f"cuDNN attention needs a GPU, this is {c.platform}",
  ),
  Rule(
    ("cudnn",),
    lambda c: c.dtype not in CUDNN_DTYPES,
    lambda c: f"cuDNN takes bf16/fp16, not {c.dtype}",
  ),
  Rule(("cudnn",), lambda c: c.softcap, lambda c: "cuDNN has no logit soft-cap"),
  Rule(
    ("cudnn",),
    lambda c: c.bidirectional_window,
    lambda c: "cuDNN has no bidirectional sliding window",
  ),
  # jax's own checks of the cuDNN call: an explicit "cudnn" meets jax's error, which names them.
  Rule(
    ("cudnn",),
    lambda c: c.head_dim % 8 or c.head_dim > c.cudnn_max_head_dim,
    lambda c: (
      f"cuDNN takes head dims that are multiples of 8 up to {c.cudnn_max_head_dim} here, "
      f"not {c.head_dim}"
    ),
    auto_only=True,
  ),
  Rule(
    ("cudnn",),
    lambda c: (c.bias or c.segments) and c.seq_len % 2,
    lambda c: f"cuDNN's biased (or segment-masked) backward needs an even length, not {c.seq_len}",
    auto_only=True,
  ),
  # Measured on an H200 (2026-12-04, docs/gpu.md): the kernel's bf16 GQA case and its
  # padded-length cases failed, not understood yet; float32 with lengths of whole blocks passed.
  Rule(
    ("flash",),
    lambda c: c.platform == "gpu" and c.dtype != "float32",
    lambda c: f"the flash kernel failed in {c.dtype} on an H200 (docs/gpu.md)",
    auto_only=True,
  ),
  Rule(
    ("flash",),
    lambda c: c.platform == "gpu" and c.seq_len % FLASH_BLOCK,
    lambda c: (
      "the flash kernel failed on padded lengths on an H200 (docs/gpu.md), and "
      f"{c.seq_len} is not a multiple of {FLASH_BLOCK}"
    ),
    auto_only=True,
  ),
  Rule(("ring",), lambda c: c.bias, lambda c: "a logit bias (ALiBi) is not passed round"),
  # Lowered for a TPU (jax 0.10), a pipeline stage's rematerialised chunk around splash leaves a
  # traced value as a constant ("No constant handler"); not understood yet.
  Rule(
    ("flash",),
    lambda c: c.pipelined and c.platform == "tpu",
    lambda c: (
      "splash attention inside a pipeline stage fails to lower for a TPU (docs/parallel.md)"
    ),
  ),
)

# How "auto"'s pick is told, after why the better candidates were refused.
AUTO_KERNELS = {"gpu": "the flash kernel (Pallas Triton)", "tpu": "jax's splash attention kernel"}
# What is logged (INFO) where an implementation runs as asked, but not as it runs in training.
NOTES = {
  # Not a fallback: the same kernel, emulated by XLA loops; on CPU it holds no [T, S] array,
  # though "xla"'s query blocks run faster there (bench/attention.py), and it keeps "flash"
  # testable.
  ("flash", "cpu"): "runs in Pallas interpret mode on CPU",
}
# Fallbacks told as INFO, not WARNING: (impl, where the keys come from). Decoding from a KV cache
# keeps no scores for a backward pass, so "blocked" (a choice for training's memory, which
# `train.fit` may write into a run's config) loses nothing there by running "xla".
EXPECTED_FALLBACKS = {("blocked", "cache")}


def refusal(impl: str, call: Call, *, auto: bool = False) -> str | None:
  """Why `impl` cannot take `call` (with `auto`, also the rules that bind "auto" only), or None."""
  for rule in RULES:
    if impl in rule.impls and (auto or not rule.auto_only) and rule.refuses(call):
      return rule.reason(call)
  return None


def runs(impl: str, call: Call) -> tuple[str, str]:
  """(implementation, why): what runs `call` where the config asks for `impl`. "auto": the first
  of AUTO's candidates for the platform that no rule refuses, else "xla"; any other: itself, or
  its FALLBACK where a rule refuses it ("why" is then the reason, else a note or "")."""
  if impl != "auto":
    reason = refusal(impl, call)
    if reason is not None:
      return FALLBACK[impl], reason
    return impl, NOTES.get((impl, call.platform), "")
  refused = []
  for candidate in AUTO.get(call.platform, ()):
    reason = refusal(candidate, call, auto=True)
    if reason is None:
      break
    refused.append(reason)
  else:
    candidate = "xla"
  if candidate == "cudnn":  # the first candidate: nothing was refused before it
    return candidate, f"{call.platform}, {call.dtype}: cuDNN fused attention"
  told = list(dict.fromkeys(refused))  # a reason two candidates share is told once
  if candidate != "xla":
    told.append(AUTO_KERNELS[call.platform])
  return candidate, f"{call.platform}: {'; '.join(told) or 'the XLA path (with query blocks)'}"


def choose(impl: str, call: Call) -> str:
  """`runs(impl, call)`'s implementation, its choice logged once per process: "auto"'s
  resolution and notes as INFO, a fallback as a WARNING (INFO where EXPECTED_FALLBACKS)."""
  chosen, why = runs(impl, call)
  if impl == "auto":
    _log_once(impl, f"resolved to {chosen!r}: {why}", logging.INFO)
  elif chosen != impl:
    expected = (impl, call.keys) in EXPECTED_FALLBACKS
    _log_once(
      impl, f"falls back to {chosen!r}: {why}", logging.INFO if expected else logging.WARNING
    )
  elif why:
    _log_once(impl, why, logging.INFO)
  return chosen


def resolve_auto(
  *, platform: str, dtype, head_dim: int, seq_len: int, cache: bool = False, **facts
) -> tuple[str, str]:
  """(impl, why): what `impl="auto"` runs on `platform` ("cpu", "gpu", "tpu") for a self-attention
  call of `seq_len` queries (and keys) in `dtype`, from a KV `cache` or not; `facts`: the rest of
  `Call`'s (bias, segments, softcap, bidirectional_window, device_kind). A pure function of its
  arguments."""
  keys = "cache" if cache else "own"
  return runs("auto", Call(platform, dtype, head_dim, seq_len, keys, **facts))


def choose_impl(impl: str, *, backend: str, dtype, cache: bool = False, **facts) -> str:
  """What an explicit `impl` runs on `backend` ("xla" where it does not apply; logged once):
  `choose` from the facts that bind an explicit choice (`Call`'s bias, softcap,
  bidirectional_window)."""
  return choose(impl, Call(backend, dtype, keys="cache" if cache else "own", **facts))


def _log_once(impl: str, message: str, level: int = logging.WARNING):
  if (impl, message) not in _logged:
    _logged.add((impl, message))
    logger.log(level, "attention impl=%r: %s", impl, message)
