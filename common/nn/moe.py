"""Mixture-of-experts feed-forward layer: a router sends each token to k of E expert MLPs.

Registered as `mlp.kind = "moe"`, so any family swaps its dense MLP for it by config. Covers the
published routers: Mixtral (softmax over the experts, top-k, the k weights renormalised),
Qwen3-MoE (renormalisation optional: `norm_topk_prob`), and Qwen2-MoE / DeepSeek shared experts
(one always-on MLP added to the routed output, with Qwen2-MoE's optional sigmoid gate).

Shapes: the legend of docs/DESIGN.md, plus M tokens (B * T flattened, as in common/tasks/losses.py),
k the top-k slots of a token (lower case: K is kv heads), A = M * k assignments (token, expert
pairs), R rows of the expert-sorted buffer, in blocks of C rows (the blocked impl).

Routing is token choice and dropless by default: every token reaches its k experts, so the
result never depends on how the batch is split. The experts' matmuls cost what each token's own
experts cost, never a dense [tokens, experts, hidden] product: assignments are sorted by expert
and multiplied group by group, by one of four `impl`s:

- "gmm": megablox's grouped-matmul Pallas kernels (kernels/tpu_gmm.py): what TPUs run (in
  Pallas interpret mode on a CPU, for the tests);
- "ragged": `jax.lax.ragged_dot` on the sorted rows (the grouped matmul GPUs lower well; on TPU
  its weight gradient compiles to a dense matmul over all E experts, E times the work; on XLA:CPU
  it measured slower than even running every expert on every token);
- "blocked": each expert's rows padded to a multiple of the smallest block size, then for each
  expert loops over its blocks, largest blocks first (`BLOCK_ROWS`), the whole expert MLP on each
  block with that expert's weights (megablox's tiling, as plain XLA, with the MLP fused into the
  loop body);
- "loop": every expert on every token, weighted by its combine weight (0 where not routed); E / k
  times the work, the reference the tests compare against;
- "auto": by the platform compiled for (a TPU slice's under `zoo plan`, though the host is a
  CPU): "blocked" on CPU (fastest there; bench/moe_layer.py: ragged_dot 7-9x the time of a
  dense MLP of the same active size), "gmm" on TPU, "ragged" elsewhere (GPU: not measured here).

`capacity_factor > 0` turns on token dropping (Switch / GShard): expert e keeps the first
Q = ceil(capacity_factor * A / E) assignments routed to it, in token order (batch-major, then
sequence, then the token's k slots by rank), and the others are dropped: their routed output is
0 (a token that loses all k slots keeps only its shared expert and the residual). Q is counted
over the tokens of one call, which inside a sharded step is the local shard, so unlike dropless
routing a mesh can change which tokens drop. It changes what tokens receive, not the compute.

Auxiliary losses (common/nn/aux.py), computed only when someone collects, over the GLOBAL batch
(the per-expert sums are `psum`ed over the batch mesh axes inside a sharded step, so a mesh
changes no loss):

- "moe_load_balance" (weight `aux_coef`): transformers' `load_balancing_loss_func` for one layer,
  E * sum_e f_e * P_e, f_e the fraction of tokens routed to e (top-k one-hot, so sum_e f_e = k),
  P_e the mean router probability of e; it is k when the routing is uniform;
- "moe_router_z" (weight `z_coef`): ST-MoE's router z-loss, the mean of logsumexp(logits)^2;
- "moe_expert_load" (weight 0, logged only): the busiest expert's assignments over the mean
  expert's (1 = balanced, E / k = all on one expert's share).

`mask_BT` (1 for real tokens, 0 for padding), when given, weights these statistics as
transformers' `attention_mask` does; padding tokens are still routed, computed and take capacity.

Expert parallelism (inside a sharded step whose mesh has `expert` = X > 1): each device holds
E_l = E / X experts (its shard of the E axis) and its own batch shard. It routes its tokens
itself, sends each assignment's row to the device holding its expert with one
`jax.lax.all_to_all` over `expert`, runs its E_l experts on what arrived (the same grouped
matmul), and a second all-to-all brings the outputs back to their tokens, combined there. The
buffers are fixed-size (XLA:CPU has no ragged all-to-all): a device sends each of the X others
Q = M * min(k, E_l) rows, padded. That bound is dropless: a token's k experts are distinct, so
at most min(k, E_l) of them live on any one device, whatever the routing. FSDP gathers the
experts' D dim as without it; with F split over `tensor` each tensor rank exchanges the same
rows and the routed output is reduced over `tensor` after the combine, as without it.
"""

