"""Llama model invariants: causality by gradients, KV-cache decoding == full forward (for each
attention and position variant), packing, jit == eager, and generation with the cache (the
sampling rules themselves: tests/common/test_sampling.py)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from nnx_zoo.common import engine, modifiers
from nnx_zoo.common.models import build
from nnx_zoo.common.nn import position
from nnx_zoo.zoo.llama import model as llama

V = 256  # the tiny preset's vocabulary


def tiny(variant="base", **overrides):
  """The tiny preset with weights large enough that attention is far from uniform, random norm
  scales and biases, and one position or attention variant."""
  cfg = llama.config("tiny", **overrides)
  cfg.init_std = 0.2
  if variant == "alibi":
    cfg = modifiers.rope_to_alibi(cfg)
  elif variant == "learned":
    cfg = modifiers.replace(
      cfg, modifiers.is_kind("rope"), lambda _: position.config("learned", max_len=32)
    )
  elif variant == "yarn":
    cfg = modifiers.rope_to_yarn(cfg, factor=4.0, original_max_len=8)
  elif variant == "bidirectional":
    cfg.attention.mask = "bidirectional"
  model = build(cfg, seed=0)
  rng = np.random.default_rng(1)
  for _, p in nnx.iter_graph(model):
    if isinstance(p, nnx.Param) and p[...].ndim == 1:
      p[...] = p[...] + jnp.asarray(0.2 * rng.standard_normal(p[...].shape), jnp.float32)
  return model


def tokens(seed, shape):
  return jnp.asarray(np.random.default_rng(seed).integers(0, V, shape), jnp.int32)


@nnx.jit
def _forward(model, tokens_BT, segment_ids_BT):
  return model(tokens_BT, segment_ids_BT=segment_ids_BT)


def forward(model, tokens_BT, segment_ids_BT=None):
  """The jitted forward; always with segment ids (one segment by default: the same positions
  and mask as none), so that packed and plain calls share one compiled program."""
  if segment_ids_BT is None:
    segment_ids_BT = jnp.ones(tokens_BT.shape, jnp.int32)
  return _forward(model, tokens_BT, segment_ids_BT)


@nnx.jit
def forward_cached(model, tokens_BT, cache):
  return model(tokens_BT, cache=cache)


# ---------------------------------------------------------------------------------------------
# Causality by gradients: d logits[t] / d (the embedding of token s).


@jax.jit
def _dependence(graphdef, state, tokens_1T, w_V):
  """[T, S]: |d (logits[t] . w) / d x[s]|, through the embedding rows of distinct tokens (each
  row feeds exactly one position, so its gradient is the gradient of that input)."""

  def f(table_VD):
    model = nnx.merge(graphdef, state, copy=True)
    model.embed.embedding[...] = table_VD
    return model(tokens_1T)[0] @ w_V

  jac_TVD = jax.jacrev(f)(state["embed"]["embedding"][...])
  return jnp.sqrt(jnp.sum(jac_TVD[:, tokens_1T[0]] ** 2, axis=-1))


def dependence(model, T=8):
  toks = jnp.asarray(np.random.default_rng(2).permutation(V)[:T][None], jnp.int32)
  w = jnp.asarray(np.random.default_rng(3).standard_normal(V), jnp.float32)
  return np.asarray(_dependence(*nnx.split(model), toks, w))


def test_causal_by_gradients():
  T = 8
  dep = dependence(tiny(), T)
  future = np.triu(np.ones((T, T), bool), k=1)
  assert np.all(dep[future] == 0.0)  # exactly: masked probabilities are exactly zero
  assert np.all(dep[~future] > 1e-4)


def test_sliding_window_receptive_field_by_gradients():
  """Causal, and each of the L layers reaches W - 1 tokens further back: s in [t-L(W-1), t].
  With ALiBi, whose bias is the other way position reaches attention."""
  T, W, L = 10, 3, 2
  dep = dependence(tiny("alibi", window=W), T)
  t, s = np.meshgrid(np.arange(T), np.arange(T), indexing="ij")
  seen = (s <= t) & (s >= t - L * (W - 1))
  assert np.all(dep[~seen] == 0.0)
  assert np.all(dep[seen] > 1e-4)


def test_bidirectional_depends_on_every_position():
  dep = dependence(tiny("bidirectional"))
  assert np.all(dep > 1e-4)


# ---------------------------------------------------------------------------------------------
# KV-cache decoding equals the full forward.


B, P, T = 2, 5, 12  # decoding: batch, prompt length, total length


@pytest.mark.parametrize(
  "variant,overrides",
  [
    ("base", {}),
    ("base", dict(window=4)),
    ("base", dict(qk_norm="rms", qkv_bias=True, num_kv_heads=1)),
    ("alibi", {}),
    ("learned", {}),
    ("base", dict(num_experts=3, top_k=2, hidden_dim=32)),
  ],
  ids=["rope-gqa", "window4", "qknorm-qkvbias-mqa", "alibi", "learned", "moe"],
)
@pytest.mark.slow
def test_cached_decoding_equals_full_forward(variant, overrides):
  model = tiny(variant, **overrides)
  toks = tokens(4, (B, T))
  full = np.asarray(forward(model, toks))
  cache = model.init_cache(B, 16)
  logits, cache = forward_cached(model, toks[:, :P], cache)
  outs = [np.asarray(logits)]
  for t in range(P, T):
    logits, cache = forward_cached(model, toks[:, t : t + 1], cache)
    outs.append(np.asarray(logits))
  assert all((np.asarray(c.index) == T).all() for c in cache)
  np.testing.assert_allclose(np.concatenate(outs, 1), full, atol=1e-5, rtol=1e-5)


def test_cached_prefill_then_chunks():
  """A prompt, then a chunk of P tokens (so it runs the prompt's compiled program at a later
  cache index), then single tokens, against the full forward."""
  model = tiny(window=4)
  toks = tokens(6, (B, T))
  cache = model.init_cache(B, 16)
  outs = []
  for a, b in [(0, P), (P, 2 * P)] + [(t, t + 1) for t in range(2 * P, T)]:
    logits, cache = forward_cached(model, toks[:, a:b], cache)
    outs.append(np.asarray(logits))
  np.testing.assert_allclose(np.concatenate(outs, 1), forward(model, toks), atol=1e-5)


def test_window_changes_the_logits():
  """So the window test above is not vacuous: with window=4, late logits differ."""
  toks = tokens(5, (B, T))
  plain = np.asarray(forward(tiny(), toks))
  windowed = np.asarray(forward(tiny(window=4), toks))
  np.testing.assert_allclose(windowed[:, :4], plain[:, :4], atol=1e-5)
  assert np.abs(windowed[:, 4:] - plain[:, 4:]).max() > 1e-2


# ---------------------------------------------------------------------------------------------
# Packing, jit == eager


@pytest.mark.parametrize("variant", ["base", "alibi"])
def test_packed_documents_equal_each_document_alone(variant):
  """Row 0 packs documents a then b, row 1 packs b then a: a document after another one gives
  the logits it gives at the start of a row, where it is alone."""
  model = tiny(variant)
  a, b = tokens(7, (1, 7)), tokens(8, (1, T - 7))
  seg = jnp.array([[1] * 7 + [2] * (T - 7), [1] * (T - 7) + [2] * 7])
  out = np.asarray(forward(model, jnp.concatenate([a, b, b, a], 1).reshape(2, T), seg))
  np.testing.assert_allclose(out[1, T - 7 :], out[0, :7], atol=1e-5)
  np.testing.assert_allclose(out[0, 7:], out[1, : T - 7], atol=1e-5)
  # Without the segment ids, the second document does see the first.
  assert not np.allclose(
    forward(model, jnp.concatenate([a, b], 1))[0, 7:], out[1, : T - 7], atol=1e-3
  )


def test_jit_equals_eager():
  model = tiny(qk_norm="rms", qkv_bias=True, num_kv_heads=1)
  toks = tokens(9, (B, T))
  eager = model(toks)
  assert eager.shape == (B, T, V)
  np.testing.assert_allclose(forward(model, toks), eager, atol=1e-5, rtol=1e-5)


def test_tied_embeddings_use_the_table():
  model = tiny(tie_embeddings=True)
  assert model.lm_head is None
  state = nnx.state(model, nnx.Param)
  assert "lm_head" not in state
  toks = tokens(10, (B, T))
  before = np.asarray(forward(model, toks))
  model.embed.embedding[...] = model.embed.embedding[...] * 2.0
  assert not np.allclose(forward(model, toks), before, atol=1e-3)


# ---------------------------------------------------------------------------------------------
# Sampling


def test_generate_equals_stepwise_greedy():
  model = tiny()
  prompt = tokens(11, (B, 3))
  slow = engine.generate_stepwise(lambda t: forward(model, t), prompt, max_new_tokens=3)
  greedy = engine.generate(model, prompt, max_new_tokens=3, rng=jax.random.key(0), temperature=0)
  assert greedy.shape == (B, 6)
  np.testing.assert_array_equal(greedy, slow)
  np.testing.assert_array_equal(greedy[:, :3], prompt)
  # The sampling path (categorical, per-step keys) with top_k=1 is greedy too.
  top1 = engine.generate(
    nnx.split(model),
    prompt,
    max_new_tokens=3,
    rng=jax.random.key(1),
    temperature=1.0,
    top_k=1,
  )
  np.testing.assert_array_equal(top1, slow)
  assert engine.generate(model, prompt, max_new_tokens=0, rng=jax.random.key(0)) is prompt
