"""ViT's model: shapes, the errors on images it cannot take, every config field changing the
model, and the encoder's image path (class token first, positions learned per patch)."""

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from nnx_zoo.common import models
from nnx_zoo.common.errors import UserError
from nnx_zoo.zoo.vit import model as vit


def tiny(**overrides):
  return models.build(vit.config("tiny", **overrides), seed=0)


def images(shape, seed=0):
  return jnp.asarray(np.random.default_rng(seed).random(shape), jnp.float32)


def test_logits_and_hidden_states():
  model = tiny()
  x = images((2, 32, 32, 3))
  assert model(x).shape == (2, 10)
  assert model.encode(x).shape == (2, 1 + 16, 64)  # the class token, then 4x4 patches
  np.testing.assert_allclose(model(x), model.classify(x), rtol=1e-6)


def test_rows_are_independent():
  model = tiny()
  a, b = images((1, 32, 32, 3), 1), images((1, 32, 32, 3), 2)
  call = nnx.jit(lambda model, x: model(x))  # one program a shape, not one per op
  both = call(model, jnp.concatenate([a, b]))
  np.testing.assert_allclose(both[1:], call(model, b), atol=1e-5)


@pytest.mark.parametrize(
  "shape",
  [(2, 32, 32, 1), (2, 3, 32, 32), (2, 16, 16, 3), (2, 32, 32)],
  ids=["channels", "channels-first", "size", "no-channel-dim"],
)
def test_images_it_cannot_take_are_refused(shape):
  with pytest.raises(UserError, match=r"Expected images \[B, 32, 32, 3\]"):
    tiny()(images(shape))


def test_patch_that_does_not_divide_the_image_is_refused():
  with pytest.raises(UserError, match="model.patch=5 does not divide model.image_size=32"):
    tiny(patch=5)
  with pytest.raises(UserError, match="one value per channel"):
    tiny(channels=1, pixel_mean=(0.5, 0.5, 0.5))


def test_pixel_normalisation_is_applied():
  """(x - mean) / std before the patches: shifting the mean by d equals shifting the images."""
  x = images((2, 32, 32, 3))
  shifted = tiny(pixel_mean=(0.4, 0.4, 0.4))
  np.testing.assert_allclose(shifted(x), tiny()(x + 0.1), atol=1e-5)


def test_every_config_field_changes_the_model():
  """A field nothing reads would leave the parameter tree unchanged (num_heads, activation,
  norm_eps and the pixel statistics change values, not shapes: checked above and by parity)."""

  def shapes(cfg):
    return {k: v.shape for k, v in nnx.to_flat_state(nnx.state(models.abstract(cfg)))}

  ref = shapes(vit.config("tiny"))
  for field, value in [
    ("dim", 32),
    ("num_layers", 3),
    ("hidden_dim", 96),
    ("image_size", 48),
    ("patch", 4),
    ("channels", 1),
    ("num_labels", 3),
    ("qkv_bias", False),
    ("pool", "mean"),
  ]:
    kw = {field: value}
    if field == "channels":
      kw.update(pixel_mean=(0.5,), pixel_std=(0.5,))
    assert shapes(vit.config("tiny", **kw)) != ref, field


def test_mean_pooling_has_no_class_token():
  """pool="mean" (big_vision's "gap"): the patches alone, averaged; HF's ViT cannot hold it."""
  from nnx_zoo.common import hub

  cfg = vit.config("tiny", pool="mean")
  model = models.build(cfg, seed=0)
  x = images((2, 32, 32, 3))
  assert model.encode(x).shape == (2, 16, 64) and model.class_token is None
  np.testing.assert_allclose(
    model(x), model.head(jnp.mean(model.encode(x), axis=1)), rtol=1e-5, atol=1e-6
  )
  with pytest.raises(UserError, match="class token"):
    hub.params_module("vit").config_to_hf(cfg)
  with pytest.raises(UserError, match="Unknown vit pool"):
    vit.config("tiny", pool="max")
