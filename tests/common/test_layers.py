"""Linear, Embedding (and its tied `attend`), RMSNorm, LayerNorm and the MLP kinds against numpy
references."""

import math

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from nnx_zoo.common.errors import UserError
from nnx_zoo.common.nn import mlp, norms
from nnx_zoo.common.nn.linear import Embedding, Linear


def randn(seed, shape, scale=1.0):
  return (np.random.default_rng(seed).standard_normal(shape) * scale).astype(np.float32)


def f64(a):
  return np.asarray(a, np.float64)


# ---------------------------------------------------------------------------------------------
# Linear


@pytest.mark.parametrize("use_bias", [False, True])
def test_linear_3d_equals_einsum(use_bias):
  lin = Linear(16, 24, use_bias=use_bias, rngs=nnx.Rngs(0))
  if use_bias:
    lin.bias[...] = jnp.asarray(randn(1, (24,)))
  x = randn(2, (3, 5, 16))
  want = np.einsum("btd,df->btf", f64(x), f64(lin.kernel[...]))
  if use_bias:
    want = want + f64(lin.bias[...])
  got = lin(jnp.asarray(x))
  assert got.shape == (3, 5, 24)
  np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)
  # Any number of leading dims, including none.
  np.testing.assert_allclose(lin(x[0, 0]), want[0, 0], atol=1e-5, rtol=1e-5)
  np.testing.assert_allclose(lin(x[None]), want[None], atol=1e-5, rtol=1e-5)


def test_linear_init_and_axes():
  lin = Linear(64, 32, use_bias=True, axes=("D", "F"), init_std=0.5, rngs=nnx.Rngs(0))
  kernel = np.asarray(lin.kernel[...])
  assert kernel.shape == (64, 32) and kernel.dtype == np.float32
  assert 0.4 < kernel.std() < 0.6 and abs(kernel.mean()) < 0.05
  np.testing.assert_array_equal(lin.bias[...], np.zeros(32))
  assert lin.kernel.get_metadata()["axes"] == ("D", "F")
  assert lin.bias.get_metadata()["axes"] == ("F",)
  assert Linear(4, 4, rngs=nnx.Rngs(0)).bias is None


def test_linear_bfloat16_compute_with_float32_params():
  lin = Linear(16, 8, use_bias=True, dtype=jnp.bfloat16, param_dtype=jnp.float32, rngs=nnx.Rngs(0))
  assert lin.kernel[...].dtype == jnp.float32 and lin.bias[...].dtype == jnp.float32
  x = randn(3, (2, 4, 16))
  y = lin(jnp.asarray(x))
  assert y.dtype == jnp.bfloat16
  ref = np.einsum("btd,df->btf", f64(x), f64(lin.kernel[...]))
  np.testing.assert_allclose(np.asarray(y, np.float32), ref, atol=2e-2, rtol=2e-2)
  # bfloat16 params too.
  lin16 = Linear(16, 8, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
  assert lin16.kernel[...].dtype == jnp.bfloat16 and lin16(x).dtype == jnp.bfloat16


# ---------------------------------------------------------------------------------------------
# Embedding


def test_embedding_lookup_and_tied_attend():
  emb = Embedding(32, 16, rngs=nnx.Rngs(0))
  table = f64(emb.embedding[...])
  tokens = np.array([[0, 5, 31, 5], [7, 7, 1, 2]])
  np.testing.assert_array_equal(emb(jnp.asarray(tokens)), table[tokens].astype(np.float32))
  x = randn(4, (2, 4, 16))
  logits = emb.attend(jnp.asarray(x))
  assert logits.shape == (2, 4, 32)
  np.testing.assert_allclose(logits, np.einsum("btd,vd->btv", f64(x), table), atol=1e-6)
  assert emb.embedding.get_metadata()["axes"] == ("V", "D")


def test_embedding_dtypes():
  emb = Embedding(8, 4, dtype=jnp.bfloat16, param_dtype=jnp.float32, rngs=nnx.Rngs(0))
  assert emb.embedding[...].dtype == jnp.float32
  assert emb(jnp.array([[1, 2]])).dtype == jnp.bfloat16
  assert emb.attend(jnp.ones((1, 2, 4))).dtype == jnp.bfloat16


# ---------------------------------------------------------------------------------------------
# Norms


def np_rms(x, scale, eps):
  x = f64(x)
  return x / np.sqrt(np.mean(x**2, -1, keepdims=True) + eps) * f64(scale)


def np_layer_norm(x, scale, bias, eps):
  x = f64(x)
  mu = x.mean(-1, keepdims=True)
  var = ((x - mu) ** 2).mean(-1, keepdims=True)
  y = (x - mu) / np.sqrt(var + eps) * f64(scale)
  return y if bias is None else y + f64(bias)


@pytest.mark.parametrize("eps", [1e-6, 1e-2])
def test_rms_norm_matches_numpy(eps):
  norm = norms.RMSNorm(16, eps=eps)
  np.testing.assert_array_equal(norm.scale[...], np.ones(16))
  norm.scale[...] = jnp.asarray(randn(5, (16,)))
  x = randn(6, (2, 3, 16), 3.0) + 1.0
  np.testing.assert_allclose(norm(x), np_rms(x, norm.scale[...], eps), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("use_bias", [True, False])
def test_layer_norm_matches_numpy(use_bias):
  norm = norms.LayerNorm(16, eps=1e-5, use_bias=use_bias)
  norm.scale[...] = jnp.asarray(randn(7, (16,)))
  bias = None
  if use_bias:
    norm.bias[...] = jnp.asarray(randn(8, (16,)))
    bias = norm.bias[...]
  else:
    assert norm.bias is None
  x = randn(9, (2, 3, 16), 3.0) + 2.0
  np.testing.assert_allclose(
    norm(x), np_layer_norm(x, norm.scale[...], bias, 1e-5), atol=1e-5, rtol=1e-5
  )


def test_norms_keep_float32_statistics_in_bfloat16():
  """bf16 in, bf16 out, but statistics in fp32: equal to the fp32 result rounded once."""
  x = jnp.asarray(randn(10, (4, 64), 100.0), jnp.bfloat16)
  x32 = np.asarray(x, np.float32)
  for norm, ref in [
    (norms.RMSNorm(64, dtype=jnp.bfloat16), lambda x: np_rms(x, np.ones(64), 1e-6)),
    (norms.LayerNorm(64, dtype=jnp.bfloat16), lambda x: np_layer_norm(x, np.ones(64), 0, 1e-5)),
  ]:
    y = norm(x)
    assert y.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(y, np.float32), ref(x32), atol=1e-2, rtol=1e-2)


def test_norm_config_and_make():
  rms = norms.make(norms.config("rms", eps=1e-5), 8)
  assert isinstance(rms, norms.RMSNorm) and rms.eps == 1e-5
  ln = norms.make(norms.config("layer", eps=1e-3, use_bias=False), 8)
  assert isinstance(ln, norms.LayerNorm) and ln.eps == 1e-3 and ln.bias is None
  with pytest.raises(UserError):
    norms.make(norms.config("batch"), 8)


# ---------------------------------------------------------------------------------------------
# MLP


def np_silu(x):
  return x / (1 + np.exp(-x))


def np_gelu_tanh(x):
  return 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)))


