"""Sampling from a decoder with its KV cache: one compiled prefill, then a compiled scan over the
new tokens (no Python per token). Greedy, temperature, top-k and top-p."""

import functools

import jax
import jax.numpy as jnp
from flax import nnx


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
  if isinstance(model_or_split, nnx.Module):
    graphdef, params = nnx.split(model_or_split)
  else:
    graphdef, params = model_or_split
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
  """Greedy decoding one Python step at a time with full recomputation: the slow reference the
  compiled path is tested against."""
  tokens = jnp.asarray(prompt_BP, jnp.int32)
  for _ in range(max_new_tokens):
    next_B = jnp.argmax(model(tokens)[:, -1], axis=-1)
    tokens = jnp.concatenate([tokens, next_B[:, None].astype(tokens.dtype)], axis=1)
  return tokens