import functools
import math

import jax
import jax.numpy as jnp
import ml_collections
from flax import nnx

from nnx_zoo.common import parallel
from nnx_zoo.common.errors import UserError, suggest
from nnx_zoo.common.nn import aux, mlp
from nnx_zoo.common.nn.linear import Linear, normal
from nnx_zoo.kernels import tpu_attention, tpu_gmm

ROUTERS = ("softmax_topk",)
IMPLS = ("auto", "gmm", "ragged", "blocked", "loop")
# Rows per block of the blocked impl, largest first: each expert's rows run in as many blocks of
# the largest size as they fill, the rest in blocks of the next, and so on, padded only to a
# multiple of the smallest. Large blocks run their matmuls near the speed of one big matmul on
# XLA:CPU; the small last ones keep the padding (at most E of them) cheap.
BLOCK_ROWS = (512, 128, 32)


def config(
  *,
  num_experts: int,
  top_k: int,
  hidden_dim: int,
  activation: str = "swiglu",
  router: str = "softmax_topk",
  norm_topk_prob: bool = True,
  shared_hidden_dim: int = 0,
  shared_gate: bool = False,
  capacity_factor: float = 0.0,
  aux_coef: float = 0.0,
  z_coef: float = 0.0,
  use_bias: bool = False,
  impl: str = "auto",
) -> ml_collections.ConfigDict:
  """An MoE sub-config (`kind="moe"`), a drop-in for `mlp.config(...)`.

  hidden_dim: each expert's MLP hidden size; shared_hidden_dim: the shared expert's (0 = none);
  shared_gate: scale the shared expert's output by sigmoid(x @ w) (Qwen2-MoE), else add it as is
  (DeepSeek); norm_topk_prob: renormalise a token's k weights to sum to 1 (Mixtral: always).
  """
  return ml_collections.ConfigDict(
    {
      "kind": "moe",
      "num_experts": num_experts,
      "top_k": top_k,
      "hidden_dim": hidden_dim,
      "activation": activation,
      "router": router,
      "norm_topk_prob": norm_topk_prob,
      "shared_hidden_dim": shared_hidden_dim,
      "shared_gate": shared_gate,
      "capacity_factor": capacity_factor,
      "aux_coef": aux_coef,
      "z_coef": z_coef,
      "use_bias": use_bias,
      "impl": impl,
    }
  )


def psum_batch(x: jax.Array) -> jax.Array:
  """The sum over the batch shards inside a sharded step (the global sum); x outside one."""
  if parallel.current_layout() is None:
    return x
  return parallel.token_sum(x)


def route(logits_ME: jax.Array, *, top_k: int, norm_topk_prob: bool):
  """(weights_Mk, experts_Mk, probs_ME): the softmax over experts, its top k, renormalised to
  sum to 1 per token when `norm_topk_prob`."""
  probs_ME = jax.nn.softmax(logits_ME.astype(jnp.float32), axis=-1)
  weights_Mk, experts_Mk = jax.lax.top_k(probs_ME, top_k)
  if norm_topk_prob:
    weights_Mk = weights_Mk / jnp.sum(weights_Mk, axis=-1, keepdims=True)
  return weights_Mk, experts_Mk, probs_ME


def expert_shards() -> int:
  """X: how many devices the experts are split over (1 outside a sharded step)."""
  layout = parallel.current_layout()
  if layout is None or layout.axis_of("E") != "expert":
    return 1
  return layout.sizes["expert"]


def resolve_impl(impl: str) -> str:
  """`impl`, with "auto" resolved for the platform the code being traced compiles for (a TPU
  slice's under `zoo plan`, though this host is a CPU)."""
  if impl not in IMPLS:
    raise UserError(f"Unknown moe impl {impl!r}.{suggest(impl, IMPLS)}")
  if impl == "auto":
    return {"cpu": "blocked", "tpu": "gmm"}.get(tpu_attention.target_platform(), "ragged")
  return impl


