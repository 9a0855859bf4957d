"""CLIP's model: feature shapes, the text tower's causality and end-token pooling, the logit
scale, and the errors on inputs it cannot take."""

import math

import jax.numpy as jnp
import numpy as np
import pytest

from nnx_zoo.common import models
from nnx_zoo.common.data import images as image_data
from nnx_zoo.common.errors import UserError
from nnx_zoo.zoo.clip import model as clip


@pytest.fixture(scope="module")
def model():
  return models.build(clip.config("tiny"), seed=0)


def pictures(n=2, seed=0):
  return jnp.asarray(np.random.default_rng(seed).random((n, 32, 32, 3)), jnp.float32)


@pytest.mark.slow
def test_feature_shapes(model):
  tokens = jnp.asarray(image_data.encode_texts(["a handwritten 7", "a seven"], 48))
  assert model.encode_text(tokens).shape == (2, 32)
  assert model.encode_image(pictures()).shape == (2, 32)
  assert model(pictures(3), tokens).shape == (3, 2)


def test_text_features_read_the_end_token_and_nothing_after_it(model):
  """Causal, pooled at the end token (the largest id): what follows it changes nothing, what
  precedes it changes the features."""
  tokens = image_data.encode_texts(["a handwritten 7"], 48)
  end = int(np.argmax(tokens[0]))
  after = tokens.copy()
  after[0, end + 1 :] = 65
  before = tokens.copy()
  before[0, end - 1] = 65
  base = model.encode_text(jnp.asarray(tokens))
  np.testing.assert_allclose(model.encode_text(jnp.asarray(after)), base, atol=1e-6)
  assert np.abs(np.asarray(model.encode_text(jnp.asarray(before)) - base)).max() > 1e-3


def test_pooling_at_an_end_token_id():
  ours = models.build(clip.config("tiny", end_token=image_data.TEXT_START), seed=0)
  argmax = models.build(clip.config("tiny"), seed=0)
  tokens = jnp.asarray(image_data.encode_texts(["a 7"], 48))
  # The start token's features, not the end token's: different from the argmax model's.
  assert np.abs(np.asarray(ours.encode_text(tokens) - argmax.encode_text(tokens))).max() > 1e-3


def test_logit_scale_starts_at_1_over_0_07_and_is_clipped_at_100(model):
  assert float(model.logit_scale[...]) == pytest.approx(math.log(1 / 0.07))
  assert float(model.logit_scale_value()) == pytest.approx(1 / 0.07, rel=1e-5)
  big = models.build(clip.config("tiny", logit_scale_init=6.0), seed=0)
  assert float(big.logit_scale_value()) == 100.0


def test_text_longer_than_the_positions_is_refused(model):
  with pytest.raises(UserError, match="A text of 49 tokens is longer than the text tower's 48"):
    model.encode_text(jnp.ones((1, 49), jnp.int32))


def test_wrong_images_are_refused(model):
  with pytest.raises(UserError, match=r"Expected images \[B, 32, 32, 3\]"):
    model.encode_image(jnp.zeros((1, 32, 32, 1)))
  with pytest.raises(UserError, match="does not divide"):
    models.build(clip.config("tiny", vision=dict(patch=5)))
  with pytest.raises(UserError, match="no keys"):
    clip.config("tiny", vision=dict(heads=2))
