"""Memory levers change memory, not results: remat == no remat, scan == no scan, accumulation ==
one batch."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from nnx_zoo.common import engine, models, tasks
from nnx_zoo.common.errors import UserError
from nnx_zoo.common.nn import accumulate, lora, stacking
from nnx_zoo.common.train import step as steps
from nnx_zoo.zoo.bert import model as bert
from nnx_zoo.zoo.gemma import model as gemma
from nnx_zoo.zoo.gpt2 import model as gpt2
from nnx_zoo.zoo.llama import model as llama
from nnx_zoo.zoo.t5 import model as t5

TASK = tasks.get("language_model")  # the task of every batch here


def sums_and_grads(*args, **kw):
  """(total, count, grads) of `steps.sums_and_grads`."""
  sums, grads = steps.sums_and_grads(*args, **kw)
  return sums["total"], sums["count"], grads


def sharded_sums_and_grads(*args, **kw):
  sums, grads = steps.sharded_sums_and_grads(*args, **kw)
  return sums["total"], sums["count"], grads


def batch(B=8, T=17, vocab=256, seed=0):
  rng = np.random.default_rng(seed)
  segments = np.where(np.arange(T) < T // 2, 1, 2)[None].repeat(B, 0).astype(np.int32)
  return {"tokens": rng.integers(0, vocab, (B, T)).astype(np.int32), "segment_ids": segments}


def source_target_pairs(B=4, S=7, T=5):
  """A batch of an encoder-decoder (T5's task): random source and target ids, no padding."""
  rng = np.random.default_rng(0)
  ids = lambda n: rng.integers(2, 100, (B, n)).astype(np.int32)
  return {
    "inputs": ids(S),
    "input_segment_ids": np.ones((B, S), np.int32),
    "targets": ids(T),
    "target_segment_ids": np.ones((B, T), np.int32),
  }


def sums(cfg, micro_batches=1):
  graphdef, params = nnx.split(models.build(cfg), nnx.Param)
  fn = jax.jit(
    lambda p, b: sums_and_grads(p, b, graphdef=graphdef, task=TASK, micro_batches=micro_batches)
  )
  return fn(params, batch()), (graphdef, params)


def assert_same(a, b, rtol=1e-5):
  """Equal sums and gradients (a's gradients one tree per layer first, if stacked)."""
  (ta, ca, ga), (tb, cb, gb) = a, b
  ga = stacking.unstack_layers(ga)
  assert jax.tree.structure(ga) == jax.tree.structure(gb)
  assert float(ca) == float(cb)
  assert float(ta) == pytest.approx(float(tb), rel=rtol)
  for x, y in zip(jax.tree.leaves(ga), jax.tree.leaves(gb), strict=True):
    scale = float(jnp.max(jnp.abs(y))) + 1e-12
    assert float(jnp.max(jnp.abs(x - y))) / scale < rtol


@pytest.mark.parametrize("policy", ["full", "save_dots"])
def test_remat_equals_no_remat_and_is_applied(policy):
  base = llama.config("tiny")
  cfg = llama.config("tiny")
  cfg.remat = policy
  (got, (graphdef, params)), (want, _) = sums(cfg), sums(base)
  assert_same(got, want)
  jaxpr = str(
    jax.make_jaxpr(lambda p: sums_and_grads(p, batch(), graphdef=graphdef, task=TASK))(params)
  )
  assert "remat" in jaxpr or "checkpoint" in jaxpr


def test_unknown_remat_policy_is_a_user_error():
  cfg = llama.config("tiny")
  cfg.remat = "sometimes"
  with pytest.raises(UserError, match="model.remat"):
    sums(cfg)


def test_accumulating_four_micro_batches_equals_one_batch():
  cfg = llama.config("tiny")
  assert_same(sums(cfg, micro_batches=4)[0], sums(cfg, micro_batches=1)[0])


@pytest.mark.slow
def test_bf16_compute_keeps_fp32_master_weights():
  cfg = llama.config("tiny")
  cfg.dtype = "bfloat16"
  (total, _, grads), (graphdef, params) = sums(cfg)
  assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(params))
  assert all(g.dtype == jnp.float32 for g in jax.tree.leaves(grads))
  logits = nnx.merge(graphdef, params)(jnp.asarray(batch()["tokens"][:, :-1]))
  assert logits.dtype == jnp.bfloat16
  fp32 = sums(llama.config("tiny"))[0][0]
  assert float(total) == pytest.approx(float(fp32), rel=2e-2)  # same model, coarser arithmetic


