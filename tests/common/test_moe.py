"""The MoE layer: routers against numpy, each impl against the per-expert loop (values and
gradients), the load-balancing loss against transformers, capacity dropping, a mesh changing
no loss."""

import inspect
import json
import os
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from nnx_zoo.common.errors import UserError
from nnx_zoo.common.nn import aux, mlp, moe

ROOT = pathlib.Path(__file__).resolve().parents[2]
D, F = 8, 12


def randn(seed, shape, scale=1.0):
  return (np.random.default_rng(seed).standard_normal(shape) * scale).astype(np.float32)


def f64(a):
  return np.asarray(a, np.float64)


def make(impl="loop", **kw):
  """An MoE with E = 6 experts and random parameters (the same for every impl)."""
  cfg = moe.config(**{"num_experts": 6, "top_k": 2, "hidden_dim": F, "impl": impl, **kw})
  return fill(nnx.eval_shape(lambda: moe.MoE(cfg, D, rngs=nnx.Rngs(0))))


def fill(model, seed=0):
  """Random values in an abstract model's parameters (eager initialisation compiles every op
  on its own: seconds). The router is scaled up so the top-k choices are far from ties."""
  rng = np.random.default_rng(seed)
  for path, var in nnx.iter_graph(model):
    if isinstance(var, nnx.Param):
      scale = 1.0 if path[-1] == "router" else 0.3
      var.set_value(jnp.asarray((rng.standard_normal(var.shape) * scale).astype(np.float32)))
  return model


def forward(model, x, mask=None):
  """model(x) under jit (eager dispatch of the scan-based impls costs seconds), with the means of
  the auxiliary losses it added."""
  graphdef, params = nnx.split(model)

  @jax.jit
  def f(params, x, mask):
    with aux.collect() as entries:
      y = nnx.merge(graphdef, params)(x, mask_BT=mask)
    return y, aux.means(entries)

  return f(params, jnp.asarray(x), None if mask is None else jnp.asarray(mask))


def np_reference(model, x_BTD, *, top_k, norm_topk_prob=True, capacity=None):
  """The layer in float64 numpy, token by token (capacity: per-expert slots in token order)."""
  x = f64(x_BTD).reshape(-1, D)
  p = {name: f64(v[...]) for name, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}
  p = {"/".join(map(str, k)): v for k, v in p.items()}
  logits = x @ p["router"]
  probs = np.exp(logits - logits.max(-1, keepdims=True))
  probs /= probs.sum(-1, keepdims=True)
  experts = np.argsort(-probs, axis=-1, kind="stable")[:, :top_k]
  weights = np.take_along_axis(probs, experts, -1)
  if norm_topk_prob:
    weights /= weights.sum(-1, keepdims=True)
  silu = lambda v: v / (1 + np.exp(-v))
  used = np.zeros(p["router"].shape[1], int)
  y = np.zeros_like(x)
  for n in range(x.shape[0]):
    for j, e in enumerate(experts[n]):
      used[e] += 1
      if capacity is not None and used[e] > capacity:
        continue
      h = silu(x[n] @ p["gate"][e]) * (x[n] @ p["up"][e])
      y[n] += weights[n, j] * (h @ p["down"][e])
    if "shared/up/kernel" in p:
      h = silu(x[n] @ p["shared/gate/kernel"]) * (x[n] @ p["shared/up/kernel"])
      s = h @ p["shared/down/kernel"]
      if "shared_gate/kernel" in p:
        s = s / (1 + np.exp(-(x[n] @ p["shared_gate/kernel"])))
      y[n] += s
  return y.reshape(x_BTD.shape), logits, experts, weights


# ---------------------------------------------------------------------------------------------
# Routing and the layer against numpy


@pytest.mark.parametrize("norm_topk_prob", [True, False])  # Mixtral / Qwen3-MoE off
def test_route_matches_numpy(norm_topk_prob):
  logits = randn(1, (10, 6), 3.0)
  weights, experts, probs = moe.route(jnp.asarray(logits), top_k=3, norm_topk_prob=norm_topk_prob)
  want_p = np.exp(f64(logits)) / np.exp(f64(logits)).sum(-1, keepdims=True)
  want_e = np.argsort(-want_p, axis=-1)[:, :3]
  want_w = np.take_along_axis(want_p, want_e, -1)
  if norm_topk_prob:
    want_w /= want_w.sum(-1, keepdims=True)
  np.testing.assert_allclose(probs, want_p, rtol=1e-5)
  np.testing.assert_array_equal(experts, want_e)
  np.testing.assert_allclose(weights, want_w, rtol=1e-5)
  assert np.allclose(np.sum(weights, -1), 1.0) == norm_topk_prob


