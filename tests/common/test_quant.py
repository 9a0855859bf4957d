"""Quantized training (common/nn/quant.py): int8 and fp8 products in the step's HLO, a Linear
against float, `none` as before, scan and micro-batches, resuming across the setting."""

import collections
import importlib.util
import json
import os
import pathlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from nnx_zoo.common import experiments, models, plan
from nnx_zoo.common.errors import UserError
from nnx_zoo.common.hub import weights
from nnx_zoo.common.nn import quant, stacking
from nnx_zoo.common.nn.linear import Linear
from nnx_zoo.common.train import optim, trainer
from nnx_zoo.common.train import step as steps
from nnx_zoo.zoo.llama import model as llama

# The tiny Llama's quantized projections: q, k, v, o, gate, up, down in each of 2 layers.
PROJECTIONS = 2 * 7


def tiny(mode="none", backward=True, scan=False, **overrides):
  cfg = llama.config("tiny", **overrides)
  cfg.quant, cfg.quant_backward, cfg.scan = mode, backward, scan
  return cfg


def tokens(B=4, T=17, seed=0):
  return jnp.asarray(np.random.default_rng(seed).integers(0, 256, (B, T)).astype(np.int32))


def rel(got, want) -> float:
  """The largest error relative to the largest value of `want`."""
  return float(jnp.max(jnp.abs(got - want)) / jnp.max(jnp.abs(want)))


def test_unknown_mode_is_a_user_error_naming_the_choices():
  with pytest.raises(UserError, match="model.quant 'int4'.*none, int8, fp8"):
    models.build(tiny("int4"))


def dots(hlo: str) -> collections.Counter:
  """{(lhs type, rhs type, lhs contracting dim, rhs contracting dim): count} of the 2-D
  dot_generals of a StableHLO text (the Linears' products and their gradients)."""
  pattern = (
    r"stablehlo\.dot_general [^\n]*contracting_dims = \[(\d)\] x \[(\d)\][^\n]*"
    r": \(tensor<\d+x\d+x(\w+)>, tensor<\d+x\d+x(\w+)>\)"
  )
  return collections.Counter((a, b, int(i), int(j)) for i, j, a, b in re.findall(pattern, hlo))


def train_step_hlo(cfg_model) -> str:
  """The StableHLO of the trainer's step (forward, gradients, AdamW) of lm/shakespeare-char's
  smoke form with `cfg_model` as its model."""
  cfg = experiments.get_config("lm/shakespeare-char:smoke")
  cfg.model = cfg_model
  tx = optim.optimizer(cfg.optim, cfg.train.steps)
  state, shardings = steps.placed_abstract_state(cfg, tx, None)
  rows = jax.ShapeDtypeStruct((cfg.train.batch_size, cfg.data.seq_len + 1), jnp.int32)
  batch = {"tokens": rows, "segment_ids": rows}
  step = steps.make_train_step(cfg, tx=tx, layout=None, shardings=shardings)
  return step.lower(state, batch).as_text()


# x @ W (x contracted on its dim 1 with W's dim 0), dx = g @ W^T (g's 1 with W's 1), dW = x^T @ g
# (x's 0 with g's 0): the operands' types in each, per mode.
E4M3, E5M2 = "f8E4M3FN", "f8E5M2"
KINDS = {
  "int8": {("i8", "i8", 1, 0), ("i8", "i8", 1, 1), ("i8", "i8", 0, 0)},
  "fp8": {(E4M3, E4M3, 1, 0), (E5M2, E4M3, 1, 1), (E5M2, E4M3, 0, 0)},
}
NARROW = ("i8", E4M3, E5M2)


