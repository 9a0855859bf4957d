"""The shared stack's extension points: the auxiliary-loss channel (through scan, remat and
gradient accumulation), layer kinds, RMSNorm's 1 + w form and the attention scale."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from nnx_zoo.common import models, tasks
from nnx_zoo.common.errors import UserError
from nnx_zoo.common.nn import attention, attention_ref, aux, mlp, norms, stacking
from nnx_zoo.common.train import step as steps
from nnx_zoo.zoo.gemma import model as gemma
from nnx_zoo.zoo.llama import model as llama

TASK = tasks.get("language_model")  # the task of every batch here


@mlp.register("toy_l2")
class ToyL2(mlp.MLP):
  """A dense MLP that adds sum(down kernel ** 2) to the aux channel: a loss whose gradient is
  known without the channel (2 * kernel per layer, times weight / layers: it is a mean)."""

  def __init__(self, cfg, dim, **kw):
    super().__init__(cfg, dim, **kw)
    self.weight = cfg.toy_weight

  def __call__(self, x_BTD, **kw):
    aux.add("toy_l2", jnp.sum(self.down.kernel[...] ** 2), weight=self.weight)
    return super().__call__(x_BTD, **kw)


def toy_config(weight: float, **levers):
  cfg = llama.config("tiny", num_layers=3)
  cfg.mlp.kind = "toy_l2"
  cfg.mlp.toy_weight = weight
  cfg.update(levers)
  return cfg


def batch(B=4, T=9):
  rng = np.random.default_rng(0)
  return {
    "tokens": jnp.asarray(rng.integers(0, 256, (B, T)), jnp.int32),
    "segment_ids": jnp.ones((B, T), jnp.int32),
  }


def sums_and_grads(cfg, micro_batches=1):
  graphdef, params = nnx.split(models.build(cfg, seed=0), nnx.Param)
  fn = jax.jit(
    lambda p: steps.sums_and_grads(
      p, batch(), graphdef=graphdef, task=TASK, micro_batches=micro_batches
    )
  )
  sums, grads = fn(params)
  # One tree per layer (model.scan stores the layers stacked: nnx_zoo.common.nn.stacking).
  return sums, stacking.unstack_layers(grads), stacking.unstack_layers(params)


@pytest.mark.slow
@pytest.mark.parametrize(
  "levers,micro",
  [({}, 1), ({"scan": True}, 1), ({"remat": "full"}, 1), ({"scan": True, "remat": "full"}, 2)],
)
def test_aux_loss_is_added_with_its_weight_and_reported(levers, micro):
  w = 0.25
  sums, grads, params = sums_and_grads(toy_config(w, **levers), micro)
  sums0, grads0, _ = sums_and_grads(toy_config(0.0, **levers), micro)
  kernels = [params["blocks"][i]["mlp"]["down"]["kernel"][...] for i in range(3)]
  want = np.mean([float(jnp.sum(k**2)) for k in kernels])
  np.testing.assert_allclose(sums["aux"]["toy_l2"], want, rtol=1e-5)
  np.testing.assert_allclose(sums0["aux"]["toy_l2"], want, rtol=1e-5)  # weight 0: logged only
  assert float(sums["total"]) == pytest.approx(float(sums0["total"]), rel=1e-6)  # task loss
  count = float(sums["count"])
  for i, kernel in enumerate(kernels):
    got = grads["blocks"][i]["mlp"]["down"]["kernel"][...]
    base = grads0["blocks"][i]["mlp"]["down"]["kernel"][...]
    # d/dk of count * w * mean_l sum(k_l ** 2) = count * w * 2 k / L
    np.testing.assert_allclose(got - base, count * w * 2 * kernel / 3, rtol=1e-4, atol=1e-6)


def test_aux_add_without_a_collector_does_nothing_and_weights_must_agree():
  aux.add("x", jnp.ones(()))  # evaluation, decoding: no cost, no error
  with aux.collect() as entries:
    aux.add("x", jnp.ones(()), weight=2.0)
    aux.add("x", 3 * jnp.ones(()), weight=2.0)
    with pytest.raises(ValueError, match="weights 2.0 and 1.0"):
      aux.add("x", jnp.ones(()), weight=1.0)
  assert float(aux.means(entries)["x"]) == 2.0
  assert float(aux.weighted_sum(entries)) == 4.0


@pytest.mark.slow
def test_the_trainer_logs_aux_losses_by_name(tmp_path):
  import json

  from nnx_zoo.common import experiments
  from nnx_zoo.common.train import trainer

  cfg = experiments.get_config(
    "lm/shakespeare-char:smoke", {"train.steps": "2", "train.eval_every": "0"}
  )
  cfg.model.mlp.kind = "toy_l2"
  cfg.model.mlp.toy_weight = 0.1
  trainer.train(cfg, str(tmp_path), progress=False)
  lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
  assert all("toy_l2" in line and line["toy_l2"] > 0 for line in lines if "split" not in line)


def test_layer_kinds_are_checked():
  cfg = gemma.config("tiny")
  cfg.layer_pattern = ("sliding", "nope")
  with pytest.raises(UserError, match="'nope', which model.layer_kinds does not define"):
    models.build(cfg)
  cfg = gemma.config("tiny")
  cfg.layer_kinds.sliding.norm = {"eps": 1e-3}
  with pytest.raises(UserError, match="may set attention, position, mlp"):
    models.build(cfg)
  cfg = gemma.config("tiny")
  cfg.layer_kinds.sliding.position = {"kind": "learned", "max_len": 8}
  with pytest.raises(UserError, match="not add to the embeddings"):
    models.build(cfg)


def test_rmsnorm_one_plus_w_form():
  x = np.random.default_rng(1).standard_normal((2, 3, 8)).astype(np.float32)
  plain = norms.make(norms.config("rms", eps=1e-6), 8)
  gemma_form = norms.make(norms.config("rms", eps=1e-6, offset=1.0), 8)
  assert np.all(gemma_form.scale[...] == 0) and np.all(plain.scale[...] == 1)
  np.testing.assert_allclose(gemma_form(jnp.asarray(x)), plain(jnp.asarray(x)), rtol=1e-6)
  w = np.linspace(-0.5, 0.5, 8).astype(np.float32)
  gemma_form.scale[...] = jnp.asarray(w)
  rms = np.sqrt(np.mean(x.astype(np.float64) ** 2, axis=-1, keepdims=True) + 1e-6)
  np.testing.assert_allclose(gemma_form(jnp.asarray(x)), x / rms * (1 + w), rtol=1e-5)


@pytest.mark.parametrize("scale", [0.0, 1.0, 0.3])
def test_attention_scale(scale):
  """attention.scale multiplies q.k (0: head_dim ** -0.5) in the reference path."""
  rng = np.random.default_rng(2)
  q, k, v = (rng.standard_normal((1, 5, 2, 4)).astype(np.float32) for _ in range(3))
  cfg = attention.config(num_heads=2, head_dim=4, scale=scale)
  s = attention.logit_scale(cfg)
  assert s == (scale or 0.5)
  mask = np.tril(np.ones((5, 5), bool))[None]
  got = attention_ref.attend(
    *(jnp.asarray(a) for a in (q, k, v)), mask_BTS=jnp.asarray(mask), scale=s
  )
  logits = np.einsum("tnh,snh->nts", q[0], k[0]) * s
  logits = np.where(mask, logits, -np.inf)
  probs = np.exp(logits - logits.max(-1, keepdims=True))
  probs /= probs.sum(-1, keepdims=True)
  np.testing.assert_allclose(got[0], np.einsum("nts,snh->tnh", probs, v[0]), rtol=1e-5, atol=1e-6)


def test_encoder_of_frames_through_a_conv_stem():
  """`frame_inputs`: an EncoderDecoder's encoder reads feature frames through the shared
  ConvStem; its output is the stack run on the stem's output, and the frames' segment ids follow
  the stem (padding frames unseen). (Frames are an encoder-decoder's input alone: the one path
  that embeds them is the one Whisper trains with.)"""
  from nnx_zoo.common.nn import transformer
  from nnx_zoo.zoo.bert import model as bert
  from nnx_zoo.zoo.t5 import model as t5

  cfg = t5.config("tiny", num_layers=1)
  cfg.update(transformer.frame_inputs(channels=6, width=3, strides=(2,)))
  model = models.build(cfg, seed=0)
  assert model.stem is not None
  x = jnp.asarray(np.random.default_rng(0).standard_normal((2, 20, 6)), jnp.float32)
  seg = np.ones((2, 20), np.int32)
  seg[1, 12:] = 0
  out = nnx.jit(lambda m, x, s: m.encode(x, segment_ids_BS=s))(model, x, jnp.asarray(seg))
  assert out.shape == (2, 10, cfg.dim)
  noisy = x.at[1, 13:].set(9.0)  # frame 12 is under window 6's edge, which is padding too
  again = nnx.jit(lambda m, x, s: m.encode(x, segment_ids_BS=s))(model, noisy, jnp.asarray(seg))
  np.testing.assert_allclose(np.asarray(again[1, :6]), np.asarray(out[1, :6]), atol=1e-5)
  # An Encoder (BERT's) has no frame path: it names its inputs instead.
  tokens_only = bert.config("tiny", num_layers=1)
  tokens_only.inputs = "frames"
  with pytest.raises(UserError, match="model.inputs"):
    models.build(tokens_only, seed=0)


def test_a_config_saved_before_keys_were_declared_builds_the_same_model():
  """The layers index every key; a config saved without the keys added since (its stack's, the
  blocks' modulation and mlp_norm) is read as today's by models.build, and builds the same
  model."""
  from nnx_zoo.zoo.t5 import model as t5

  for cfg, added in (
    (llama.config("tiny"), ("modulation", "mlp_norm", "final_softcap")),
    (t5.config("tiny"), ("modulation", "mlp_norm", "final_softcap", "inputs")),
  ):
    old = cfg.to_dict()
    for key in added:
      del old[key]
    want = nnx.state(models.build(cfg, seed=0), nnx.Param)
    got = nnx.state(models.build(old, seed=0), nnx.Param)
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
      np.testing.assert_array_equal(a, b)


def test_a_stack_s_keys_come_from_its_builder():
  """transformer.config(stack=...) takes the keys a stack's builder declares, not a dict."""
  from nnx_zoo.common.nn import position, transformer

  shared = dict(
    family="llama",
    vocab_size=8,
    dim=8,
    num_layers=1,
    attention=attention.config(num_heads=2, head_dim=4),
    position=position.config("rope"),
    norm=norms.config("rms"),
    mlp=mlp.config("swiglu", hidden_dim=16),
  )
  cfg = transformer.config(**shared, stack=transformer.decoder_keys(final_softcap=30.0))
  assert (cfg.tie_embeddings, cfg.final_softcap) == (False, 30.0)
  with pytest.raises(TypeError, match="decoder_keys"):
    transformer.config(**shared, stack={"tie_embeddings": True, "final_softcap": 0.0})