@pytest.mark.parametrize(
  "kw",
  [
    {"top_k": 2},  # Mixtral
    {"top_k": 3, "norm_topk_prob": False},  # Qwen3-MoE without renormalisation
    {"top_k": 2, "norm_topk_prob": False, "shared_hidden_dim": 10, "shared_gate": True},  # Qwen2
    {"top_k": 1, "shared_hidden_dim": 10},  # DeepSeek-style ungated shared expert
  ],
)
def test_layer_matches_numpy(kw):
  model = make(**kw)
  x = randn(2, (2, 5, D))
  want, *_ = np_reference(model, x, top_k=kw["top_k"], norm_topk_prob=kw.get("norm_topk_prob", 1))
  np.testing.assert_allclose(forward(model, x)[0], want, atol=1e-5, rtol=1e-4)


# ---------------------------------------------------------------------------------------------
# Each impl equals the per-expert loop, in values and gradients


def values_and_grads(models: dict, x, dy):
  """{name: (sum(model(x) * dy), (grads of the params, grad of x))}, all in one jit (one
  compilation instead of one per impl)."""
  split = {name: nnx.split(m) for name, m in models.items()}

  def f(params, x, graphdef):
    return jnp.sum(nnx.merge(graphdef, params)(x) * dy)

  @jax.jit
  def all_of(params, x):
    return {
      name: jax.value_and_grad(f, argnums=(0, 1))(params[name], x, split[name][0])
      for name in params
    }

  return all_of({name: p for name, (_, p) in split.items()}, x)


@pytest.mark.parametrize(
  "kw",
  [
    {"top_k": 1, "activation": "gelu", "use_bias": True},
    {"top_k": 2, "shared_hidden_dim": 10, "shared_gate": True, "capacity_factor": 0.5},
    {"top_k": 3, "shared_hidden_dim": 10},
  ],
  ids=["k1-gelu-bias", "k2-shared-gated-capacity", "k3-shared"],
)
def test_impls_equal_loop(kw):
  """ "gmm" (megablox, interpret mode here), "ragged" and "blocked" against the per-expert
  loop, E = 6 experts."""
  x, dy = jnp.asarray(randn(3, (2, 9, D))), jnp.asarray(randn(4, (2, 9, D)))
  impls = ("loop", "gmm", "ragged", "blocked")
  out = values_and_grads({impl: make(impl, **kw) for impl in impls}, x, dy)
  v_ref, (g_ref, gx_ref) = out.pop("loop")
  flat_ref = dict(nnx.to_flat_state(g_ref))
  for impl, (v, (g, gx)) in out.items():
    np.testing.assert_allclose(v, v_ref, rtol=1e-5, atol=1e-6, err_msg=impl)
    np.testing.assert_allclose(gx, gx_ref, rtol=1e-4, atol=1e-6, err_msg=impl)
    flat = dict(nnx.to_flat_state(g))
    assert flat.keys() == flat_ref.keys()
    for path, leaf in flat.items():
      np.testing.assert_allclose(
        leaf[...], flat_ref[path][...], rtol=1e-4, atol=1e-6, err_msg=f"{impl} {path}"
      )


# ---------------------------------------------------------------------------------------------
# Capacity


@pytest.mark.parametrize("impl", ["loop", "ragged", "blocked"])
def test_capacity_drops_exactly_the_overflow(impl):
  """C = ceil(0.5 * 18 * 2 / 6) = 3 slots per expert, kept in token order; the rest add 0."""
  model = make(impl, top_k=2, capacity_factor=0.5)
  x = randn(6, (2, 9, D))
  want, _, experts, _ = np_reference(model, x, top_k=2, capacity=3)
  counts = np.bincount(experts.reshape(-1), minlength=6)
  assert counts.max() > 3, "the test should overflow some expert"
  np.testing.assert_allclose(forward(model, x)[0], want, atol=1e-5, rtol=1e-4)
  # Dropless: the same model without capacity differs exactly where a slot was dropped.
  full, *_ = np_reference(model, x, top_k=2)
  rank = np.zeros_like(experts)
  seen = np.zeros(6, int)
  for n, j in np.ndindex(*experts.shape):
    rank[n, j] = seen[experts[n, j]]
    seen[experts[n, j]] += 1
  dropped_tokens = (rank >= 3).any(-1)
  changed = ~np.isclose(want.reshape(-1, D), full.reshape(-1, D)).all(-1)
  np.testing.assert_array_equal(changed, dropped_tokens)


# ---------------------------------------------------------------------------------------------
# Auxiliary losses


