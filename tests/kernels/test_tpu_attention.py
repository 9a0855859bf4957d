"""The TPU splash-attention wrapper: values and gradients against the pure-jnp reference
(`nnx_zoo.common.nn.attention_ref.attend`) in Pallas TPU interpret mode on CPU, the same sharded
over 4 fake CPU devices under the trainer's check_vma shard_map against one device, and forward +
backward compiled ahead of time for a TPU slice (v5e:2x2, libtpu needed) under `jax.shard_map`."""

import os
import pathlib
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from nnx_zoo.common.nn import attention_ref as attn
from nnx_zoo.kernels import tpu_attention as tpu

# Interpret mode compiles the kernel's grid into XLA loops; these cut that compile time.
FAST = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}

# (name, settings): every feature, and their combinations where the kernel's mask handling meets
CASES = [
  ("causal", dict(causal=True)),
  ("bidirectional", dict(causal=False)),
  ("causal_window", dict(causal=True, window=40)),
  ("bidirectional_window", dict(causal=False, window=40)),
  ("segments_gqa_softcap", dict(causal=True, segments=True, N=4, K=2, softcap=5.0)),
  ("mqa_window_segments_padded", dict(causal=True, window=24, segments=True, N=4, K=1, T=100)),
]


def randn(seed, shape):
  return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), jnp.float32)


