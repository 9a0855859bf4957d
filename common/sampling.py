"""Sampling from a decoder with its KV cache: one loop for every caller (`begin`, then `decode`
in resumable chunks; docs/sampling.md), over ragged prompts, stopping at stop ids, with no
Python per token. Greedy, temperature, top-k and top-p. An encoder-decoder (T5, Whisper) runs
its encoder once on its input, then decodes after a forced decoder prompt, with tokens it may
not write (`generate_seq2seq`)."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from nnx_zoo.common import programs
from nnx_zoo.common.errors import UserError
from nnx_zoo.common.nn.encoder_decoder import EncoderDecoder


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


# A prompt is padded to its bucket (`bucket` from this many tokens: 64, 96, 128, 192, ...) before
# the prefill: prompts of nearby lengths share one compiled program (and its copy in the
# persistent compilation cache).
PROMPT_BUCKET = 64


# --- the one sampling loop ---
#
# Every caller samples through `begin` and `decode`: `generate` (zoo generate, zoo chat),
# `continue_rows` (GRPO's rollouts, DPO's on-policy replies), lm-eval's generate_until. Rows are
# ragged: row b's prompt is its first lengths_B[b] tokens, left-aligned. `begin` runs one prefill
# over the first `prefill` tokens and rewinds the cache to the shortest prompt; from there every
# step writes one token a row at the cache's one index t, the row's own prompt token while it
# lasts (forced) and a sampled one after. Row b's token at t is drawn with fold_in(keys_B[b], t):
# a row's tokens depend on its prompt and key only, not on the rows beside it, the padding, or
# how the steps were split into calls. A row stops at its first token of `stop_ids` after its
# prompt, or with its max_new_tokens; after that it holds the first stop id (0 without one).
# `decode` runs at most `steps` steps and returns the state, which a later call continues: the
# host checks what only it can (lm-eval's stop strings) between calls and may mark rows done.


def bucket(n: int, *, minimum: int = 16) -> int:
  """The padded length for `n` tokens: the next of minimum, 1.5x, 2x, 3x, 4x, ... of it (powers
  of two and 1.5x them from 16: 16, 24, 32, 48, 64, 96, ...), so a row wastes at most a third
  and a range of lengths compiles a few programs."""
  size = minimum
  while size < n:
    size = size * 3 // 2 if size & (size - 1) == 0 else size // 3 * 4
  return size


def bucket_below(n: int, *, minimum: int = 16) -> int:
  """The largest bucket length at most `n` (0 below `minimum`): a prefill a batch's rows all
  fill."""
  size, below = minimum, 0
  while size <= n:
    size, below = bucket(size + 1, minimum=minimum), size
  return below


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class State:
  """Where the loop is: tokens_BL (each row's prompt, then what it has written), the prompts'
  lengths, each row's end (its length plus max_new_tokens), the KV cache, the logits of the
  last token fed, the next position t, which rows are done, and each row's key."""

  tokens_BL: jax.Array
  lengths_B: jax.Array
  limits_B: jax.Array
  cache: list
  logits_BV: jax.Array
  t: jax.Array
  done_B: jax.Array
  keys_B: jax.Array


@functools.partial(jax.jit, static_argnames=("graphdef", "prefill", "max_new_tokens"))
def begin(params, prompt_BP, lengths_B, keys_B, *, graphdef, prefill: int, max_new_tokens: int):
  """The loop's state for ragged prompts (row b: the first lengths_B[b] tokens of prompt_BP,
  at least 1) to be continued by up to `max_new_tokens` tokens: room for P + max_new_tokens
  tokens a row, and the first `prefill` tokens (1 to P; static: one program per value) run as
  one prefill. The cache is rewound to the shortest prompt: a causal model's logits there never
  saw what lies after, and the steps overwrite it."""
  model = nnx.merge(graphdef, params)
  B, P = prompt_BP.shape
  tokens_BL = jnp.pad(jnp.asarray(prompt_BP, jnp.int32), ((0, 0), (0, max_new_tokens)))
  lengths_B = jnp.asarray(lengths_B, jnp.int32)
  cache = model.init_cache(B, P + max_new_tokens)
  logits_BKV, cache = model(tokens_BL[:, :prefill], cache=cache)
  # The shortest prompt (a row of length 0 is padding: nothing of it is read).
  start = jnp.minimum(jnp.min(jnp.where(lengths_B > 0, lengths_B, prefill)), prefill)
  cache = [c.rewound(start) for c in cache]
  logits_BV = jax.lax.dynamic_index_in_dim(logits_BKV, start - 1, axis=1, keepdims=False)
  return State(
    tokens_BL=tokens_BL,
    lengths_B=lengths_B,
    limits_B=lengths_B + max_new_tokens,
    cache=cache,
    logits_BV=logits_BV,
    t=start,
    done_B=jnp.zeros((B,), bool),
    keys_B=keys_B,
  )


@functools.partial(
  jax.jit,
  static_argnames=("graphdef", "steps", "temperature", "top_k", "top_p", "stop_ids"),
  donate_argnames=("state",),
)
def decode(
  params,
  state: State,
  *,
  graphdef,
  steps: int,
  temperature: float,
  top_k: int = 0,
  top_p: float = 1.0,
  stop_ids: tuple[int, ...] = (),
) -> State:
  """The state after at most `steps` more steps (fewer once every row is done, or the rows are
  full): the one loop every sampler runs. `stop_ids` as `stop_tuple` gives them."""
  model = nnx.merge(graphdef, params)
  options = dict(temperature=temperature, top_k=top_k, top_p=top_p)
  stops = jnp.asarray(stop_ids or (-1,), jnp.int32)
  fill = jnp.int32(stop_ids[0] if stop_ids else 0)
  L = state.tokens_BL.shape[1]
  end = jnp.minimum(jnp.max(state.limits_B), L)

  def one(logits_V, key):
    return sample_logits(logits_V[None], key, **options)[0]

  def cond(carry):
    i, s = carry
    return (i < steps) & (s.t < end) & ~jnp.all(s.done_B)

  def body(carry):
    i, s = carry
    t = s.t
    keys_B = jax.vmap(jax.random.fold_in, in_axes=(0, None))(s.keys_B, t)
    sampled_B = jax.vmap(one)(s.logits_BV, keys_B).astype(jnp.int32)
    prompt_B = jax.lax.dynamic_index_in_dim(s.tokens_BL, t, axis=1, keepdims=False)
    token_B = jnp.where(t < s.lengths_B, prompt_B, sampled_B)  # the prompt's, while it lasts
    token_B = jnp.where(s.done_B, fill, token_B)
    tokens_BL = jax.lax.dynamic_update_index_in_dim(s.tokens_BL, token_B, t, axis=1)
    stopped_B = (t >= s.lengths_B) & jnp.isin(token_B, stops)
    done_B = s.done_B | stopped_B | (t + 1 >= s.limits_B)
    logits_B1V, cache = model(token_B[:, None], cache=s.cache)  # the last one is not needed
    s = dataclasses.replace(
      s, tokens_BL=tokens_BL, cache=cache, logits_BV=logits_B1V[:, 0], t=t + 1, done_B=done_B
    )
    return i + 1, s

  return jax.lax.while_loop(cond, body, (jnp.int32(0), state))[1]


def stop_tuple(stop_ids) -> tuple[int, ...]:
  """Stop ids as `decode` takes them (a static argument): sorted, once each, None and negative
  ids dropped."""
  return tuple(sorted({int(i) for i in stop_ids if i is not None and i >= 0}))


# `generate`'s program is `begin` and then `decode`; tests count its programs by this name.
_generate = decode


def continue_rows(
  params,
  prompt_BP,
  lengths_B,
  keys_B,
  *,
  graphdef,
  prefill: int,
  max_new_tokens: int,
  temperature: float,
  top_k: int = 0,
  top_p: float = 1.0,
  stop_ids: tuple[int, ...] = (),
):
  """Rows of prompts of different lengths continued in one call (`begin`, then `decode` to the
  end): [B, P + max_new_tokens], row b its prompt (the first `lengths_B[b]` tokens of
  `prompt_BP`, every row at least `prefill` long) and then its max_new_tokens sampled tokens,
  row b's token at index t drawn with fold_in(keys_B[b], t). A row stops at one of `stop_ids`
  (single-token ends of turn); what a row holds after its stop, or after its max_new_tokens, is
  the first stop id (0 without one)."""
  state = begin(
    params, prompt_BP, lengths_B, keys_B, graphdef=graphdef, prefill=prefill,
    max_new_tokens=max_new_tokens,
  )  # fmt: skip
  options = dict(temperature=float(temperature), top_k=int(top_k), top_p=float(top_p))
  state = decode(
    params, state, graphdef=graphdef, steps=max_new_tokens + prompt_BP.shape[1] - prefill,
    stop_ids=stop_tuple(stop_ids), **options,
  )  # fmt: skip
  return state.tokens_BL


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
      "This is an encoder-decoder model: generate with sampling.generate_seq2seq, which encodes "
      "the prompt and decodes from the start token."
    )
  if seq2seq and not is_seq2seq:
    raise UserError(
      f"{kind.__name__} is not an encoder-decoder: generate with sampling.generate, "
      "which continues the prompt."
    )
  return graphdef, params