FAMILIES = {"llama": llama, "gpt2": gpt2, "bert": bert}


def with_scan(cfg, scan=True, remat="none"):
  cfg = cfg.copy_and_resolve_references()
  cfg.scan, cfg.remat = scan, remat
  return cfg


def forward_and_grads(cfg, tokens_BT):
  """Output and gradients of a scalar of it, with the same (seed 0) weights whatever cfg's
  memory levers say."""
  graphdef, params = nnx.split(models.build(cfg), nnx.Param)

  def f(params):
    out = nnx.merge(graphdef, params)(tokens_BT)
    return jnp.sum(jnp.sin(out)), out

  (_, out), grads = jax.jit(jax.value_and_grad(f, has_aux=True))(params)
  return out, grads, graphdef, params


@pytest.mark.parametrize(
  ("family", "remat"),
  [("llama", "none"), ("gpt2", "none"), ("bert", "none"), ("llama", "full"), ("bert", "save_dots")],
)
def test_scan_equals_no_scan(family, remat):
  """Forward and gradients, scanned (and rematerialised: the scan body) or not."""
  base = FAMILIES[family].config("tiny", num_layers=3)
  tokens_BT = jnp.asarray(batch(B=2, T=9)["tokens"])
  want, want_g, _, _ = forward_and_grads(base, tokens_BT)
  got, got_g, graphdef, params = forward_and_grads(with_scan(base, remat=remat), tokens_BT)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
  # Stored stacked (one tree per slot, [L, ...]), from the unscanned model's values: one tree
  # per layer again, the gradients are the unscanned model's.
  assert "stacked" in params and "blocks" not in params
  assert_params_equal(stacking.unstack_layers(params), nnx.state(models.build(base), nnx.Param))
  got_g = stacking.unstack_layers(got_g)
  assert jax.tree.structure(got_g) == jax.tree.structure(want_g)
  # Relative to each leaf's largest gradient, or to a thousandth of the largest of all where a
  # leaf's gradient is zero up to rounding (BERT's key bias: softmax ignores a constant shift).
  floor = 1e-3 * max(float(jnp.max(jnp.abs(y))) for y in jax.tree.leaves(want_g))
  for x, y in zip(jax.tree.leaves(got_g), jax.tree.leaves(want_g), strict=True):
    scale = max(float(jnp.max(jnp.abs(y))), floor)
    assert float(jnp.max(jnp.abs(x - y))) / scale < 1e-5
  jaxpr = str(jax.make_jaxpr(lambda p: nnx.merge(graphdef, p)(tokens_BT))(params))
  assert "scan[" in jaxpr and jaxpr.count("dot_general") < 3 * 4 + 2  # one block body, not 3


def test_scan_trains_the_same():
  """Through the trainer's loss and gradient sums."""
  cfg = llama.config("tiny")
  assert_same(sums(with_scan(cfg, remat="save_dots"))[0], sums(cfg)[0])


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_decoding_with_scan_equals_without(family):
  """Decoding runs the blocks one by one (see nnx_zoo.common.memory.run_blocks): same tokens, same
  cache, and the prefill logits equal the scanned full forward."""
  cfg = FAMILIES[family].config("tiny")
  plain, scanned = models.build(cfg), models.build(with_scan(cfg))
  prompt = jnp.asarray(batch(B=2, T=5)["tokens"])
  cache = scanned.init_cache(2, 8)
  logits, _ = scanned(prompt, cache=cache)
  np.testing.assert_allclose(logits, scanned(prompt), rtol=1e-5, atol=1e-5)
  out = [
    engine.generate(m, prompt, max_new_tokens=3, rng=jax.random.key(0), temperature=0)
    for m in (plain, scanned)
  ]
  np.testing.assert_array_equal(out[0], out[1])


