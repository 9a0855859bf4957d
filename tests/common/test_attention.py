"""Attention against a plain numpy reference (explicit loops over heads), and its invariants:
causality by gradients, GQA/MQA == MHA with repeated k/v, masks, soft-cap, QK-norm, KV cache;
impl="flash" == impl="xla", and the fallbacks to "xla"."""

import contextlib
import logging
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from nnx_zoo.common import attention_impl
from nnx_zoo.common.errors import UserError
from nnx_zoo.common.nn import attention, attention_ref, attention_report, position

# ---------------------------------------------------------------------------------------------
# Independent references (numpy, float64, one head at a time).


def np_mask(q_idx, k_idx, q_seg, k_seg, *, causal, window=0):
  """[B, T, S]: query t sees key s in its own segment; causal: s <= t; a window of W: the keys
  t-W+1 .. t (and up to t+W-1 when bidirectional)."""
  B, T, S = q_seg.shape[0], len(q_idx), len(k_idx)
  out = np.zeros((B, T, S), bool)
  for b in range(B):
    for i, t in enumerate(q_idx):
      lo = t - window + 1 if window else -math.inf
      hi = t if causal else (t + window - 1 if window else math.inf)
      for j, s in enumerate(k_idx):
        out[b, i, j] = q_seg[b, i] == k_seg[b, j] and lo <= s <= hi
  return out


def np_attend(q, k, v, mask, bias=None, softcap=0.0):
  q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
  B, T, N, H = q.shape
  G = N // k.shape[2]
  out = np.zeros((B, T, N, H))
  for b in range(B):
    for n in range(N):
      kv = n // G  # query head n reads key/value head n // G (HF's repeat_kv)
      logits = q[b, :, n] @ k[b, :, kv].T / math.sqrt(H)
      if softcap:
        logits = softcap * np.tanh(logits / softcap)
      if bias is not None:
        logits = logits + np.asarray(bias, np.float64)[b, n]
      logits = np.where(mask[b], logits, -np.inf)
      p = np.exp(logits - logits.max(-1, keepdims=True))
      out[b, :, n] = (p / p.sum(-1, keepdims=True)) @ v[b, :, kv]
  return out


