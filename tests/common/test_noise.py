"""Stochastic depth (model.drop_path, common/nn/noise.py): what a block computes with it, its
schedule over the layers, and draws that do not depend on how a step is computed."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from nnx_zoo.common import models, tasks
from nnx_zoo.common.nn import noise
from nnx_zoo.common.train import step as steps
from nnx_zoo.zoo.llama import model as llama
from nnx_zoo.zoo.t5 import model as t5

from .test_memory import assert_same, batch, source_target_pairs, sums_and_grads, with_scan

TASK = tasks.get("language_model")  # the task of every batch here

KEY = jax.random.key_data(jax.random.key(3))


def dropping(cfg, rate=0.5):
  cfg = cfg.copy_and_resolve_references()
  cfg.drop_path = rate
  return cfg


def test_each_row_keeps_or_drops_each_branch_whole_and_rescales():
  """Layer 1 of 2 (p = the full rate, 0.5): each row's output is x + s1 * attn(...) then
  + s2 * mlp(...) with s1, s2 each 0 or 1 / (1 - p), the two drawn apart, about half dropped;
  the reference composes the block's own sub-layers by hand."""
  model = models.build(dropping(llama.config("tiny", num_layers=2)))
  block = model.layer(1)
  B, T = 400, 3
  x = jax.random.normal(jax.random.key(0), (B, T, model.layer(0).attn_norm.scale.shape[0]))
  kw = dict(positions_BT=jnp.arange(T)[None].repeat(B, 0), segment_ids_BT=None)
  with noise.drawing(KEY, jnp.arange(B)), noise.layer(noise.stack(), 1, 2):
    got, _ = block(x, position=model.position, **kw)
  h1 = block.attn(block.attn_norm(x), position=model.position, cache=None, **kw)[0]

  def candidate(s1, s2):
    x1 = x + s1 * h1
    return x1 + s2 * block.mlp(block.mlp_norm(x1), mask_BT=None)

  scales = list(itertools.product([0.0, 2.0], repeat=2))
  errors = jnp.stack([jnp.max(jnp.abs(got - candidate(*s)), axis=(1, 2)) for s in scales])
  assert float(jnp.max(jnp.min(errors, axis=0))) < 1e-5  # every row is one of the four
  which = np.asarray(jnp.argmin(errors, axis=0))
  counts = np.bincount(which, minlength=4)  # (drop, drop), (drop, keep), (keep, drop), (keep, keep)
  assert (counts > 60).all(), counts  # 100 each expected: independent, about half dropped


def test_the_rate_rises_over_the_layers_and_nothing_is_drawn_outside_a_step():
  rows = 4000
  ones = jnp.ones((rows, 1, 1))
  dropped = []
  with noise.drawing(KEY, jnp.arange(rows)):
    stream = noise.stack()
    for i in range(5):
      with noise.layer(stream, i, 5):
        dropped.append(float(jnp.mean(noise.drop_path(ones, 0.4) == 0)))
        assert noise.drop_path(ones, 0.0) is ones
  np.testing.assert_allclose(dropped, [0.0, 0.1, 0.2, 0.3, 0.4], atol=0.025)
  assert noise.drop_path(ones, 0.4) is ones  # evaluation, decoding: no drawing context
  with noise.drawing(KEY, jnp.arange(rows)), noise.layer(noise.stack(), 1, 2):
    kept = noise.drop_path(ones, 0.4)
    assert float(jnp.mean(kept)) == pytest.approx(1.0, abs=0.05)  # rescaled: the mean is kept
    with pytest.raises(ValueError, match="drop_path"):
      noise.drop_path(ones, 1.0)


def test_a_model_outside_a_training_step_is_the_model_without_drop_path():
  tokens = jnp.asarray(batch(B=2, T=9)["tokens"])
  plain = models.build(llama.config("tiny", num_layers=3))
  noisy = models.build(dropping(llama.config("tiny", num_layers=3)))
  call = nnx.jit(lambda model, x: model(x))  # one program each, not one per op
  np.testing.assert_array_equal(call(noisy, tokens), call(plain, tokens))


