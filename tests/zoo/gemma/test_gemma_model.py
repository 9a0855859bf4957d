"""Gemma invariants: published parameter counts (checked against transformers on the meta
device), the layer pattern under scan, decoding with sliding-window layers, and the final
soft-cap on every path that makes logits."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from nnx_zoo.common import engine, hub, models
from nnx_zoo.common.nn import stacking
from nnx_zoo.common.tasks import losses
from nnx_zoo.zoo.gemma import model as gemma

# transformers' own counts (Gemma2ForCausalLM / Gemma3ForCausalLM, tied embeddings).
PUBLISHED = {"gemma2-2b": 2_614_341_888, "gemma3-1b": 999_885_952}


@pytest.mark.parametrize("preset", sorted(PUBLISHED))
def test_published_parameter_count(preset):
  assert models.num_params(gemma.config(preset)) == PUBLISHED[preset]


@pytest.mark.parametrize("preset", sorted(p for p in gemma.PRESETS if p != "tiny"))
@pytest.mark.slow
def test_every_preset_counts_as_transformers(preset):
  """Each preset exported as config.json and built by transformers on the meta device (no
  memory) has our parameter count."""
  import torch
  import transformers as tf

  cfg = gemma.config(preset)
  hf = hub.params_module("gemma").config_to_hf(cfg)
  config_class = tf.Gemma2Config if hf["model_type"] == "gemma2" else tf.Gemma3TextConfig
  model_class = tf.Gemma2ForCausalLM if hf["model_type"] == "gemma2" else tf.Gemma3ForCausalLM
  with torch.device("meta"):
    model = model_class(config_class(**{k: v for k, v in hf.items() if k != "architectures"}))
  assert model.num_parameters() == models.num_params(cfg)


def tiny(**overrides):
  cfg = gemma.config("tiny", **overrides)
  cfg.init_std = 0.2
  model = models.build(cfg, seed=0)
  rng = np.random.default_rng(1)
  for _, p in nnx.iter_graph(model):  # (1 + w) norms start at w = 0: make them matter
    if isinstance(p, nnx.Param) and p[...].ndim == 1:
      p[...] = jnp.asarray(0.3 * rng.standard_normal(p[...].shape), jnp.float32)
  return cfg, model


def tokens(seed, shape):
  return jnp.asarray(np.random.default_rng(seed).integers(0, 256, shape), jnp.int32)


# Gemma 2's alternation with a layer past the last whole repetition; a Gemma 3 pattern with its
# own local RoPE theta, scanned twice.
PATTERNS = {
  "gemma2-5-layers": dict(num_layers=5),
  "gemma3-pattern-3": dict(
    version=3, num_layers=6, layer_pattern=("sliding", "sliding", "full"), local_rope_theta=10.0
  ),
}


@pytest.mark.parametrize("remat", ["none", "full"])
@pytest.mark.parametrize("name", list(PATTERNS))
@pytest.mark.slow
def test_scan_over_the_pattern_equals_no_scan(name, remat):
  cfg, model = tiny(**PATTERNS[name])
  graphdef, params = nnx.split(model, nnx.Param)
  scan_cfg = cfg.copy_and_resolve_references()
  scan_cfg.scan, scan_cfg.remat = True, remat
  scan_model = models.abstract(scan_cfg)
  scan_graphdef = nnx.graphdef(scan_model)
  # The same weights stored stacked, one stack per slot of the pattern.
  scan_params = stacking.match_layers(params, nnx.state(scan_model, nnx.Param))
  assert len(scan_params["stacked"]) == len(cfg.layer_pattern)
  x = tokens(0, (2, 12))

  def loss(graphdef, params):
    return jnp.sum(jnp.sin(nnx.merge(graphdef, params)(x)))

  want, want_g = jax.value_and_grad(loss, argnums=1)(graphdef, params)
  got, got_g = jax.value_and_grad(loss, argnums=1)(scan_graphdef, scan_params)
  # A sum of sines of every logit cancels to a small number: its fp32 rounding is about the
  # number of terms times eps, not a fraction of the sum (7.6e-5 on an AVX-512 Xeon).
  terms = x.size * cfg.vocab_size
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=terms * float(jnp.finfo(jnp.float32).eps))
  got_g = stacking.unstack_layers(got_g)
  assert jax.tree.structure(got_g) == jax.tree.structure(want_g)
  for a, b in zip(jax.tree.leaves(got_g), jax.tree.leaves(want_g), strict=True):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5 * float(jnp.max(jnp.abs(b))) + 1e-7)
  jaxpr = str(jax.make_jaxpr(lambda p: nnx.merge(scan_graphdef, p)(x))(scan_params))
  assert "scan[" in jaxpr  # one body per repetition of the pattern


def test_layers_get_their_kinds_window_and_theta():
  cfg, model = tiny(**PATTERNS["gemma3-pattern-3"])
  windows = [block.attn.window for block in model.blocks]
  assert windows == [8, 8, None, 8, 8, None]  # None: no window
  local, glob = model.layer_positions[0], model.position
  assert model.layer_positions[2] is None  # the full layers use the model's RoPE
  assert local.inv_freq[1] > glob.inv_freq[1]  # theta 10 turns faster than 1e4


def test_cached_decoding_with_sliding_windows_equals_full_forward():
  """A window (8) shorter than prompt + new tokens (20): the cache masks what the window
  drops."""
  _, model = tiny(num_layers=2)
  prompt = tokens(3, (2, 6))
  out = engine.generate(model, prompt, max_new_tokens=14, rng=jax.random.key(0), temperature=0)
  want = engine.generate_stepwise(model, prompt, max_new_tokens=14)
  np.testing.assert_array_equal(out, want)


@pytest.mark.slow
def test_final_softcap_on_every_path():
  """Plain logits, the chunked loss, the eval loss and decoding all see capped logits."""
  cfg, model = tiny(final_softcap=0.5)
  x = tokens(4, (2, 10))
  logits = model(x)
  assert float(jnp.max(jnp.abs(logits))) <= 0.5  # tanh saturates to the cap in fp32
  batch = {"tokens": x, "segment_ids": jnp.ones_like(x)}
  plain = losses.loss_sums(model, batch)[0]
  chunked = losses.loss_sums(model, batch, loss_chunk=4)[0]
  np.testing.assert_allclose(chunked, plain, rtol=1e-6)
  # With logits within (-0.5, 0.5) the loss per token is within ln(V) +- 1.
  per_token = float(plain) / 18
  assert abs(per_token - np.log(256)) < 1.0
  cache = model.init_cache(2, 12)
  decoded, _ = model(x, cache=cache)
  np.testing.assert_allclose(decoded, logits, rtol=1e-5, atol=1e-6)
