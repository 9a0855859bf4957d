"""Flash attention (FlashAttention-2) in Pallas, forward and backward, and its pure-jnp reference.

Causal or bidirectional, sliding window, segment ids (packed documents), GQA/MQA and logit soft-cap,
with the masks of `nnx_zoo.common.nn.attention_ref.make_mask` (query t and key s at positions t
and s, both counted from 0). The softmax runs online over key blocks in fp32 and saves only the
logsumexp per query; the backward recomputes the probabilities from it (FlashAttention-2: one
kernel for dq, one for dk/dv), so no [T, S] array is ever stored. Key blocks that causality or
the window rule out entirely are never visited, in either direction.

Layout: q/k/v stay [B, T, N, H] / [B, S, K, H] (no transpose); a query head n reads key/value
head n // G (G = N // K) through the BlockSpec index map, so K/V are never repeated, and the dk/dv
kernel sums over the G query heads of its group itself.

Lengths that are not multiples of the block are padded (zeros, and masked inside the kernel by
position), then the output is sliced back: any T and S work. Compiled, the kernel targets GPU
(Pallas Triton; a head dim that is not a power of 2, or under 16, is zero-padded, and blocks are
at least 16: Triton's smallest dot); on CPU it runs in Pallas interpret mode; compiled TPU is not
supported (see `flash_attention`). Its fp32 dots follow `jax_default_matmul_precision`: Triton
runs them as TF32 by default on a GPU, as IEEE fp32 under "highest".

A query that sees no key at all (its segment absent from the keys, or a window past the end of
S) outputs zeros, as does the reference below (`nnx_zoo.common.nn.attention_ref.attend` gives the
mean of v).
"""

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from nnx_zoo.kernels import tpu_attention

# The smallest block. Blocks are powers of 2 (Triton works on power-of-2 arrays only).
MIN_BLOCK = 8
# Triton's smallest dot for 16- and 32-bit inputs on NVIDIA GPUs: K of at least 16, and M and N
# of at least 16 in Triton releases before small M/N were padded (its Python front end asserts
# this, the backend's `min_dot_size`; Pallas emits Triton IR past that check). Compiled, the
# blocks and the head dim are raised to 16, so no dot in the kernels is smaller.
TRITON_MIN_DOT = 16


@dataclasses.dataclass(frozen=True)
class _Spec:
  """Everything static about one call (hashable: it is a nondiff argument of the custom_vjp)."""

  causal: bool
  window: int
  softcap: float
  scale: float
  T: int  # real lengths; the arrays are padded to whole blocks
  S: int
  block_q: int
  block_k: int
  groups: int  # G = N // K
  segments: bool
  interpret: bool


def _dot(a, b, contract=(1, 0)):
  """a @ b contracting a's dim contract[0] with b's dim contract[1], accumulated in fp32."""
  dims = (((contract[0],), (contract[1],)), ((), ()))
  return jax.lax.dot_general(a, b, dims, preferred_element_type=jnp.float32)


def _logits(spec: _Spec, q, k):
  s = _dot(q, k, (1, 1)) * spec.scale
  if spec.softcap:
    s = spec.softcap * jnp.tanh(s / spec.softcap)
  return s


def _mask(spec: _Spec, q_first, k_first, q_seg, k_seg):
  """[block_q, block_k]: True where query q_first + i may attend to key k_first + j."""
  shape = (spec.block_q, spec.block_k)
  t = q_first + jax.lax.broadcasted_iota(jnp.int32, shape, 0)
  s = k_first + jax.lax.broadcasted_iota(jnp.int32, shape, 1)
  mask = (t < spec.T) & (s < spec.S)  # padding
  if spec.causal:
    mask &= s <= t
  if spec.window:
    mask &= t - s < spec.window
    if not spec.causal:
      mask &= s - t < spec.window
  if spec.segments:
    mask &= q_seg[:, None] == k_seg[None, :]
  return mask


def _block_range(lo, hi, block):
  """The blocks holding positions lo..hi (none if hi < lo: e.g. a window past the end of S)."""
  first = jax.lax.div(lo, block)
  return first, jnp.where(hi >= lo, jax.lax.div(hi, block) + 1, first)


def _kv_blocks(spec: _Spec, i):
  """[lo, hi): the key blocks query block i can see (the rest is masked whole)."""
  q_first = i * spec.block_q
  q_last = jnp.minimum(q_first + spec.block_q, spec.T) - 1
  lo, hi = 0, spec.S - 1
  if spec.window:
    lo = jnp.maximum(q_first - spec.window + 1, 0)
  if spec.causal:
    hi = jnp.minimum(q_last, hi)
  elif spec.window:
    hi = jnp.minimum(q_last + spec.window - 1, hi)
  return _block_range(lo, hi, spec.block_k)


