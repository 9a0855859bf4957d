"""QLoRA (`model.lora.base_quant`): the stored base within one quantization step of the source
(against a numpy formula of the scales), the model computing with exactly the dequantized
kernels, gradients reaching the adapters only, the merge and the export, exact resume, a GGUF
file of K-quants read straight into nf4 equal to reading it in fp32 and then quantizing, and
every bad input as one line, exit 2, nothing written."""

import contextlib
import dataclasses
import functools
import io
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from nnx_zoo.common import cli, experiments, models, tasks
from nnx_zoo.common.errors import UserError
from nnx_zoo.common.hub import gguf as gguf_lib
from nnx_zoo.common.hub import weights
from nnx_zoo.common.nn import lora, qlora, stacking
from nnx_zoo.common.train import optim, trainer
from nnx_zoo.common.train import step as steps
from nnx_zoo.zoo.llama import model as llama

KINDS = ("int8", "int4", "nf4")
# QLoRA's NF4 code book (Dettmers et al. 2023, appendix E), written out as the reference.
NF4 = np.array(
  [-1.0, -0.6961928, -0.5250731, -0.3949175, -0.2844414, -0.1847734, -0.0910500, 0.0]
  + [0.0795803, 0.1609302, 0.2461123, 0.3379152, 0.4407098, 0.5626170, 0.7229568, 1.0]
)
BOUND = {"int8": 127.5, "int4": 7.5, "nf4": 1.0}  # |w| / scale at a block's absmax
TOKENS = jnp.asarray(np.random.default_rng(0).integers(0, 256, (2, 16)), jnp.int32)


def llama_cfg(kind="nf4", **kw):
  cfg = llama.config("tiny", num_kv_heads=2, **kw)
  cfg.lora = lora.config(rank=4, targets="attn.q,attn.v,mlp.*", base_quant=kind)
  return cfg


@pytest.mark.parametrize("kind", KINDS)
def test_dequantized_base_is_within_one_step_of_the_source(kind):
  """Scales = each 64-row block's absmax per column / the type's bound (numpy), and every
  dequantized weight within one step (int: one scale; nf4: the code book's widest gap) of w."""
  w = np.random.default_rng(1).normal(size=(2, 128, 48)).astype(np.float32)  # stacked [L, in, out]
  codes, scale = qlora.quantize(jnp.asarray(w), kind=kind)
  absmax = np.abs(w.reshape(2, 2, 64, 48)).max(axis=2)
  np.testing.assert_allclose(np.asarray(scale), absmax / BOUND[kind], rtol=1e-6)
  assert codes.dtype == (jnp.int8 if kind == "int8" else jnp.uint8)
  assert codes.shape == ((2, 128, 48) if kind == "int8" else (2, 64, 48))  # 4-bit: two a byte
  back = np.asarray(qlora.dequantize(codes, scale, kind=kind, dtype=jnp.float32))
  s = np.repeat(np.asarray(scale), 64, axis=1)
  gap = np.diff(NF4).max() if kind == "nf4" else 1.0
  assert (np.abs(back - w) <= s * gap * (1 + 1e-4)).all()
  assert (np.abs(back - w) <= s * 0.5 * gap * (1 + 1e-4)).all()  # rounded to the nearest code
  if kind == "nf4":  # every value a code of the book times its block's scale
    ratio = back / s
    assert np.abs(ratio[..., None] - NF4).min(-1).max() < 1e-6
  else:
    np.testing.assert_allclose(back / s, np.round(back / s), atol=1e-5)


