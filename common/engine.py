"""The inference engine: continuous batching over a decoder's KV cache, the one loop every caller
of a decoder samples through (docs/sampling.md).

The engine holds `slots` rows of KV cache, each with its own position (`attention.KVCache`'s
per-row index), so its requests advance independently:

- **admission**: between steps a waiting request takes a free slot, preferring the slot whose
  cache already holds the longest prefix of its prompt (the last turn of a chat: those tokens
  are not computed again); where another slot, free or running, holds a longer prefix (a
  shared system prompt, the copies of one prompt GRPO samples a group from) by `MIN_SHARED`
  tokens or more, that slot's cache row is copied into the free one instead, and a request
  whose prefix another slot is still reading waits a step for it (`share_prefixes`);
- **prefill in chunks**: a prompt is read `prefill_chunk` tokens per step, beside the decode
  step of the slots already writing, so a long prompt never stalls the streams that run;
- **decode**: one compiled step writes a token for every running slot, each with its own
  temperature, top-k, top-p, stop ids and key;
- a slot frees as soon as its request ends (a stop id, max_tokens, or `cancel`).

Sampling rules: a request's token at position t is drawn with `fold_in(key, t)` (`key` from its
seed), so its tokens depend on its prompt, settings and seed only, never on the requests beside
it, the chunking or its slot; the batch they share changes only the rounding of its logits.
Temperature 0 is greedy; top-k 0 and top-p 1 mean no truncation, and a step where no running
request truncates compiles without the vocabulary sort truncation needs. Log-probabilities are
the model's own (log-softmax of the logits, before temperature).

Programs: the decode step per cache length and the prefill per (rows, chunk, cache length), each
in two variants (with or without the sort) times (with or without top log-probs). The cache
starts short and grows by powers of two (from `MIN_CACHE` to `max_len`), so a step reads only
the cache its longest request needs. On one device each program goes through
`programs.load` (traced once across processes, memory checked); on a mesh the weights stay
sharded as they are (GRPO samples with the weights it trains).

A static batch (`generate`, `continue_rows`: `zoo generate`, GRPO, DPO's and distillation's
on-policy samples) is every row admitted at once. An encoder-decoder (T5, Whisper) decodes with
`generate_seq2seq`, its own loop: its encoder runs once on the source and its decoder prompt is
forced, which the engine's decoder-only slots do not do.
"""

import collections
import dataclasses
import functools
import math
import os

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from nnx_zoo.common import device_memory, programs
from nnx_zoo.common.errors import UserError
from nnx_zoo.common.nn.encoder_decoder import EncoderDecoder

MAX_TOP_LOGPROBS = 20  # the most alternatives a request may ask for (OpenAI's chat limit)
MAX_STOP_IDS = 8  # stop ids a request may have
MIN_SHARED = 16  # the fewest tokens, beyond a free slot's own, another slot's cache is copied for
MIN_CACHE = 128  # the shortest cache the engine keeps (then 256, 512, ... up to max_len)
FINISHES = ("stop", "length", "cancelled")


@dataclasses.dataclass(frozen=True)
class SamplingParams:
  """How one request samples. temperature 0: greedy. logprobs None: none; 0: the sampled
  token's; n: also the n most likely. prompt_logprobs: each prompt token's (the first: None),
  with the same alternatives."""

  max_tokens: int
  temperature: float = 1.0
  top_k: int = 0
  top_p: float = 1.0
  stop_ids: tuple[int, ...] = ()
  logprobs: int | None = None
  prompt_logprobs: bool = False

  def check(self):
    if self.max_tokens < 1:
      raise UserError(f"max_tokens is {self.max_tokens}: ask for at least 1 token.")
    if self.temperature < 0:
      raise UserError(f"temperature is {self.temperature}: give 0 (greedy) or more.")
    if self.top_k < 0:
      raise UserError(f"top_k is {self.top_k}: give 0 (off) or more.")
    if not 0 < self.top_p <= 1:
      raise UserError(f"top_p is {self.top_p}: give a value in (0, 1].")
    if len(stop_tuple(self.stop_ids)) > MAX_STOP_IDS:
      raise UserError(f"{len(self.stop_ids)} stop ids: give at most {MAX_STOP_IDS}.")
    if self.logprobs is not None and not 0 <= self.logprobs <= MAX_TOP_LOGPROBS:
      raise UserError(f"logprobs is {self.logprobs}: give 0 to {MAX_TOP_LOGPROBS}.")

  @property
  def truncates(self) -> bool:
    return self.temperature > 0 and (self.top_k > 0 or self.top_p < 1)


@dataclasses.dataclass
class Output:
  """What one step did for one request: its new tokens (a stop id it stopped at included),
  their log-probabilities where asked, and how it finished (None while it runs)."""

  rid: int
  tokens: list[int]
  logprobs: list[float] | None = None
  top_logprobs: list[list[tuple[int, float]]] | None = None
  prompt_logprobs: list[float | None] | None = None  # the request's first Output only
  prompt_top_logprobs: list[list[tuple[int, float]] | None] | None = None
  finish_reason: str | None = None
  prompt_tokens: int = 0
  cached_tokens: int = 0  # of the prompt, reused from a slot's cache


@dataclasses.dataclass
class _Request:
  rid: int
  prompt: list[int]
  params: SamplingParams
  key: np.ndarray  # uint32 key data
  slot: int = -1
  filled: int = 0  # prompt tokens in the cache
  cached: int = 0
  generated: list[int] = dataclasses.field(default_factory=list)
  prompt_lps: list = dataclasses.field(default_factory=list)
  prompt_tops: list = dataclasses.field(default_factory=list)
  reported: bool = False


def stop_tuple(stop_ids) -> tuple[int, ...]:
  """Stop ids sorted, once each, None and negative ids dropped."""
  return tuple(sorted({int(i) for i in stop_ids if i is not None and i >= 0}))


def bucket(n: int, *, minimum: int = 16) -> int:
  """The padded length for `n` tokens: the next of minimum, 1.5x, 2x, 3x, 4x, ... of it (powers
  of two and 1.5x them from 16: 16, 24, 32, 48, 64, 96, ...), so a row wastes at most a third
  and a range of lengths compiles a few programs."""
  size = minimum
  while size < n:
    size = size * 3 // 2 if size & (size - 1) == 0 else size // 3 * 4
  return size


def _pow2(n: int, minimum: int = 1) -> int:
  return max(minimum, 1 << max(int(n) - 1, 0).bit_length())


# --- what runs on the device ---


