"""The Pallas flash attention kernel (interpret mode on CPU) against its pure-jnp reference: values
and gradients (dq, dk, dv) over MHA/GQA/MQA, causal/bidirectional, window, packed segments,
soft-cap, block sizes, padding and T != S; its block skipping; under shard_map; and that the
compiled path lowers for GPU (Triton)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from nnx_zoo.kernels import flash_attention as fa

# Interpret mode compiles the kernel's grid into XLA loops; these options cut that compile time
# by ~40% (the shapes are tiny, so run time does not matter).
FAST = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}


def randn(seed, shape, scale=1.0, dtype=jnp.float32):
  return jnp.asarray(np.random.default_rng(seed).standard_normal(shape) * scale, dtype)


def packed(T, lengths, B=2):
  """Segment ids of documents of `lengths` packed in a row, the rest padding (segment 0)."""
  row = np.concatenate([np.full(n, i + 1) for i, n in enumerate(lengths)])
  row = np.concatenate([row, np.zeros(T - len(row), int)])
  return jnp.asarray(np.stack([row, np.roll(row, 3)][:B]), jnp.int32)


def out_and_grads(fn, q, k, v, do, **kw):
  @jax.jit
  def f(q, k, v, do):
    out, vjp = jax.vjp(lambda q, k, v: fn(q, k, v, **kw), q, k, v)
    return out, *vjp(do)

  return f.lower(q, k, v, do).compile(FAST)(q, k, v, do)


def check(*, N, K, T, S=None, H=16, B=2, blocks=(8, 8), seg=None, scale=1.0, dtype=None, **kw):
  S = S or T
  dtype = dtype or jnp.float32
  q, k, v = (
    randn(0, (B, T, N, H), scale, dtype),
    randn(1, (B, S, K, H), 1, dtype),
    randn(2, (B, S, K, H), 1, dtype),
  )
  do = randn(3, (B, T, N, H), 1, dtype)
  if seg is not None:
    kw |= dict(q_segment_ids_BT=seg[0], kv_segment_ids_BS=seg[1])
  got = out_and_grads(fa.flash_attention, q, k, v, do, block_q=blocks[0], block_k=blocks[1], **kw)
  want = out_and_grads(fa.reference, q, k, v, do, **kw)
  tol = 2e-5 if dtype == jnp.float32 else 3e-2
  for name, g, w in zip(["out", "dq", "dk", "dv"], got, want, strict=True):
    assert g.shape == w.shape and g.dtype == w.dtype, name
    g, w = np.asarray(g, np.float32), np.asarray(w, np.float32)
    assert np.abs(w).max() > 1e-3, name  # not vacuous
    np.testing.assert_allclose(g, w, atol=tol * max(1.0, np.abs(w).max()), rtol=tol, err_msg=name)


# ---------------------------------------------------------------------------------------------
# Values and gradients against the reference. A handful run by default; the rest of the grid
# (each case compiles three interpret-mode kernels, ~2 s) is marked slow.

CASES = {
  "mha-causal": dict(N=2, K=2, T=24, causal=True),
  "gqa-bidirectional-padded": dict(N=4, K=2, T=20, causal=False, blocks=(8, 16)),
  "mqa-causal-window": dict(N=4, K=1, T=32, causal=True, window=5),
  "gqa-causal-packed": dict(N=4, K=2, T=24, causal=True, seg="packed"),
}
SLOW_CASES = {
  "gqa-bidirectional-window-softcap": dict(
    N=4, K=2, T=24, causal=False, window=6, softcap=2.0, scale=3.0, blocks=(16, 8)
  ),
  "mha-bidirectional-packed-window": dict(N=2, K=2, T=24, causal=False, window=4, seg="packed"),
  "mqa-causal-softcap-default-blocks": dict(
    N=3, K=1, T=19, causal=True, softcap=1.5, scale=3.0, blocks=(128, 128)
  ),
  "gqa-cross-T<S-segments": dict(N=4, K=2, T=12, S=28, causal=False, seg="cross"),
  "gqa-causal-T>S-window": dict(N=4, K=2, T=28, S=20, causal=True, window=7, blocks=(16, 8)),
  "gqa-causal-bf16": dict(N=4, K=2, T=24, causal=True, dtype=jnp.bfloat16),
}


def segments(case):
  if case.get("seg") == "packed":
    seg = packed(case["T"], [7, 9, 3])
    return seg, seg
  if case.get("seg") == "cross":  # each query sees only the keys of its own document
    return packed(case["T"], [5, 7]), packed(case["S"], [10, 14])
  return None


@pytest.mark.parametrize("name", list(CASES))
def test_matches_reference(name):
  case = CASES[name]
  check(**{**case, "seg": segments(case)})


@pytest.mark.slow
@pytest.mark.parametrize("name", list(SLOW_CASES))
def test_matches_reference_more(name):
  case = SLOW_CASES[name]
  check(**{**case, "seg": segments(case)})


def test_query_with_no_key_gives_zeros():
  # Queries of segment 3 have no key of segment 3: zeros (the reference agrees), not nan.
  q_seg = jnp.asarray([[1] * 6 + [3] * 2], jnp.int32)
  k_seg = jnp.asarray([[1] * 8], jnp.int32)
  q, k, v = randn(4, (1, 8, 2, 8)), randn(5, (1, 8, 2, 8)), randn(6, (1, 8, 2, 8))
  kw = dict(causal=False, q_segment_ids_BT=q_seg, kv_segment_ids_BS=k_seg)
  got = jax.jit(lambda q, k, v: fa.flash_attention(q, k, v, **kw)).lower(q, k, v).compile(FAST)
  out = np.asarray(got(q, k, v))
  np.testing.assert_array_equal(out[:, 6:], 0.0)
  np.testing.assert_allclose(out, fa.reference(q, k, v, **kw), atol=1e-5)


# ---------------------------------------------------------------------------------------------
# Block skipping: the kernel visits exactly the key blocks the causal/window rule leaves visible.


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("window", [0, 1, 5, 20])
@pytest.mark.parametrize("T,S", [(40, 40), (24, 40), (40, 24)])
def test_visits_exactly_the_needed_blocks(causal, window, T, S):
  bq, bk = 8, 16
  spec = fa._Spec(causal, window, 0.0, 1.0, T, S, bq, bk, 1, False, True)
  t, s = np.arange(T)[:, None], np.arange(S)[None, :]
  mask = np.ones((T, S), bool)
  if causal:
    mask &= s <= t
  if window:
    mask &= (t - s < window) & ((s - t < window) | causal)
  Tp, Sp = -(-T // bq) * bq, -(-S // bk) * bk
  blocks = np.pad(mask, ((0, Tp - T), (0, Sp - S))).reshape(Tp // bq, bq, Sp // bk, bk)
  needed = blocks.any(axis=(1, 3))  # [query blocks, key blocks]
  with jax.ensure_compile_time_eval():
    for i in range(Tp // bq):
      lo, hi = (int(x) for x in fa._kv_blocks(spec, i))
      assert set(range(lo, hi)) == set(np.flatnonzero(needed[i])), i
    for j in range(Sp // bk):
      lo, hi = (int(x) for x in fa._q_blocks(spec, j))
      assert set(range(lo, hi)) == set(np.flatnonzero(needed[:, j])), j


# ---------------------------------------------------------------------------------------------
# Under shard_map (as in the trainer: heads split over `tensor`, check_vma=True).


def test_under_shard_map_with_vma_checks():
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("tensor",))
  B, T, N, K, H = 1, 16, 4, 2, 8
  q, k, v = randn(7, (B, T, N, H)), randn(8, (B, T, K, H)), randn(9, (B, T, K, H))
  seg = packed(T, [9, 7], B=1)
  heads = P(None, None, "tensor")

  def loss(fn):
    def local(q, k, v, seg):
      out = fn(q, k, v, causal=True, q_segment_ids_BT=seg, kv_segment_ids_BS=seg)
      return jnp.sum(out * jnp.sin(out))[None]

    sharded = jax.shard_map(
      local, mesh=mesh, in_specs=(heads, heads, heads, P()), out_specs=P("tensor"), check_vma=True
    )
    return lambda q, k, v: sharded(q, k, v, seg).sum()

  step = lambda fn: jax.jit(jax.value_and_grad(loss(fn), argnums=(0, 1, 2)))
  got = step(fa.flash_attention).lower(q, k, v).compile(FAST)(q, k, v)
  want = step(fa.reference)(q, k, v)
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
    np.testing.assert_allclose(g, w, atol=2e-5, rtol=2e-5)


# ---------------------------------------------------------------------------------------------
# Errors


def test_bad_arguments_are_clear_errors():
  q, k = jnp.zeros((1, 8, 3, 8)), jnp.zeros((1, 8, 2, 8))
  with pytest.raises(ValueError, match="multiple"):
    fa.flash_attention(q, k, k, causal=True)
  q = jnp.zeros((1, 8, 4, 8))
  with pytest.raises(ValueError, match="both"):
    fa.flash_attention(q, k, k, causal=True, q_segment_ids_BT=jnp.ones((1, 8), jnp.int32))
  with pytest.raises(ValueError, match="Block sizes"):
    fa.flash_attention(q, k, k, causal=True, block_q=24)


# ---------------------------------------------------------------------------------------------
# No GPU here: at least the compiled path must lower to Triton (power-of-2 arrays, supported ops).


@pytest.mark.parametrize("N,K,H", [(8, 2, 64), (6, 3, 96)])
def test_lowers_for_gpu_with_triton(N, K, H):
  q = jax.ShapeDtypeStruct((1, 300, N, H), jnp.bfloat16)
  k = jax.ShapeDtypeStruct((1, 300, K, H), jnp.bfloat16)
  seg = jax.ShapeDtypeStruct((1, 300), jnp.int32)

  def step(q, k, v, do, seg):
    kw = dict(q_segment_ids_BT=seg, kv_segment_ids_BS=seg, window=64, softcap=30.0)
    f = lambda q, k, v: fa.flash_attention(q, k, v, causal=True, interpret=False, **kw)
    out, vjp = jax.vjp(f, q, k, v)
    return out, vjp(do)

  # Under an abstract mesh of GPUs: jax 0.12 lowers Pallas Triton without a GPU only so.
  device = jax.sharding.AbstractDevice(device_kind="NVIDIA H100", num_cores=None, platform="gpu")
  with jax.sharding.use_abstract_mesh(
    jax.sharding.AbstractMesh((1,), ("x",), abstract_device=device)
  ):
    text = jax.jit(step).trace(q, k, k, q, seg).lower(lowering_platforms=("cuda",)).as_text()
  assert text.count("xla.gpu.triton") == 3, "forward, dq and dk/dv kernels"


def _kernel_dots(fn, *args):
  """(lhs shape, rhs shape, precision) of every dot_general inside the Pallas kernels `fn` traces
  (the kernels' own jaxprs, loops included)."""
  dots = []

  def walk(jaxpr, in_kernel):
    for eqn in jaxpr.eqns:
      inside = in_kernel or eqn.primitive.name == "pallas_call"
      if inside and eqn.primitive.name == "dot_general":
        lhs, rhs = (v.aval.shape for v in eqn.invars)
        dots.append((lhs, rhs, eqn.params["precision"]))
      for value in eqn.params.values():
        for sub in value if isinstance(value, (tuple, list)) else (value,):
          if hasattr(sub, "eqns"):
            walk(sub, inside)
          elif hasattr(sub, "jaxpr") and hasattr(sub.jaxpr, "eqns"):
            walk(sub.jaxpr, inside)

  walk(jax.make_jaxpr(fn)(*args).jaxpr, False)
  return dots


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_compiled_kernels_have_no_dot_under_16(dtype):
  """Triton's smallest dot is 16 x 16 x 16 (its front end asserts it; Pallas emits Triton IR past
  that check): compiled, the kernel raises small blocks and head dims to 16. Interpret mode keeps
  the blocks asked for (8 here)."""
  q, k = randn(10, (1, 12, 4, 8), dtype=dtype), randn(11, (1, 12, 2, 8), dtype=dtype)

  def step(interpret):
    f = lambda q, k, v: fa.flash_attention(
      q, k, v, causal=True, block_q=8, block_k=8, interpret=interpret
    )
    return lambda q, k, v, do: jax.vjp(f, q, k, v)[1](do)

  compiled = _kernel_dots(step(False), q, k, k, q)
  assert len(compiled) >= 7  # forward 2, dq 3, dk/dv 4 (per loop body)
  assert all(min(*lhs, *rhs) >= fa.TRITON_MIN_DOT for lhs, rhs, _ in compiled), compiled
  interpreted = _kernel_dots(step(True), q, k, k, q)
  assert min(min(*lhs, *rhs) for lhs, rhs, _ in interpreted) == 8


def test_kernel_dots_follow_the_default_matmul_precision():
  """On a GPU, Triton runs an fp32 dot of DEFAULT precision as TF32; under
  jax_default_matmul_precision="highest" (what tests/conftest.py sets on a GPU) the kernels' dots
  carry HIGHEST, which Pallas lowers to IEEE fp32 (jax._src.pallas.triton.lowering)."""
  q = randn(12, (1, 16, 2, 16))
  f = lambda q, k, v: fa.flash_attention(q, k, v, causal=True, interpret=False)
  with jax.default_matmul_precision("highest"):
    highest = _kernel_dots(f, q, q, q)
  assert highest and all(p == (jax.lax.Precision.HIGHEST,) * 2 for *_, p in highest), highest


def test_scale_other_than_one_over_sqrt_h():
  """attention.scale (Gemma's query_pre_attn_scalar, T5's 1): the kernel and the reference
  agree, and differ from the default scale."""
  rng = np.random.default_rng(3)
  q, k, v = (jnp.asarray(rng.normal(size=(1, 16, 2, 8)), jnp.float32) for _ in range(3))
  got = fa.flash_attention(q, k, v, causal=True, scale=0.3, block_q=8, block_k=8)
  want = fa.reference(q, k, v, causal=True, scale=0.3)
  np.testing.assert_allclose(got, want, atol=2e-5)
  default = fa.reference(q, k, v, causal=True)
  assert float(jnp.max(jnp.abs(default - want))) > 1e-3
