"""BERT model invariants: bidirectional, padding never reaches a real token, token types and the
pooler. (Parity with transformers: tests/common/test_hub.py.)"""

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from nnx_zoo.common.errors import UserError
from nnx_zoo.common.models import build
from nnx_zoo.zoo.bert import model as bert

V, B, T, D = 256, 2, 8, 64


def tiny(**overrides):
  cfg = bert.config("tiny", **overrides)
  cfg.init_std = 0.2
  return build(cfg, seed=0)


def tokens(seed, shape=(B, T)):
  return jnp.asarray(np.random.default_rng(seed).integers(1, V, shape), jnp.int32)


def test_bidirectional():
  model = tiny()
  call = nnx.jit(lambda model, x: model(x))  # one program, not one per op
  a = tokens(0)
  h = np.asarray(call(model, a))
  assert h.shape == (B, T, D)
  changed = np.asarray(call(model, a.at[:, -1].set((a[:, -1] + 1) % V)))
  assert np.abs(changed[:, 0] - h[:, 0]).max() > 1e-3  # the first token sees the last


def test_padding_never_reaches_real_tokens():
  """Real tokens' outputs do not depend on how much padding follows, nor on its ids."""
  model = tiny()
  call = nnx.jit(lambda model, x, mask=None: model(x, attention_mask=mask))
  real = tokens(1, (1, 5))
  alone = np.asarray(call(model, real))
  pad = tokens(2, (1, 3))
  padded = jnp.concatenate([real, pad], 1)
  mask = jnp.array([[1] * 5 + [0] * 3])
  np.testing.assert_allclose(call(model, padded, mask)[:, :5], alone, atol=1e-5)
  assert np.abs(np.asarray(call(model, padded)[:, :5]) - alone).max() > 1e-3  # without the mask


def test_token_types():
  model = tiny()
  a = tokens(3)
  zeros = jnp.zeros((B, T), jnp.int32)
  np.testing.assert_allclose(model(a), model(a, token_type_ids=zeros), atol=1e-6)
  ones = jnp.ones((B, T), jnp.int32)
  assert np.abs(np.asarray(model(a, token_type_ids=ones) - model(a))).max() > 1e-3


def test_pooler():
  model = tiny()
  h = model(tokens(4))
  pooled = model.pool(h)
  assert pooled.shape == (B, D) and np.abs(np.asarray(pooled)).max() <= 1.0
  bare = tiny(pooler=False)
  assert "pooler" not in nnx.state(bare, nnx.Param)
  with pytest.raises(UserError, match="no pooler"):
    bare.pool(h)
