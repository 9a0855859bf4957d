"""The conditioning parts of common/nn (timestep features, class table with a null class,
adaLN-Zero modulation of the shared Block, the 2-D sin-cos positions, unpatchify, LayerNorm
without affine, the Denoiser stack), each against a numpy reference written from the papers'
formulas (or diffusers' function where one exists)."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from nnx_zoo.common import models
from nnx_zoo.common.errors import UserError
from nnx_zoo.common.nn import conditioning, norms, patch, position, stacking
from nnx_zoo.common.nn.block import Block
from nnx_zoo.zoo.dit import model as dit


def perturb(module, scale: float, seed: int = 0):
  """Every parameter of `module` moved by scale * N(0, 1), so no zero-initialised path hides."""
  rng = np.random.default_rng(seed)
  state = nnx.state(module, nnx.Param)
  nnx.update(
    module,
    jax.tree.map(lambda a: a + scale * jnp.asarray(rng.standard_normal(a.shape), a.dtype), state),
  )


def np_layer_norm(x, eps):
  mu = x.mean(-1, keepdims=True)
  return (x - mu) / np.sqrt(((x - mu) ** 2).mean(-1, keepdims=True) + eps)


def np_timestep_features(t, dim, max_period=10_000.0, shift=0.0):
  half = dim // 2
  freqs = np.exp(-math.log(max_period) * np.arange(half) / (half - shift))
  args = t[:, None].astype(np.float64) * freqs[None]
  return np.concatenate([np.cos(args), np.sin(args)], axis=1)


@pytest.mark.parametrize("shift", [0.0, 1.0])
def test_timestep_features_match_the_formula(shift):
  t = np.array([0, 1, 17, 250, 999])
  got = conditioning.timestep_features(jnp.asarray(t), 64, freq_shift=shift)
  np.testing.assert_allclose(got, np_timestep_features(t, 64, shift=shift), atol=1e-4)
  # Small timesteps are exact to float32 (large ones lose digits in t * f, as in torch).
  np.testing.assert_allclose(got[:3], np_timestep_features(t[:3], 64, shift=shift), atol=2e-6)


def test_timestep_features_match_diffusers():
  torch = pytest.importorskip("torch")
  emb = pytest.importorskip("diffusers.models.embeddings")
  t = np.array([0, 3, 40])
  want = emb.get_timestep_embedding(
    torch.tensor(t), 256, flip_sin_to_cos=True, downscale_freq_shift=1
  ).numpy()
  np.testing.assert_allclose(
    conditioning.timestep_features(jnp.asarray(t), 256, freq_shift=1.0), want, atol=5e-6
  )


def test_sincos_2d_table_matches_diffusers_and_the_formula():
  table = position.sincos_2d_table(16, 3)
  # The formula: patch (i, j) -> [sin/cos of j, sin/cos of i], frequencies 1e4^(-k / 4).
  w = 1 / 10_000 ** (np.arange(4) / 4)
  i, j = 1, 2  # row 1, column 2: token 1 * 3 + 2
  want = np.concatenate([np.sin(j * w), np.cos(j * w), np.sin(i * w), np.cos(i * w)])
  np.testing.assert_allclose(table[5], want, atol=1e-6)
  emb = pytest.importorskip("diffusers.models.embeddings")
  ref = emb.get_2d_sincos_pos_embed(16, 3, base_size=3, interpolation_scale=1.0, output_type="np")
  np.testing.assert_allclose(table, ref, atol=1e-6)


def test_unpatchify_reads_row_column_channel():
  B, S, p, C = 2, 4, 2, 3
  img = np.random.default_rng(0).standard_normal((B, S, S, C)).astype(np.float32)
  # Token (h, w) holds its patch's pixels in (row, column, channel) order.
  tokens = img.reshape(B, S // p, p, S // p, p, C).transpose(0, 1, 3, 2, 4, 5).reshape(B, 4, -1)
  np.testing.assert_array_equal(patch.unpatchify(jnp.asarray(tokens), patch=p, channels=C), img)
  with pytest.raises(UserError):
    patch.unpatchify(jnp.zeros((1, 3, 12)), patch=2, channels=3)


def test_layer_norm_without_affine_has_no_params():
  cfg = norms.config("layer", eps=1e-6, affine=False)
  norm = norms.make(cfg, 8)
  assert jax.tree.leaves(nnx.state(norm, nnx.Param)) == []
  x = np.random.default_rng(0).standard_normal((3, 8)).astype(np.float32)
  np.testing.assert_allclose(norm(jnp.asarray(x)), np_layer_norm(x, 1e-6), atol=1e-5)
  assert "affine" not in norms.config("layer")  # the configs written before read the same


def test_modulation_starts_at_zero_and_splits_in_order():
  mod = conditioning.Modulation(4, 3, rngs=nnx.Rngs(0))
  c = jnp.ones((2, 4))
  assert all(np.all(np.asarray(v) == 0) for v in mod(c))
  kernel = np.random.default_rng(0).standard_normal((4, 12)).astype(np.float32)
  mod.proj.kernel[...] = kernel
  silu = np.asarray(jax.nn.silu(c))
  out = mod(c)
  for k in range(3):
    np.testing.assert_allclose(out[k], silu @ kernel[:, 4 * k : 4 * (k + 1)], rtol=1e-5)


def test_class_table_has_the_null_class():
  cfg = conditioning.config(num_classes=10)
  cond = conditioning.Conditioning(cfg, 8, init_std=0.02, rngs=nnx.Rngs(0))
  assert cond.label.embedding.shape == (11, 8) and cond.label.null_id == 10


def block_cfg(**kw):
  cfg = dit.config("tiny")
  cfg.update(kw)
  return cfg


def test_adaln_zero_block_matches_the_formula():
  """x + g1 * Attn(LN(x)(1 + s1) + b1), then + g2 * MLP(LN(x)(1 + s2) + b2), against the same
  block's own attention and MLP run on the modulated inputs by hand."""
  cfg = block_cfg()
  block = Block(cfg, rngs=nnx.Rngs(0))
  rng = np.random.default_rng(0)
  perturb(block.modulation, 0.5)
  B, T, D = 2, 5, cfg.dim
  x = jnp.asarray(rng.standard_normal((B, T, D)), jnp.float32)
  c = jnp.asarray(rng.standard_normal((B, D)), jnp.float32)
  pos = jnp.broadcast_to(jnp.arange(T), (B, T))
  seg = jnp.ones((B, T), jnp.int32)
  nope = position.Position()
  got, _ = block(x, positions_BT=pos, segment_ids_BT=seg, position=nope, cond_BD=c)

  k = block.modulation.proj.kernel[...]
  b = block.modulation.proj.bias[...]
  chunks = np.split(np.asarray(jax.nn.silu(c)) @ np.asarray(k) + np.asarray(b), 6, axis=1)
  b1, s1, g1, b2, s2, g2 = (v[:, None, :] for v in chunks)
  xn = np_layer_norm(np.asarray(x), 1e-6) * (1 + s1) + b1
  h, _ = block.attn(jnp.asarray(xn), positions_BT=pos, segment_ids_BT=seg, position=nope)
  x1 = np.asarray(x) + g1 * np.asarray(h)
  xn2 = np_layer_norm(x1, 1e-6) * (1 + s2) + b2
  want = x1 + g2 * np.asarray(block.mlp(jnp.asarray(xn2)))
  np.testing.assert_allclose(got, want, atol=1e-5)


