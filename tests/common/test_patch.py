"""Patch embedding against jax.lax.conv_general_dilated and torch's nn.Conv2d (HF's layout)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from nnx_zoo.common.errors import UserError
from nnx_zoo.common.nn import patch as patch_lib
from nnx_zoo.common.nn.patch import PatchEmbed


def conv_reference(images_BHWC, w_DCpp, b_D, p):
  """A strided convolution (NHWC input, torch's OIHW weight), flattened row by row."""
  y = jax.lax.conv_general_dilated(
    images_BHWC,
    w_DCpp,
    window_strides=(p, p),
    padding="VALID",
    dimension_numbers=("NHWC", "OIHW", "NHWC"),
    precision=jax.lax.Precision.HIGHEST,
  )
  B, h, w, D = y.shape
  y = y.reshape(B, h * w, D)
  return y if b_D is None else y + b_D


def embed_with(w_DCpp, b_D, *, p, C):
  model = PatchEmbed(
    w_DCpp.shape[0], patch=p, channels=C, use_bias=b_D is not None, rngs=nnx.Rngs(0)
  )
  model.proj.kernel[...] = patch_lib.kernel_from_conv(w_DCpp)
  if b_D is not None:
    model.proj.bias[...] = b_D
  return model


@pytest.mark.parametrize(("H", "W", "C", "p", "bias"), [(8, 8, 1, 2, True), (12, 8, 3, 4, False)])
def test_equals_lax_conv_values_and_gradients(H, W, C, p, bias):
  D, B = 5, 2
  k = jax.random.split(jax.random.key(0), 4)
  images = jax.random.uniform(k[0], (B, H, W, C))
  w = jax.random.normal(k[1], (D, C, p, p))
  b = jax.random.normal(k[2], (D,)) if bias else None
  cot = jax.random.normal(k[3], (B, (H // p) * (W // p), D))

  def ours(images, w, b):
    model = embed_with(w, b, p=p, C=C)
    return jnp.sum(model(images) * cot), model(images)

  def ref(images, w, b):
    y = conv_reference(images, w, b, p)
    return jnp.sum(y * cot), y

  argnums = (0, 1, 2) if bias else (0, 1)
  (_, y), g = jax.jit(jax.value_and_grad(ours, argnums, has_aux=True))(images, w, b)
  (_, y_ref), g_ref = jax.jit(jax.value_and_grad(ref, argnums, has_aux=True))(images, w, b)
  assert y.shape == (B, (H // p) * (W // p), D)
  np.testing.assert_allclose(y, y_ref, rtol=1e-5, atol=1e-5)
  for got, want in zip(g, g_ref, strict=True):  # images, conv weight (, bias)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_equals_torch_conv2d_from_hf_weights():
  torch = pytest.importorskip("torch")
  D, C, p, B, H, W = 6, 3, 4, 2, 16, 12
  conv = torch.nn.Conv2d(C, D, kernel_size=p, stride=p, bias=True)  # ViTPatchEmbeddings'
  images = np.random.default_rng(0).uniform(size=(B, H, W, C)).astype(np.float32)
  with torch.no_grad():
    # HF ViT: projection(pixel_values).flatten(2).transpose(1, 2), pixel_values [B, C, H, W].
    want = conv(torch.tensor(images).permute(0, 3, 1, 2)).flatten(2).transpose(1, 2).numpy()
  w, b = conv.weight.detach().numpy(), conv.bias.detach().numpy()
  model = embed_with(jnp.asarray(w), jnp.asarray(b), p=p, C=C)
  np.testing.assert_allclose(model(jnp.asarray(images)), want, rtol=1e-5, atol=1e-5)
  # And back to HF's layout unchanged (what an export's key map does).
  back = patch_lib.conv_from_kernel(model.proj.kernel[...], patch=p)
  np.testing.assert_array_equal(np.asarray(back), w)


def test_no_bias_and_layout():
  model = PatchEmbed(7, patch=2, channels=3, use_bias=False, rngs=nnx.Rngs(0))
  assert model.proj.bias is None
  assert model.proj.kernel.shape == (3 * 2 * 2, 7) and model.proj.kernel.axes == (None, "D")


def test_refuses_images_the_patch_does_not_divide():
  model = PatchEmbed(4, patch=4, channels=1, rngs=nnx.Rngs(0))
  with pytest.raises(UserError, match="10x8 pixels do not divide into 4x4 patches"):
    model(jnp.zeros((1, 10, 8, 1)))
  with pytest.raises(UserError, match="channels last"):
    model(jnp.zeros((1, 1, 8, 8)))  # channels first