@pytest.mark.parametrize("with_mask", [False, True])
def test_load_balance_loss_equals_transformers(with_mask):
  torch = pytest.importorskip("torch")
  mixtral = pytest.importorskip("transformers.models.mixtral.modeling_mixtral")
  model = make(top_k=2)
  x = randn(8, (2, 9, D))
  mask = np.ones((2, 9), np.int32)
  mask[1, 6:] = 0
  _, means = forward(model, x, mask if with_mask else None)
  got = {name: float(v) for name, v in means.items()}
  assert got.keys() == {"moe_load_balance", "moe_router_z", "moe_expert_load"}
  logits = x.reshape(-1, D) @ np.asarray(model.router[...])
  want = mixtral.load_balancing_loss_func(
    (torch.tensor(logits),), 6, 2, torch.tensor(mask) if with_mask else None
  )
  np.testing.assert_allclose(got["moe_load_balance"], float(want), rtol=1e-5)
  # z-loss and expert load over the same (masked) tokens, in numpy.
  w = mask.reshape(-1).astype(np.float64) if with_mask else np.ones(18)
  lse = np.log(np.exp(f64(logits)).sum(-1))
  np.testing.assert_allclose(got["moe_router_z"], (w * lse**2).sum() / w.sum(), rtol=1e-5)
  experts = np.argsort(-logits, axis=-1)[:, :2]
  counts = np.array([(w[:, None] * (experts == e)).sum() for e in range(6)])
  np.testing.assert_allclose(got["moe_expert_load"], counts.max() / counts.mean(), rtol=1e-5)


def test_stack_passes_the_padding_mask_to_the_aux_losses():
  """In a Llama MoE decoder, tokens of segment 0 (padding) count in no aux statistic: changing
  them changes no aux loss (the real tokens never attend to them)."""
  from nnx_zoo.zoo.llama import model as llama

  cfg = llama.config("tiny", num_experts=4, top_k=2, router_aux_coef=0.02, router_z_coef=0.01)
  graphdef, params = nnx.split(fill(nnx.eval_shape(lambda: llama.Model(cfg, rngs=nnx.Rngs(0)))))
  segments = np.ones((2, 9), np.int32)
  segments[1, 5:] = 0
  tokens = np.random.default_rng(0).integers(0, 256, (2, 9)).astype(np.int32)
  other = np.where(segments == 0, (tokens + 7) % 256, tokens)

  @jax.jit
  def aux_means(tokens):
    with aux.collect() as entries:
      nnx.merge(graphdef, params)(tokens, segment_ids_BT=jnp.asarray(segments))
    return aux.means(entries)

  got, changed = aux_means(tokens), aux_means(other)
  assert got.keys() == {"moe_load_balance", "moe_router_z", "moe_expert_load"}
  for name in got:
    np.testing.assert_allclose(changed[name], got[name], rtol=1e-6, err_msg=name)


def test_aux_weights_from_config_and_silent_without_collector():
  model = make(aux_coef=0.01, z_coef=0.001)
  x = jax.ShapeDtypeStruct((1, 4, D), jnp.float32)
  jax.eval_shape(lambda x: model(x), x)  # nobody collects: nothing added, no error
  with aux.collect() as entries:  # traced, not compiled (a new function: no trace cache hit)
    jax.eval_shape(lambda x: model(x), x)
  assert {name: e.weight for name, e in entries.items()} == {
    "moe_load_balance": 0.01,
    "moe_router_z": 0.001,
    "moe_expert_load": 0.0,
  }


# ---------------------------------------------------------------------------------------------
# Config and registration


def test_registered_as_mlp_kind_moe():
  cfg = moe.config(num_experts=4, top_k=2, hidden_dim=F, shared_hidden_dim=6, shared_gate=True)
  assert cfg.kind == "moe"
  model = fill(nnx.eval_shape(lambda: mlp.make(cfg, D, rngs=nnx.Rngs(0))))
  assert isinstance(model, moe.MoE)
  assert model.gate.shape == model.up.shape == (4, D, F) and model.down.shape == (4, F, D)
  assert model.gate.axes == ("E", "D", "F") and model.down.axes == ("E", "F", "D")
  assert model.router.shape == (D, 4) and model.router.axes == ("D", None)
  assert isinstance(model.shared, mlp.MLP) and model.shared_gate.kernel.shape == (D, 1)
  y = jax.eval_shape(lambda x: model(x), jax.ShapeDtypeStruct((2, 3, D), jnp.float32))
  assert y.shape == (2, 3, D)
  want = {"cpu": "blocked", "tpu": "gmm"}.get(jax.default_backend(), "ragged")
  assert model.impl == want


@pytest.mark.parametrize(
  "kw, words",
  [
    ({"router": "sigmoid"}, "router"),
    ({"impl": "megablox"}, "impl"),
    ({"top_k": 7}, "top_k"),
    ({"shared_gate": True}, "shared_hidden_dim"),
    ({"capacity_factor": -1.0}, "capacity_factor"),
  ],
)
def test_bad_config_is_a_user_error(kw, words):
  with pytest.raises(UserError, match=words):
    make(**kw)