@pytest.mark.parametrize("scan", [False, True])
def test_remat_and_scan_with_frozen_lora_base_weights(scan):
  """The trainer merges trained and frozen parameters inside the differentiated function; the
  rematerialised (and scanned) blocks must take both, and give the plain model's gradients."""
  tokens_BT = jnp.asarray(batch(B=2, T=9)["tokens"])
  grads = []
  for cfg in (llama.config("tiny"), with_scan(llama.config("tiny"), scan=scan, remat="full")):
    cfg.lora.rank = 4
    graphdef, trained, frozen = nnx.split(models.build(cfg), lora.LoRAParam, ...)
    trained = jax.tree.map(lambda x: x + 0.05, trained)  # B != 0: every adapter has a gradient

    def f(trained, graphdef=graphdef, frozen=frozen):
      return jnp.sum(jnp.sin(nnx.merge(graphdef, trained, frozen)(tokens_BT)))

    grads.append(jax.jit(jax.grad(f))(trained))
  got = stacking.unstack_layers(grads[1])
  assert jax.tree.structure(got) == jax.tree.structure(grads[0])
  for x, y in zip(jax.tree.leaves(got), jax.tree.leaves(grads[0]), strict=True):
    assert float(jnp.max(jnp.abs(x - y))) / float(jnp.max(jnp.abs(y))) < 1e-5


def assert_params_equal(got, want):
  got, want = dict(nnx.to_flat_state(got)), dict(nnx.to_flat_state(want))
  assert got.keys() == want.keys()
  for k, v in want.items():
    np.testing.assert_array_equal(np.asarray(got[k][...]), np.asarray(v[...]), err_msg=str(k))


# Stacked layers (model.scan): the conversions every boundary uses, on a pattern of period 2 with
# a layer past the last whole repetition (5 layers: stacked [2, ...] x 2 slots, then one), and
# on a model of two stacks (T5's encoder and decoder).


def _gemma_tiny(num_layers):
  """Gemma 2's local/global pattern (period 2)."""
  cfg = gemma.config("tiny", num_layers=num_layers)
  assert len(cfg.layer_pattern) == 2, cfg.layer_pattern
  return cfg


def test_stack_and_unstack_layers_round_trip():
  """The scanned model's state is the unscanned one's (same seed) stacked per slot of the
  pattern; unstacking gives it back, and stacking the unscanned state gives the scanned one."""
  cfg = _gemma_tiny(5)
  plain = nnx.state(models.build(cfg))
  scanned = nnx.state(models.build(with_scan(cfg)))
  assert stacking.layouts(k for k, _ in nnx.to_flat_state(scanned)) == {(): 2}
  flat = dict(nnx.to_flat_state(scanned))
  q = flat[("stacked", 1, "attn", "q", "kernel")]
  assert q.shape[0] == 2 and q.axes[0] == "L"  # layers 1 and 3
  np.testing.assert_array_equal(
    q[...][1], dict(nnx.to_flat_state(plain))[("blocks", 3, "attn", "q", "kernel")][...]
  )
  assert ("rest", 0, "attn", "q", "kernel") in flat  # layer 4
  assert_params_equal(stacking.unstack_layers(scanned), plain)
  assert_params_equal(stacking.match_layers(plain, scanned), scanned)
  assert_params_equal(stacking.match_layers(scanned, plain), plain)
  assert_params_equal(stacking.stack_layers(stacking.unstack_layers(scanned), {(): 2}), scanned)
  # Each Variable's axes: the layer axis first when stacked, the per-layer axes otherwise.
  for k, v in nnx.to_flat_state(stacking.unstack_layers(scanned)):
    assert v.axes == dict(nnx.to_flat_state(plain))[k].axes, k


def test_two_stacks_convert_each_on_its_own():
  cfg = t5.config("tiny")
  plain = nnx.state(models.build(cfg), nnx.Param)
  scanned = nnx.state(models.build(with_scan(cfg)), nnx.Param)
  assert set(stacking.layouts(k for k, _ in nnx.to_flat_state(scanned))) == {
    ("encoder",),
    ("decoder",),
  }
  assert_params_equal(stacking.unstack_layers(scanned), plain)
  assert_params_equal(stacking.match_layers(plain, scanned), scanned)


@pytest.mark.slow  # 13-17 s: the quick suite's budget
def test_scanned_pattern_with_a_rest_equals_unscanned_and_decodes():
  """Logits of the same seed scanned (a remainder layer past the last repetition) or not;
  cached greedy decoding of the scanned model (layer by layer on slices of the stacks) equals
  the unscanned model's."""
  cfg = _gemma_tiny(5)
  plain, scanned = models.build(cfg), models.build(with_scan(cfg))
  tokens = jnp.asarray(batch(B=2, T=9, vocab=cfg.vocab_size)["tokens"])
  np.testing.assert_allclose(scanned(tokens), plain(tokens), rtol=1e-5, atol=1e-5)
  prompt = tokens[:, :5]
  logits, _ = scanned(prompt, cache=scanned.init_cache(2, 8))
  np.testing.assert_allclose(logits, plain(prompt), rtol=1e-5, atol=1e-5)
  out = [
    engine.generate(m, prompt, max_new_tokens=3, rng=jax.random.key(0), temperature=0)
    for m in (plain, scanned)
  ]
  np.testing.assert_array_equal(out[0], out[1])