@pytest.mark.parametrize("mode", ["int8", "fp8"])
def test_train_step_multiplies_quantized_in_the_forward_and_both_gradients(mode):
  """Each projection's three products (forward, input gradient, weight gradient) in the narrow
  types; the rest (embedding, output head, attention's scores and values) in float; `none` has
  no narrow product at all, and quant_backward=False only the forward ones."""
  got = dots(train_step_hlo(tiny(mode)))
  for kind in KINDS[mode]:
    assert got[kind] == PROJECTIONS, (kind, got)
  assert sum(n for k, n in got.items() if k[0] in NARROW) == 3 * PROJECTIONS
  assert any(k[0] == "f32" for k in got)  # the output head and its gradients stay float

  forward_only = dots(train_step_hlo(tiny(mode, backward=False)))
  narrow = {k: n for k, n in forward_only.items() if k[0] in NARROW or k[1] in NARROW}
  assert narrow == {next(k for k in KINDS[mode] if k[2:] == (1, 0)): PROJECTIONS}


def test_float_step_has_no_quantized_product():
  hlo = train_step_hlo(tiny("none"))
  assert not any(t in hlo for t in ("xi8>", "xf8E4M3FN>", "xf8E5M2>"))


def linear_and_grads(x, g, how=None, seed=0):
  """A Linear's output for `x` and the gradients of sum(output * g) for its kernel and `x`."""
  layer = Linear(128, 96, rngs=nnx.Rngs(seed))
  layer.quant = how

  def f(layer, x):
    return jnp.sum(layer(x) * g)

  grads, dx = jax.grad(f, argnums=(0, 1))(layer, x)
  return layer(x), grads.kernel[...], dx


# Largest error relative to the largest float value, forward / gradients (measured on 10 seeds:
# int8 1.2% / 1.3%, fp8 4.6% / 7.7%). fp8's e4m3 keeps 3 mantissa bits, int8 about 7.
TOLERANCES = {"int8": (0.02, 0.02), "fp8": (0.07, 0.12)}


@pytest.mark.parametrize("mode", ["int8", "fp8"])
@pytest.mark.parametrize("backward", [True, False])
def test_linear_against_float(mode, backward):
  """Quantized output and gradients within the mode's noise; without quant_backward the
  gradients are float's exactly (the straight-through estimator: float residuals, float
  products)."""
  x = jax.random.normal(jax.random.key(1), (4, 16, 128))
  g = jax.random.normal(jax.random.key(2), (4, 16, 96))
  want = linear_and_grads(x, g)
  got = linear_and_grads(x, g, quant.Quant(mode, backward))
  forward, gradients = TOLERANCES[mode]
  assert 1e-4 < rel(got[0], want[0]) < forward
  for a, b in zip(got[1:], want[1:], strict=True):
    if backward:
      assert 1e-4 < rel(a, b) < gradients
    else:
      np.testing.assert_array_equal(a, b)


def test_none_is_bitwise_the_float_layer():
  """model.quant=none leaves every Linear as it was: x @ W by jnp.dot, the same bits."""
  x = jax.random.normal(jax.random.key(1), (4, 16, 128))
  layer = Linear(128, 96, rngs=nnx.Rngs(0))
  want = jnp.dot(x.reshape(-1, 128), layer.kernel[...]).reshape(4, 16, 96)
  np.testing.assert_array_equal(jax.jit(lambda x: layer(x))(x), jax.jit(lambda x: want)(x))
  model = models.build(tiny("none"))
  assert all(m.quant is None for _, m in nnx.iter_graph(model) if isinstance(m, Linear))


def test_only_the_blocks_projections_are_quantized():
  """Attention's and the MLP's Linears are marked; the output head is not (nor the embedding,
  which is no Linear)."""
  model = models.build(tiny("int8", tie_embeddings=False))
  marked = {
    ".".join(map(str, path))
    for path, m in nnx.iter_graph(model)
    if isinstance(m, Linear) and m.quant is not None
  }
  assert len(marked) == PROJECTIONS and all(".attn." in p or ".mlp." in p for p in marked)
  assert model.lm_head.quant is None


