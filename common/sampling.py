"""Sampling from a decoder with its KV cache: one compiled prefill, then a compiled scan over the
new tokens (no Python per token). Greedy, temperature, top-k and top-p. An encoder-decoder (T5,
Whisper) runs its encoder once on its input, then decodes the same way after a forced decoder
prompt, with tokens it may not write (`generate_seq2seq`)."""

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


# Prompts are padded up to a multiple of this many tokens before the prefill: prompts of nearby
# lengths share one compiled program (and its copy in the persistent compilation cache).
PROMPT_BUCKET = 64


@functools.partial(
  jax.jit,
  static_argnames=("graphdef", "max_new_tokens", "temperature", "top_k", "top_p", "stop_ids"),
)
def _generate(
  params, prompt_BL, length, rng, *, graphdef, max_new_tokens, temperature, top_k, top_p, stop_ids
):
  """[B, max_new_tokens] new tokens after the first `length` tokens of `prompt_BL` (the rest is
  padding). The prefill runs over the padded prompt, and the cache is rewound to `length`: a
  causal model's logits at `length - 1` never saw the padding, and the new tokens overwrite it.
  A row stops at its first token of `stop_ids`, filled with the first stop id after it; the loop
  ends when every row has stopped."""
  model = nnx.merge(graphdef, params)
  B, L = prompt_BL.shape
  sample = functools.partial(sample_logits, temperature=temperature, top_k=top_k, top_p=top_p)
  cache = model.init_cache(B, L + max_new_tokens)
  logits_BLV, cache = model(prompt_BL, cache=cache)
  cache = [c.rewound(length) for c in cache]
  rng, first_rng = jax.random.split(rng)
  first_B = sample(logits_BLV[:, length - 1], first_rng).astype(jnp.int32)
  step_rngs = jax.random.split(rng, max(max_new_tokens - 1, 1))
  stops = jnp.asarray(stop_ids or (-1,), jnp.int32)
  fill = stops[0]

  def cond(carry):
    t, _, _, _, done_B = carry
    return (t < max_new_tokens) & ~jnp.all(done_B)

  def body(carry):
    t, token_B, cache, out_BN, done_B = carry
    out_BN = out_BN.at[:, t].set(token_B)
    done_B = done_B | jnp.isin(token_B, stops)
    logits_B1V, cache = model(token_B[:, None], cache=cache)
    next_B = sample(logits_B1V[:, 0], step_rngs[jnp.minimum(t, max_new_tokens - 2)])
    next_B = jnp.where(done_B, fill, next_B.astype(jnp.int32))
    return t + 1, next_B, cache, out_BN, done_B

  out_BN = jnp.full((B, max_new_tokens), fill, jnp.int32)
  done_B = jnp.zeros((B,), bool)
  carry = (jnp.int32(0), first_B, cache, out_BN, done_B)
  return jax.lax.while_loop(cond, body, carry)[3]


