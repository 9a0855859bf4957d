"""Memory levers change memory, not results: remat == no remat, scan == no scan, accumulation ==
one batch."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from nnx_zoo.common import models, sampling
from nnx_zoo.common.errors import UserError
from nnx_zoo.common.nn import lora
from nnx_zoo.common.train import step as steps
from nnx_zoo.zoo.bert import model as bert
from nnx_zoo.zoo.gpt2 import model as gpt2
from nnx_zoo.zoo.llama import model as llama


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


def sums(cfg, micro_batches=1):
  graphdef, params = nnx.split(models.build(cfg), nnx.Param)
  fn = jax.jit(lambda p, b: sums_and_grads(p, b, graphdef=graphdef, micro_batches=micro_batches))
  return fn(params, batch()), (graphdef, params)


def assert_same(a, b, rtol=1e-5):
  (ta, ca, ga), (tb, cb, gb) = a, b
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
  jaxpr = str(jax.make_jaxpr(lambda p: sums_and_grads(p, batch(), graphdef=graphdef))(params))
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
  # The parameter tree is unchanged: checkpoints and HF key maps address blocks.0, blocks.1...
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
    sampling.generate(m, prompt, max_new_tokens=3, rng=jax.random.key(0), temperature=0)
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
  for x, y in zip(jax.tree.leaves(grads[1]), jax.tree.leaves(grads[0]), strict=True):
    assert float(jnp.max(jnp.abs(x - y))) / float(jnp.max(jnp.abs(y))) < 1e-5
