"""GPT-2 model invariants: causal, KV-cache decoding == full forward, packing restarts the learned
positions, tied output projection. (Parity with transformers: tests/common/test_hub.py.)"""

import jax.numpy as jnp
import numpy as np
from flax import nnx

from nnx_zoo.common.models import build
from nnx_zoo.zoo.gpt2 import model as gpt2

V, B, T = 256, 2, 10


def tiny(**overrides):
  cfg = gpt2.config("tiny", **overrides)
  cfg.init_std = 0.2  # attention far from uniform
  return build(cfg, seed=0)


def tokens(seed, shape=(B, T)):
  return jnp.asarray(np.random.default_rng(seed).integers(0, V, shape), jnp.int32)


def test_logits_shape_and_causal():
  model = tiny()
  a = tokens(0)
  b = a.at[:, 6:].set(tokens(1)[:, 6:])  # a different future
  la, lb = np.asarray(model(a)), np.asarray(model(b))
  assert la.shape == (B, T, V)
  np.testing.assert_allclose(la[:, :6], lb[:, :6], atol=1e-6)
  assert np.abs(la[:, 6:] - lb[:, 6:]).max() > 1e-2


def test_cached_decoding_equals_full_forward():
  model = tiny()
  call = nnx.jit(lambda model, x, cache=None: model(x, cache=cache))  # a compile per shape
  toks = tokens(2)
  full = np.asarray(call(model, toks))
  cache = model.init_cache(B, 16)
  logits, cache = call(model, toks[:, :4], cache)
  outs = [np.asarray(logits)]
  for t in range(4, T):
    logits, cache = call(model, toks[:, t : t + 1], cache)
    outs.append(np.asarray(logits))
  np.testing.assert_allclose(np.concatenate(outs, 1), full, atol=1e-5)


def test_packed_documents_restart_positions():
  """The second document of a packed row gives the logits it gives alone at a row's start."""
  model = tiny()
  call = nnx.jit(lambda model, x, segment_ids_BT=None: model(x, segment_ids_BT=segment_ids_BT))
  a, b = tokens(3, (1, 6)), tokens(4, (1, 4))
  packed = call(model, jnp.concatenate([a, b], 1), jnp.array([[1] * 6 + [2] * 4]))
  np.testing.assert_allclose(packed[:, 6:], call(model, b), atol=1e-5)


def test_tied_and_untied_output():
  """Tied: the output layer is the embedding table, so changing the row of a token absent from
  the input changes that token's logit and no other."""
  tied = tiny()
  assert tied.lm_head is None and "lm_head" not in nnx.state(tied, nnx.Param)
  toks = tokens(5) % 200
  before = np.asarray(tied(toks))
  tied.embed.embedding[...] = tied.embed.embedding[...].at[200].multiply(2.0)
  after = np.asarray(tied(toks))
  assert np.abs(after[..., 200] - before[..., 200]).min() > 1e-4
  np.testing.assert_array_equal(np.delete(after, 200, -1), np.delete(before, 200, -1))
  untied = tiny(tie_embeddings=False)
  assert untied.lm_head.kernel.shape == (64, V)