def _q_blocks(spec: _Spec, j):
  """[lo, hi): the query blocks that can see key block j."""
  k_first = j * spec.block_k
  k_last = jnp.minimum(k_first + spec.block_k, spec.S) - 1
  lo, hi = 0, spec.T - 1
  if spec.causal:
    lo = k_first
  elif spec.window:
    lo = jnp.maximum(k_first - spec.window + 1, 0)
  if spec.window:
    hi = jnp.minimum(k_last + spec.window - 1, hi)
  return _block_range(lo, hi, spec.block_q)


def _out(shape, dtype, like):
  """An output shape that varies over the same mesh axes as `like` (for shard_map's check_vma:
  a kernel under shard_map runs per shard, on its local heads)."""
  return jax.ShapeDtypeStruct(shape, dtype, manual_axis_type=jax.typeof(like).mat)


def _split_refs(spec: _Spec, refs, n_in):
  ins, outs = list(refs[:n_in]), list(refs[n_in:])
  segs = (ins.pop(), ins.pop())[::-1] if spec.segments else (None, None)
  return ins, segs, outs


# ---------------------------------------------------------------------------------------------
# Kernels. Grid (B, N, T / block_q) for the forward and dq, (B, K, S / block_k) for dk/dv.


def _fwd_kernel(*refs, spec: _Spec):
  (q_ref, k_ref, v_ref), (qseg_ref, kseg_ref), (o_ref, lse_ref) = _split_refs(
    spec, refs, 3 + 2 * spec.segments
  )
  i = pl.program_id(2)
  bq, bk = spec.block_q, spec.block_k
  q = q_ref[...]
  q_seg = qseg_ref[...] if spec.segments else None

  def body(j, carry):
    acc, m, l = carry
    k = k_ref[pl.ds(j * bk, bk), :]
    v = v_ref[pl.ds(j * bk, bk), :]
    k_seg = kseg_ref[pl.ds(j * bk, bk)] if spec.segments else None
    s = _logits(spec, q, k)
    s = jnp.where(_mask(spec, i * bq, j * bk, q_seg, k_seg), s, -jnp.inf)
    m_new = jnp.maximum(m, s.max(axis=1))
    # While a row has seen no key, m stays -inf; subtract 0 then, so exp gives 0, not nan.
    m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
    alpha = jnp.exp(m - m_safe)
    p = jnp.exp(s - m_safe[:, None])
    l = alpha * l + p.sum(axis=1)
    acc = alpha[:, None] * acc + _dot(p.astype(v.dtype), v)
    return acc, m_new, l

  init = (
    jnp.zeros((bq, q.shape[-1]), jnp.float32),
    jnp.full((bq,), -jnp.inf, jnp.float32),
    jnp.zeros((bq,), jnp.float32),
  )
  lo, hi = _kv_blocks(spec, i)
  acc, m, l = jax.lax.fori_loop(lo, hi, body, init)
  empty = l == 0.0
  o_ref[...] = (acc / jnp.where(empty, 1.0, l)[:, None]).astype(o_ref.dtype)
  # +inf for a row with no key: the backward's exp(s - lse) is then 0 there, not nan.
  lse_ref[...] = jnp.where(empty, jnp.inf, m + jnp.log(jnp.where(empty, 1.0, l)))


def _dlogits(spec: _Spec, s, p, dp, delta):
  """d loss / d (scaled q.k) from the probabilities p, dp = do.v^T and delta = rowsum(o * do)."""
  ds = p * (dp - delta[:, None])
  if spec.softcap:  # d/dx c*tanh(x/c) = 1 - tanh^2
    ds = ds * (1.0 - jnp.square(s / spec.softcap))
  return ds


def _dq_kernel(*refs, spec: _Spec):
  ins, (qseg_ref, kseg_ref), (dq_ref,) = _split_refs(spec, refs, 6 + 2 * spec.segments)
  q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref = ins
  i = pl.program_id(2)
  bq, bk = spec.block_q, spec.block_k
  q, do, lse, delta = q_ref[...], do_ref[...], lse_ref[...], delta_ref[...]
  q_seg = qseg_ref[...] if spec.segments else None

  def body(j, dq):
    k = k_ref[pl.ds(j * bk, bk), :]
    v = v_ref[pl.ds(j * bk, bk), :]
    k_seg = kseg_ref[pl.ds(j * bk, bk)] if spec.segments else None
    s = _logits(spec, q, k)
    p = jnp.exp(jnp.where(_mask(spec, i * bq, j * bk, q_seg, k_seg), s, -jnp.inf) - lse[:, None])
    ds = _dlogits(spec, s, p, _dot(do, v, (1, 1)), delta)
    return dq + _dot(ds.astype(k.dtype), k)

  lo, hi = _kv_blocks(spec, i)
  dq = jax.lax.fori_loop(lo, hi, body, jnp.zeros(q.shape, jnp.float32))
  dq_ref[...] = (dq * spec.scale).astype(dq_ref.dtype)