def sample_rows(logits_SV, keys_S, temperature_S, top_k_S, top_p_S, *, truncate: bool):
  """Each row's next token by its own settings (temperature 0: greedy; top_k 0, top_p 1: no
  truncation), row s drawn with keys_S[s]. `truncate` (static): whether any row truncates;
  without it no sort is compiled."""
  logits_SV = logits_SV.astype(jnp.float32)
  greedy_S = jnp.argmax(logits_SV, axis=-1)
  x_SV = logits_SV / jnp.where(temperature_S > 0, temperature_S, 1.0)[:, None]
  if truncate:
    neg = jnp.finfo(jnp.float32).min
    sorted_SV = jnp.sort(x_SV, axis=-1)[:, ::-1]
    # Top-k: below the k-th largest is out (ties with it stay).
    kth_S1 = jnp.take_along_axis(sorted_SV, jnp.maximum(top_k_S - 1, 0)[:, None], axis=-1)
    use_k_S1 = (top_k_S > 0)[:, None]
    x_SV = jnp.where(use_k_S1 & (x_SV < kth_S1), neg, x_SV)
    sorted_SV = jnp.where(use_k_S1 & (sorted_SV < kth_S1), neg, sorted_SV)
    # Top-p of what top-k kept: the smallest set whose mass reaches p (at least the first).
    probs_SV = jax.nn.softmax(sorted_SV, axis=-1)
    before_SV = jnp.cumsum(probs_SV, axis=-1) - probs_SV
    top_p_S1 = top_p_S[:, None]
    cutoff_S1 = jnp.min(jnp.where(before_SV < top_p_S1, sorted_SV, jnp.inf), -1, keepdims=True)
    x_SV = jnp.where((top_p_S1 < 1) & (x_SV < cutoff_S1), neg, x_SV)
  drawn_S = jax.vmap(lambda x_V, key: jax.random.categorical(key, x_V[None], axis=-1)[0])(
    x_SV, keys_S
  )
  return jnp.where(temperature_S > 0, drawn_S, greedy_S).astype(jnp.int32)


def sample_logits(
  logits_BV: jax.Array, rng: jax.Array, *, temperature: float, top_k: int, top_p: float
) -> jax.Array:
  """Next tokens [B]. temperature 0 is greedy; top_k 0 and top_p 1.0 mean no truncation."""
  if temperature == 0:
    return jnp.argmax(logits_BV, axis=-1)
  logits_BV = logits_BV.astype(jnp.float32) / temperature
  neg = jnp.finfo(jnp.float32).min
  if top_k:
    kth_B1 = jax.lax.top_k(logits_BV, top_k)[0][:, -1:]
    logits_BV = jnp.where(logits_BV < kth_B1, neg, logits_BV)
  if top_p < 1.0:
    sorted_BV = jnp.sort(logits_BV, axis=-1)[:, ::-1]
    probs_BV = jax.nn.softmax(sorted_BV, axis=-1)
    # Keep the smallest set of tokens whose mass reaches top_p (always at least the first).
    before_BV = jnp.cumsum(probs_BV, axis=-1) - probs_BV
    cutoff_B1 = jnp.min(jnp.where(before_BV < top_p, sorted_BV, jnp.inf), axis=-1, keepdims=True)
    logits_BV = jnp.where(logits_BV < cutoff_B1, neg, logits_BV)
  return jax.random.categorical(rng, logits_BV, axis=-1)


def _logprobs(logits_SV, token_S, top_n: int):
  """The tokens' log-probabilities under the logits, and (top_n > 0) the top_n most likely."""
  lp_SV = jax.nn.log_softmax(logits_SV.astype(jnp.float32), axis=-1)
  lp_S = jnp.take_along_axis(lp_SV, token_S[..., None], axis=-1)[..., 0]
  if not top_n:
    return lp_S, None, None
  top_lp, top_id = jax.lax.top_k(lp_SV, top_n)
  return lp_S, top_id.astype(jnp.int32), top_lp


def _keys_at(keys_S, positions_S):
  """Each row's key for the token it writes at its position: fold_in(key, position)."""
  keys_S = jax.random.wrap_key_data(keys_S)
  return jax.vmap(jax.random.fold_in)(keys_S, positions_S)


@dataclasses.dataclass(frozen=True)
class _Variant:
  truncate: bool
  top_n: int  # 0 or MAX_TOP_LOGPROBS


def _prefill_fn(graphdef, treedef, cache_def, variant: _Variant, prompt_lp: bool):
  """The program reading a chunk of prompt tokens for some slots: rows_k (padding rows: an
  index past the slots, dropped), their chunks tokens_kC (row k's first n_k are real) written
  after start_k cached tokens. A row whose prompt this chunk completes (last_k) draws its first
  token. With prompt_lp, the log-probabilities of targets_kC (each token's next) too."""

  def run(leaves, cache, rows_k, tokens_kC, start_k, n_k, last_k, keys_k, temp_k, topk_k, topp_k,
          targets_kC):  # fmt: skip
    model = nnx.merge(graphdef, jax.tree.unflatten(treedef, leaves))
    cache = jax.tree.unflatten(cache_def, cache)
    take = lambda x: jnp.take(x, rows_k, axis=0, mode="clip")
    sub = [c.rewound(start_k) for c in jax.tree.map(take, cache)]
    logits_kCV, sub = model(tokens_kC, cache=sub)
    sub = [c.rewound(start_k + n_k) for c in sub]
    cache = jax.tree.map(lambda full, part: full.at[rows_k].set(part, mode="drop"), cache, sub)
    k = rows_k.shape[0]
    last_kV = logits_kCV[jnp.arange(k), jnp.maximum(n_k - 1, 0)]
    keys = _keys_at(keys_k, start_k + n_k)
    token_k = sample_rows(last_kV, keys, temp_k, topk_k, topp_k, truncate=variant.truncate)
    token_k = jnp.where(last_k, token_k, 0)
    out = (jax.tree.leaves(cache), token_k, *_logprobs(last_kV, token_k, variant.top_n))
    if prompt_lp:
      out += _logprobs(logits_kCV, targets_kC, variant.top_n)
    return out

  return run