def test_the_model_computes_with_the_dequantized_kernels_and_nf4_base_bytes():
  """A QLoRA model's logits = those of the plain model holding its dequantized kernels; the
  nf4 base takes <= 0.16x of its fp32 bytes (0.14: 4-bit codes, fp32 scales per 64)."""
  model = models.build(llama_cfg("nf4"))
  params = nnx.state(model, nnx.Param)
  quantized, fp32 = qlora.base_bytes(params)
  assert quantized / fp32 <= 0.16, quantized / fp32
  # Counted as weights, not bytes.
  assert models.num_params(llama_cfg("nf4")) == models.num_params(llama_cfg(""))
  plain = models.build(llama_cfg(""))
  nodes = dict(nnx.iter_graph(plain))
  for path, q in nnx.iter_graph(model):
    if getattr(q, "base_quant", ""):
      deq = qlora.dequantize(q.kernel[...], q.kernel_scale[...], kind="nf4", dtype=jnp.float32)
      nodes[path].kernel[...] = deq
  # The frozen embedding and head are held in bf16 (model.lora.frozen_dtype): the plain model
  # gets their values.
  for name in ("embed.embedding", "lm_head.kernel"):
    mine, theirs = (functools.reduce(getattr, name.split("."), m) for m in (model, plain))
    assert mine[...].dtype == jnp.bfloat16, name
    theirs[...] = mine[...].astype(jnp.float32)
  forward = nnx.jit(lambda m, t: m(t))
  np.testing.assert_allclose(
    np.asarray(forward(model, TOKENS)), np.asarray(forward(plain, TOKENS)), rtol=1e-5, atol=1e-5
  )


def test_a_scanned_stack_is_quantized_and_computes_as_the_unscanned_one():
  """With model.scan the blocks are stored stacked (`stacked`, `rest`): their kernels are
  quantized as the unscanned blocks' are, and the model computes the same logits from the
  same weights."""
  plain = models.build(llama_cfg("nf4"))
  cfg = llama_cfg("nf4")
  cfg.scan = True
  scanned = models.build(cfg)
  params = nnx.state(plain, nnx.Param)
  assert qlora.base_bytes(nnx.state(scanned, nnx.Param)) == qlora.base_bytes(params)
  nnx.update(scanned, stacking.match_layers(params, nnx.state(scanned, nnx.Param)))
  forward = nnx.jit(lambda m, t: m(t))
  np.testing.assert_allclose(
    np.asarray(forward(scanned, TOKENS)), np.asarray(forward(plain, TOKENS)), rtol=1e-5, atol=1e-5
  )


def test_gradients_reach_the_adapters_only():
  """A step changes the adapters alone; the optimizer holds moments for them alone; the base
  stays its quantized codes."""
  cfg = experiments.get_config("lm/shakespeare-char:smoke")
  cfg.model.lora = lora.config(rank=4, targets="attn.q,attn.v", base_quant="nf4")
  cfg.optim.warmup_steps = 0
  tx = optim.optimizer(cfg.optim, 10)
  graphdef, state = steps.init_state(cfg, tx)
  trainable = lora.trainable(cfg.model)
  adapters = {k for k, v in nnx.to_flat_state(state.params) if isinstance(v, lora.LoRAParam)}
  assert any(isinstance(v, qlora.QuantizedBase) for _, v in nnx.to_flat_state(state.params))
  moments = [x for x in jax.tree.leaves(state.opt_state) if getattr(x, "ndim", 0) > 0]
  trained_part, _ = nnx.split_state(state.params, trainable, ...)
  assert {k for k, _ in nnx.to_flat_state(trained_part)} == adapters
  assert sum(x.size for x in moments) == 2 * sum(x.size for x in jax.tree.leaves(trained_part))
  step = jax.jit(
    lambda s, b: steps.train_step(
      s, b, graphdef=graphdef, task=tasks.get("language_model"), tx=tx, trainable=trainable
    )
  )
  tokens = jnp.asarray(np.random.default_rng(0).integers(0, 256, (4, 33)), jnp.int32)
  before = {k: np.asarray(v[...]) for k, v in nnx.to_flat_state(state.params)}
  new, metrics = step(state, {"tokens": tokens, "segment_ids": jnp.ones_like(tokens)})
  assert np.isfinite(float(metrics["loss"]))
  changed = {
    k for k, v in nnx.to_flat_state(new.params) if not np.array_equal(np.asarray(v[...]), before[k])
  }
  assert changed == {k for k in adapters if k[-1] == "b"} | {k for k in adapters if k[-1] == "a"}