def forward_and_grads(cfg, tokens_BT):
  graphdef, params = nnx.split(models.build(cfg), nnx.Param)

  def loss(params):
    logits = nnx.merge(graphdef, params)(tokens_BT[:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(logits, tokens_BT[:, 1:]).mean()

  return jax.jit(jax.value_and_grad(loss))(params)


@pytest.mark.slow  # several steps compiled: 7-17 s on a cold cache
def test_scanned_equals_unscanned_quantized():
  """model.scan runs the same quantized products (per-layer weight scales inside the body)."""
  x = tokens()
  want_loss, want = forward_and_grads(tiny("int8", num_layers=3), x)
  got_loss, got = forward_and_grads(tiny("int8", num_layers=3, scan=True), x)
  assert float(got_loss) == pytest.approx(float(want_loss), rel=1e-6)
  got = stacking.unstack_layers(got)
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
    assert float(jnp.max(jnp.abs(a - b))) <= 1e-5 * float(jnp.max(jnp.abs(b))) + 1e-12


@pytest.mark.parametrize("mode", ["int8", "fp8"])
def test_model_loss_and_gradients_near_float(mode):
  """The tiny Llama's loss and each gradient near float's (quantization noise, summed over the
  layers: gradients within a few percent of their largest value)."""
  x = tokens(B=8)
  want_loss, want = forward_and_grads(tiny("none"), x)
  got_loss, got = forward_and_grads(tiny(mode), x)
  assert float(got_loss) == pytest.approx(float(want_loss), rel=1e-3)
  limit = {"int8": 0.05, "fp8": 0.2}[mode]
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
    assert rel(a, b) < limit


# A short run of lm/shakespeare-char's smoke form, as tests/common/test_trainer.py's.
BASE = {
  "train.steps": "6",
  "train.checkpoint_every": "2",
  "train.log_every": "1",
  "train.eval_every": "0",
  "optim.schedule": "constant",
  "optim.warmup_steps": "2",
}


def train_losses(workdir) -> dict[int, float]:
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    records = [json.loads(line) for line in f if line.strip()]
  return {r["step"]: r["loss"] for r in records if "split" not in r}


@pytest.mark.slow
def test_trains_with_micro_batches_and_scan_and_resumes_with_any_setting(tmp_path):
  """int8 through the trainer with 2 micro-batches and model.scan (remat=full: each slice's
  gradients added in the layers' backward loop) follows the float run's losses within
  quantization noise; its workdir resumes in float, and from a config saved before the keys
  existed; its checkpoint (float weights) loads into a float model."""
  SMOKE = "lm/shakespeare-char:smoke"
  levers = {"train.micro_batches": "2", "model.scan": "True", "model.remat": "full"}
  float_dir, int8_dir = str(tmp_path / "float"), str(tmp_path / "int8")
  trainer.train(experiments.get_config(SMOKE, {**BASE, **levers}), float_dir, progress=False)
  quantized = {**BASE, **levers, "model.quant": "int8", "train.steps": "4"}
  trainer.train(experiments.get_config(SMOKE, quantized), int8_dir, progress=False)
  path = os.path.join(int8_dir, "config.json")
  with open(path) as f:
    saved = json.load(f)
  del saved["model"]["quant"], saved["model"]["quant_backward"]
  with open(path, "w") as f:
    json.dump(saved, f)
  trainer.train(experiments.get_config(SMOKE, BASE), int8_dir, progress=False)  # steps 5, 6
  got, want = train_losses(int8_dir), train_losses(float_dir)
  assert list(got) == list(want) == [1, 2, 3, 4, 5, 6]
  for step, loss in want.items():
    assert got[step] == pytest.approx(loss, rel=2e-3), step
  _, params, at = weights.restore_params(experiments.get_config(SMOKE, BASE), int8_dir)
  assert at == 6 and all(x.dtype == jnp.float32 for x in jax.tree.leaves(params))


def test_fp8_step_lowers_for_gpu():
  """The GPU recipe (bf16 compute, fp8 products) lowers for CUDA with e4m3 forward products and
  e5m2 x e4m3 gradient products, the pairs cuBLASLt's fp8 matmuls take. Compiled and timed only
  where a GPU is lent."""
  cfg = tiny("fp8")
  # Attention's own GPU lowering (cuDNN) is test_attention.py's.
  cfg.dtype, cfg.attention.impl = "bfloat16", "xla"
  graphdef, params = nnx.eval_shape(lambda: nnx.split(models.build(cfg), nnx.Param))

  def loss(params, tokens_BT):
    logits = nnx.merge(graphdef, params)(tokens_BT[:, :-1]).astype(jnp.float32)
    return optax.softmax_cross_entropy_with_integer_labels(logits, tokens_BT[:, 1:]).mean()

  rows = jax.ShapeDtypeStruct((4, 17), jnp.int32)
  lowered = jax.jit(jax.grad(loss)).trace(params, rows).lower(lowering_platforms=("cuda",))
  got = dots(lowered.as_text())
  for kind in KINDS["fp8"]:
    assert got[kind] == PROJECTIONS, (kind, got)


# zoo plan: int8 products at the chip's int8 peak.


@pytest.mark.parametrize(
  "overrides,passes",
  [
    ({}, 0),
    ({"model.quant": "fp8"}, 0),  # no TPU peak of its own: counted as bf16
    ({"model.quant": "int8"}, 3),
    ({"model.quant": "int8", "model.quant_backward": "False"}, 1),
    ({"model.quant": "int8", "model.scan": "True", "model.remat": "full"}, 4),
  ],
)
def test_plan_counts_the_int8_products(overrides, passes):
  """2 FLOPs per weight of the quantized projections per token, per pass: forward, its
  recomputation under remat=full, the input and weight gradients."""
  cfg = experiments.get_config("lm/shakespeare-char:smoke", overrides)
  D, F, NH, KH = 64, 128, 4 * 16, 2 * 16  # the tiny Llama
  weights = 2 * (D * NH + 2 * D * KH + NH * D + 3 * D * F)
  tokens = cfg.train.batch_size * cfg.data.seq_len
  assert plan.int8_flops(cfg)[0] == 2 * passes * weights * tokens


libtpu = pytest.mark.skipif(importlib.util.find_spec("libtpu") is None, reason="needs libtpu")


@libtpu
@pytest.mark.slow
def test_planned_int8_step_runs_int8_on_tpu():
  """The step XLA:TPU compiles multiplies in int8, and the plan's roofline counts those
  products at v5e's int8 peak, twice its bf16 one."""
  from nnx_zoo.common import mesh, parallel

  topology = plan.parse_topology("v5e:2x2")
  cfg = plan.config("lm/shakespeare-char:smoke", topology, {"mesh.data": "4"})
  cfg.model.quant = "int8"
  layout = parallel.make_layout(mesh.resolve(cfg.mesh, 4), plan.devices(topology))
  hlo = plan._compile(cfg, layout)[1].as_text()
  # XLA:TPU writes each int8 x int8 -> int32 product as a convolution: all three of each
  # projection's (the forward and both gradients).
  int8 = re.findall(r"= s32\[[\d,]+\]\{[^}]*\} (?:convolution|dot)\(", hlo)
  assert len(int8) == 3 * PROJECTIONS
  r = plan.plan(cfg, topology)
  assert r["int8_flops_per_device"] == plan.int8_flops(cfg)[0] / 4
  chip = topology.chip
  compute = (r["compiler_flops_per_device"] + r["kernel_flops_per_device"]) / chip.peak
  compute -= r["int8_flops_per_device"] * (1 / chip.peak - 1 / chip.int8)
  assert r["step_s"] == pytest.approx(
    max(compute, r["bytes_accessed_per_device"] / chip.bandwidth), rel=1e-9
  )


def test_qwix_is_imported_in_the_quantization_modules_only():
  root = pathlib.Path(__file__).resolve().parents[2]
  importers = [
    str(path.relative_to(root))
    for folder in ("common", "zoo", "kernels", "experiments", "bench")
    for path in sorted((root / folder).rglob("*.py"))
    if re.search(r"^\s*(from|import) qwix", path.read_text(), re.M)
  ]
  # quant: int8/fp8 products; qlora: the frozen base stored quantized (model.lora.base_quant)
  assert importers == ["common/nn/qlora.py", "common/nn/quant.py"]