def _decode_fn(graphdef, treedef, cache_def, variant: _Variant, steps: int):
  """The program of `steps` decode steps for the first n slots (n: the length of token_S, a
  power of two covering every running slot; the rest of the cache is left alone): a running
  slot (active_S) feeds its token at its position, draws the next, and stops at one of its stop
  ids or its limit; the others among the n compute but keep their cache as it was."""

  def run(leaves, cache, token_S, active_S, keys_S, temp_S, topk_S, topp_S, limit_S, stops_SK):
    model = nnx.merge(graphdef, jax.tree.unflatten(treedef, leaves))
    full, n = cache, token_S.shape[0]
    if n < cache[0].shape[0]:  # the first n rows
      cache = [x[:n] for x in cache]
    cache = jax.tree.unflatten(cache_def, cache)

    S, N = n, variant.top_n

    def step(carry):
      i, cache, token_S, active_S, outs = carry
      pos_S = cache[0].index
      logits_S1V, cache = model(token_S[:, None], cache=cache)
      cache = [c.rewound(jnp.where(active_S, pos_S + 1, pos_S)) for c in cache]
      logits_SV = logits_S1V[:, 0]
      keys = _keys_at(keys_S, pos_S + 1)
      next_S = sample_rows(logits_SV, keys, temp_S, topk_S, topp_S, truncate=variant.truncate)
      new = (next_S, *(x for x in _logprobs(logits_SV, next_S, N) if x is not None))
      outs = [
        jax.lax.dynamic_update_index_in_dim(o, x, i, axis=1) for o, x in zip(outs, new, strict=True)
      ]
      done_S = jnp.any(next_S[:, None] == stops_SK, axis=-1) | (pos_S + 2 >= limit_S)
      next_S = jnp.where(active_S, next_S, token_S)
      return i + 1, cache, next_S, active_S & ~done_S, outs

    # Up to `steps` steps, fewer once every slot has stopped (a static batch's last steps).
    outs = [jnp.zeros((S, steps), jnp.int32), jnp.zeros((S, steps), jnp.float32)]
    if N:
      outs += [jnp.zeros((S, steps, N), jnp.int32), jnp.zeros((S, steps, N), jnp.float32)]
    carry = (jnp.int32(0), cache, token_S, active_S, outs)
    cond = lambda c: (c[0] < steps) & jnp.any(c[3])
    _, cache, _, _, outs = jax.lax.while_loop(cond, step, carry)
    outs = (*outs, None, None) if not N else tuple(outs)
    cache = jax.tree.leaves(cache)
    if n < full[0].shape[0]:
      put = lambda f, c: jax.lax.dynamic_update_slice_in_dim(f, c, 0, axis=0)
      cache = [put(f, c) for f, c in zip(full, cache, strict=True)]
    return (cache, *outs)

  return run


def min_decode_rows(model) -> int:
  """The fewest rows a decode step computes: 2 for a bfloat16 model on a CPU, whose bf16 dots
  XLA:CPU sends to YNNPACK only with at least two rows (reported for jax 0.12; on jax 0.10 a
  bf16 SmolLM2 step measured 9x fp32's at one row and 5x at eight, bench/RESULTS.md), else 1."""
  bf16 = any(getattr(m, "dtype", None) == jnp.bfloat16 for _, m in nnx.iter_graph(model))
  return 2 if bf16 and jax.default_backend() == "cpu" else 1


@functools.partial(jax.jit, donate_argnums=(0,))
def _copy_rows(cache, src_k, dst_k):
  """Slot src_k[i]'s cache row copied into slot dst_k[i] (a dst past the slots: nothing);
  every source read before any row is written."""
  return [x.at[dst_k].set(x[src_k], mode="drop") for x in cache]


def _grow_fn(length: int):
  """The cache padded to `length` tokens a row (what it held kept)."""

  def run(cache):
    def pad(x):
      if x.ndim < 2:
        return x  # the rows' indices
      return jnp.pad(x, [(0, 0), (0, length - x.shape[1])] + [(0, 0)] * (x.ndim - 2))

    return jax.tree.map(pad, cache)

  return run


# --- the engine ---

_PROGRAMS: dict = {}  # the engines' compiled programs, by what shapes them


def _on_device(leaves):
  """The weights as device arrays: host arrays (a restored checkpoint's numpy leaves) put on the
  device once, not copied in at every step (a SmolLM2 decode step: 90 against 26 ms)."""
  return [
    x if isinstance(x, jax.Array | jax.ShapeDtypeStruct) else jax.device_put(x) for x in leaves
  ]


def _replicated(leaves):
  """A sharding replicating over the mesh the weights are laid out on (None off a mesh)."""
  for leaf in leaves:
    sharding = getattr(leaf, "sharding", None)
    if isinstance(sharding, jax.sharding.NamedSharding):
      return jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec())
  return None


