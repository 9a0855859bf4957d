"""Blocked attention (`attention.impl="blocked"`, common/nn/attention_blocked.py) equals the
reference `attention_ref.attend` to 1e-6 in fp32, forward and gradients, over every mask, head
grouping, soft-cap and logit bias; whole models with impl="blocked" equal impl="xla"; and the
table gives it only a row's own keys."""

import functools
import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from nnx_zoo.common import attention_impl, models
from nnx_zoo.common.nn import attention_blocked, attention_ref, position
from nnx_zoo.common.tasks import losses
from nnx_zoo.zoo.gemma import model as gemma
from nnx_zoo.zoo.llama import model as llama


def randn(seed, shape, scale=1.0):
  return jnp.asarray(np.random.default_rng(seed).standard_normal(shape) * scale, jnp.float32)


def assert_close(got, want, what):
  """Equal to 1e-6 of the larger of 1 and the array's largest entry (fp32 sums in another
  order)."""
  got, want = np.asarray(got), np.asarray(want)
  err = np.max(np.abs(got - want)) / max(1.0, np.max(np.abs(want)))
  assert err <= 1e-6, (what, err)


# (causal, window, N, K, segments, bias, softcap): bias "random" (a [B, N, T, S] input of its
# own, its gradient compared), "alibi" (ALiBi of each document's positions) or "t5" (T5's
# learned relative bias, the gradient of its table compared).
CASES = {
  "causal-segments": (True, 0, 4, 4, True, None, 0.0),
  "bidirectional-gqa": (False, 0, 4, 2, False, None, 0.0),
  "causal-window-mqa": (True, 5, 4, 1, False, None, 0.0),
  "bidirectional-window-gqa-segments": (False, 6, 6, 3, True, None, 0.0),
  "causal-window-softcap-bias": (True, 7, 4, 2, True, "random", 3.0),
  "alibi": (True, 0, 4, 4, True, "alibi", 0.0),
  "t5": (False, 0, 4, 2, True, "t5", 0.0),
}
B, T, H = 2, 13, 8  # 4-row blocks: [0, 3) [3, 6) [6, 9) [9, 13), a ragged key range


@functools.partial(jax.jit, static_argnames=("case", "blocked"))
def loss_and_grads(q, k, v, bias_in, seg, w, *, case, blocked):
  """(output, gradients of sum(output * w) by q, k, v and the bias's input)."""
  causal, window, N, _, _, bias, softcap = CASES[case]
  rules = dict(causal=causal, window=window or None)

  def make_bias(bias_in):
    positions = position.positions_from_segments(seg)
    if bias == "alibi":  # its slopes and the positions: no gradient of its own but q's, k's
      return position.ALiBi().logit_bias(positions, positions, N) + 0.0 * bias_in.sum()
    if bias == "t5":
      t5 = nnx.eval_shape(lambda: position.RelativeBias(N, num_buckets=8, rngs=nnx.Rngs(0)))
      t5.table.set_value(bias_in)
      return t5.logit_bias(positions, positions, N)
    return bias_in if bias == "random" else None

  def attend(q, k, v, bias_in):
    bias_BNTS = make_bias(bias_in)
    kw = dict(bias_BNTS=bias_BNTS, softcap=softcap or None)
    if blocked:
      return attention_blocked.attend_blocked(
        q, k, v, q_seg_BT=seg, k_seg_BS=seg, block=4, **rules, **kw
      )
    mask = attention_ref.make_mask(jnp.arange(T), jnp.arange(T), seg, seg, **rules)
    return attention_ref.attend(q, k, v, mask_BTS=mask, **kw)

  out, vjp = jax.vjp(attend, q, k, v, bias_in)
  return out, vjp(w)


def inputs(case):
  _, _, N, K, segments, bias, _ = CASES[case]
  q, k, v = randn(1, (B, T, N, H), 1.5), randn(2, (B, T, K, H), 1.5), randn(3, (B, T, K, H))
  seg = np.ones((B, T), np.int32)
  if segments:  # two documents in row 0, padding at the end of row 1
    seg[0, 7:] = 2
    seg[1, -3:] = 0
  bias_in = {"t5": randn(4, (8, N)), "random": randn(4, (B, N, T, T))}.get(bias, jnp.zeros(()))
  return q, k, v, bias_in, jnp.asarray(seg), randn(5, (B, T, N, H))


@pytest.mark.parametrize("case", CASES)
def test_equals_reference_forward_and_gradients(case):
  args = inputs(case)
  out, grads = loss_and_grads(*args, case=case, blocked=True)
  out_ref, grads_ref = loss_and_grads(*args, case=case, blocked=False)
  assert_close(out, out_ref, "output")
  for name, g, g_ref in zip(("q", "k", "v", "bias"), grads, grads_ref, strict=True):
    assert_close(g, g_ref, name)


@pytest.mark.parametrize(
  "causal,window,nan,finite",
  [(True, None, slice(9, None), slice(0, 9)), (True, 4, slice(0, 3), slice(6, None))],
)
def test_skips_the_key_blocks_the_rules_mask(causal, window, nan, finite):
  """Values that are NaN where no query of a block may look: a block that read them would be
  NaN (0 x NaN), as the dense path is; the query blocks that skip them are not. Causal: keys
  from 9 on; a causal window of 4: keys before 3."""
  q, k, v, _, seg, _ = inputs("causal-segments")
  v = v.at[:, nan].set(jnp.nan)
  rules = dict(causal=causal, window=window)
  out = jax.jit(
    lambda q, k, v: attention_blocked.attend_blocked(
      q, k, v, q_seg_BT=seg, k_seg_BS=seg, block=4, **rules
    )
  )(q, k, v)
  assert np.isfinite(out[:, finite]).all()
  assert np.isnan(out).any()  # the blocks that read them