# ---------------------------------------------------------------------------------------------
# Moving rows between token order and the expert-sorted buffer.


# Inside shard_map (check_vma) every array is typed with the mesh axes it varies over. Autodiff
# keeps those types consistent itself; the custom VJPs and loop carries below do it by hand.


@jax.custom_vjp
def _gather_rows(x_MD, src_R, inverse_Mj):
  """out[r] = x[src[r]] (0 where src[r] is out of range), where inverse[n] lists every r with
  src[r] == n (out of range entries padding it). A custom VJP because autodiff would transpose
  the gather into a scatter-add, which XLA:CPU runs far slower than the gather by `inverse` that
  it equals here."""
  return jnp.take(x_MD, src_R, axis=0, mode="fill", fill_value=0)


def _gather_rows_fwd(x_MD, src_R, inverse_Mj):
  # x_MD[:0] is empty but typed like x (the axes it varies over), all the backward needs of it.
  return _gather_rows(x_MD, src_R, inverse_Mj), (inverse_Mj, x_MD[:0])


def _gather_rows_bwd(res, g_RD):
  inverse_Mj, x_type = res
  g_MjD = jnp.take(g_RD, inverse_Mj, axis=0, mode="fill", fill_value=0)
  return parallel.sum_to(jnp.sum(g_MjD, axis=1), parallel.varying(x_type)), None, None


_gather_rows.defvjp(_gather_rows_fwd, _gather_rows_bwd)


def _sort_by_expert(experts_A: jax.Array, E: int):
  """(order_A, group_sizes_E, rank_A): the assignments sorted by expert (stable, so each
  expert's rows stay in token order), how many each expert got, and each assignment's place
  among its expert's (what capacity and the blocked padding count)."""
  A = experts_A.shape[0]
  order_A = jnp.argsort(experts_A, stable=True).astype(jnp.int32)
  sizes_E = jnp.bincount(experts_A, length=E).astype(jnp.int32)
  starts_E = jnp.cumsum(sizes_E) - sizes_E
  rank_sorted = jnp.arange(A, dtype=jnp.int32) - starts_E[experts_A[order_A]]
  rank_A = jnp.zeros((A,), jnp.int32).at[order_A].set(rank_sorted)
  return order_A, sizes_E, rank_A