def test_a_scanned_step_copies_no_stacked_parameters():
  """The compiled scanned step reads the stored stacks: no concatenate or stacking
  dynamic-update-slice of a whole parameter stack outside the loop (what stacking per call
  compiled to)."""
  cfg = with_scan(llama.config("tiny", num_layers=4), remat="full")
  graphdef, params = nnx.split(models.build(cfg), nnx.Param)
  tokens_BT = jnp.asarray(batch(B=2, T=9)["tokens"])
  loss = lambda p: jnp.sum(nnx.merge(graphdef, p)(tokens_BT))
  jaxpr = str(jax.make_jaxpr(jax.grad(loss))(params))
  assert "scan[" in jaxpr
  # jnp.stack of the 4 layers' weights is a concatenate into [4, ...] (the only 4 here: B=2, T=9).
  assert not re.search(r"f32\[4(,\d+)*\] = concatenate", jaxpr)


@pytest.mark.slow  # several steps compiled: 7-17 s on a cold cache
def test_scanned_layers_add_each_micro_batch_into_the_sums_in_their_backward_loop(monkeypatch):
  """Scanned and rematerialised in full, with micro-batches: each slice's layer gradients are
  added into the running sums inside the layers' own backward loop (accumulate.accumulating, a
  custom VJP), and the sums and gradients are still one batch's, unscanned."""
  fused = []
  scan = accumulate.scan
  monkeypatch.setattr(accumulate, "scan", lambda *a: fused.append(1) or scan(*a))
  base = llama.config("tiny", num_layers=3)
  cfg = with_scan(base, remat="full")
  (got, (graphdef, params)) = sums(cfg, micro_batches=4)
  assert fused  # the layers' own backward loop ran
  assert_same(got, sums(base)[0])
  fused.clear()
  sums(cfg, micro_batches=1)  # nothing to add into
  sums(with_scan(base, remat="save_dots"), micro_batches=4)  # its policy is the scan's
  assert not fused


def test_the_running_sums_are_found_by_the_stack_s_path():
  """accumulate's keys are parameter paths: a stack finds its sums at its path in the model
  (the model's own, ()), and a stack that names another path finds none (the plain scan)."""
  model = models.build(with_scan(llama.config("tiny", num_layers=3), remat="full"))
  params = nnx.state(model, nnx.Param)
  sums = jax.tree.map(jnp.zeros_like, params)
  states = tuple(nnx.split(slot)[1] for slot in model.stacked)
  with accumulate.accumulating(params, sums) as fused:
    found = accumulate.sums_of(model.path, states)
    assert accumulate.sums_of(("encoder",), states) is None
  assert model.path == () and found is not None and len(found) == len(jax.tree.leaves(states))
  stacked = [i for i, p in enumerate(accumulate.paths(params)) if p[0] == "stacked"]
  assert sorted(fused) == stacked  # what the scan added into, by index in params' leaves


@pytest.mark.slow  # several steps compiled: 7-17 s on a cold cache
def test_an_encoder_decoder_accumulates_in_both_stacks_and_through_the_cross_attention(
  monkeypatch,
):
  """T5, scanned and rematerialised in full: the decoder's backward loop also gives the
  gradient of the encoder's states it reads (what its body closes over), and the encoder's
  loop accumulates too."""
  fused = []
  scan = accumulate.scan
  monkeypatch.setattr(accumulate, "scan", lambda *a: fused.append(1) or scan(*a))
  pairs = source_target_pairs()

  def run(cfg, micro):
    graphdef, params = nnx.split(models.build(cfg), nnx.Param)
    fn = lambda p: sums_and_grads(
      p, pairs, graphdef=graphdef, task=tasks.get("seq2seq"), micro_batches=micro
    )
    return jax.jit(fn)(params)

  base = t5.config("tiny", num_layers=3)
  got = run(with_scan(base, remat="full"), 2)
  assert len(fused) == 2  # the encoder's loop and the decoder's
  assert_same(got, run(base, 1))