def _dkdv_kernel(*refs, spec: _Spec):
  ins, (qseg_ref, kseg_ref), (dk_ref, dv_ref) = _split_refs(spec, refs, 6 + 2 * spec.segments)
  q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref = ins  # q, do: [T, G, H]; lse, delta: [G, T]
  j = pl.program_id(2)
  bq, bk = spec.block_q, spec.block_k
  k, v = k_ref[...], v_ref[...]
  k_seg = kseg_ref[...] if spec.segments else None
  lo, hi = _q_blocks(spec, j)

  def q_block(i, g, carry):
    dk, dv = carry
    rows = pl.ds(i * bq, bq)
    q, do = q_ref[rows, g, :], do_ref[rows, g, :]
    lse, delta = lse_ref[g, rows], delta_ref[g, rows]
    q_seg = qseg_ref[rows] if spec.segments else None
    s = _logits(spec, q, k)
    p = jnp.exp(jnp.where(_mask(spec, i * bq, j * bk, q_seg, k_seg), s, -jnp.inf) - lse[:, None])
    dv = dv + _dot(p.astype(do.dtype), do, (0, 0))
    ds = _dlogits(spec, s, p, _dot(do, v, (1, 1)), delta)
    return dk + _dot(ds.astype(q.dtype), q, (0, 0)), dv

  # The G query heads that share this key/value head all add to its gradient: one flat loop
  # over (head in group, query block), as nested loops trip shard_map's vma check in interpret.
  n = jnp.maximum(hi - lo, 0)
  zeros = jnp.zeros(k.shape, jnp.float32)
  step = lambda idx, carry: q_block(lo + idx % n, idx // n, carry)
  dk, dv = jax.lax.fori_loop(0, n * spec.groups, step, (zeros, zeros))
  dk_ref[...] = (dk * spec.scale).astype(dk_ref.dtype)
  dv_ref[...] = dv.astype(dv_ref.dtype)


# ---------------------------------------------------------------------------------------------
# pallas_calls and the custom VJP.

_sq = pl.squeezed


def _compiler_params(spec: _Spec):
  """Triton on GPU (Pallas' default there is Mosaic GPU, which this kernel is not written for);
  the platform's defaults elsewhere."""
  if spec.interpret or tpu_attention.target_platform() == "tpu":
    return None
  return pltriton.CompilerParams(num_warps=4, num_stages=2)


def _seg_specs(spec: _Spec, q_block, k_block, q_map, k_map):
  if not spec.segments:
    return []
  return [pl.BlockSpec((_sq, q_block), q_map), pl.BlockSpec((_sq, k_block), k_map)]


def _forward(spec: _Spec, q, k, v, q_seg, k_seg):
  B, T, N, H = q.shape
  S, G, bq = k.shape[1], spec.groups, spec.block_q
  q_spec = pl.BlockSpec((_sq, bq, _sq, H), lambda b, n, i: (b, i, n, 0))
  kv_spec = pl.BlockSpec((_sq, S, _sq, H), lambda b, n, i: (b, 0, n // G, 0))
  in_specs = [q_spec, kv_spec, kv_spec] + _seg_specs(
    spec, bq, S, lambda b, n, i: (b, i), lambda b, n, i: (b, 0)
  )
  o, lse = pl.pallas_call(
    functools.partial(_fwd_kernel, spec=spec),
    grid=(B, N, T // bq),
    in_specs=in_specs,
    out_specs=[q_spec, pl.BlockSpec((_sq, _sq, bq), lambda b, n, i: (b, n, i))],
    out_shape=[
      _out(q.shape, q.dtype, q),
      _out((B, N, T), jnp.float32, q),
    ],
    interpret=spec.interpret,
    compiler_params=_compiler_params(spec),
    name="flash_attention_fwd",
  )(q, k, v, *((q_seg, k_seg) if spec.segments else ()))
  return o, lse


def _backward(spec: _Spec, res, do):
  q, k, v, q_seg, k_seg, o, lse = res
  B, T, N, H = q.shape
  S, K, G = k.shape[1], k.shape[2], spec.groups
  bq, bk = spec.block_q, spec.block_k
  delta = jnp.einsum("BTNH,BTNH->BNT", o.astype(jnp.float32), do.astype(jnp.float32))
  segs = (q_seg, k_seg) if spec.segments else ()

  q_spec = pl.BlockSpec((_sq, bq, _sq, H), lambda b, n, i: (b, i, n, 0))
  kv_spec = pl.BlockSpec((_sq, S, _sq, H), lambda b, n, i: (b, 0, n // G, 0))
  row_spec = pl.BlockSpec((_sq, _sq, bq), lambda b, n, i: (b, n, i))
  dq = pl.pallas_call(
    functools.partial(_dq_kernel, spec=spec),
    grid=(B, N, T // bq),
    in_specs=[q_spec, kv_spec, kv_spec, q_spec, row_spec, row_spec]
    + _seg_specs(spec, bq, S, lambda b, n, i: (b, i), lambda b, n, i: (b, 0)),
    out_specs=q_spec,
    out_shape=_out(q.shape, q.dtype, q),
    interpret=spec.interpret,
    compiler_params=_compiler_params(spec),
    name="flash_attention_dq",
  )(q, k, v, do, lse, delta, *segs)

  # One program per key/value block; it reads the whole query group of its head (G heads).
  group_spec = pl.BlockSpec((_sq, T, G, H), lambda b, h, j: (b, 0, h, 0))
  kv_block_spec = pl.BlockSpec((_sq, bk, _sq, H), lambda b, h, j: (b, j, h, 0))
  group_rows_spec = pl.BlockSpec((_sq, G, T), lambda b, h, j: (b, h, 0))
  dk, dv = pl.pallas_call(
    functools.partial(_dkdv_kernel, spec=spec),
    grid=(B, K, S // bk),
    in_specs=[
      group_spec,
      kv_block_spec,
      kv_block_spec,
      group_spec,
      group_rows_spec,
      group_rows_spec,
    ]
    + _seg_specs(spec, T, bk, lambda b, h, j: (b, 0), lambda b, h, j: (b, j)),
    out_specs=[kv_block_spec, kv_block_spec],
    out_shape=[_out(k.shape, k.dtype, q), _out(v.shape, v.dtype, q)],
    interpret=spec.interpret,
    compiler_params=_compiler_params(spec),
    name="flash_attention_dkdv",
  )(q, k, v, do, lse, delta, *segs)
  return dq, dk, dv, None, None


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _flash(spec, q, k, v, q_seg, k_seg):
  return _forward(spec, q, k, v, q_seg, k_seg)[0]


def _flash_fwd(spec, q, k, v, q_seg, k_seg):
  o, lse = _forward(spec, q, k, v, q_seg, k_seg)
  return o, (q, k, v, q_seg, k_seg, o, lse)


_flash.defvjp(_flash_fwd, _backward)


def _block(requested: int, length: int, smallest: int = MIN_BLOCK) -> int:
  """The requested block, or less for a short sequence (a power of 2, at least `smallest`)."""
  if requested < MIN_BLOCK or requested & (requested - 1):
    raise ValueError(f"Block sizes must be powers of 2, at least {MIN_BLOCK}; got {requested}.")
  return max(smallest, min(requested, max(MIN_BLOCK, pl.next_power_of_2(length))))


def _pad(x, axis, to):
  if x is None or x.shape[axis] == to:
    return x
  widths = [(0, 0)] * x.ndim
  widths[axis] = (0, to - x.shape[axis])
  return jnp.pad(x, widths)


def flash_attention(
  q_BTNH: jax.Array,
  k_BSKH: jax.Array,
  v_BSKH: jax.Array,
  *,
  causal: bool,
  window: int = 0,
  q_segment_ids_BT: jax.Array | None = None,
  kv_segment_ids_BS: jax.Array | None = None,
  softcap: float = 0.0,
  scale: float | None = None,
  block_q: int = 128,
  block_k: int = 128,
  interpret: bool | None = None,
) -> jax.Array:
  """softmax(q k^T * scale) v, [B, T, N, H], masked as `nnx_zoo.common.nn.attention_ref.make_mask`
  (scale None: 1 / sqrt(H)).

  window=0: no sliding window; softcap=0: no soft-cap; segment ids: both or neither (segment 0
  is a segment like any other). interpret=None: Pallas interpret mode when compiling for a CPU
  (the mesh's devices, else the default backend), compiled elsewhere.
  T and S need not be multiples of the blocks (padded, see the module docstring). k and v are
  cast to q's dtype; the output has q's dtype.
  """
  B, T, N, H = q_BTNH.shape
  S, K = k_BSKH.shape[1], k_BSKH.shape[2]
  if k_BSKH.shape != (B, S, K, H) or v_BSKH.shape != k_BSKH.shape:
    raise ValueError(f"k and v must be [B, S, K, H] = {k_BSKH.shape}, got {v_BSKH.shape}.")
  if N % K:
    raise ValueError(f"num_heads={N} is not a multiple of num_kv_heads={K}.")
  if (q_segment_ids_BT is None) != (kv_segment_ids_BS is None):
    raise ValueError("Pass both q_segment_ids_BT and kv_segment_ids_BS, or neither.")
  if interpret is None:
    interpret = tpu_attention.target_platform() == "cpu"
  if not interpret and tpu_attention.target_platform() == "tpu":
    # Mosaic TPU tiles the last two block dims by (8, 128): it would need [B, N, T, H] blocks
    # and lane-replicated row statistics, a port not written (nor testable) here.
    raise NotImplementedError(
      "flash_attention is compiled for GPU (Triton) only; on TPU use interpret=True, or "
      "jax.experimental.pallas.ops.tpu.splash_attention."
    )
  smallest = MIN_BLOCK if interpret else TRITON_MIN_DOT
  bq, bk = _block(block_q, T, smallest), _block(block_k, S, smallest)
  spec = _Spec(
    causal=causal,
    window=int(window),
    softcap=float(softcap),
    scale=1.0 / math.sqrt(H) if scale is None else float(scale),
    T=T,
    S=S,
    block_q=bq,
    block_k=bk,
    groups=N // K,
    segments=q_segment_ids_BT is not None,
    interpret=bool(interpret),
  )
  Tp, Sp = -(-T // bq) * bq, -(-S // bk) * bk
  segs = (None, None)
  if spec.segments:
    segs = (
      _pad(q_segment_ids_BT.astype(jnp.int32), 1, Tp),
      _pad(kv_segment_ids_BS.astype(jnp.int32), 1, Sp),
    )
  # Triton works on power-of-2 arrays only, and dots of at least 16: zero columns change no q.k
  # and give zero outputs.
  Hp = H if interpret else max(TRITON_MIN_DOT, pl.next_power_of_2(H))
  q = _pad(_pad(q_BTNH, 1, Tp), 3, Hp)
  k = _pad(_pad(k_BSKH.astype(q.dtype), 1, Sp), 3, Hp)
  v = _pad(_pad(v_BSKH.astype(q.dtype), 1, Sp), 3, Hp)
  return _flash(spec, q, k, v, *segs)[:, :T, :, :H]


def reference(
  q_BTNH: jax.Array,
  k_BSKH: jax.Array,
  v_BSKH: jax.Array,
  *,
  causal: bool,
  window: int = 0,
  q_segment_ids_BT: jax.Array | None = None,
  kv_segment_ids_BS: jax.Array | None = None,
  softcap: float = 0.0,
  scale: float | None = None,
) -> jax.Array:
  """The same function in plain jnp: the [B, N, T, S] logits materialised."""
  B, T, N, H = q_BTNH.shape
  S, K = k_BSKH.shape[1], k_BSKH.shape[2]
  q_BTKGH = q_BTNH.reshape(B, T, K, N // K, H)
  logits = jnp.einsum("BTKGH,BSKH->BKGTS", q_BTKGH, k_BSKH, preferred_element_type=jnp.float32)
  logits = logits * (1.0 / math.sqrt(H) if scale is None else scale)
  if softcap:
    logits = softcap * jnp.tanh(logits / softcap)
  t, s = jnp.arange(T)[:, None], jnp.arange(S)[None, :]
  mask_BTS = jnp.ones((1, T, S), bool)
  if causal:
    mask_BTS &= s <= t
  if window:
    mask_BTS &= (t - s < window) & ((s - t < window) | causal)
  if q_segment_ids_BT is not None:
    mask_BTS = mask_BTS & (q_segment_ids_BT[:, :, None] == kv_segment_ids_BS[:, None, :])
  mask = mask_BTS[:, None, None]
  probs = jax.nn.softmax(jnp.where(mask, logits, jnp.finfo(jnp.float32).min), axis=-1)
  probs = jnp.where(mask, probs, 0.0)  # a row with no key at all: zeros, as the kernel
  out = jnp.einsum("BKGTS,BSKH->BTKGH", probs.astype(v_BSKH.dtype), v_BSKH)
  return out.reshape(B, T, N, H)