def np_rope(x, positions, theta=10_000.0):
  x = np.asarray(x, np.float64)
  H = x.shape[-1]
  inv_freq = 1.0 / theta ** (np.arange(0, H, 2) / H)
  freqs = np.asarray(positions, np.float64)[..., None] * inv_freq
  emb = np.concatenate([freqs, freqs], -1)[:, :, None]
  rotated = np.concatenate([-x[..., H // 2 :], x[..., : H // 2]], -1)
  return x * np.cos(emb) + rotated * np.sin(emb)


def np_norm(x, kind, scale, bias=None, eps=1e-6):
  x = np.asarray(x, np.float64)
  if kind == "rms":
    return x / np.sqrt(np.mean(x * x, -1, keepdims=True) + eps) * scale
  mu = x.mean(-1, keepdims=True)
  var = ((x - mu) ** 2).mean(-1, keepdims=True)
  return (x - mu) / np.sqrt(var + eps) * scale + bias


def np_alibi(num_heads, q_pos, k_pos):
  # Press et al.: for a power of two n, slopes 2^(-8/n), 2^(-16/n), ...
  assert math.log2(num_heads).is_integer()
  slopes = np.array([2.0 ** (-8.0 * (i + 1) / num_heads) for i in range(num_heads)])
  return -slopes[None, :, None, None] * np.abs(q_pos[:, None, :, None] - k_pos[:, None, None, :])


def randn(seed, shape, scale=1.0):
  return (np.random.default_rng(seed).standard_normal(shape) * scale).astype(np.float32)


def layer(seed=0, dim=32, **kw):
  """An Attention layer with random weights, biases and norm scales (numpy, so that no eager op
  is compiled; kernels larger than the 0.02 init, so attention is far from uniform)."""
  kw = {"num_heads": 4, "head_dim": 8, **kw}
  cfg = attention.config(**kw)
  attn = nnx.eval_shape(lambda: attention.Attention(cfg, dim, rngs=nnx.Rngs(0)))
  rng = np.random.default_rng(seed)
  for _, p in nnx.iter_graph(attn):
    if isinstance(p, nnx.Param):
      shape = p.get_value().shape
      base = 1.0 if len(shape) == 1 and shape[0] == kw["head_dim"] else 0.0  # norm scales
      p.set_value(jnp.asarray(base + 0.3 * rng.standard_normal(shape), jnp.float32))
  return attn


def np_layer(
  attn, x, positions, seg, *, pos_kind="rope", qk_norm="none", causal=True, window=0, softcap=0.0
):
  """The whole layer in numpy from its weights."""
  B, T, _ = x.shape
  N, K, H = attn.num_heads, attn.num_kv_heads, attn.head_dim
  x = np.asarray(x, np.float64)

  def proj(lin):
    y = x @ np.asarray(lin.kernel[...], np.float64)
    return y + np.asarray(lin.bias[...]) if lin.bias is not None else y

  q = proj(attn.q).reshape(B, T, N, H)
  k = proj(attn.k).reshape(B, T, K, H)
  v = proj(attn.v).reshape(B, T, K, H)
  if qk_norm != "none":
    qn, kn = attn.q_norm, attn.k_norm
    bq = np.asarray(qn.bias[...]) if qk_norm == "layer" else None
    bk = np.asarray(kn.bias[...]) if qk_norm == "layer" else None
    q = np_norm(q, qk_norm, np.asarray(qn.scale[...]), bq)
    k = np_norm(k, qk_norm, np.asarray(kn.scale[...]), bk)
  bias = None
  if pos_kind == "rope":
    q, k = np_rope(q, positions), np_rope(k, positions)
  elif pos_kind == "alibi":
    bias = np_alibi(N, positions, positions)
  mask = np_mask(range(T), range(T), seg, seg, causal=causal, window=window)
  out = np_attend(q, k, v, mask, bias, softcap).reshape(B, T, N * H)
  y = out @ np.asarray(attn.o.kernel[...], np.float64)
  return y + np.asarray(attn.o.bias[...]) if attn.o.bias is not None else y


ROPE = position.RoPE(8, theta=1e4, scaling=position.rope_scaling())


@nnx.jit
def _apply(attn, pos, x, positions, seg, cache):
  return attn(x, positions_BT=positions, segment_ids_BT=seg, position=pos, cache=cache)


def run(attn, x, positions=None, seg=None, pos=None, cache=None):
  """The layer under jit (one compile per shape, much faster on CPU than eager op by op)."""
  B, T = x.shape[:2]
  if positions is None:
    positions = np.broadcast_to(np.arange(T), (B, T))
  seg = None if seg is None else jnp.asarray(seg, jnp.int32)
  return _apply(
    attn, ROPE if pos is None else pos, jnp.asarray(x), jnp.asarray(positions), seg, cache
  )


attend = jax.jit(attention_ref.attend, static_argnames="softcap")

# ---------------------------------------------------------------------------------------------
# attend: the core against the reference; GQA / MQA against MHA with repeated heads.


@pytest.mark.parametrize("N,K", [(4, 4), (4, 2), (4, 1), (6, 3)])
@pytest.mark.parametrize("causal", [True, False])
def test_attend_matches_reference(N, K, causal):
  B, T, H = 2, 7, 8
  q, k, v = randn(0, (B, T, N, H)), randn(1, (B, T, K, H)), randn(2, (B, T, K, H))
  seg = np.ones((B, T), np.int32)
  mask = np_mask(range(T), range(T), seg, seg, causal=causal)
  got = attend(q, k, v, mask_BTS=jnp.asarray(mask))
  np.testing.assert_allclose(got, np_attend(q, k, v, mask), atol=1e-5)


@pytest.mark.parametrize("K", [1, 2, 4])
def test_gqa_equals_mha_with_repeated_kv(K):
  B, T, N, H = 2, 7, 4, 8
  q, k, v = randn(3, (B, T, N, H)), randn(4, (B, T, K, H)), randn(5, (B, T, K, H))
  mask = jnp.tril(jnp.ones((T, T), bool))[None].repeat(B, 0)
  bias = jnp.asarray(np_alibi(N, np.tile(np.arange(T), (B, 1)), np.tile(np.arange(T), (B, 1))))
  for b in (None, bias):
    gqa = attend(q, k, v, mask_BTS=mask, bias_BNTS=b)
    mha = attend(
      q,
      jnp.repeat(k, N // K, axis=2),
      jnp.repeat(v, N // K, axis=2),
      mask_BTS=mask,
      bias_BNTS=b,
    )
    np.testing.assert_allclose(gqa, mha, atol=1e-6)


def test_attend_bias_and_softcap_match_reference():
  B, T, N, K, H = 2, 7, 4, 2, 8
  q, k, v = randn(6, (B, T, N, H), 3.0), randn(7, (B, T, K, H), 3.0), randn(8, (B, T, K, H))
  seg = np.ones((B, T), np.int32)
  mask = np_mask(range(T), range(T), seg, seg, causal=True)
  bias = randn(9, (B, N, T, T))
  got = attend(q, k, v, mask_BTS=jnp.asarray(mask), bias_BNTS=bias, softcap=2.0)
  np.testing.assert_allclose(got, np_attend(q, k, v, mask, bias, softcap=2.0), atol=1e-5)
  # The cap changes the answer with these large logits (so the test is not vacuous).
  plain = attend(q, k, v, mask_BTS=jnp.asarray(mask), bias_BNTS=bias)
  assert not np.allclose(got, plain, atol=1e-3)


# ---------------------------------------------------------------------------------------------
# Masks


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("window", [0, 1, 3])
def test_make_mask_matches_reference(causal, window):
  seg = np.array([[1, 1, 1, 1, 2, 2, 2, 2, 2], [3, 3, 3, 3, 3, 3, 3, 0, 0]])
  T = seg.shape[1]
  got = attention_ref.make_mask(
    jnp.arange(T),
    jnp.arange(T),
    jnp.asarray(seg),
    jnp.asarray(seg),
    causal=causal,
    window=window,
  )
  np.testing.assert_array_equal(
    got, np_mask(range(T), range(T), seg, seg, causal=causal, window=window)
  )


def test_sliding_window_sees_exactly_the_last_w_keys():
  T, W = 8, 3
  ones = jnp.ones((1, T), jnp.int32)
  mask = np.asarray(
    attention_ref.make_mask(jnp.arange(T), jnp.arange(T), ones, ones, causal=True, window=W)
  )[0]
  for t in range(T):
    assert set(np.flatnonzero(mask[t])) == set(range(max(0, t - W + 1), t + 1))


# ---------------------------------------------------------------------------------------------
# The layer against the numpy reference, for each variant.


@pytest.mark.parametrize(
  "kw",
  [
    dict(),
    dict(num_kv_heads=2),
    dict(num_kv_heads=1),
    dict(qkv_bias=True, out_bias=True),
    dict(qk_norm="rms", num_kv_heads=2),
    dict(qk_norm="layer"),
    dict(softcap=3.0),
    dict(window=3, num_kv_heads=2),
    dict(mask="bidirectional", window=2),
  ],
  ids=lambda kw: "-".join(f"{k}={v}" for k, v in kw.items()) or "mha",
)
def test_layer_matches_reference(kw):
  attn = layer(**kw)
  x = randn(10, (2, 7, 32))
  seg = np.array([[1] * 7, [1, 1, 1, 2, 2, 2, 2]])
  positions = np.asarray(position.positions_from_segments(jnp.asarray(seg)))
  got, cache = run(attn, x, positions, seg)
  assert cache is None
  want = np_layer(
    attn,
    x,
    positions,
    seg,
    qk_norm=kw.get("qk_norm", "none"),
    causal=kw.get("mask", "causal") == "causal",
    window=kw.get("window", 0),
    softcap=kw.get("softcap", 0.0),
  )
  np.testing.assert_allclose(got, want, atol=2e-5, rtol=1e-5)


def test_key_bias_false_drops_a_bias_softmax_ignores():
  """key_bias=False (Whisper): k has no bias, and a layer with one (any value) computes the same,
  since q.b shifts all of a query's logits alike."""
  with_bias = layer(qkv_bias=True, out_bias=True)
  without = layer(qkv_bias=True, key_bias=False, out_bias=True)
  assert without.k.bias is None and with_bias.k.bias is not None
  for name in ("q", "k", "v", "o"):
    getattr(without, name).kernel[...] = getattr(with_bias, name).kernel[...]
    if name != "k":
      getattr(without, name).bias[...] = getattr(with_bias, name).bias[...]
  x = randn(3, (2, 7, 32))
  none = position.Position()  # RoPE would rotate the bias, and then it would count
  np.testing.assert_allclose(
    run(without, x, pos=none)[0], run(with_bias, x, pos=none)[0], atol=1e-4, rtol=1e-4
  )


@pytest.mark.parametrize("num_kv_heads", [4, 2])
def test_layer_with_alibi_matches_reference(num_kv_heads):
  attn = layer(num_kv_heads=num_kv_heads)
  x = randn(11, (2, 6, 32))
  positions = np.tile(np.arange(6), (2, 1))
  got, _ = run(attn, x, positions, pos=position.ALiBi())
  want = np_layer(attn, x, positions, np.ones((2, 6)), pos_kind="alibi")
  np.testing.assert_allclose(got, want, atol=2e-5, rtol=1e-5)


def test_bad_configs_are_user_errors():
  with pytest.raises(UserError):
    layer(num_heads=4, num_kv_heads=3)
  with pytest.raises(UserError):
    layer(mask="prefix")
  with pytest.raises(UserError):
    layer(impl="pallas")
  with pytest.raises(UserError, match="auto"):
    layer(impl="Auto")


def test_bfloat16_compute_stays_close():
  attn32 = layer(num_kv_heads=2)
  cfg = attention.config(num_heads=4, num_kv_heads=2, head_dim=8)
  attn16 = nnx.eval_shape(
    lambda: attention.Attention(cfg, 32, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
  )
  nnx.update(attn16, nnx.state(attn32))
  x = randn(12, (1, 5, 32))
  out16, _ = run(attn16, x)
  out32, _ = run(attn32, x)
  assert out16.dtype == jnp.bfloat16
  np.testing.assert_allclose(np.asarray(out16, np.float32), out32, atol=0.05, rtol=0.05)


# ---------------------------------------------------------------------------------------------
# Invariants by gradients: which inputs each output depends on.


def jacobian_norms(attn, x, seg=None, pos=None):
  """[T, S]: |d out[0, t] / d x[0, s]|."""

  @nnx.jit
  def norms(attn, pos, x):
    T = x.shape[1]
    positions = jnp.arange(T)[None]
    f = lambda x: attn(x, positions_BT=positions, segment_ids_BT=seg, position=pos)[0][0]
    jac = jax.jacrev(f)(x)  # [T, D, 1, S, D]
    return jnp.sqrt(jnp.sum(jac[:, :, 0] ** 2, axis=(1, 3)))

  return np.asarray(norms(attn, ROPE if pos is None else pos, jnp.asarray(x)))


@pytest.mark.parametrize("pos", [None, position.ALiBi(), position.Position()])
def test_causal_by_gradients(pos):
  T = 8
  attn = layer(num_kv_heads=2)
  dep = jacobian_norms(attn, randn(13, (1, T, 32)), pos=pos)
  future = np.triu(np.ones((T, T), bool), k=1)
  assert np.all(dep[future] == 0.0)  # exactly: masked probabilities are exactly zero
  assert np.all(dep[~future] > 1e-6)


def test_bidirectional_depends_on_every_position():
  T = 8
  dep = jacobian_norms(layer(mask="bidirectional"), randn(14, (1, T, 32)))
  assert np.all(dep > 1e-6)


@pytest.mark.parametrize("mask", ["causal", "bidirectional"])
def test_sliding_window_by_gradients(mask):
  T, W = 8, 3
  dep = jacobian_norms(layer(window=W, mask=mask), randn(15, (1, T, 32)))
  t, s = np.meshgrid(np.arange(T), np.arange(T), indexing="ij")
  visible = (s >= t - W + 1) & ((s <= t) if mask == "causal" else (s <= t + W - 1))
  assert np.all(dep[~visible] == 0.0)
  assert np.all(dep[visible] > 1e-6)


@pytest.mark.parametrize("mask", ["causal", "bidirectional"])
def test_segments_never_attend_across_by_gradients(mask):
  seg = np.array([[1, 1, 1, 2, 2, 3, 3, 3]])
  dep = jacobian_norms(layer(mask=mask), randn(16, (1, 8, 32)), seg=seg)
  same = seg[0][:, None] == seg[0][None, :]
  assert np.all(dep[~same] == 0.0)
  if mask == "bidirectional":
    assert np.all(dep[same] > 1e-6)


# ---------------------------------------------------------------------------------------------
# Packing and padding: a segment's output is that segment run alone.


@pytest.mark.parametrize("pos", [None, position.ALiBi()])
@pytest.mark.parametrize("mask", ["causal", "bidirectional"])
def test_packed_segment_equals_segment_alone(mask, pos):
  attn = layer(num_kv_heads=2, mask=mask)
  lengths = [5, 3]
  docs = [randn(20 + i, (1, n, 32)) for i, n in enumerate(lengths)]
  seg = np.concatenate([np.full(n, i + 1) for i, n in enumerate(lengths)])[None]
  positions = np.asarray(position.positions_from_segments(jnp.asarray(seg)))
  packed, _ = run(attn, np.concatenate(docs, 1), positions, seg, pos)
  start = 0
  for doc, n in zip(docs, lengths, strict=True):
    alone, _ = run(attn, doc, pos=pos)
    np.testing.assert_allclose(packed[:, start : start + n], alone, atol=1e-5)
    start += n


@pytest.mark.parametrize("mask", ["causal", "bidirectional"])
def test_padding_segment_does_not_change_real_tokens(mask):
  attn = layer(mask=mask)
  real = randn(30, (2, 5, 32))
  x = np.concatenate([real, randn(31, (2, 3, 32), 10.0)], 1)  # 3 padding tokens
  seg = np.array([[1] * 5 + [0] * 3] * 2)
  out, _ = run(attn, x, seg=seg)
  alone, _ = run(attn, real)
  np.testing.assert_allclose(out[:, :5], alone, atol=1e-5)
  assert np.all(np.isfinite(out))


# ---------------------------------------------------------------------------------------------
# KV cache: prefill then steps equals one full pass.


@pytest.mark.parametrize(
  "kw,pos",
  [
    (dict(), None),
    (dict(num_kv_heads=1, qk_norm="rms", qkv_bias=True), None),
    (dict(num_kv_heads=2, window=3), None),
    (dict(num_kv_heads=2), position.ALiBi()),
  ],
  ids=["mha", "mqa-qknorm-bias", "window", "alibi"],
)
def test_kv_cache_equals_full_pass(kw, pos):
  attn = layer(**kw)
  B, T, P = 2, 8, 4
  x = randn(40, (B, T, 32))
  full, _ = run(attn, x, pos=pos)
  cache = attn.init_cache(B, 10)
  # A prompt, one step of 2 tokens (in one case: it compiles once more), then 1 at a time.
  two = [(P, P + 2)] if not kw else []
  chunks = [(0, P), *two] + [(t, t + 1) for t in range(P + 2 * len(two), T)]
  outs = []
  for a, b in chunks:
    positions = np.broadcast_to(np.arange(a, b), (B, b - a))
    out, cache = run(attn, x[:, a:b], positions, pos=pos, cache=cache)
    outs.append(out)
    assert (np.asarray(cache.index) == b).all()
  np.testing.assert_allclose(np.concatenate(outs, 1), full, atol=1e-5)


# ---------------------------------------------------------------------------------------------
# Implementations: "flash" (the Pallas kernel, interpret mode on CPU) equals "xla" on the layer's
# output and gradients; where an impl does not apply the layer runs "xla" and says so once.


@nnx.jit
def _out_and_grads(attn, pos, x, positions, seg, w):
  def loss(attn, x):
    out, _ = attn(x, positions_BT=positions, segment_ids_BT=seg, position=pos)
    return jnp.sum(out * w), out

  (_, out), grads = nnx.value_and_grad(loss, argnums=(0, 1), has_aux=True)(attn, x)
  return out, grads


@pytest.mark.parametrize(
  "kw",
  [
    dict(num_kv_heads=2, qk_norm="rms"),
    pytest.param(dict(mask="bidirectional", window=3, softcap=2.0), marks=pytest.mark.slow),
  ],
  ids=["gqa-causal-packed", "bidirectional-window-softcap"],
)
def test_flash_layer_equals_xla(kw):
  x = randn(50, (2, 12, 32))
  seg = np.array([[1] * 5 + [2] * 7, [3] * 9 + [0] * 3])
  positions = position.positions_from_segments(jnp.asarray(seg))
  w = randn(51, (2, 12, 32))
  args = (ROPE, jnp.asarray(x), positions, jnp.asarray(seg, jnp.int32), jnp.asarray(w))
  out_x, grads_x = _out_and_grads(layer(**kw), *args)
  out_f, grads_f = _out_and_grads(layer(impl="flash", **kw), *args)
  np.testing.assert_allclose(out_f, out_x, atol=2e-5, rtol=1e-5)
  for g_f, g_x in zip(jax.tree.leaves(grads_f), jax.tree.leaves(grads_x), strict=True):
    np.testing.assert_allclose(g_f, g_x, atol=5e-5, rtol=1e-4)


def test_flash_with_alibi_falls_back_to_xla_and_logs_once(caplog, monkeypatch):
  monkeypatch.setattr(attention_impl, "_logged", set())
  caplog.set_level(logging.WARNING, logger=attention_impl.__name__)
  flash, xla = layer(impl="flash"), layer()
  for T in (6, 7):  # two traces, one message
    x = randn(52, (1, T, 32))
    np.testing.assert_array_equal(
      run(flash, x, pos=position.ALiBi())[0], run(xla, x, pos=position.ALiBi())[0]
    )
  messages = [r.getMessage() for r in caplog.records if "falls back" in r.getMessage()]
  assert len(messages) == 1 and "ALiBi" in messages[0], messages


@pytest.mark.parametrize(
  "impl,kw,backend,want",
  [
    ("flash", dict(), "cpu", "flash"),  # interpret mode
    ("flash", dict(bias=True), "gpu", "xla"),
    ("flash", dict(cache=True), "gpu", "xla"),
    ("flash", dict(), "tpu", "flash"),  # jax's splash kernel (kernels/tpu_attention.py)
    ("flash", dict(bias=True), "tpu", "xla"),
    ("flash", dict(softcap=True, bidirectional_window=True), "gpu", "flash"),
    ("cudnn", dict(), "cpu", "xla"),
    ("cudnn", dict(), "gpu", "cudnn"),
    ("cudnn", dict(bias=True), "gpu", "cudnn"),
    ("cudnn", dict(dtype=jnp.float32), "gpu", "xla"),
    ("cudnn", dict(softcap=True), "gpu", "xla"),
    ("cudnn", dict(cache=True), "gpu", "xla"),
    ("cudnn", dict(bidirectional_window=True), "gpu", "xla"),
    ("xla", dict(bias=True, cache=True), "gpu", "xla"),
  ],
)
def test_choose_impl(impl, kw, backend, want):
  kw = (
    dict(bias=False, cache=False, softcap=False, bidirectional_window=False, dtype=jnp.bfloat16)
    | kw
  )
  assert attention_impl.choose_impl(impl, backend=backend, **kw) == want


@pytest.mark.cpu_only
def test_cudnn_on_cpu_and_flash_when_decoding_run_xla():
  x = randn(53, (2, 6, 32))
  want, _ = run(layer(), x)
  got, _ = run(layer(impl="cudnn"), x)
  np.testing.assert_array_equal(got, want)
  flash = layer(impl="flash")
  cache = flash.init_cache(2, 8)
  got, cache = run(flash, x, cache=cache)
  np.testing.assert_allclose(got, want, atol=1e-5)


# ---------------------------------------------------------------------------------------------
# impl="auto": resolved for the platform compiled for (a pure function), and on this CPU the xla
# path exactly.

BF16, F32 = jnp.bfloat16, jnp.float32


@pytest.mark.parametrize(
  "platform,kw,want",
  [
    ("cpu", dict(), "xla"),
    ("cpu", dict(dtype=F32), "xla"),
    ("tpu", dict(), "flash"),  # splash
    ("tpu", dict(softcap=True, bidirectional_window=True), "flash"),
    ("tpu", dict(bias=True), "xla"),
    ("tpu", dict(cache=True), "xla"),
    ("gpu", dict(), "cudnn"),
    ("gpu", dict(dtype=jnp.float16, segments=True, bias=True), "cudnn"),
    ("gpu", dict(head_dim=256), "xla"),  # over 128 on a GPU not known to be Hopper or later
    ("gpu", dict(head_dim=256, device_kind="NVIDIA H200"), "cudnn"),
    ("gpu", dict(head_dim=256, device_kind="gpu-nvidia-h100-80gb-hbm3x8"), "cudnn"),
    ("gpu", dict(head_dim=256, device_kind="NVIDIA A100-SXM4-80GB"), "xla"),
    ("gpu", dict(head_dim=72), "cudnn"),
    ("gpu", dict(head_dim=36), "xla"),  # not a multiple of 8; the kernel failed in bf16
    ("gpu", dict(seq_len=2047, segments=True), "xla"),  # odd length with a mask-as-bias
    ("gpu", dict(seq_len=2047), "cudnn"),
    # What cuDNN cannot take: float32, a soft-cap, a bidirectional window, a cache.
    ("gpu", dict(dtype=F32), "flash"),
    ("gpu", dict(dtype=F32, seq_len=2000), "xla"),  # a padded length: the kernel failed there
    ("gpu", dict(dtype=F32, bias=True), "xla"),
    ("gpu", dict(softcap=True), "xla"),  # bf16: the kernel failed its bf16 case on an H200
    ("gpu", dict(dtype=F32, softcap=True), "flash"),
    ("gpu", dict(bidirectional_window=True), "xla"),
    ("gpu", dict(dtype=F32, bidirectional_window=True), "flash"),
    ("gpu", dict(cache=True), "xla"),
    ("gpu", dict(cache=True, dtype=F32), "xla"),
  ],
)
def test_resolve_auto(platform, kw, want):
  kw = dict(dtype=BF16, head_dim=64, seq_len=2048) | kw
  impl, why = attention_impl.resolve_auto(platform=platform, **kw)
  assert impl == want, why
  assert why.startswith(platform)


@pytest.mark.cpu_only
def test_auto_is_the_default_and_runs_the_xla_path_on_cpu(caplog, monkeypatch):
  """On a CPU "auto" is "xla": the same numbers, output and gradients, with packed segments;
  the choice is logged once."""
  assert attention.config(num_heads=2, head_dim=8).impl == "auto"
  monkeypatch.setattr(attention_impl, "_logged", set())
  caplog.set_level(logging.INFO, logger=attention_impl.__name__)
  x = randn(54, (2, 12, 32))
  seg = np.array([[1] * 5 + [2] * 7, [3] * 9 + [0] * 3])
  positions = position.positions_from_segments(jnp.asarray(seg))
  w = randn(55, (2, 12, 32))
  args = (ROPE, jnp.asarray(x), positions, jnp.asarray(seg, jnp.int32), jnp.asarray(w))
  kw = dict(num_kv_heads=2, qk_norm="rms")
  out_a, grads_a = _out_and_grads(layer(impl="auto", **kw), *args)
  out_x, grads_x = _out_and_grads(layer(impl="xla", **kw), *args)
  np.testing.assert_array_equal(out_a, out_x)
  for g_a, g_x in zip(jax.tree.leaves(grads_a), jax.tree.leaves(grads_x), strict=True):
    np.testing.assert_array_equal(g_a, g_x)
  run(layer(impl="auto"), randn(56, (1, 7, 32)))  # another trace: no second message
  messages = [r.getMessage() for r in caplog.records if "resolved" in r.getMessage()]
  assert messages == [
    "attention impl='auto': resolved to 'xla': cpu: the XLA path (with query blocks)"
  ], messages


def test_describe_auto_per_layer_kind():
  """`zoo show`'s line: Gemma 2 (soft-cap) never gets cuDNN; Gemma 3's 256-wide heads get it on a
  Hopper GPU only; an fp32 Llama gets the kernel on a GPU, xla on a CPU."""
  from nnx_zoo.zoo.gemma import model as gemma
  from nnx_zoo.zoo.llama import model as llama

  g2, g3 = gemma.config("gemma2-2b"), gemma.config("gemma3-1b")
  g2.dtype = g3.dtype = "bfloat16"
  assert attention_report.describe_auto(g2, platform="gpu", seq_len=4096).startswith("xla (")
  assert attention_report.describe_auto(g3, platform="gpu", seq_len=4096).startswith("xla (")
  h200 = attention_report.describe_auto(g3, platform="gpu", seq_len=4096, device_kind="NVIDIA H200")
  assert h200.startswith("cudnn (")
  tiny = llama.config("tiny")
  assert attention_report.describe_auto(tiny, platform="gpu", seq_len=256).startswith("flash (")
  assert attention_report.describe_auto(tiny, platform="cpu", seq_len=256).startswith("xla (")
  tiny.attention.impl = "xla"
  assert attention_report.describe_auto(tiny, platform="gpu", seq_len=256) == ""


# What compiles for a GPU, proved on this CPU: the layer traced as for GPUs and lowered for CUDA.
# The platform "auto" resolves for is the mesh's devices (checked first); the lowering patches
# that lookup, and runs under an abstract mesh of GPUs only where the Triton kernel is expected:
# jax 0.12 lowers Pallas Triton without a GPU only under one, and refuses cuDNN's call under one
# (jax 0.10 takes both). jax builds the cuDNN call only with a local cuDNN (its version and
# compute-capability checks query the machine), so those checks are stubbed: everything else
# (shapes, layout, mask, GQA, the backward) is jax's own validation.


def gpu_mesh(device_kind="NVIDIA H200"):
  """An abstract one-GPU mesh to trace under: what a sharded step on a GPU machine sees."""
  device = jax.sharding.AbstractDevice(device_kind=device_kind, num_cores=None, platform="gpu")
  mesh = jax.sharding.AbstractMesh((1,), ("data",), abstract_device=device)
  return jax.sharding.use_abstract_mesh(mesh)


def test_target_platform_is_the_meshs_devices():
  from nnx_zoo.kernels import tpu_attention

  assert tpu_attention.target_platform() == "cpu"
  with gpu_mesh():
    assert tpu_attention.target_platform() == "gpu"
    assert tpu_attention.target_device_kind() == "NVIDIA H200"


def _lower_layer_for_gpu(monkeypatch, dtype, device_kind="NVIDIA H200", pos=None, **kw):
  from jax._src.cudnn import fused_attention_stablehlo as cudnn_fa

  from nnx_zoo.kernels import tpu_attention

  monkeypatch.setattr(cudnn_fa, "check_cudnn_version", lambda: 91000)
  monkeypatch.setattr(cudnn_fa, "check_compute_capability", lambda capability: False)
  monkeypatch.setattr(cudnn_fa, "is_cuda_compute_capability_equal", lambda capability: False)
  monkeypatch.setattr(tpu_attention, "target_platform", lambda: "gpu")
  monkeypatch.setattr(tpu_attention, "target_device_kind", lambda: device_kind)
  monkeypatch.setattr(attention_impl, "_logged", set())
  cfg = attention.config(num_heads=8, num_kv_heads=2, head_dim=64, **kw)
  attn = nnx.eval_shape(lambda: attention.Attention(cfg, 256, dtype=dtype, rngs=nnx.Rngs(0)))
  graphdef, state = nnx.split(attn)
  rope = pos or position.RoPE(64, theta=1e4, scaling=position.rope_scaling())

  def loss(state, x_BTD, seg_BT):
    positions = jnp.broadcast_to(jnp.arange(x_BTD.shape[1]), x_BTD.shape[:2])
    out, _ = nnx.merge(graphdef, state)(
      x_BTD, positions_BT=positions, segment_ids_BT=seg_BT, position=rope
    )
    return out.astype(jnp.float32).sum()

  x = jax.ShapeDtypeStruct((2, 256, 256), dtype)
  seg = jax.ShapeDtypeStruct((2, 256), jnp.int32)
  with gpu_mesh() if dtype == jnp.float32 else contextlib.nullcontext():
    lowered = jax.jit(jax.grad(loss)).trace(state, x, seg).lower(lowering_platforms=("cuda",))
  text = lowered.as_text()
  return {
    "cudnn": text.count("__cudnn$fmha"),
    "triton": text.count("xla.gpu.triton"),
  }


@pytest.mark.parametrize(
  "dtype,kw,want",
  [
    (jnp.bfloat16, dict(), {"cudnn": 2, "triton": 0}),  # forward, backward
    (jnp.bfloat16, dict(window=64), {"cudnn": 2, "triton": 0}),
    (jnp.float32, dict(), {"cudnn": 0, "triton": 3}),  # forward, dq, dk/dv kernels
    (jnp.bfloat16, dict(softcap=30.0), {"cudnn": 0, "triton": 0}),  # xla
    (jnp.bfloat16, dict(pos=position.ALiBi()), {"cudnn": 2, "triton": 0}),  # bias + segments
  ],
  ids=["bf16-cudnn", "bf16-window-cudnn", "fp32-flash", "bf16-softcap-xla", "bf16-alibi-cudnn"],
)
def test_auto_lowers_for_gpu(monkeypatch, dtype, kw, want):
  assert _lower_layer_for_gpu(monkeypatch, dtype, **kw) == want


# ---------------------------------------------------------------------------------------------
# Cross-attention (encoder-decoder): queries of one sequence, keys and values of another.


@nnx.jit
def _cross(attn, x, src, seg, src_seg):
  return attn.cross(x, attn.source_kv(src, src_seg), segment_ids_BT=seg)


@pytest.mark.parametrize(
  "kw", [dict(), dict(num_kv_heads=2, qk_norm="rms"), dict(qkv_bias=True, scale=1.0)]
)
def test_cross_attention_matches_reference(kw):
  attn = layer(mask="bidirectional", **kw)
  x, src = randn(12, (2, 5, 32)), randn(13, (2, 9, 32))
  # Row 0: one pair, the source padded; row 1: two pairs packed, each query sees its own source.
  seg = np.array([[1] * 5, [1, 1, 2, 2, 2]])
  src_seg = np.array([[1] * 6 + [0] * 3, [1] * 4 + [2] * 5])
  got = _cross(attn, jnp.asarray(x), jnp.asarray(src), jnp.asarray(seg), jnp.asarray(src_seg))

  N, K, H = attn.num_heads, attn.num_kv_heads, attn.head_dim

  def proj(lin, a):
    y = np.asarray(a, np.float64) @ np.asarray(lin.kernel[...], np.float64)
    return y + np.asarray(lin.bias[...]) if lin.bias is not None else y

  q, k, v = proj(attn.q, x).reshape(2, 5, N, H), proj(attn.k, src), proj(attn.v, src)
  k, v = k.reshape(2, 9, K, H), v.reshape(2, 9, K, H)
  if attn.q_norm is not None:
    q = np_norm(q, "rms", np.asarray(attn.q_norm.scale[...]))
    k = np_norm(k, "rms", np.asarray(attn.k_norm.scale[...]))
  # np_attend scales by 1/sqrt(H): fold the layer's own scale into q.
  q = q * attn.scale * math.sqrt(H)
  mask = np_mask(range(5), range(9), seg, src_seg, causal=False)
  want = np_attend(q, k, v, mask).reshape(2, 5, N * H) @ np.asarray(attn.o.kernel[...])
  if attn.o.bias is not None:
    want = want + np.asarray(attn.o.bias[...])
  np.testing.assert_allclose(got, want, atol=2e-5, rtol=1e-5)


# ---------------------------------------------------------------------------------------------
# attend_in_blocks: blocks of queries against the keys the rules let them see


@pytest.mark.parametrize(
  "causal,window,N,K,segments,bias,softcap",
  [
    (True, 0, 4, 2, False, False, 0.0),
    (True, 5, 4, 1, True, False, 0.0),
    (False, 6, 4, 4, False, True, 0.0),
    (True, 0, 6, 3, True, True, 3.0),
    (False, 0, 4, 2, False, False, 0.0),
  ],
  ids=["causal-gqa", "causal-window-mqa-segments", "bidir-window-bias", "all", "bidir"],
)
def test_attend_in_blocks_equals_attend(monkeypatch, causal, window, N, K, segments, bias, softcap):
  """Values and gradients, with 4-row query blocks over T = 19 (a ragged last block)."""
  monkeypatch.setattr(attention_ref, "QUERY_BLOCK", 4)
  B, T, H = 2, 19, 8
  q, k, v = randn(10, (B, T, N, H), 2.0), randn(11, (B, T, K, H), 2.0), randn(12, (B, T, K, H))
  seg = np.ones((B, T), np.int32)
  if segments:
    seg[:, 11:] = 2
  mask = jnp.asarray(np_mask(range(T), range(T), seg, seg, causal=causal, window=window))
  b = randn(13, (B, N, T, T)) if bias else None
  kw = dict(mask_BTS=mask, bias_BNTS=b, softcap=softcap)

  def loss(f, **more):
    return lambda q, k, v: jnp.sum(f(q, k, v, **kw, **more) * jnp.arange(H))

  # Compiled: op by op, the blocks' loop and its gradient took 10-25 s a case.
  blocked = jax.jit(loss(attention_ref.attend_in_blocks, causal=causal, window=window))
  whole = jax.jit(loss(attention_ref.attend))
  want, got = whole(q, k, v), blocked(q, k, v)
  np.testing.assert_allclose(got, want, rtol=1e-5)
  for g, w in zip(
    jax.jit(jax.grad(blocked, (0, 1, 2)))(q, k, v),
    jax.jit(jax.grad(whole, (0, 1, 2)))(q, k, v),
    strict=True,
  ):
    np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("causal,window", [(True, 0), (True, 7), (False, 7), (False, 0)])
def test_key_range_holds_every_key_the_mask_allows(causal, window):
  T = 40
  seg = np.ones((1, T), np.int32)
  mask = np_mask(range(T), range(T), seg, seg, causal=causal, window=window)[0]
  for t0, t1 in [(0, 8), (8, 16), (24, 40), (13, 14)]:
    lo, hi = attention_ref.key_range(t0, t1, T, causal=causal, window=window)
    assert not mask[t0:t1, :lo].any() and not mask[t0:t1, hi:].any()
    assert mask[t0:t1, lo].any() and mask[t0:t1, hi - 1].any()  # and no wider