def inputs(*, N=2, K=2, T=128, H=32, B=2, segments=False):
  q, k, v = randn(0, (B, T, N, H)), randn(1, (B, T, K, H)), randn(2, (B, T, K, H))
  seg = None
  if segments:  # two documents and padding (segment 0), differently in each row
    row = np.concatenate([np.full(T // 3, 1), np.full(T // 2, 2), np.zeros(T - T // 3 - T // 2)])
    seg = jnp.asarray(np.stack([row, np.roll(row, 5)][:B]), jnp.int32)
  return q, k, v, seg


def reference(q, k, v, *, causal, window=0, segment_ids_BT=None, softcap=0.0, scale=None):
  B, T = q.shape[:2]
  seg = jnp.ones((B, T), jnp.int32) if segment_ids_BT is None else segment_ids_BT
  idx = jnp.arange(T)
  mask = attn.make_mask(idx, idx, seg, seg, causal=causal, window=window)
  return attn.attend(q, k, v, mask_BTS=mask, softcap=softcap, scale=scale)


@pytest.mark.slow
@pytest.mark.parametrize("name,case", CASES, ids=[c[0] for c in CASES])
def test_matches_reference_values_and_grads(name, case):
  case = dict(case)
  shape = {k: case.pop(k) for k in ("N", "K", "T", "segments") if k in case}
  q, k, v, seg = inputs(**shape)
  kw = dict(case, segment_ids_BT=seg, scale=0.3)
  do = randn(3, q.shape)

  def out_and_grads(fn):
    def f(q, k, v):
      out, vjp = jax.vjp(lambda q, k, v: fn(q, k, v, **kw), q, k, v)
      return out, *vjp(do)

    return jax.jit(f).lower(q, k, v).compile(FAST)(q, k, v)

  got = out_and_grads(lambda *a, **k: tpu.attention(*a, interpret=True, **k))
  want = out_and_grads(reference)
  for g, w, what in zip(got, want, ("out", "dq", "dk", "dv"), strict=True):
    np.testing.assert_allclose(g, w, atol=2e-4, rtol=2e-4, err_msg=f"{name}: {what}")


# Each device's rows and heads through the kernel inside a check_vma shard_map (kernels/vma.py
# types its outputs and residuals), against the unsharded call: equal only if no cotangent was
# summed over devices on the way back (the mistake an untyped output invites).
SHARDED = """
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import PartitionSpec as P
from nnx_zoo.kernels import tpu_attention as tpu

mesh = jax.sharding.Mesh(np.asarray(jax.devices()).reshape(2, 2), ("data", "tensor"))
B, T, N, K, H = 4, 100, 4, 2, 32
ks = jax.random.split(jax.random.key(0), 4)
q = jax.random.normal(ks[0], (B, T, N, H))
k, v = (jax.random.normal(key, (B, T, K, H)) for key in ks[1:3])
do = jax.random.normal(ks[3], (B, T, N, H))
seg = jnp.repeat(jnp.arange(2), T // 2)[None].repeat(B, 0)

def out_and_grads(q, k, v, seg, do):
  f = lambda q, k, v: tpu.attention(q, k, v, causal=True, window=40, segment_ids_BT=seg)
  out, vjp = jax.vjp(f, q, k, v)
  return out, *vjp(do)

rows, heads = P("data"), P("data", None, "tensor")
sharded = jax.shard_map(out_and_grads, mesh=mesh, in_specs=(heads, heads, heads, rows, heads),
                        out_specs=(heads,) * 4, check_vma=True)
got = jax.jit(sharded)(q, k, v, seg, do)
want = jax.jit(out_and_grads)(q, k, v, seg, do)
for g, w in zip(got, want, strict=True):
  np.testing.assert_allclose(g, w, atol=1e-6, rtol=1e-6)
print("equal")
"""


@pytest.mark.slow
@pytest.mark.multidevice
def test_sharded_under_check_vma_equals_one_device():
  root = pathlib.Path(__file__).resolve().parents[2]
  env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=4"}
  proc = subprocess.run(
    [sys.executable, "-P", "-c", textwrap.dedent(SHARDED)],
    cwd=root,
    env=env,
    capture_output=True,
    text=True,
    timeout=600,
  )
  assert proc.returncode == 0 and "equal" in proc.stdout, proc.stderr[-3000:]


def test_unsupported_reasons():
  q, k = jnp.zeros((1, 128, 4, 64)), jnp.zeros((1, 128, 2, 64))
  assert tpu.unsupported_reason(q, k, platform="tpu") is None
  assert tpu.unsupported_reason(q, k, platform="cpu") is None  # interpret mode
  assert "TPU" in tpu.unsupported_reason(q, k, platform="gpu")
  assert "bias" in tpu.unsupported_reason(q, k, bias=True, platform="tpu")
  assert "cache" in tpu.unsupported_reason(q, k, cache=True, platform="tpu")
  assert "lengths" in tpu.unsupported_reason(q, jnp.zeros((1, 256, 2, 64)), platform="tpu")
  assert "multiple" in tpu.unsupported_reason(jnp.zeros((1, 128, 3, 64)), k, platform="tpu")


# Compiled for a TPU slice, ahead of time: the kernel as it would run (Mosaic, not interpret).


@pytest.fixture(scope="module")
def tpu_mesh():
  pytest.importorskip("libtpu")
  from nnx_zoo.common import plan

  devices = plan.devices(plan.parse_topology("v5e:2x2"))
  return jax.sharding.Mesh(np.asarray(devices).reshape(2, 2), ("data", "tensor"))


AOT_CASES = [
  ("causal", dict(causal=True)),
  ("bidirectional", dict(causal=False)),
  ("window", dict(causal=True, window=256)),
  ("segments", dict(causal=True, segments=True)),
  ("gqa", dict(causal=True, K=2)),
  ("softcap", dict(causal=True, softcap=30.0)),
  ("all", dict(causal=True, window=200, segments=True, K=2, softcap=30.0)),
]


@pytest.mark.slow
@pytest.mark.parametrize("name,case", AOT_CASES, ids=[c[0] for c in AOT_CASES])
def test_compiles_for_tpu_under_shard_map(tpu_mesh, name, case):
  """Forward and backward, batch split over `data` and heads over `tensor` (each device runs the
  kernel on its own rows and heads), bf16, lowered and compiled by XLA:TPU, under check_vma as
  in the trainer's step."""
  case = dict(case)
  B, T, N, K, H = 4, 1024, 8, case.pop("K", 8), 128
  segments = case.pop("segments", False)
  bf16 = jnp.bfloat16
  q = jax.ShapeDtypeStruct((B, T, N, H), bf16)
  kv = jax.ShapeDtypeStruct((B, T, K, H), bf16)
  seg = jax.ShapeDtypeStruct((B, T), jnp.int32)
  spec, seg_spec = P("data", None, "tensor"), P("data")

  def local(q, k, v, seg):
    assert tpu.target_platform() == "tpu"  # the mesh's platform, though this machine is a CPU
    assert tpu.unsupported_reason(q, k) is None

    def loss(q, k, v):
      out = tpu.attention(q, k, v, segment_ids_BT=seg if segments else None, **case)
      return jnp.sum(out.astype(jnp.float32) ** 2)

    return jax.grad(loss, argnums=(0, 1, 2))(q, k, v)

  step = jax.jit(
    jax.shard_map(
      local,
      mesh=tpu_mesh,
      in_specs=(spec, spec, spec, seg_spec),
      out_specs=(spec, spec, spec),
      check_vma=True,
    )
  )
  lowered = step.lower(q, kv, kv, seg)
  assert "tpu_custom_call" in lowered.as_text()  # the Mosaic kernel, not interpret-mode loops
  compiled = lowered.compile()
  assert compiled.memory_analysis().temp_size_in_bytes < B * N * T * T  # no [T, S] array