class Engine:
  """Continuous batching over `slots` rows of KV cache of up to `max_len` tokens each; see the
  module's docstring. Single-threaded: one thread submits, steps and cancels."""

  def __init__(
    self,
    model_or_split,
    *,
    slots: int = 8,
    max_len: int = 2048,
    prefill_chunk: int = 256,
    decode_steps: int = 1,
    check_memory: bool = True,
    persist: bool = True,
    share_prefixes: bool = True,
  ):
    if slots < 1 or max_len < 2:
      raise UserError(f"slots={slots}, max_len={max_len}: give at least 1 slot of 2 tokens.")
    graphdef, params = _split(model_or_split, seq2seq=False)
    self.graphdef = graphdef
    leaves, self._treedef = jax.tree.flatten(params)
    self._leaves = _on_device(leaves)
    self.slots, self.max_len = slots, max_len
    self.prefill_chunk, self.decode_steps = max(1, prefill_chunk), max(1, decode_steps)
    self.persist, self.share_prefixes = persist, share_prefixes
    self._model = nnx.merge(graphdef, params)  # only its shapes are read: nothing computed
    # A one-token cache's shapes: its bytes a token, and its tree (the programs take and give the
    # cache as its leaves: jax.export keeps no custom trees).
    one = jax.eval_shape(lambda: self._model.init_cache(1, 1))
    self._token_bytes = sum(
      math.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(one) if len(x.shape) > 1
    )
    self._cache_def = jax.tree.structure(one)
    self._min_rows = min_decode_rows(self._model)
    if check_memory:
      self._check_memory()
    self._cache = None
    self._cache_len = 0
    self._slot_rid: list[int | None] = [None] * slots
    self._held: list[list[int]] = [[] for _ in range(slots)]  # what each slot's cache holds
    self._last = np.zeros(slots, np.int32)  # each decoding slot's token to feed next
    self._waiting: collections.deque[int] = collections.deque()
    self._requests: dict[int, _Request] = {}
    self._cancelled: list[int] = []
    self._next_rid = 0
    self._programs: dict = {}

  # what a caller sees

  @property
  def busy(self) -> bool:
    return bool(self._requests)

  @property
  def num_running(self) -> int:
    return sum(r is not None for r in self._slot_rid)

  @property
  def num_waiting(self) -> int:
    return len(self._waiting)

  @property
  def cache_bytes(self) -> int:
    """The KV cache at its full size: slots x max_len tokens."""
    return self.slots * self.max_len * self._token_bytes

  def submit(self, prompt, params: SamplingParams, *, seed: int | None = None, key=None) -> int:
    """Queue a request: its id. Its draws use `key` (a PRNG key), else key(seed), else a fresh
    random seed."""
    prompt = [int(t) for t in np.asarray(prompt).reshape(-1)]
    params.check()
    params = dataclasses.replace(params, stop_ids=stop_tuple(params.stop_ids))  # read each step
    if not prompt:
      raise UserError("The prompt is empty: give at least one token.")
    if len(prompt) + params.max_tokens > self.max_len:
      raise UserError(
        f"The prompt's {len(prompt)} tokens plus max_tokens={params.max_tokens} exceed the "
        f"context of {self.max_len} tokens: shorten the prompt or ask for fewer tokens."
      )
    if key is None:
      seed = int.from_bytes(os.urandom(4), "little") if seed is None else int(seed)
      key = jax.random.key(seed)
    data = jax.random.key_data(key) if jnp.issubdtype(key.dtype, jax.dtypes.prng_key) else key
    rid = self._next_rid
    self._next_rid += 1
    self._requests[rid] = _Request(rid, prompt, params, np.asarray(data, np.uint32))
    self._waiting.append(rid)
    return rid

  def cancel(self, rid: int):
    """End request `rid` at the next step (its final Output says "cancelled"); unknown or
    finished ids are ignored."""
    if rid in self._requests:
      self._cancelled.append(rid)

  def set_weights(self, params):
    """New weights of the same shapes (RL after an update): nothing recompiles; the cached
    prefixes, computed with the old ones, are forgotten."""
    leaves, treedef = jax.tree.flatten(params)
    if treedef != self._treedef:
      raise UserError("set_weights: the new weights are not the tree the engine was built with.")
    self._leaves = _on_device(leaves)
    self._held = [[] for _ in range(self.slots)]

  def step(self) -> list[Output]:
    """One step: cancellations, admission, a prefill chunk for the slots still reading their
    prompts, and a decode step for those writing. What each request got."""
    outputs = [self._finish(rid, "cancelled") for rid in self._cancelled if rid in self._requests]
    self._cancelled = []
    self._admit()
    outputs += self._prefill()
    outputs += self._decode()
    return outputs

  def run(self) -> dict[int, list[int]]:
    """Step until every request has ended: each request's generated tokens."""
    tokens: dict[int, list[int]] = collections.defaultdict(list)
    while self.busy:
      for out in self.step():
        tokens[out.rid] += out.tokens
    return dict(tokens)

  # inside

  def _check_memory(self):
    budget = device_memory.budget()
    if budget is None:
      return
    per_slot = self.max_len * self._token_bytes
    # What the steps need besides the cache: the logits of a prefill chunk and a decode step,
    # and their float32 log-softmax (a rough bound; each program is measured when compiled).
    vocab = getattr(getattr(self._model, "embed", None), "vocab_size", 0)
    extra = 3 * 4 * vocab * (self.prefill_chunk + self.slots)
    available = budget.bytes - extra
    if self.cache_bytes <= 0.9 * available:
      return
    fit_slots = int(0.9 * available // per_slot)
    fit_len = int(0.9 * available // (self.slots * self._token_bytes))
    raise UserError(
      f"The KV cache of {self.slots} slots x {self.max_len} tokens needs "
      f"{device_memory.gib(self.cache_bytes)}, and {device_memory.gib(max(available, 0))} is "
      f"available ({budget.where}): use --slots {max(fit_slots, 0)} or --max-len "
      f"{max(fit_len, 0)}."
    )

  def _admit(self):
    free = [s for s in range(self.slots) if self._slot_rid[s] is None]
    deferred, copies, copied_to = [], [], set()
    while self._waiting and free:
      req = self._requests[self._waiting.popleft()]
      # The free slot holding the longest prefix of the prompt (at least one prompt token is
      # read again: its logits give the first new token); prompt log-probs need them all.
      # No prefix to reuse: the lowest free slot (a step decodes the first slots, up to the
      # highest running one).
      best, match = free[0], 0
      if not req.params.prompt_logprobs:
        limit = len(req.prompt) - 1
        for s in free:
          m = _common_prefix(self._held[s], req.prompt, limit)
          if m > match:
            best, match = s, m
        source, shared = self._shared_prefix(req.prompt, limit, least=match + MIN_SHARED)
        if source is not None:
          if len(self._held[source]) < shared or source in copied_to:
            deferred.append(req.rid)  # the slot is still reading it: a step later
            continue
          # Copied into the free slot holding the least (the others' prefixes kept).
          best = min(free, key=lambda s: (len(self._held[s]), s))
          copies.append((source, best))
          copied_to.add(best)
          match = shared
      free.remove(best)
      req.slot, req.filled, req.cached = best, match, match
      self._held[best] = req.prompt[:match]
      self._slot_rid[best] = req.rid
    self._waiting.extendleft(reversed(deferred))
    if copies:
      rows = _pow2(len(copies))
      src = np.zeros(rows, np.int32)
      dst = np.full(rows, self.slots, np.int32)  # padding: dropped
      src[: len(copies)], dst[: len(copies)] = zip(*copies, strict=True)
      self._cache = _copy_rows(self._cache, src, dst)

  def _shared_prefix(self, prompt: list[int], limit: int, *, least: int):
    """(slot, length) of the longest prefix of `prompt`, `least` tokens or more, that a running
    slot holds or is reading (a request still in its prompt will hold all of it); (None, 0)
    where there is none. A free slot never is one: admission reads those first."""
    if not self.share_prefixes:
      return None, 0
    source, shared = None, least - 1
    for s, rid in enumerate(self._slot_rid):
      if rid is None:
        continue
      req = self._requests[rid]
      reading = req.prompt if req.filled < len(req.prompt) else self._held[s]
      if len(reading) > shared:
        m = _common_prefix(reading, prompt, limit)
        if m > shared:
          source, shared = s, m
    return (source, shared) if source is not None else (None, 0)

  def _program(self, name, make, args, static):
    """The compiled program `make()` builds for these arguments' shapes (kept for the process:
    engines of one model share them; through `programs.load` on one device)."""
    shapes = tuple((tuple(x.shape), str(x.dtype)) for x in jax.tree.leaves(args[1:]))
    local = (name, static, shapes)  # this engine's model: hashing its graph costs ~50 ms a step
    if local not in self._programs:
      key = (name, static, self.graphdef, self._treedef, self._cache_def, shapes, self.persist)
      if key not in _PROGRAMS and not self.persist:
        _PROGRAMS[key] = jax.jit(make(), donate_argnums=(1,))
      elif key not in _PROGRAMS:
        static_all = (static, self.graphdef, self._treedef, self._cache_def)
        _PROGRAMS[key] = programs.load(f"engine-{name}", make(), args, static=static_all,
                                       donate=(1,))  # fmt: skip
      self._programs[local] = _PROGRAMS[key]
    return self._programs[local]

  def _ensure_cache(self, needed: int):
    """A cache of at least `needed` tokens a row: the next power of two (from MIN_CACHE, at
    most max_len); a longer one is the old one padded."""
    length = min(_pow2(needed, MIN_CACHE), self.max_len)
    if self._cache is not None and length <= self._cache_len:
      return
    if self._cache is None:
      out = _replicated(self._leaves)
      init = lambda: jax.tree.leaves(self._model.init_cache(self.slots, length))
      self._cache = jax.jit(init, out_shardings=out)() if out else jax.jit(init)()
    else:
      self._cache = jax.jit(_grow_fn(length))(self._cache)
    self._cache_len = length

  def prepare(self, prompt_len: int, max_tokens: int, *, rows: int = 1, truncate: bool = False):
    """Compile (or load) the programs `rows` requests of `prompt_len` tokens and `max_tokens`
    new ones admitted at once run, before they come: the weights may still be abstract (being
    restored)."""
    C = min(bucket(prompt_len), self.prefill_chunk)
    variant = _Variant(truncate, 0)
    k = _pow2(min(rows, self.slots))
    S, lengths = self.slots, set()
    for n in (C, prompt_len + 1, prompt_len + max_tokens):
      lengths.add(min(_pow2(n, MIN_CACHE), self.max_len))
    for length in sorted(lengths):
      cache = jax.eval_shape(lambda n=length: jax.tree.leaves(self._model.init_cache(S, n)))
      i32, f32, u32 = np.int32, np.float32, np.uint32
      sd = jax.ShapeDtypeStruct
      key = sd(jax.random.key_data(jax.random.key(0)).shape, u32)
      args = (self._leaves, cache, sd((k,), i32), sd((k, C), i32), sd((k,), i32), sd((k,), i32),
              sd((k,), bool), sd((k, *key.shape), u32), sd((k,), f32), sd((k,), i32),
              sd((k,), f32), sd((k, C), i32))  # fmt: skip
      make = lambda: _prefill_fn(self.graphdef, self._treedef, self._cache_def, variant, False)
      self._program("prefill", make, args, (variant, False))
      args = (self._leaves, cache, sd((k,), i32), sd((k,), bool), sd((k, *key.shape), u32),
              sd((k,), f32), sd((k,), i32), sd((k,), f32), sd((k,), i32),
              sd((k, MAX_STOP_IDS), i32))  # fmt: skip
      make = lambda: _decode_fn(
        self.graphdef, self._treedef, self._cache_def, variant, self.decode_steps
      )
      self._program("decode", make, args, (variant, self.decode_steps))

  def _variant(self, reqs) -> _Variant:
    truncate = any(r.params.truncates for r in reqs)
    top_n = MAX_TOP_LOGPROBS if any(r.params.logprobs for r in reqs) else 0
    return _Variant(truncate, top_n)

  def _prefill(self) -> list[Output]:
    reqs = [
      self._requests[rid]
      for rid in self._slot_rid
      if rid is not None and self._requests[rid].filled < len(self._requests[rid].prompt)
    ]
    if not reqs:
      return []
    remaining = max(len(r.prompt) - r.filled for r in reqs)
    C = min(bucket(remaining), self.prefill_chunk)
    k = _pow2(len(reqs))
    self._ensure_cache(max(r.filled for r in reqs) + C)
    rows = np.full(k, self.slots, np.int32)
    tokens = np.zeros((k, C), np.int32)
    targets = np.zeros((k, C), np.int32)
    start, n = np.zeros(k, np.int32), np.zeros(k, np.int32)
    last = np.zeros(k, bool)
    keys = np.zeros((k, *reqs[0].key.shape), np.uint32)
    temp, top_p = np.zeros(k, np.float32), np.ones(k, np.float32)
    top_k = np.zeros(k, np.int32)
    for i, r in enumerate(reqs):
      chunk = r.prompt[r.filled : r.filled + C]
      rows[i], start[i], n[i] = r.slot, r.filled, len(chunk)
      tokens[i, : n[i]] = chunk
      nxt = r.prompt[r.filled + 1 : r.filled + 1 + C]
      targets[i, : len(nxt)] = nxt
      last[i] = r.filled + n[i] == len(r.prompt)
      keys[i], temp[i], top_k[i], top_p[i] = (
        r.key,
        r.params.temperature,
        r.params.top_k,
        r.params.top_p,
      )
    variant = self._variant(reqs)
    prompt_lp = any(r.params.prompt_logprobs for r in reqs)
    args = (self._leaves, self._cache, rows, tokens, start, n, last, keys, temp, top_k, top_p,
            targets)  # fmt: skip
    make = lambda: _prefill_fn(self.graphdef, self._treedef, self._cache_def, variant, prompt_lp)
    out = self._program("prefill", make, args, (variant, prompt_lp))(*args)
    self._cache = out[0]
    host = jax.device_get(out[1:])
    token_k, lp_k, topi_k, topl_k = host[:4]
    outputs = []
    for i, r in enumerate(reqs):
      chunk = r.prompt[r.filled : r.filled + n[i]]
      if r.params.prompt_logprobs:
        count = min(n[i], len(r.prompt) - 1 - r.filled)  # the last token's target is not prompt
        if r.filled == 0:
          r.prompt_lps.append(None)
          r.prompt_tops.append(None)
        for j in range(count):
          r.prompt_lps.append(float(host[4][i, j]))
          if r.params.logprobs:
            n_top = r.params.logprobs
            pairs = zip(host[5][i, j, :n_top], host[6][i, j, :n_top], strict=True)
            r.prompt_tops.append([(int(a), float(b)) for a, b in pairs])
          else:
            r.prompt_tops.append(None)
      r.filled += int(n[i])
      self._held[r.slot] += chunk
      if last[i]:
        tops = None if topi_k is None else (topi_k[i], topl_k[i])
        outputs.append(self._emit(r, [int(token_k[i])], [float(lp_k[i])], [tops]))
    return outputs

  def _decode(self) -> list[Output]:
    reqs = [
      self._requests[rid]
      for rid in self._slot_rid
      if rid is not None and self._requests[rid].filled == len(self._requests[rid].prompt)
    ]
    if not reqs:
      return []
    steps = self.decode_steps
    self._ensure_cache(max(len(r.prompt) + len(r.generated) for r in reqs) + steps)
    # The first S slots, a power of two covering every running one: idle rows past them cost
    # nothing (admission fills the lowest free slots first).
    S = min(_pow2(max(max(r.slot for r in reqs) + 1, self._min_rows)), self.slots)
    active = np.zeros(S, bool)
    keys = np.zeros((S, *reqs[0].key.shape), np.uint32)
    temp, top_p = np.zeros(S, np.float32), np.ones(S, np.float32)
    top_k, limit = np.zeros(S, np.int32), np.zeros(S, np.int32)
    stops = np.full((S, MAX_STOP_IDS), -1, np.int32)
    for r in reqs:
      s = r.slot
      active[s], keys[s] = True, r.key
      temp[s], top_k[s], top_p[s] = r.params.temperature, r.params.top_k, r.params.top_p
      limit[s] = len(r.prompt) + r.params.max_tokens
      ids = r.params.stop_ids
      stops[s, : len(ids)] = ids
    variant = self._variant(reqs)
    last = self._last[:S].copy()
    args = (self._leaves, self._cache, last, active, keys, temp, top_k, top_p, limit, stops)
    make = lambda: _decode_fn(self.graphdef, self._treedef, self._cache_def, variant, steps)
    out = self._program("decode", make, args, (variant, steps))(*args)
    self._cache = out[0]
    token_SN, lp_SN, topi, topl = jax.device_get(out[1:])
    outputs = []
    for r in reqs:
      s, stops_r = r.slot, r.params.stop_ids
      new, lps, tops = [], [], []
      for j in range(steps):
        if len(r.generated) + len(new) >= r.params.max_tokens or (new and new[-1] in stops_r):
          break
        new.append(int(token_SN[s, j]))
        lps.append(float(lp_SN[s, j]))
        tops.append(None if topi is None else (topi[s, j], topl[s, j]))
      outputs.append(self._emit(r, new, lps, tops))
    return outputs

  def _emit(self, r: _Request, tokens, lps, tops) -> Output:
    """Output for `tokens` just written by request r; it finishes at a stop id or its length."""
    # The slot's cache holds every token but the last written (fed at the next step).
    if r.generated:
      self._held[r.slot].append(r.generated[-1])
    self._held[r.slot] += tokens[:-1]
    r.generated += tokens
    self._last[r.slot] = tokens[-1] if tokens else self._last[r.slot]
    p = r.params
    out = Output(r.rid, tokens, prompt_tokens=len(r.prompt), cached_tokens=r.cached)
    if p.logprobs is not None:
      out.logprobs = lps
      n = p.logprobs
      out.top_logprobs = [
        []
        if t is None or not n
        else [(int(a), float(b)) for a, b in zip(t[0][:n], t[1][:n], strict=True)]
        for t in tops
      ]
    if not r.reported:
      r.reported = True
      if p.prompt_logprobs:
        out.prompt_logprobs, out.prompt_top_logprobs = r.prompt_lps, r.prompt_tops
    if tokens and tokens[-1] in p.stop_ids:
      self._release(r)
      out.finish_reason = "stop"
    elif len(r.generated) >= p.max_tokens:
      self._release(r)
      out.finish_reason = "length"
    return out

  def _finish(self, rid: int, reason: str) -> Output:
    r = self._requests[rid]
    if rid in self._waiting:
      self._waiting.remove(rid)
    self._release(r)
    return Output(
      rid, [], finish_reason=reason, prompt_tokens=len(r.prompt), cached_tokens=r.cached
    )

  def _release(self, r: _Request):
    if r.slot >= 0:
      self._slot_rid[r.slot] = None
      held = self._held[r.slot]
      self._held[r.slot] = held[: r.filled + max(len(r.generated) - 1, 0)]
    self._requests.pop(r.rid, None)


def _common_prefix(a: list[int], b: list[int], limit: int) -> int:
  n = min(len(a), len(b), limit)
  for i in range(n):
    if a[i] != b[i]:
      return i
  return max(n, 0)


# --- static batches: every row admitted at once ---

# Decode steps a static batch runs per program call (the host has nothing to check between its
# steps): fewer dispatches and host round trips; the loop stops early once every row has.
STATIC_DECODE_STEPS = 8

# A prompt is padded to its bucket (`bucket` from this many tokens: 64, 96, 128, 192, ...) where
# callers batch prompts of nearby lengths into one array.
PROMPT_BUCKET = 64


def bucket_below(n: int, *, minimum: int = 16) -> int:
  """The largest bucket length at most `n` (0 below `minimum`)."""
  size, below = minimum, 0
  while size <= n:
    size, below = bucket(size + 1, minimum=minimum), size
  return below


def continue_rows(
  params,
  prompt_BP,
  lengths_B,
  keys_B,
  *,
  graphdef,
  max_new_tokens: int,
  temperature: float,
  top_k: int = 0,
  top_p: float = 1.0,
  stop_ids: tuple[int, ...] = (),
  prefill: int | None = None,
  logprobs: bool = False,
  persist: bool = False,
):
  """Rows of prompts of different lengths continued on an engine with a slot a row: [B, P +
  max_new_tokens], row b its prompt (the first `lengths_B[b]` tokens of `prompt_BP`; a row of
  length 0 is padding, never read) and then its sampled tokens, drawn with keys_B[b]. A row
  stops at one of `stop_ids`; what a row holds after its stop, or after its max_new_tokens, is
  the first stop id (0 without one). With `logprobs`, also [B, max_new_tokens]: each new
  token's log-probability under the model (0 after the row's end). `prefill` is accepted for
  old callers and unused: the engine reads each prompt in chunks of its own."""
  del prefill
  prompt_BP = np.asarray(jax.device_get(prompt_BP), np.int32)
  B, P = prompt_BP.shape
  rows = Rows(
    graphdef, params, slots=B, prompt_len=P, max_new_tokens=max_new_tokens,
    temperature=temperature, top_k=top_k, top_p=top_p, stop_ids=stop_ids, logprobs=logprobs,
    persist=persist,
  )  # fmt: skip
  batch, _ = rows.add(prompt_BP, lengths_B, keys_B)
  while rows.busy:
    rows.step()
  out, logps = rows.result(batch)
  return (out, logps) if logprobs else out


class Rows:
  """Batches of rows continued on one engine, a slot a row, as `continue_rows` does for one:
  a batch added while others run waits for the slots their finished rows free (the engine
  admits in order), so no row waits for the longest of another batch. Each row's tokens are
  drawn with its own key, whatever its slot or neighbours (`Engine`), so they are those
  `continue_rows` gives that batch alone. GRPO's dynamic sampling adds its extra prompts so."""

  def __init__(
    self, graphdef, params, *, slots: int, prompt_len: int, max_new_tokens: int,
    temperature: float, top_k: int = 0, top_p: float = 1.0, stop_ids: tuple[int, ...] = (),
    logprobs: bool = False, persist: bool = False,
  ):  # fmt: skip
    self.max_new_tokens, self.logprobs = max_new_tokens, logprobs
    self.stops = stop_tuple(stop_ids)
    self.options = SamplingParams(
      max_new_tokens, float(temperature), int(top_k), float(top_p), stop_ids=self.stops,
      logprobs=0 if logprobs else None,
    )  # fmt: skip
    self.engine = None
    if max_new_tokens >= 1:
      self.engine = _static_engine(graphdef, params, slots, prompt_len, max_new_tokens,
                                   persist=persist)  # fmt: skip
    self._batches = []  # [out [B, P + N], logps [B, N], lengths [B], tokens written [B]]
    self._rows = {}  # request id -> (batch, row)

  def add(self, prompt_BP, lengths_B, keys_B) -> tuple[int, list[int]]:
    """Queue a batch: its index (for `result`) and its rows that are padding (length 0),
    finished as they are added."""
    prompt_BP = np.asarray(jax.device_get(prompt_BP), np.int32)
    lengths_B = np.asarray(jax.device_get(lengths_B), np.int32)
    B, P = prompt_BP.shape
    N = self.max_new_tokens
    fill = self.stops[0] if self.stops else 0
    out = np.full((B, P + max(N, 0)), fill, np.int32)
    out[:, :P] = np.where(np.arange(P) < lengths_B[:, None], prompt_BP, fill)
    i = len(self._batches)
    self._batches.append([out, np.zeros((B, max(N, 0)), np.float32), lengths_B, np.zeros(B, int)])
    padding = [b for b in range(B) if lengths_B[b] <= 0 or self.engine is None]
    for b in range(B):
      if b not in padding:
        rid = self.engine.submit(prompt_BP[b, : lengths_B[b]], self.options, key=keys_B[b])
        self._rows[rid] = (i, b)
    return i, padding

  @property
  def busy(self) -> bool:
    return self.engine is not None and self.engine.busy

  def step(self) -> list[tuple[int, int]]:
    """One engine step: the (batch, row) of each row it finished."""
    finished = []
    for got in self.engine.step():
      i, b = self._rows[got.rid]
      out, logps, lengths, done = self._batches[i]
      n = len(got.tokens)
      out[b, lengths[b] + done[b] : lengths[b] + done[b] + n] = got.tokens
      if self.logprobs and n:
        logps[b, done[b] : done[b] + n] = got.logprobs
      done[b] += n
      if got.finish_reason is not None:
        finished.append((i, b))
    return finished

  def result(self, i: int) -> tuple[np.ndarray, np.ndarray]:
    """Batch i's rows [B, P + N] and its new tokens' log-probabilities [B, N] (0 unless asked)."""
    out, logps, _, _ = self._batches[i]
    return out, logps


def _static_engine(
  graphdef, params, batch: int, prompt_len: int, max_new_tokens: int, *, persist: bool = False
) -> Engine:
  """The engine a static batch runs on: a slot a row, the cache a power of two long (batches of
  nearby lengths share programs), each prompt read in one chunk. `persist`: its programs kept
  across processes (`zoo generate`'s; a training run's rollouts compile in their process)."""
  length = _pow2(prompt_len + max_new_tokens, MIN_CACHE)
  return Engine(
    (graphdef, params), slots=batch, max_len=length, prefill_chunk=1024, check_memory=False,
    decode_steps=STATIC_DECODE_STEPS, persist=persist,
  )  # fmt: skip


def prepare(
  model_or_split,
  batch: int,
  prompt_len: int,
  *,
  max_new_tokens: int,
  rng=None,
  temperature: float = 1.0,
  top_k: int = 0,
  top_p: float = 1.0,
  stop_ids: tuple[int, ...] = (),
):
  """Ready `generate`'s programs for `batch` prompts of `prompt_len` tokens and these options:
  loaded from the persistent compilation cache, or traced and compiled. The params may be
  abstract (`jax.ShapeDtypeStruct`s): a caller readies the programs while they are restored."""
  del rng, stop_ids  # neither shapes a program
  if max_new_tokens >= 1:
    graphdef, params = _split(model_or_split, seq2seq=False)
    eng = _static_engine(graphdef, params, batch, prompt_len, max_new_tokens, persist=True)
    truncate = temperature > 0 and (top_k > 0 or top_p < 1)
    eng.prepare(prompt_len, max_new_tokens, rows=batch, truncate=truncate)


def generate(
  model_or_split,
  prompt_BP,
  *,
  max_new_tokens: int,
  rng: jax.Array,
  temperature: float = 1.0,
  top_k: int = 0,
  top_p: float = 1.0,
  stop_ids: tuple[int, ...] = (),
) -> jax.Array:
  """The prompt followed by `max_new_tokens` sampled tokens: [B, P + max_new_tokens]. A row that
  writes one of `stop_ids` (an end-of-turn token) stops there, the rest of it filled with the
  first stop id. Row b samples with the key split(rng, B)[b]."""
  if max_new_tokens < 1:
    return jnp.asarray(prompt_BP, jnp.int32)
  graphdef, params = _split(model_or_split, seq2seq=False)
  prompt_BP = np.asarray(jax.device_get(prompt_BP), np.int32)
  B, P = prompt_BP.shape
  out = continue_rows(
    params, prompt_BP, np.full(B, P, np.int32), jax.random.split(rng, B), graphdef=graphdef,
    max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
    stop_ids=stop_ids, persist=True,
  )  # fmt: skip
  return jnp.asarray(out)


def _split(model_or_split, *, seq2seq: bool):
  """(graphdef, state) of a model or a split one, refusing the other kind of model."""
  if isinstance(model_or_split, nnx.Module):
    graphdef, params = nnx.split(model_or_split)
  else:
    graphdef, params = model_or_split
  kind = type(nnx.merge(graphdef, params))  # objects around the same arrays: nothing computed
  is_seq2seq = issubclass(kind, EncoderDecoder)
  if is_seq2seq and not seq2seq:
    raise UserError(
      "This is an encoder-decoder model: generate with engine.generate_seq2seq, which encodes "
      "the prompt and decodes from the start token."
    )
  if seq2seq and not is_seq2seq:
    raise UserError(
      f"{kind.__name__} is not an encoder-decoder: generate with engine.generate, "
      "which continues the prompt."
    )
  return graphdef, params


def generate_stepwise(model, prompt_BP, *, max_new_tokens: int) -> jax.Array:
  """Greedy decoding with full recomputation and no cache: the slow reference the compiled path
  is tested against. `model` is any causal tokens -> logits callable; each step runs it over the
  whole [B, P + max_new_tokens] buffer (the positions after the current one hold 0s, which a
  causal model never sees), so a jitted callable (or a module, jitted here) compiles once
  instead of once per length."""
  if isinstance(model, nnx.Module):
    graphdef, state = nnx.split(model)
    full = jax.jit(lambda state, tokens_BL: nnx.merge(graphdef, state)(tokens_BL))
    model = functools.partial(full, state)
  prompt_BP = jnp.asarray(prompt_BP, jnp.int32)
  P = prompt_BP.shape[1]
  buffer_BL = jnp.pad(prompt_BP, ((0, 0), (0, max_new_tokens)))
  for t in range(P, P + max_new_tokens):
    next_B = jnp.argmax(model(buffer_BL)[:, t - 1], axis=-1)
    buffer_BL = buffer_BL.at[:, t].set(next_B.astype(jnp.int32))
  return buffer_BL


def suppressed(logits_BV: jax.Array, ids: jax.Array) -> jax.Array:
  """`logits_BV` with the tokens `ids` made impossible (the lowest float), as transformers'
  SuppressTokensLogitsProcessor; ids past the vocabulary are ignored."""
  mask_V = jnp.zeros(logits_BV.shape[-1], bool).at[ids].set(True, mode="drop")
  return jnp.where(mask_V, jnp.finfo(logits_BV.dtype).min, logits_BV)


@functools.partial(
  jax.jit, static_argnames=("graphdef", "max_new_tokens", "temperature", "top_k", "top_p")
)
def _generate_seq2seq(
  params,
  inputs_BS,
  segment_ids_BS,
  prompt_BP,
  suppress_ids,
  begin_suppress_ids,
  rng,
  *,
  graphdef,
  max_new_tokens,
  temperature,
  top_k,
  top_p,
):
  model = nnx.merge(graphdef, params)
  P = prompt_BP.shape[1]
  sample = functools.partial(sample_logits, temperature=temperature, top_k=top_k, top_p=top_p)
  source_BSD = model.encode(inputs_BS, segment_ids_BS=segment_ids_BS)  # once, for every step
  # The source's own ids (an audio encoder's stem shortens the frames' ones).
  segment_ids_BS = model.source_segment_ids(inputs_BS, segment_ids_BS)
  num_steps = P - 1 + max_new_tokens  # the prompt's tokens, then the sampled ones but the last
  cache = model.init_cache(source_BSD, num_steps, segment_ids_BS=segment_ids_BS)

  # One step per decoder input: while the prompt lasts, its next token is the next input
  # (forced, one compiled loop either way); after it, the sampled token is.
  def step(carry, xs):
    token_B, cache = carry
    i, step_rng = xs
    logits_BV, cache = model.decode(token_B[:, None], cache=cache)
    logits_BV = suppressed(logits_BV[:, 0], suppress_ids)
    first_BV = suppressed(logits_BV, begin_suppress_ids)  # only the first token after the prompt
    sampled_B = sample(jnp.where(i == P - 1, first_BV, logits_BV), step_rng).astype(jnp.int32)
    next_B = jnp.where(i + 1 < P, prompt_BP[:, jnp.minimum(i + 1, P - 1)], sampled_B)
    return (next_B, cache), next_B

  xs = (jnp.arange(num_steps), jax.random.split(rng, num_steps))
  _, inputs_TB = jax.lax.scan(step, (prompt_BP[:, 0], cache), xs)
  return inputs_TB.T[:, P - 1 :]


def generate_seq2seq(
  model_or_split,
  inputs_BS: jax.Array,
  *,
  max_new_tokens: int,
  rng: jax.Array,
  segment_ids_BS: jax.Array | None = None,
  decoder_prompt: jax.Array | list[int] | None = None,
  suppress_ids: list[int] = (),
  begin_suppress_ids: list[int] = (),
  temperature: float = 1.0,
  top_k: int = 0,
  top_p: float = 1.0,
) -> jax.Array:
  """An encoder-decoder's output for source tokens `inputs_BS` (segment ids: 0 = padding), or
  an audio encoder's feature frames [B, T, C]: `max_new_tokens` tokens sampled after the
  decoder's prompt, [B, max_new_tokens] int32.

  The decoder's prompt is its first tokens, forced: the start token alone by default, or
  `decoder_prompt` ([P] for every row, or [B, P]; Whisper's <|startoftranscript|> <|en|>
  <|transcribe|> <|notimestamps|>). `suppress_ids` are never sampled, `begin_suppress_ids` not
  as the first token after the prompt (transformers' suppress_tokens, begin_suppress_tokens).
  Nothing stops at an end token: cut each row at its first one."""
  graphdef, params = _split(model_or_split, seq2seq=True)
  inputs_BS = jnp.asarray(inputs_BS)
  if jnp.issubdtype(inputs_BS.dtype, jnp.integer):
    inputs_BS = inputs_BS.astype(jnp.int32)
  B = inputs_BS.shape[0]
  if max_new_tokens < 1:
    return jnp.zeros((B, 0), jnp.int32)
  if segment_ids_BS is None:
    segment_ids_BS = jnp.ones(inputs_BS.shape[:2], jnp.int32)
  if decoder_prompt is None:
    decoder_prompt = [nnx.merge(graphdef, params).decoder_start_id]
  prompt_BP = jnp.asarray(decoder_prompt, jnp.int32)
  if prompt_BP.ndim == 1:
    prompt_BP = jnp.broadcast_to(prompt_BP, (B, prompt_BP.shape[0]))
  if prompt_BP.shape[0] != B or prompt_BP.shape[1] < 1:
    raise UserError(
      f"decoder_prompt has shape {prompt_BP.shape}: give [P] or [{B}, P] tokens, P >= 1."
    )
  return _generate_seq2seq(
    params,
    inputs_BS,
    jnp.asarray(segment_ids_BS, jnp.int32),
    prompt_BP,
    jnp.asarray([i for i in suppress_ids if i >= 0], jnp.int32),
    jnp.asarray([i for i in begin_suppress_ids if i >= 0], jnp.int32),
    rng,
    graphdef=graphdef,
    max_new_tokens=max_new_tokens,
    temperature=float(temperature),
    top_k=int(top_k),
    top_p=float(top_p),
  )


def generate_seq2seq_stepwise(
  model,
  inputs_BS,
  *,
  max_new_tokens: int,
  segment_ids_BS=None,
  decoder_prompt=None,
  suppress_ids=(),
  begin_suppress_ids=(),
):
  """Greedy encoder-decoder decoding one Python step at a time, the whole model (encoder
  included) recomputed for every token: the slow reference of `generate_seq2seq` (the same
  prompt and suppressed tokens)."""
  B = inputs_BS.shape[0]
  prompt = [model.decoder_start_id] if decoder_prompt is None else decoder_prompt
  decoder_BT = jnp.broadcast_to(jnp.asarray(prompt, jnp.int32), (B, len(prompt)))
  # Jitted per length: op-by-op dispatch of the whole model is far slower on CPU.
  forward = nnx.jit(lambda model, x, d, s: model(x, d, segment_ids_BS=s))
  for t in range(max_new_tokens):
    logits_BV = forward(model, inputs_BS, decoder_BT, segment_ids_BS)[:, -1]
    logits_BV = suppressed(logits_BV, jnp.asarray(suppress_ids, jnp.int32))
    if t == 0:
      logits_BV = suppressed(logits_BV, jnp.asarray(begin_suppress_ids, jnp.int32))
    next_B = jnp.argmax(logits_BV, axis=-1)
    decoder_BT = jnp.concatenate([decoder_BT, next_B[:, None].astype(jnp.int32)], axis=1)
  return decoder_BT[:, len(prompt) :]