def generate(
  model_or_split,
  prompt_BP: jax.Array,
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
  first stop id, and decoding ends once every row has stopped. Row b samples with the key
  split(rng, B)[b] (the one loop's rule: fold_in(its key, t) for the token at t)."""
  if max_new_tokens < 1:
    return jnp.asarray(prompt_BP, jnp.int32)
  prompt_BP = np.asarray(prompt_BP, np.int32)  # padded and joined on the host: no eager programs
  B, P = prompt_BP.shape
  padded_BW = np.pad(prompt_BP, ((0, 0), (0, bucket(P, minimum=PROMPT_BUCKET) - P)))
  options = dict(temperature=temperature, top_k=top_k, top_p=top_p, stop_ids=stop_ids)
  program, params, key = _program(model_or_split, B, P, max_new_tokens, rng, **options)
  tokens_BL = program(jax.tree.leaves(params), padded_BW, np.full(B, P, np.int32), key)
  new_BN = np.asarray(tokens_BL)[:, P : P + max_new_tokens]
  return jnp.asarray(np.concatenate([prompt_BP, new_BN], axis=1))


def prepare(
  model_or_split,
  batch: int,
  prompt_len: int,
  *,
  max_new_tokens: int,
  rng: jax.Array,
  temperature: float = 1.0,
  top_k: int = 0,
  top_p: float = 1.0,
  stop_ids: tuple[int, ...] = (),
):
  """Ready `generate`'s program for `batch` prompts of `prompt_len` tokens (any length in its
  bucket) and these options: loaded from the persistent compilation cache, or traced and
  compiled. The params may be abstract (`jax.ShapeDtypeStruct`s): a caller readies the program
  while they are restored. Without a persistent cache, nothing is done."""
  if max_new_tokens >= 1:
    options = dict(temperature=temperature, top_k=top_k, top_p=top_p, stop_ids=stop_ids)
    _program(model_or_split, batch, prompt_len, max_new_tokens, rng, **options)


def _program(model_or_split, B, P, max_new_tokens, rng, *, temperature, top_k, top_p, stop_ids):
  """`generate`'s program for [B, P] prompts (`begin` over the prompt's bucket, then `decode`
  for max_new_tokens steps), traced once across processes where a persistent compilation cache
  is on (common/programs.py), with the params and the key as it takes them: its arguments are
  arrays, the params as their leaves and the key as its data."""
  graphdef, params = _split(model_or_split, seq2seq=False)
  options = dict(temperature=float(temperature), top_k=int(top_k), top_p=float(top_p))
  static = dict(
    graphdef=graphdef, max_new_tokens=max_new_tokens, stop_ids=stop_tuple(stop_ids), **options
  )
  leaves, treedef = jax.tree.flatten(params)
  typed = jnp.issubdtype(rng.dtype, jax.dtypes.prng_key)
  impl = jax.random.key_impl(rng) if typed else None
  W = bucket(P, minimum=PROMPT_BUCKET)

  def run(leaves, padded_BW, lengths_B, key):
    key = jax.random.wrap_key_data(key, impl=impl) if typed else key
    params = jax.tree.unflatten(treedef, leaves)
    keys_B = jax.random.split(key, B)
    state = begin(
      params, padded_BW, lengths_B, keys_B, graphdef=graphdef, prefill=W,
      max_new_tokens=max_new_tokens,
    )  # fmt: skip
    state = decode(
      params, state, graphdef=graphdef, steps=max_new_tokens, stop_ids=static["stop_ids"],
      **options,
    )  # fmt: skip
    return state.tokens_BL

  key = jax.random.key_data(rng) if typed else rng
  shape = jax.ShapeDtypeStruct
  args = (leaves, shape((B, W), jnp.int32), shape((B,), jnp.int32), shape(key.shape, key.dtype))
  return programs.load("generate", run, args, static=(static, treedef, impl)), params, key


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