def np_gelu_erf(x):
  return 0.5 * x * (1 + np.vectorize(math.erf)(x / math.sqrt(2)))


NP_ACT = {
  "swiglu": np_silu,
  "geglu": np_gelu_tanh,
  "gelu": np_gelu_tanh,
  "gelu_exact": np_gelu_erf,
  "relu": lambda x: np.maximum(x, 0),
  "quick_gelu": lambda x: x / (1 + np.exp(-1.702 * x)),
}


@pytest.mark.parametrize("kind", sorted(NP_ACT))
@pytest.mark.parametrize("use_bias", [False, True])
def test_mlp_matches_numpy(kind, use_bias):
  D, F = 16, 32
  m = mlp.MLP(mlp.config(kind, hidden_dim=F, use_bias=use_bias), D, rngs=nnx.Rngs(0))
  gated = kind in ("swiglu", "geglu")
  assert (m.gate is not None) == gated
  rng = np.random.default_rng(11)
  for _, p in nnx.iter_graph(m):  # weights large enough that the activations are not linear
    if isinstance(p, nnx.Param):
      p[...] = jnp.asarray(rng.standard_normal(p[...].shape) * 0.5, jnp.float32)

  def lin(layer, h):
    y = h @ f64(layer.kernel[...])
    return y + f64(layer.bias[...]) if use_bias else y

  x = randn(12, (2, 5, D))
  act = NP_ACT[kind]
  h = act(lin(m.gate, f64(x))) * lin(m.up, f64(x)) if gated else act(lin(m.up, f64(x)))
  np.testing.assert_allclose(m(jnp.asarray(x)), lin(m.down, h), atol=1e-4, rtol=1e-4)


def test_mlp_unknown_activation_and_kind():
  with pytest.raises(UserError, match="activation 'swish'"):
    mlp.MLP(mlp.config("swish", hidden_dim=8), 4, rngs=nnx.Rngs(0))
  cfg = mlp.config(hidden_dim=8)
  cfg.kind = "densee"
  with pytest.raises(UserError, match="Did you mean: dense"):
    mlp.make(cfg, 4, rngs=nnx.Rngs(0))


def test_mlp_kind_is_an_extension_point():
  """A feed-forward layer registered under a new kind is what `mlp.make` builds for it."""

  @mlp.register("doubled_for_test")
  class Doubled(mlp.MLP):
    def __call__(self, x_BTD):
      return 2 * super().__call__(x_BTD)

  try:
    cfg = mlp.config("relu", hidden_dim=8)
    cfg.kind = "doubled_for_test"
    layer = mlp.make(cfg, 4, rngs=nnx.Rngs(0))
    assert isinstance(layer, Doubled)
    x = jnp.ones((1, 2, 4))
    dense = nnx.merge(*nnx.split(layer))
    np.testing.assert_allclose(layer(x), 2 * mlp.MLP.__call__(dense, x), rtol=1e-6)
  finally:
    del mlp.KINDS["doubled_for_test"]