def draws(cfg, micro_batches=1, data=None, task=TASK):
  data = batch() if data is None else data
  graphdef, params = nnx.split(models.build(cfg), nnx.Param)
  kw = dict(noise_key=KEY, rows=jnp.arange(steps.batch_rows(data)))
  fn = lambda p, b: sums_and_grads(
    p, b, graphdef=graphdef, task=task, micro_batches=micro_batches, **kw
  )
  return jax.jit(fn)(params, data)


@pytest.mark.slow  # several steps compiled: 7-17 s on a cold cache
def test_the_draws_do_not_depend_on_how_the_step_is_computed():
  """One batch unscanned against micro-batches, the layers scanned, and scanned rematerialised
  in full with micro-batches (the layers' own backward loop, accumulate._fused_scan): the same
  rows dropped, so the same sums and gradients. And they are drawn: not the noiseless ones."""
  base = dropping(llama.config("tiny", num_layers=3))
  want = draws(base)
  assert_same(draws(base, micro_batches=4), want)
  assert_same(draws(with_scan(base)), want)
  assert_same(draws(with_scan(base, remat="full"), micro_batches=2), want)
  graphdef, params = nnx.split(models.build(base), nnx.Param)
  plain = jax.jit(lambda p, b: sums_and_grads(p, b, graphdef=graphdef, task=TASK))(params, batch())
  differ = [
    float(jnp.max(jnp.abs(a - b)) / jnp.max(jnp.abs(b)))
    for a, b in zip(jax.tree.leaves(plain[2]), jax.tree.leaves(want[2]), strict=True)
  ]
  assert float(plain[0]) != float(want[0]) and max(differ) > 0.1


@pytest.mark.slow  # several steps compiled: 7-17 s on a cold cache
def test_an_encoder_decoder_draws_per_stack_the_same_scanned_or_not():
  """T5's encoder and decoder each take their own stream (the same layer index of the two is
  not the same draw); scanned and rematerialised with micro-batches, the same sums."""
  pairs = source_target_pairs()
  base = dropping(t5.config("tiny", num_layers=2))
  seq2seq = tasks.get("seq2seq")
  assert_same(
    draws(with_scan(base, remat="full"), 2, pairs, seq2seq), draws(base, 1, pairs, seq2seq)
  )
  rows, streams = jnp.arange(64), []
  with noise.drawing(KEY, rows):
    for _ in range(2):
      stream = noise.stack()
      with noise.layer(stream, 1, 2):
        streams.append(noise.drop_path(jnp.ones((64, 1, 1)), 0.5))
  assert not np.array_equal(streams[0], streams[1])


def test_noisy_finds_drop_path_in_a_model_or_its_towers():
  from nnx_zoo.zoo.clip import model as clip

  assert not steps.noisy(llama.config("tiny"))
  assert steps.noisy(dropping(llama.config("tiny"), 0.1))
  towers = clip.config("tiny")
  assert not steps.noisy(towers)
  towers.vision.drop_path = 0.1  # CLIP's towers are two stacks, each with its own
  assert steps.noisy(towers)


def test_a_train_step_draws_from_the_run_seed_and_the_step_alone():
  """The loss (computed before the update) of the same state and batch is the same twice, and
  another at the next step: what a resumed run restores (seed's key and step) fixes the draws."""
  import dataclasses

  from nnx_zoo.common import experiments
  from nnx_zoo.common.train import optim

  cfg = experiments.get_config("lm/shakespeare-char:smoke", {"model.drop_path": "0.5"})
  tx = optim.optimizer(cfg.optim, cfg.train.steps)
  graphdef, state = steps.init_state(cfg, tx)
  data = batch(B=4, T=cfg.data.seq_len + 1, vocab=cfg.model.vocab_size)
  step = jax.jit(
    lambda s, b: steps.train_step(s, b, graphdef=graphdef, task=TASK, tx=tx, noisy=True)[1]["loss"]
  )
  first = float(step(state, data))
  assert float(step(state, data)) == first
  later = dataclasses.replace(state, step=state.step + 1)
  assert float(step(later, data)) != first
  quiet = jax.jit(
    lambda s, b: steps.train_step(s, b, graphdef=graphdef, task=TASK, tx=tx)[1]["loss"]
  )
  assert float(quiet(later, data)) == float(quiet(state, data))  # without noise: no step in it