# ---------------------------------------------------------------------------------------------
# A mesh changes no loss (4 fake CPU devices, in a subprocess)

SHARDED = """
import json
import jax, jax.numpy as jnp, numpy as np
from flax import nnx
from nnx_zoo.common import parallel
from nnx_zoo.common.nn import aux, moe
# fill(), as defined in this file above

def objective(model, x, dy, mask):
  with aux.collect() as entries:
    y = model(x, mask_BT=mask)
  count = jnp.sum(mask)  # as the trainer weighs its aux losses: by the local target count
  return jnp.sum(y * dy) + count * aux.weighted_sum(entries), aux.means(entries)

def value_and_grads(impl, layout=None, **kw):
  cfg = moe.config(**{"num_experts": 6, "top_k": 2, "hidden_dim": 12, "shared_hidden_dim": 10,
                      "shared_gate": True, "aux_coef": 0.1, "z_coef": 0.01, "impl": impl, **kw})
  graphdef, params = nnx.split(fill(nnx.eval_shape(lambda: moe.MoE(cfg, 8, rngs=nnx.Rngs(0)))))
  f = jax.value_and_grad(lambda p, *a: objective(nnx.merge(graphdef, p), *a), has_aux=True)

  def single(p, *a):
    (_, means), g = f(p, *a)
    return means, g

  if layout is None:
    return jax.jit(single), params
  specs = layout.param_specs(params)

  def local(p, *a):
    with parallel.active(layout):
      means, g = single(p, *a)
    return jax.tree.map(lambda v: jax.lax.pmean(v, parallel.BATCH_AXES), means), g

  return jax.jit(jax.shard_map(local, mesh=layout.mesh, in_specs=(specs, *[layout.batch_spec] * 3),
                               out_specs=(parallel.P(), specs), check_vma=True)), params

rng = np.random.default_rng(0)
x, dy = (jnp.asarray(rng.standard_normal((4, 5, 8)), jnp.float32) for _ in range(2))
mask = jnp.asarray(rng.random((4, 5)) < 0.8, jnp.float32)
out = {}
# (data, fsdp, expert, tensor): fsdp gathers D, tensor splits F (a psum of the routed output),
# expert splits E (3 experts a device, tokens sent to them by all-to-all), the batch over data x
# fsdp x expert. The last: biases (the down bias added at the token's device), 3 slots a token.
# Not "gmm": Pallas interpret mode cannot run megablox under check_vma (its index maps slice the
# varying group metadata by the interpreter's invariant grid index); compiled for TPU it can
# (tests/kernels/test_tpu_gmm.py), and its numerics are tested on one device.
BIAS = {"use_bias": True, "activation": "gelu", "top_k": 3}
for impl, sizes, kw in (("blocked", (1, 2, 1, 2), {}), ("ragged", (2, 2, 1, 1), {}),
                        ("blocked", (1, 1, 2, 2), {}), ("ragged", (1, 2, 2, 1), {}),
                        ("loop", (2, 1, 2, 1), {}), ("blocked", (1, 2, 2, 1), BIAS)):
  axes = ("data", "fsdp", "expert", "tensor")
  layout = parallel.make_layout(dict(zip(axes, sizes, strict=True)), jax.devices()[:4])
  fn, params = value_and_grads(impl, layout, **kw)
  ref, gref = value_and_grads("blocked", **kw)[0](params, x, dy, mask)
  got, g = fn(params, x, dy, mask)
  diff = max(float(jnp.max(jnp.abs(a - b))) for a, b in zip(*map(jax.tree.leaves, (g, gref))))
  aux_pairs = {k: [float(got[k]), float(ref[k])] for k in ref}
  out[f"{impl} {sizes} {kw}"] = {"aux": aux_pairs, "grad": diff}
print(json.dumps(out))
"""


@pytest.mark.multidevice
@pytest.mark.slow
def test_mesh_changes_no_loss():
  """Aux losses and gradients (aux included, weighted as the trainer does) on data x fsdp x
  expert x tensor meshes equal one device's: the aux statistics are global-batch sums, and the
  expert-parallel all-to-alls drop nothing."""
  env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=4"}
  proc = subprocess.run(
    [
      sys.executable,
      "-P",
      "-c",
      SHARDED.replace("# fill(), as defined in this file above\n", inspect.getsource(fill)),
    ],
    cwd=ROOT,
    env=env,
    capture_output=True,
    text=True,
  )
  assert proc.returncode == 0, proc.stderr[-3000:]
  results = json.loads(proc.stdout.strip().splitlines()[-1])
  for mesh, r in results.items():
    for name, (got, want) in r["aux"].items():
      assert abs(got - want) <= 1e-5 * max(1.0, abs(want)), (mesh, name, got, want)
    assert r["grad"] < 1e-5, (mesh, r["grad"])