def test_a_short_row_runs_the_dense_path():
  """At most one block of queries: `attend_in_blocks`, the "xla" path, exactly."""
  q, k, v, _, seg, _ = inputs("causal-segments")
  mask = attention_ref.make_mask(jnp.arange(T), jnp.arange(T), seg, seg, causal=True)
  got = attention_blocked.attend_blocked(
    q, k, v, q_seg_BT=seg, k_seg_BS=seg, causal=True, window=None
  )
  want = attention_ref.attend_in_blocks(q, k, v, mask_BTS=mask, causal=True, window=None)
  np.testing.assert_array_equal(got, want)


# ---------------------------------------------------------------------------------------------
# The table: "blocked" takes a row's own keys; "auto" never picks it.


@pytest.mark.parametrize("keys", ["cache", "source", "context"])
def test_foreign_keys_fall_back_to_xla(keys):
  call = attention_impl.Call("cpu", "float32", 64, 128, keys=keys)
  impl, why = attention_impl.runs("blocked", call)
  assert impl == "xla" and why == attention_impl.FOREIGN_KEYS[keys]


def test_decoding_falls_back_quietly_and_cross_attention_with_a_warning(monkeypatch, caplog):
  """A KV cache keeps no scores for a backward pass: INFO; cross-attention in training would."""
  monkeypatch.setattr(attention_impl, "_logged", set())
  caplog.set_level(logging.INFO, logger=attention_impl.__name__)
  for keys in ("cache", "source"):
    assert (
      attention_impl.choose("blocked", attention_impl.Call("cpu", "float32", keys=keys)) == "xla"
    )
  levels = {r.getMessage().rsplit(": ", 1)[-1]: r.levelno for r in caplog.records}
  assert levels == {
    attention_impl.FOREIGN_KEYS["cache"]: logging.INFO,
    attention_impl.FOREIGN_KEYS["source"]: logging.WARNING,
  }


@pytest.mark.parametrize("platform", ["cpu", "gpu", "tpu"])
def test_blocked_runs_as_named_and_auto_never_picks_it(platform):
  facts = dict(bias=True, segments=True, softcap=True, bidirectional_window=True)
  call = attention_impl.Call(platform, "bfloat16", 64, 4096, **facts)
  assert attention_impl.runs("blocked", call) == ("blocked", "")
  assert attention_impl.runs("auto", attention_impl.Call("cpu", "float32", 64, 4096))[0] == "xla"


# ---------------------------------------------------------------------------------------------
# Whole models: impl="blocked" equals impl="xla" in loss and gradients.


def model_batch(vocab: int, Bm: int = 2, Tm: int = 33):
  rng = np.random.default_rng(0)
  tokens = jnp.asarray(rng.integers(0, vocab, (Bm, Tm + 1)), jnp.int32)
  segments = np.ones((Bm, Tm + 1), np.int32)
  segments[0, 14:] = 2
  segments[1, -5:] = 0
  return {"tokens": tokens, "segment_ids": jnp.asarray(segments)}


def model_loss_and_grads(cfg, impl):
  cfg = cfg.copy_and_resolve_references()
  cfg.attention.impl = impl
  graphdef, params = nnx.split(models.build(cfg, seed=1), nnx.Param)
  b = model_batch(cfg.vocab_size)

  def total(params):
    return losses.loss_sums(nnx.merge(graphdef, params), b)

  return jax.jit(jax.value_and_grad(total, has_aux=True))(params)


MODELS = {
  "llama": lambda: llama.config("tiny", vocab_size=97),
  # Sliding-window and global layers alternating, soft-capped logits, GQA (Gemma 2).
  "gemma2": lambda: gemma.config(
    "gemma2-2b",
    vocab_size=97,
    dim=32,
    hidden_dim=64,
    num_heads=4,
    num_kv_heads=2,
    head_dim=8,
    window=6,
    query_pre_attn_scalar=8,
    num_layers=2,
  ),  # fmt: skip
}


@pytest.mark.slow
@pytest.mark.parametrize("family", MODELS)
def test_model_loss_and_gradients_equal_xla(monkeypatch, caplog, family):
  monkeypatch.setattr(attention_blocked, "BLOCK", 8)  # rows of 33 tokens: 5 blocks
  monkeypatch.setattr(attention_impl, "_logged", set())
  caplog.set_level(logging.WARNING, logger=attention_impl.__name__)
  cfg = MODELS[family]()
  if family == "gemma2":
    assert cfg.attention.softcap and cfg.layer_kinds.sliding.attention.window
  (total, count), grads = model_loss_and_grads(cfg, "blocked")
  (total_x, count_x), grads_x = model_loss_and_grads(cfg, "xla")
  assert not caplog.records  # no fallback: every layer ran "blocked"
  assert count == count_x
  np.testing.assert_allclose(total, total_x, rtol=1e-6)
  largest = max(float(jnp.abs(g[...]).max()) for _, g in nnx.to_flat_state(grads_x))
  for (path, g), (_, g_x) in zip(nnx.to_flat_state(grads), nnx.to_flat_state(grads_x), strict=True):
    np.testing.assert_allclose(g[...], g_x[...], rtol=1e-5, atol=1e-6 * largest, err_msg=str(path))


def test_init_from_takes_blocked_as_a_lever():
  cfg = models.levers(attention={"impl": "blocked"})
  assert cfg.attention.impl == "blocked" and models.is_lever("model.attention.impl")
