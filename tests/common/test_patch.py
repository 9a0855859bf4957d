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


# The 1-D convolutional stem (an audio front-end: Whisper's two Conv1d + GELU).


def stem_with(ws, bs, *, C, strides, width=3, activation="gelu_exact"):
  stem = patch_lib.ConvStem(
    ws[0].shape[0], channels=C, width=width, strides=strides, activation=activation,
    rngs=nnx.Rngs(0),
  )  # fmt: skip
  for conv, w, b in zip(stem.convs, ws, bs, strict=True):
    conv.kernel[...] = patch_lib.kernel_from_conv(w)
    conv.bias[...] = b
  return stem


def stem_reference(x_BTC, ws, bs, *, strides, act):
  """Each layer a lax convolution (NWC input, torch's OIW weight, padded by width // 2)."""
  for w, b, s in zip(ws, bs, strides, strict=True):
    pad = w.shape[-1] // 2
    x_BTC = act(
      jax.lax.conv_general_dilated(
        x_BTC, w, window_strides=(s,), padding=[(pad, pad)],
        dimension_numbers=("NWC", "OIW", "NWC"), precision=jax.lax.Precision.HIGHEST,
      ) + b
    )  # fmt: skip
  return x_BTC


@pytest.mark.parametrize(("T", "width", "strides"), [(20, 3, (1, 2)), (15, 5, (2, 1, 3))])
def test_stem_equals_lax_conv_values_and_gradients(T, width, strides):
  D, C, B = 6, 4, 2
  k = jax.random.split(jax.random.key(1), 2 * len(strides) + 2)
  x = jax.random.normal(k[0], (B, T, C))
  ws = [jax.random.normal(k[1 + i], (D, C if i == 0 else D, width)) for i in range(len(strides))]
  bs = [jax.random.normal(k[-1], (D,)) * (i + 1) for i in range(len(strides))]
  act = lambda y: jax.nn.gelu(y, approximate=False)  # noqa: E731
  out = patch_lib.stem_length(T, width=width, strides=strides)
  cot = jax.random.normal(k[-2], (B, out, D))

  def ours(x, ws, bs):
    y = stem_with(ws, bs, C=C, strides=strides, width=width)(x)
    return jnp.sum(y * cot), y

  def ref(x, ws, bs):
    y = stem_reference(x, ws, bs, strides=strides, act=act)
    return jnp.sum(y * cot), y

  (_, y), g = jax.jit(jax.value_and_grad(ours, (0, 1, 2), has_aux=True))(x, ws, bs)
  (_, y_ref), g_ref = jax.jit(jax.value_and_grad(ref, (0, 1, 2), has_aux=True))(x, ws, bs)
  assert y.shape == (B, out, D)
  np.testing.assert_allclose(y, y_ref, rtol=1e-5, atol=1e-5)
  for got, want in zip(jax.tree.leaves(g), jax.tree.leaves(g_ref), strict=True):
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


def test_stem_equals_torch_conv1d_from_hf_weights():
  """Whisper's encoder front-end: gelu(conv2(gelu(conv1(x)))), conv2 of stride 2, features
  [B, mels, T] in HF's layout."""
  torch = pytest.importorskip("torch")
  D, C, T, B = 8, 5, 21, 2
  conv1 = torch.nn.Conv1d(C, D, kernel_size=3, padding=1)
  conv2 = torch.nn.Conv1d(D, D, kernel_size=3, stride=2, padding=1)
  x = np.random.default_rng(0).standard_normal((B, T, C)).astype(np.float32)
  gelu = torch.nn.functional.gelu
  with torch.no_grad():
    want = gelu(conv2(gelu(conv1(torch.tensor(x).permute(0, 2, 1))))).permute(0, 2, 1).numpy()
  ws = [jnp.asarray(c.weight.detach().numpy()) for c in (conv1, conv2)]
  bs = [jnp.asarray(c.bias.detach().numpy()) for c in (conv1, conv2)]
  stem = stem_with(ws, bs, C=C, strides=(1, 2))
  np.testing.assert_allclose(stem(jnp.asarray(x)), want, rtol=1e-5, atol=1e-5)
  back = patch_lib.conv1d_from_kernel(stem.convs[1].kernel[...], width=3)
  np.testing.assert_array_equal(np.asarray(back), conv2.weight.detach().numpy())


def test_stem_wrong_features_is_a_clear_error():
  stem = patch_lib.ConvStem(4, channels=3, rngs=nnx.Rngs(0))
  with pytest.raises(UserError, match=r"frames \[B, T, 3\]"):
    stem(jnp.zeros((1, 10, 2)))