def test_adaln_zero_block_starts_as_identity_and_needs_the_conditioning():
  block = Block(block_cfg(), rngs=nnx.Rngs(0))
  x = jnp.asarray(np.random.default_rng(1).standard_normal((1, 3, 32)), jnp.float32)
  kw = dict(
    positions_BT=jnp.arange(3)[None], segment_ids_BT=jnp.ones((1, 3), jnp.int32),
    position=position.Position(),
  )  # fmt: skip
  out, _ = block(x, cond_BD=jnp.ones((1, 32)), **kw)
  np.testing.assert_array_equal(out, x)
  with pytest.raises(UserError, match="cond_BD"):
    block(x, **kw)


def test_modulation_needs_pre_norm():
  with pytest.raises(UserError, match="pre"):
    Block(block_cfg(norm_placement="post"), rngs=nnx.Rngs(0))
  with pytest.raises(UserError, match="modulation"):
    Block(block_cfg(modulation="film"), rngs=nnx.Rngs(0))


def test_denoiser_scan_and_remat_equal_the_plain_stack():
  cfg = dit.config("tiny", num_layers=3)
  model = models.build(cfg, seed=0)
  perturb(model, 0.05)
  x = jnp.asarray(np.random.default_rng(0).standard_normal((2, 8, 8, 1)), jnp.float32)
  t, y = jnp.array([5, 900]), jnp.array([3, 10])
  call = nnx.jit(lambda model, *args: model(*args))  # one program a model, not one per op
  want = call(model, x, t, y)
  assert want.shape == (2, 8, 8, 1) and float(jnp.abs(want).max()) > 0
  state = nnx.state(model)
  for flags in (dict(scan=True), dict(remat="full")):
    other = models.build(_with(cfg, **flags))
    nnx.update(other, stacking.match_layers(state, other))  # scan stores the layers stacked
    np.testing.assert_allclose(call(other, x, t, y), want, atol=1e-5)


def _with(cfg, **kw):
  out = cfg.copy_and_resolve_references()
  out.update(kw)
  return out


def test_denoiser_learned_sigma_prediction_is_the_first_channels():
  model = models.build(dit.config("tiny", out_channels=2), seed=0)
  perturb(model, 0.05)
  x = jnp.zeros((1, 8, 8, 1))
  both = nnx.jit(lambda model, *args: (model(*args), model.prediction(*args)))
  full, prediction = both(model, x, jnp.array([1]), jnp.array([2]))
  assert full.shape == (1, 8, 8, 2)
  np.testing.assert_array_equal(prediction, full[..., :1])
