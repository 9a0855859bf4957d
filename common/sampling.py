"""Sampling from a decoder with its KV cache: one compiled prefill, then a compiled scan over the
new tokens (no Python per token). Greedy, temperature, top-k and top-p. An encoder-decoder (T5)
runs its encoder once on the prompt, then decodes the same way (`generate_seq2seq`)."""

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from nnx_zoo.common.errors import UserError
from nnx_zoo.common.nn.transformer import EncoderDecoder


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


@functools.partial(
  jax.jit, static_argnames=("graphdef", "max_new_tokens", "temperature", "top_k", "top_p")
)
def _generate(params, prompt_BP, rng, *, graphdef, max_new_tokens, temperature, top_k, top_p):
  model = nnx.merge(graphdef, params)
  B, P = prompt_BP.shape
  sample = functools.partial(sample_logits, temperature=temperature, top_k=top_k, top_p=top_p)
  cache = model.init_cache(B, P + max_new_tokens)
  logits_BPV, cache = model(prompt_BP, cache=cache)
  rng, first_rng = jax.random.split(rng)
  first_B = sample(logits_BPV[:, -1], first_rng)

  def step(carry, step_rng):
    token_B, cache = carry
    logits_B1V, cache = model(token_B[:, None], cache=cache)
    next_B = sample(logits_B1V[:, 0], step_rng)
    return (next_B, cache), token_B

  rngs = jax.random.split(rng, max_new_tokens - 1)
  (last_B, _), tokens_NB = jax.lax.scan(step, (first_B, cache), rngs)
  new_BN = jnp.concatenate([tokens_NB.T, last_B[:, None]], axis=1)
  return jnp.concatenate([prompt_BP, new_BN.astype(prompt_BP.dtype)], axis=1)


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
) -> jax.Array:
  """The prompt followed by `max_new_tokens` sampled tokens: [B, P + max_new_tokens]."""
  graphdef, params = _split(model_or_split, seq2seq=False)
  if max_new_tokens < 1:
    return prompt_BP
  return _generate(
    params,
    jnp.asarray(prompt_BP, jnp.int32),
    rng,
    graphdef=graphdef,
    max_new_tokens=max_new_tokens,
    temperature=float(temperature),
    top_k=int(top_k),
    top_p=float(top_p),
  )


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


@functools.partial(
  jax.jit, static_argnames=("graphdef", "max_new_tokens", "temperature", "top_k", "top_p")
)
def _generate_seq2seq(
  params, inputs_BS, segment_ids_BS, rng, *, graphdef, max_new_tokens, temperature, top_k, top_p
):
  model = nnx.merge(graphdef, params)
  B = inputs_BS.shape[0]
  sample = functools.partial(sample_logits, temperature=temperature, top_k=top_k, top_p=top_p)
  source_BSD = model.encode(inputs_BS, segment_ids_BS=segment_ids_BS)  # once, for every step
  # The source's own ids (an audio encoder's stem shortens the frames' ones).
  segment_ids_BS = model.source_segment_ids(inputs_BS, segment_ids_BS)
  cache = model.init_cache(source_BSD, max_new_tokens, segment_ids_BS=segment_ids_BS)

  def step(carry, step_rng):
    token_B, cache = carry
    logits_B1V, cache = model.decode(token_B[:, None], cache=cache)
    next_B = sample(logits_B1V[:, 0], step_rng)
    return (next_B, cache), next_B

  start_B = jnp.full((B,), model.decoder_start_id, jnp.int32)
  _, new_NB = jax.lax.scan(step, (start_B, cache), jax.random.split(rng, max_new_tokens))
  return new_NB.T.astype(jnp.int32)


def generate_seq2seq(
  model_or_split,
  inputs_BS: jax.Array,
  *,
  max_new_tokens: int,
  rng: jax.Array,
  segment_ids_BS: jax.Array | None = None,
  temperature: float = 1.0,
  top_k: int = 0,
  top_p: float = 1.0,
) -> jax.Array:
  """An encoder-decoder's output for source tokens `inputs_BS` (segment ids: 0 = padding), or
  an audio encoder's feature frames [B, T, C]: `max_new_tokens` tokens sampled after the
  decoder's start token, [B, max_new_tokens] int32."""
  graphdef, params = _split(model_or_split, seq2seq=True)
  inputs_BS = jnp.asarray(inputs_BS)
  if jnp.issubdtype(inputs_BS.dtype, jnp.integer):
    inputs_BS = inputs_BS.astype(jnp.int32)
  if max_new_tokens < 1:
    return jnp.zeros((inputs_BS.shape[0], 0), jnp.int32)
  if segment_ids_BS is None:
    segment_ids_BS = jnp.ones(inputs_BS.shape[:2], jnp.int32)
  return _generate_seq2seq(
    params,
    inputs_BS,
    jnp.asarray(segment_ids_BS, jnp.int32),
    rng,
    graphdef=graphdef,
    max_new_tokens=max_new_tokens,
    temperature=float(temperature),
    top_k=int(top_k),
    top_p=float(top_p),
  )


def generate_seq2seq_stepwise(model, inputs_BS, *, max_new_tokens: int, segment_ids_BS=None):
  """Greedy encoder-decoder decoding one Python step at a time, the whole model (encoder
  included) recomputed for every token: the slow reference of `generate_seq2seq`."""
  B = inputs_BS.shape[0]
  decoder_BT = jnp.full((B, 1), model.decoder_start_id, jnp.int32)
  # Jitted per length: op-by-op dispatch of the whole model is far slower on CPU.
  forward = nnx.jit(lambda model, x, d, s: model(x, d, segment_ids_BS=s))
  for _ in range(max_new_tokens):
    logits_BTV = forward(model, inputs_BS, decoder_BT, segment_ids_BS)
    next_B = jnp.argmax(logits_BTV[:, -1], axis=-1)
    decoder_BT = jnp.concatenate([decoder_BT, next_B[:, None].astype(jnp.int32)], axis=1)
  return decoder_BT[:, 1:]