@functools.partial(
  jax.jit,
  static_argnames=(
    "graphdef",
    "prefill",
    "max_new_tokens",
    "temperature",
    "top_k",
    "top_p",
    "stop_ids",
  ),
)
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
  """Rows of prompts of different lengths continued in one compiled call (GRPO's rollouts):
  [B, P + max_new_tokens], row b its prompt (the first `lengths_B[b]` tokens of `prompt_BP`,
  left-aligned, every row at least `prefill` long) and then sampled tokens. The first `prefill`
  tokens run as one prefill; from there a loop writes one token a step, the prompt's own while
  it lasts (forced) and a sampled one after, so a short prompt gets more than max_new_tokens
  (its caller keeps the first max_new_tokens). Row b's token at index t is drawn with
  fold_in(keys_B[b], t): a row's tokens depend on its key and its prompt only, not on the rows
  beside it or the mesh. The loop ends with the longest prompt's max_new_tokens, or before once
  every row has sampled one of `stop_ids` (single-token ends of turn); what a row holds after
  its stop, or after its first max_new_tokens, is undefined."""
  model = nnx.merge(graphdef, params)
  B, P = prompt_BP.shape
  L = P + max_new_tokens
  prompt_BL = jnp.pad(prompt_BP, ((0, 0), (0, max_new_tokens)))
  options = dict(temperature=temperature, top_k=top_k, top_p=top_p)
  stops = jnp.asarray(stop_ids or (-1,), prompt_BL.dtype)

  def draw(logits_BV, t):
    keys = jax.vmap(jax.random.fold_in, in_axes=(0, None))(keys_B, t)
    one = lambda logits_V, key: sample_logits(logits_V[None], key, **options)[0]  # noqa: E731
    sampled_B = jax.vmap(one)(logits_BV, keys).astype(prompt_BL.dtype)
    return jnp.where(t < lengths_B, prompt_BL[:, t], sampled_B)  # the prompt's, while it lasts

  cache = model.init_cache(B, L)
  logits_BPV, cache = model(prompt_BL[:, :prefill], cache=cache)

  end = jnp.minimum(jnp.max(lengths_B) + max_new_tokens, L)  # the longest prompt's last token

  def cond(carry):
    t, _, _, _, done_B = carry
    return (t < end) & ~jnp.all(done_B)

  def body(carry):
    t, buffer_BL, logits_BV, cache, done_B = carry
    token_B = draw(logits_BV, t)
    buffer_BL = buffer_BL.at[:, t].set(token_B)
    done_B = done_B | ((t >= lengths_B) & jnp.isin(token_B, stops))
    logits_B1V, cache = model(token_B[:, None], cache=cache)  # the last one is not needed
    return t + 1, buffer_BL, logits_B1V[:, 0], cache, done_B

  carry = (jnp.int32(prefill), prompt_BL, logits_BPV[:, -1], cache, jnp.zeros((B,), bool))
  return jax.lax.while_loop(cond, body, carry)[1]


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
  first stop id, and decoding ends once every row has stopped."""
  if max_new_tokens < 1:
    return jnp.asarray(prompt_BP, jnp.int32)
  prompt_BP = np.asarray(prompt_BP, np.int32)  # padded and joined on the host: no eager programs
  B, P = prompt_BP.shape
  padded_BL = np.pad(prompt_BP, ((0, 0), (0, -P % PROMPT_BUCKET)))
  options = dict(temperature=temperature, top_k=top_k, top_p=top_p, stop_ids=stop_ids)
  program, params, key = _program(model_or_split, B, P, max_new_tokens, rng, **options)
  new_BN = program(jax.tree.leaves(params), padded_BL, np.int32(P), key)
  return jnp.asarray(np.concatenate([prompt_BP, np.asarray(new_BN)], axis=1))


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
  bucket of PROMPT_BUCKET) and these options: loaded from the persistent compilation cache, or
  traced and compiled. The params may be abstract (`jax.ShapeDtypeStruct`s): a caller readies
  the program while they are restored. Without a persistent cache, nothing is done."""
  if max_new_tokens >= 1:
    options = dict(temperature=temperature, top_k=top_k, top_p=top_p, stop_ids=stop_ids)
    _program(model_or_split, batch, prompt_len, max_new_tokens, rng, **options)


def _program(model_or_split, B, P, max_new_tokens, rng, *, temperature, top_k, top_p, stop_ids):
  """`generate`'s program for [B, P] prompts, traced once across processes where a persistent
  compilation cache is on (common/programs.py), with the params and the key as it takes them:
  its arguments are arrays, the params as their leaves and the key as its data."""
  graphdef, params = _split(model_or_split, seq2seq=False)
  static = dict(
    graphdef=graphdef,
    max_new_tokens=max_new_tokens,
    temperature=float(temperature),
    top_k=int(top_k),
    top_p=float(top_p),
    stop_ids=tuple(sorted({int(i) for i in stop_ids if i is not None and i >= 0})),
  )
  leaves, treedef = jax.tree.flatten(params)
  typed = jnp.issubdtype(rng.dtype, jax.dtypes.prng_key)
  impl = jax.random.key_impl(rng) if typed else None

  def run(leaves, padded_BL, length, key):
    key = jax.random.wrap_key_data(key, impl=impl) if typed else key
    return _generate(jax.tree.unflatten(treedef, leaves), padded_BL, length, key, **static)

  key = jax.random.key_data(rng) if typed else rng
  shape = jax.ShapeDtypeStruct
  L = P + -P % PROMPT_BUCKET
  args = (leaves, shape((B, L), jnp.int32), shape((), jnp.int32), shape(key.shape, key.dtype))
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