def test_merge_folds_the_adapters_into_the_dequantized_base():
  """`merge_lora` of a QLoRA model: a plain fp32 model (no adapters, no codes) with its
  logits."""
  cfg = llama_cfg("int4")
  model = models.build(cfg)
  for path, x in nnx.to_flat_state(nnx.state(model, lora.LoRAParam)):
    if path[-1] == "b":
      x[...] = jax.random.normal(jax.random.key(len(path)), x[...].shape) * 0.1
  want = np.asarray(nnx.jit(lambda m, t: m(t))(model, TOKENS))
  merged_cfg, params = weights.merge_lora(cfg, nnx.state(model, nnx.Param))
  assert merged_cfg.lora.rank == 0 and merged_cfg.lora.base_quant == ""
  assert {type(v) for _, v in nnx.to_flat_state(params)} == {nnx.Param}
  merged = nnx.merge(nnx.graphdef(models.abstract(merged_cfg)), params)
  got = np.asarray(nnx.jit(lambda m, t: m(t))(merged, TOKENS))
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


# A tiny llama whose every block input dim is a multiple of 256 (a K-quant's super-block).
WIDE = dict(dim=256, hidden_dim=512, num_layers=1, num_heads=4, num_kv_heads=2, vocab_size=256)


def k_quant(x: np.ndarray, qtype) -> np.ndarray:
  """Random but well-formed blocks of `qtype` (Q4_K, Q6_K) for a matrix of x's shape: the gguf
  library dequantizes K-quants but does not write them."""
  import gguf

  block, size = gguf.GGML_QUANT_SIZES[qtype]
  rng = np.random.default_rng(x.shape[0])
  raw = rng.integers(0, 256, (x.shape[0], x.shape[1] // block, size), dtype=np.uint8)
  d = np.full((x.shape[0], x.shape[1] // block), 1e-3, np.float16).view(np.uint8)
  d = d.reshape(x.shape[0], -1, 2)
  if qtype == gguf.GGMLQuantizationType.Q4_K:  # d, dmin at the start
    raw[..., 0:2], raw[..., 2:4] = d, d
  else:  # Q6_K: d at the end
    raw[..., -2:] = d
  return raw.reshape(x.shape[0], -1)


def test_gguf_k_quants_straight_into_nf4_equal_fp32_then_quantized(tmp_path, monkeypatch):
  import gguf

  Q = gguf.GGMLQuantizationType
  cfg = llama.config("tiny", **WIDE)
  model = models.build(cfg)
  weights.write_converted(
    str(tmp_path / "zoo"),
    cfg,
    nnx.state(model, nnx.Param),
    source={},
    files=[],
    add_files=lambda tmp: None,
  )

  def quantized(x, kind):
    x = np.ascontiguousarray(x, np.float32)
    if x.ndim < 2:
      return x, None
    qtype = Q.Q6_K if x.shape[0] in (64, 256) else Q.Q4_K  # the llama.cpp mix: some of each
    return k_quant(x, qtype), qtype

  monkeypatch.setattr(gguf_lib, "_quantized", quantized)
  path = str(tmp_path / "k.gguf")
  weights.export_gguf(str(tmp_path / "zoo"), path, type="q8_0")
  types = {t.tensor_type.name for t in gguf.GGUFReader(path).tensors}
  assert {"Q4_K", "Q6_K"} <= types

  qcfg = llama.config("tiny", **WIDE)
  qcfg.lora = lora.config(rank=4, base_quant="nf4")
  want = dict(nnx.to_flat_state(stacking.unstack_layers(nnx.state(models.abstract(qcfg)))))
  quantize = qlora.quantizer(want, "nf4")
  assert len(quantize.targets) == 7  # q k v o gate up down
  _, straight, _ = gguf_lib.read_gguf(path, quantize=quantize)
  _, fp32, _ = gguf_lib.read_gguf(path)
  after = nnx.from_flat_state([kv for k, v in nnx.to_flat_state(fp32) for kv in quantize(k, v)])
  a, b = dict(nnx.to_flat_state(straight)), dict(nnx.to_flat_state(after))
  assert a.keys() == b.keys() and ("blocks", 0, "mlp", "down", "kernel_scale") in a
  for k in a:
    assert type(a[k]) is type(b[k]), k
    np.testing.assert_array_equal(np.asarray(a[k][...]), np.asarray(b[k][...]), err_msg=str(k))
  assert isinstance(a[("blocks", 0, "attn", "q", "kernel")], qlora.QuantizedBase)
  assert a[("embed", "embedding")][...].dtype == jnp.bfloat16  # model.lora.frozen_dtype


def test_a_zoo_checkpoint_read_a_kernel_at_a_time(tmp_path):
  """`init_params` of a QLoRA experiment from a plain zoo checkpoint: each kernel restored
  alone and quantized = the checkpoint's weights quantized."""
  cfg = llama_cfg("")
  cfg.lora.rank = 0
  params = nnx.state(models.build(cfg), nnx.Param)
  out = str(tmp_path / "zoo")
  weights.write_converted(out, cfg, params, source={}, files=[], add_files=lambda tmp: None)
  qcfg = llama_cfg("int8")
  want = dict(nnx.to_flat_state(nnx.state(models.abstract(qcfg), nnx.Param)))
  quantize = qlora.quantizer(want, "int8")
  _, got = weights.read(out, quantize=quantize)
  ref = [kv for k, v in nnx.to_flat_state(params) for kv in quantize(k, v)]
  got = dict(nnx.to_flat_state(got))
  assert got.keys() == dict(ref).keys()
  for k, v in ref:
    np.testing.assert_array_equal(np.asarray(got[k][...]), np.asarray(v[...]), err_msg=str(k))


# Runs: resume and export


BASE = {
  "model.lora.rank": "4",
  "model.lora.targets": "attn.*,mlp.*",
  "model.lora.base_quant": "nf4",
  "train.checkpoint_every": "2",
  "train.log_every": "1",
  "train.eval_every": "0",
  "optim.schedule": "constant",
  "optim.warmup_steps": "1",
  "optim.lr": "1e-2",
}


def smoke(steps_: int):
  return experiments.get_config("lm/shakespeare-char:smoke", {**BASE, "train.steps": str(steps_)})


def losses(workdir) -> dict:
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    records = [json.loads(line) for line in f if line.strip()]
  return {r["step"]: r["loss"] for r in records if "split" not in r}


@pytest.mark.slow
def test_qlora_run_resumes_exactly_and_exports_merged(tmp_path):
  """4 steps straight = 2, then resumed to 4 (losses and params bitwise); init_from it reads the
  merged model; `zoo export hf` of it loads in transformers with the QLoRA model's logits (the
  adapters folded into the dequantized base)."""
  import torch
  import transformers

  straight, resumed = str(tmp_path / "straight"), str(tmp_path / "resumed")
  trainer.train(smoke(4), straight, progress=False)
  trainer.train(smoke(2), resumed, progress=False)
  trainer.train(smoke(4), resumed, progress=False)
  assert losses(straight) == losses(resumed) and len(losses(straight)) == 4
  graphdef, a, _ = weights.restore_params(smoke(4), straight)
  _, b, _ = weights.restore_params(smoke(4), resumed)
  a_flat, b_flat = dict(nnx.to_flat_state(a)), dict(nnx.to_flat_state(b))
  assert a_flat.keys() == b_flat.keys()
  for k in a_flat:
    np.testing.assert_array_equal(np.asarray(a_flat[k][...]), np.asarray(b_flat[k][...]))
  assert any(isinstance(v, qlora.QuantizedBase) for v in a_flat.values())  # checkpointed codes

  # init_from a QLoRA workdir: its adapters merged into the dequantized base, a plain model;
  # a QLoRA run from it quantizes that merged base again.
  merged_cfg, merged = weights.read(straight)
  assert merged_cfg.lora.rank == 0 and merged_cfg.lora.base_quant == ""
  assert not any(isinstance(v, qlora.QuantizedBase) for _, v in nnx.to_flat_state(merged))
  again = smoke(4)
  again.init_from, again.model.lora.base_quant = straight, "int8"
  loaded = weights.init_params(again, nnx.state(models.abstract(again.model), nnx.Param))
  kernel = ("blocks", 0, "attn", "q", "kernel")
  # The run trained scanned (train.fit's QLoRA levers): its checkpoint is stacked.
  merged = stacking.unstack_layers(merged)
  codes, _ = qlora.quantize(dict(nnx.to_flat_state(merged))[kernel][...], kind="int8")
  got = dict(nnx.to_flat_state(loaded))[kernel][...]
  np.testing.assert_array_equal(np.asarray(got), np.asarray(codes))

  weights.export_hf(straight, str(tmp_path / "hf"))
  back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
  ids = np.random.default_rng(0).integers(0, 60, (2, 12))
  with torch.no_grad():
    ref = back(torch.tensor(ids)).logits.numpy()
  ours = nnx.merge(graphdef, a)
  got = np.asarray(nnx.jit(lambda m, t: m(t))(ours, jnp.asarray(ids)))
  np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-4)


# Bad input: one line, exit 2, nothing written


def run_cli(argv) -> tuple[int, str]:
  out, err = io.StringIO(), io.StringIO()
  with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
    code = cli.main([str(a) for a in argv])
  return code, err.getvalue()


@pytest.mark.parametrize(
  "overrides, match",
  [
    (["model.lora.base_quant=nf4"], r"base_quant='nf4' .* set model\.lora\.rank > 0"),
    (["model.lora.rank=4", "model.lora.base_quant=fp4"], r"'fp4'.*'', 'int8', 'int4', 'nf4'"),
    (
      ["model.lora.rank=4", "model.lora.base_quant=int4", "model.mlp.hidden_dim=96"],
      r"blocks\.0\.mlp\.down\.kernel \[96, 64\] has 96",
    ),
  ],
)
def test_bad_input_is_one_line_exit_2_nothing_written(tmp_path, overrides, match):
  import re

  workdir = tmp_path / "run"
  argv = ["run", "lm/shakespeare-char:smoke", "--workdir", workdir]
  code, err = run_cli(argv + [f"--config.{o}" for o in overrides])
  lines = [line for line in err.splitlines() if line.strip()]
  assert code == 2, err
  assert len(lines) == 1 and re.search(match, lines[0]), err
  assert not workdir.exists()


def test_bad_input_in_the_layers():
  cfg = llama_cfg("int8")
  cfg.lora.rank = 0
  with pytest.raises(UserError, match="rank > 0"):
    models.build(cfg)
  with pytest.raises(UserError, match=r"blocks\.0\.attn\.k\.kernel \[32, 16\] has 32"):
    models.build(llama_cfg("nf4", dim=32, num_heads=4))


@pytest.mark.slow
@pytest.mark.parametrize(
  "over",
  [
    {"model.lora.rank": "4", "train.ema": "0.9"},
    {"model.lora.rank": "4", "model.scan": "True", "init_reinit": "head.*"},
    {"model.lora.rank": "4", "model.lora.base_quant": "nf4"},
    {"model.lora.rank": "4", "model.lora.base_quant": "nf4", "model.scan": "True"},
  ],
)
def test_start_from_init_from_is_the_fresh_state_with_its_weights_in_place(tmp_path, over):
  """`trainer.start_state` computes only what init_from does not give (no fresh base, no random
  fp32 QLoRA kernels), and starts where a whole fresh state with init_from's weights put in
  place (`weights.with_init_from`, the reference) does, bit for bit."""
  cfg = experiments.get_config("lm/continue:smoke", {"init_from": "tiny:llama", **over})
  tx = optim.optimizer(cfg.optim, cfg.train.steps)
  _, shardings = steps.placed_abstract_state(cfg, tx, None)
  want = jax.jit(lambda: steps.init_state(cfg, tx)[1], out_shardings=shardings)()
  loaded = weights.init_params(cfg, nnx.state(models.abstract(cfg.model), nnx.Param))
  params = weights.with_init_from(loaded, want.params, shardings.params)
  ema = None if want.ema is None else params
  want = dataclasses.replace(want, params=params, ema=ema)
  got, _ = trainer.start_state(cfg, tx, None, str(tmp_path))
  (got_leaves, got_tree), (want_leaves, want_tree) = map(jax.tree.flatten, (got, want))
  assert got_tree == want_tree
  for x, y in zip(got_leaves, want_leaves, strict=True):
    assert x.dtype == y.dtype
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