def _block_rows(A: int, E: int) -> tuple[int, ...]:
  """The block sizes, largest first: BLOCK_ROWS, those no expert's A / E rows could fill
  dropped, and the smallest no larger than that mean (at least 8)."""
  mean = max(8, -(-A // E // 8) * 8)
  return tuple(c for c in BLOCK_ROWS if c <= mean) or (mean,)


def _blocks_per_size(padded_E, Cs):
  """[len(Cs), E]: how many blocks of each size cover each expert's padded rows, largest
  first (padded_E a multiple of the smallest)."""
  counts = []
  for C in Cs:
    counts.append(padded_E // C)
    padded_E = padded_E - counts[-1] * C
  return jnp.stack(counts).astype(jnp.int32)


def _over_blocks(e, starts_E, blocks_LE, Cs, block, carry):
  """carry through block(r, C, carry) for each block of expert e's rows, [r, r + C), in order."""
  r0 = starts_E[e]
  for level, C in enumerate(Cs):
    count = blocks_LE[level, e]
    carry = jax.lax.fori_loop(0, count, lambda i, c, C=C, r0=r0: block(r0 + i * C, C, c), carry)
    r0 = r0 + count * C
  return carry


def _expert_mlp_fwd_loops(x_RD, w, starts_E, blocks_LE, Cs, act, keep):
  """The whole expert MLP, block by block: for each block of C rows of expert e
  (`_over_blocks`), h = act(x @ gate + b) * (x @ up + b) (act(x @ up + b) without a gate) and
  y = h @ down, the [C, F] hidden never leaving the loop body. `keep`: also return the
  pre-activations (gate, up) [R, F] the backward pass reads (zeros in rows no expert owns)."""
  R, D = x_RD.shape
  F = w["up"].shape[2]
  gated = w["gate"] is not None
  names = ("gate", "up") if gated else ("up",)
  varying = parallel.varying(x_RD, starts_E, *(v for v in w.values() if v is not None))
  zeros = lambda shape, dtype: parallel.to_varying(jnp.zeros(shape, dtype), varying)
  y_RD = zeros((R, D), x_RD.dtype)
  kept = {n: zeros((R, F), x_RD.dtype) for n in names} if keep else {}

  def expert(e, carry):
    we = {
      n: None if v is None else jax.lax.dynamic_index_in_dim(v, e, keepdims=False)
      for n, v in w.items()
    }

    def block(r, C, carry):
      y_RD, kept = carry
      x_CD = jax.lax.dynamic_slice_in_dim(x_RD, r, C)
      pre = {}
      for n in names:
        pre[n] = jnp.dot(x_CD, we[n])
        if we[f"{n}_bias"] is not None:
          pre[n] = pre[n] + we[f"{n}_bias"]
      h_CF = act(pre["gate"]) * pre["up"] if gated else act(pre["up"])
      y_RD = jax.lax.dynamic_update_slice_in_dim(y_RD, jnp.dot(h_CF, we["down"]), r, 0)
      kept = {n: jax.lax.dynamic_update_slice_in_dim(kept[n], pre[n], r, 0) for n in kept}
      return y_RD, kept

    return _over_blocks(e, starts_E, blocks_LE, Cs, block, carry)

  return jax.lax.fori_loop(0, starts_E.shape[0], expert, (y_RD, kept))


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _expert_mlp(x_RD, w, starts_E, blocks_LE, Cs, act):
  """The blocked impl's expert MLP in one pass (`_expert_mlp_fwd_loops`): x [R, D] sorted and
  padded by expert, `w` the experts' gate/up/down weights and gate/up biases (or None).

  One loop over the experts and their blocks for the whole MLP, not one grouped matmul per
  weight with the activation between them over all R rows: a block's [C, F] hidden is computed,
  activated and multiplied down while it is in cache, and each expert's weights are sliced once.
  A custom VJP because autodiff of the loops would add each block's weight gradient into a fresh
  zero [E, D, F] array (E times the traffic); here the backward pass reads back the
  pre-activations the forward kept and computes each block's input gradient and weight
  gradients in the same loops, each expert's summed in one fp32 accumulator (megablox's gmm and
  tgmm in one pass)."""
  return _expert_mlp_fwd_loops(x_RD, w, starts_E, blocks_LE, Cs, act, keep=False)[0]


def _expert_mlp_fwd(x_RD, w, starts_E, blocks_LE, Cs, act):
  y_RD, kept = _expert_mlp_fwd_loops(x_RD, w, starts_E, blocks_LE, Cs, act, keep=True)
  return y_RD, (x_RD, w, starts_E, blocks_LE, kept)


def _expert_mlp_bwd(Cs, act, res, g_RD):
  x_RD, w, starts_E, blocks_LE, kept = res
  gated = w["gate"] is not None
  names = ("gate", "up") if gated else ("up",)
  present = {n: v for n, v in w.items() if v is not None}
  varying = parallel.varying(x_RD, g_RD, starts_E, *present.values())
  zeros = lambda shape, dtype: parallel.to_varying(jnp.zeros(shape, dtype), varying)

  def expert(e, carry):
    dx_RD, dw = carry
    we = {n: jax.lax.dynamic_index_in_dim(v, e, keepdims=False) for n, v in present.items()}

    def block(r, C, carry):
      dx_RD, dwe = carry
      x_CD = jax.lax.dynamic_slice_in_dim(x_RD, r, C)
      g_CD = jax.lax.dynamic_slice_in_dim(g_RD, r, C)
      pre = {n: jax.lax.dynamic_slice_in_dim(kept[n], r, C) for n in names}
      if gated:
        a_CF, act_vjp = jax.vjp(act, pre["gate"])
        h_CF = a_CF * pre["up"]
      else:
        h_CF, act_vjp = jax.vjp(act, pre["up"])
      f32 = dict(preferred_element_type=jnp.float32)
      dwe = dict(dwe, down=dwe["down"] + jnp.dot(h_CF.T, g_CD, **f32))
      dh_CF = jnp.dot(g_CD, we["down"].T)
      if gated:
        dpre = {"up": dh_CF * a_CF, "gate": act_vjp(dh_CF * pre["up"])[0]}
      else:
        dpre = {"up": act_vjp(dh_CF)[0]}
      dx_CD = sum(jnp.dot(dpre[n], we[n].T) for n in names).astype(dx_RD.dtype)
      for n in names:
        dwe[n] = dwe[n] + jnp.dot(x_CD.T, dpre[n], **f32)
        if f"{n}_bias" in dwe:
          dwe[f"{n}_bias"] = dwe[f"{n}_bias"] + jnp.sum(dpre[n].astype(jnp.float32), axis=0)
      return jax.lax.dynamic_update_slice_in_dim(dx_RD, dx_CD, r, 0), dwe

    dwe = {n: zeros(v.shape, jnp.float32) for n, v in we.items() if n != "down_bias"}
    dx_RD, dwe = _over_blocks(e, starts_E, blocks_LE, Cs, block, (dx_RD, dwe))
    dw = {n: jax.lax.dynamic_update_index_in_dim(dw[n], dwe[n], e, 0) for n in dw}
    return dx_RD, dw

  dw = {n: zeros(v.shape, jnp.float32) for n, v in present.items() if n != "down_bias"}
  dx_RD, dw = jax.lax.fori_loop(0, starts_E.shape[0], expert, (zeros(x_RD.shape, x_RD.dtype), dw))
  dw_out = {
    n: None if n not in dw else parallel.sum_to(dw[n].astype(v.dtype), parallel.varying(v))
    for n, v in w.items()
  }
  return parallel.sum_to(dx_RD, parallel.varying(x_RD)), dw_out, None, None


_expert_mlp.defvjp(_expert_mlp_fwd, _expert_mlp_bwd)


def _all_experts(w_E___):
  """All E experts of a weight split over `expert` (the shard as is otherwise)."""
  if expert_shards() == 1:
    return w_E___
  return jax.lax.all_gather(w_E___, "expert", axis=0, tiled=True)


# ---------------------------------------------------------------------------------------------
# The layer.


@mlp.register("moe")
class MoE(nnx.Module):
  """Token-choice top-k MoE: y = sum over the token's k experts of weight * expert(x), plus the
  optional shared expert."""

  def __init__(
    self,
    cfg,
    dim: int,
    *,
    out_init_std: float = 0.02,
    dtype=jnp.float32,
    param_dtype=jnp.float32,
    rngs: nnx.Rngs,
  ):
    if cfg.router not in ROUTERS:
      raise UserError(f"Unknown moe router {cfg.router!r}.{suggest(cfg.router, ROUTERS)}")
    if not 1 <= cfg.top_k <= cfg.num_experts:
      raise UserError(f"moe top_k={cfg.top_k} must lie in [1, num_experts={cfg.num_experts}].")
    if cfg.capacity_factor < 0:
      raise UserError(f"moe capacity_factor={cfg.capacity_factor} must be >= 0 (0 = dropless).")
    self.act = mlp.activation(cfg.activation)
    resolve_impl(cfg.impl)  # refuse an unknown one now
    self._impl = cfg.impl
    self.num_experts, self.top_k = cfg.num_experts, cfg.top_k
    self.norm_topk_prob = cfg.norm_topk_prob
    self.capacity_factor = cfg.capacity_factor or None  # the config's 0: dropless
    self.aux_coef, self.z_coef = cfg.aux_coef, cfg.z_coef
    self.dtype = dtype
    E, D, F = cfg.num_experts, dim, cfg.hidden_dim

    def param(shape, axes, std):
      return nnx.Param(normal(std)(rngs.params(), shape, param_dtype), axes=axes)

    def bias(shape, axes):
      return nnx.Param(jnp.zeros(shape, param_dtype), axes=axes) if cfg.use_bias else None

    # The router stays fp32 whatever `dtype`: small logit differences flip top-k choices.
    self.router = param((D, E), ("D", None), 0.02)
    gated = cfg.activation in mlp.GATED
    self.gate = param((E, D, F), ("E", "D", "F"), 0.02) if gated else None
    self.up = param((E, D, F), ("E", "D", "F"), 0.02)
    self.down = param((E, F, D), ("E", "F", "D"), out_init_std)
    self.gate_bias = bias((E, F), ("E", "F")) if gated else None
    self.up_bias = bias((E, F), ("E", "F"))
    self.down_bias = bias((E, D), ("E", "D"))

    if cfg.shared_gate and not cfg.shared_hidden_dim:
      raise UserError("moe shared_gate=True needs a shared expert: set shared_hidden_dim > 0.")
    dt = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
    shared_cfg = mlp.config(cfg.activation, hidden_dim=cfg.shared_hidden_dim, use_bias=cfg.use_bias)
    self.shared = (
      mlp.MLP(shared_cfg, dim, out_init_std=out_init_std, **dt) if cfg.shared_hidden_dim else None
    )
    self.shared_gate = Linear(dim, 1, axes=("D", None), **dt) if cfg.shared_gate else None

  @property
  def impl(self) -> str:
    """The impl that runs, resolved when traced (for the platform being compiled for)."""
    return resolve_impl(self._impl)

  def __call__(self, x_BTD: jax.Array, *, mask_BT: jax.Array | None = None) -> jax.Array:
    B, T, D = x_BTD.shape
    E, k = self.num_experts, self.top_k
    x_MD = x_BTD.reshape(B * T, D)
    router_DE = parallel.gather(self.router[...], ("D", None)).astype(jnp.float32)
    logits_ME = jnp.dot(x_MD.astype(jnp.float32), router_DE)
    weights_Mk, experts_Mk, probs_ME = route(logits_ME, top_k=k, norm_topk_prob=self.norm_topk_prob)
    if aux.collecting():
      mask_M = None if mask_BT is None else mask_BT.reshape(B * T)
      self._add_aux_losses(logits_ME, probs_ME, experts_Mk, mask_M)

    experts_A = experts_Mk.reshape(-1)
    order_A, sizes_E, rank_A = _sort_by_expert(experts_A, E)
    if self.capacity_factor is not None:
      capacity = math.ceil(self.capacity_factor * B * T * k / E)
      weights_Mk = jnp.where((rank_A < capacity).reshape(B * T, k), weights_Mk, 0.0)
    weights_Mk = weights_Mk.astype(self.dtype)

    shards = expert_shards()
    # The reference loop runs every expert here, so it gathers all of them (E x the memory).
    w = self._expert_weights(whole_E=self.impl == "loop")
    x_MD = x_MD.astype(self.dtype)
    if self.impl == "loop":
      y_MD = self._loop(x_MD, w, experts_Mk, weights_Mk)
    elif shards > 1:
      y_MD = self._expert_parallel(x_MD, w, experts_A, sizes_E, rank_A, weights_Mk, shards)
    else:
      ys_AD = self._per_assignment(x_MD, w, experts_A, order_A, sizes_E, rank_A, k=k, E=E)
      # A weighted sum over k, not an einsum: XLA:CPU would run that as M tiny batched matmuls.
      y_MD = jnp.sum(weights_Mk[..., None] * ys_AD.reshape(B * T, k, D), axis=1)
    # Each device holds an F slice of every expert when F is split over `tensor`: y is partial.
    y_MD = parallel.reduce(y_MD, "F")
    if self.down_bias is not None:  # after the reduce: added once, not per shard
      down_bias_ED = w["down_bias"] if self.impl == "loop" else _all_experts(w["down_bias"])
      bias_MD = jnp.sum(weights_Mk[..., None] * down_bias_ED[experts_Mk], axis=1)
      y_MD = y_MD + bias_MD

    if self.shared is not None:
      shared_MD = self.shared(x_MD)
      if self.shared_gate is not None:
        shared_MD = jax.nn.sigmoid(self.shared_gate(x_MD)) * shared_MD
      y_MD = y_MD + shared_MD
    return y_MD.reshape(B, T, D)

  def _expert_weights(self, whole_E: bool = False) -> dict[str, jax.Array | None]:
    """This device's experts' weights, fsdp dims gathered (all E experts when `whole_E`)."""

    def get(p, axes):
      if p is None:
        return None
      w = parallel.gather(p[...], axes).astype(self.dtype)
      return _all_experts(w) if whole_E else w

    return {
      "gate": get(self.gate, ("E", "D", "F")),
      "up": get(self.up, ("E", "D", "F")),
      "down": get(self.down, ("E", "F", "D")),
      "gate_bias": get(self.gate_bias, ("E", "F")),
      "up_bias": get(self.up_bias, ("E", "F")),
      "down_bias": get(self.down_bias, ("E", "D")),
    }

  def _hidden(self, x, gate, up, gate_bias, up_bias):
    """act(x @ gate + b) * (x @ up + b), or act(x @ up + b) without a gate (2-D matmuls)."""
    u = jnp.dot(x, up) if up_bias is None else jnp.dot(x, up) + up_bias
    if gate is None:
      return self.act(u)
    g = jnp.dot(x, gate) if gate_bias is None else jnp.dot(x, gate) + gate_bias
    return self.act(g) * u

  def _loop(self, x_MD, w, experts_Mk, weights_Mk):
    """Every expert on every token, weighted by its combine weight (the reference)."""
    one_hot_MkE = jax.nn.one_hot(experts_Mk, self.num_experts, dtype=self.dtype)
    combine_ME = jnp.sum(weights_Mk[..., None] * one_hot_MkE, axis=1)
    y_MD = jnp.zeros_like(x_MD)
    for e in range(self.num_experts):
      pick = lambda name, e=e: None if w[name] is None else w[name][e]
      h_MF = self._hidden(x_MD, pick("gate"), pick("up"), pick("gate_bias"), pick("up_bias"))
      y_MD = y_MD + combine_ME[:, e : e + 1] * jnp.dot(h_MF, w["down"][e])
    return y_MD

  def _per_assignment(self, x_MD, w, experts_A, order_A, sizes_E, rank_A, *, k, E, rows=None):
    """Each assignment's expert output, unweighted [A, D] (A = M * k, assignment n * k + j is
    token n's slot j): the rows sorted by expert (padded per expert for "blocked"), each group
    through its own expert of `w`, and brought back to assignment order. An assignment whose
    expert is E (a padding row of the expert-parallel buffer) is computed by no expert and its
    row is 0. `rows`: how many real assignments to expect (A), what sizes the blocks."""
    M = x_MD.shape[0]
    A = M * k
    real_A = experts_A < E
    if self.impl in ("ragged", "gmm"):
      # Padding rows sort last, past every group: both grouped matmuls give them zeros.
      slot_A = jnp.zeros((A,), jnp.int32).at[order_A].set(jnp.arange(A, dtype=jnp.int32))
      src_A = order_A  # the assignment in each row
    else:
      Cs = _block_rows(A if rows is None else rows, E)
      C = Cs[-1]  # the padding granularity
      padded_E = -(-sizes_E // C) * C
      pstarts_E = jnp.cumsum(padded_E) - padded_E
      G = -(-(A + E * (C - 1)) // C)  # the most blocks any routing can need
      R = G * C
      # Padding assignments get no row (slot R: out of range, so dropped by the scatter).
      slot_A = jnp.where(real_A, pstarts_E[jnp.minimum(experts_A, E - 1)] + rank_A, R)
      # Rows no assignment fills point past the end: they read zeros and are never read back.
      src_A = jnp.full((R,), A, jnp.int32).at[slot_A].set(jnp.arange(A, dtype=jnp.int32))
    token_R = jnp.where(src_A < A, src_A // k, M)
    xs_RD = _gather_rows(x_MD, token_R, slot_A.reshape(M, k))
    if self.impl in ("ragged", "gmm"):
      ys_RD = self._grouped(xs_RD, w, sizes_E, jnp.minimum(experts_A[order_A], E - 1))
    else:
      ys_RD = self._blocked(xs_RD, w, padded_E, Cs)
    return _gather_rows(ys_RD, slot_A, src_A[:, None])

  def _expert_parallel(self, x_MD, w, experts_A, sizes_E, rank_A, weights_Mk, shards):
    """The routed output with the experts split over the `expert` mesh axis (X = `shards`
    devices, E_l experts each): each assignment's row sent to its expert's device and its
    output sent back by all-to-all (see the module docstring for the buffer bound)."""
    (M, D), k, E = x_MD.shape, self.top_k, self.num_experts
    A, El = M * k, E // shards
    Q = M * min(k, El)  # rows per destination: dropless (module docstring)
    R = shards * Q
    # The send buffer: destination-major (destination = expert // E_l), and in each
    # destination's Q rows its assignments sorted by expert (token order within one), then
    # padding. Its place among its destination's is its rank among its expert's plus the
    # assignments of that destination's earlier experts.
    dest_A = experts_A // El
    starts_E = jnp.cumsum(sizes_E) - sizes_E
    slot_A = dest_A * Q + starts_E[experts_A] - starts_E[dest_A * El] + rank_A
    src_R = jnp.full((R,), A, jnp.int32).at[slot_A].set(jnp.arange(A, dtype=jnp.int32))
    # Each row's expert among its destination's E_l (E_l marks padding).
    local_R = jnp.full((R,), El, jnp.int32).at[slot_A].set(experts_A % El)
    token_R = jnp.where(src_R < A, src_R // k, M)
    send_RD = _gather_rows(x_MD, token_R, slot_A.reshape(M, k))

    def exchange(v):
      """Chunk j of v to device j; back, chunk i from device i (its own transpose)."""
      return jax.lax.all_to_all(v, "expert", 0, 0, tiled=True)

    # What arrived: Q rows from each device, for this device's experts.
    recv_RD, recv_R = exchange(send_RD), exchange(local_R)
    order_R, sizes_El, rank_R = _sort_by_expert(recv_R, El)
    out_RD = self._per_assignment(recv_RD, w, recv_R, order_R, sizes_El, rank_R, k=1, E=El, rows=A)
    ys_AD = _gather_rows(exchange(out_RD), slot_A, src_R[:, None])
    # A weighted sum over k, not an einsum: XLA:CPU would run that as M tiny batched matmuls.
    return jnp.sum(weights_Mk[..., None] * ys_AD.reshape(M, k, D), axis=1)

  def _grouped(self, xs_AD, w, sizes_E, experts_sorted_A):
    """The expert MLP on rows sorted by expert, one grouped matmul per weight: XLA's
    `ragged_dot` ("ragged") or megablox's TPU kernels ("gmm", kernels/tpu_gmm.py)."""
    grouped = tpu_gmm.gmm if self.impl == "gmm" else jax.lax.ragged_dot

    def dot(x, W, b):
      y = grouped(x, W, sizes_E)
      return y if b is None else y + b[experts_sorted_A]

    u = dot(xs_AD, w["up"], w["up_bias"])
    h = self.act(u) if w["gate"] is None else self.act(dot(xs_AD, w["gate"], w["gate_bias"])) * u
    return grouped(h, w["down"], sizes_E)

  def _blocked(self, xs_RD, w, padded_E, Cs):
    # Expert e owns rows [starts_E[e], starts_E[e] + padded_E[e]); rows past the last expert's
    # hold only zeros and are computed by none.
    starts_E = (jnp.cumsum(padded_E) - padded_E).astype(jnp.int32)
    mlp_w = {n: w[n] for n in ("gate", "up", "down", "gate_bias", "up_bias")}
    return _expert_mlp(xs_RD, mlp_w, starts_E, _blocks_per_size(padded_E, Cs), Cs, self.act)

  def _add_aux_losses(self, logits_ME, probs_ME, experts_Mk, mask_M):
    E = self.num_experts
    mask_M = jnp.ones(logits_ME.shape[:1], jnp.float32) if mask_M is None else mask_M
    mask_M = mask_M.astype(jnp.float32)
    routed_ME = jnp.sum(jax.nn.one_hot(experts_Mk, E, dtype=jnp.float32), axis=1)
    lse_M = jax.nn.logsumexp(logits_ME, axis=-1)
    sums = psum_batch(
      {
        "count": jnp.sum(mask_M),
        "routed_E": mask_M @ routed_ME,
        "prob_E": mask_M @ probs_ME,
        "z": jnp.sum(mask_M * lse_M**2),
      }
    )
    count = jnp.maximum(sums["count"], 1.0)
    fraction_E, prob_E = sums["routed_E"] / count, sums["prob_E"] / count
    aux.add("moe_load_balance", E * jnp.sum(fraction_E * prob_E), weight=self.aux_coef)
    aux.add("moe_router_z", sums["z"] / count, weight=self.z_coef)
    load = jnp.max(sums["routed_E"]) / jnp.maximum(jnp.mean(sums["routed_E"]), 1e-9)
    aux.add("moe_expert_load", jax.lax.stop_gradient(load), weight=0.0)
