"""QLoRA keeps its memory promise by default: a compiled step (train, evaluation, decoding) holds
one layer's dequantized kernels at a time, not every layer's (its temporaries from 2 to 4 layers
grow by less than the two extra layers' fp32 kernels would add); the frozen embeddings and head
in bf16 unless float32 is asked for; train.fit=auto's QLoRA levers; and the losses and
adapter gradients those of today's QLoRA (the kernel dequantized, then multiplied by autodiff's
rules) to fp tolerance."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from nnx_zoo.common import device_memory, experiments, models, tasks
from nnx_zoo.common.errors import UserError
from nnx_zoo.common.hub import weights
from nnx_zoo.common.nn import lora, qlora
from nnx_zoo.common.train import fit, optim
from nnx_zoo.common.train import step as steps
from nnx_zoo.zoo.llama import model as llama

D, F = 256, 1024  # wide enough that a layer's kernels outweigh its activations at 1 x 32 tokens


def experiment(layers: int, base_quant: str, **lora_kw):
  cfg = experiments.get_config("lm/shakespeare-char:smoke")
  cfg.model = llama.config(
    "tiny", vocab_size=256, dim=D, num_layers=layers, num_heads=4, num_kv_heads=4, hidden_dim=F
  )
  cfg.model.lora = lora.config(rank=4, targets="attn.q,attn.v", base_quant=base_quant, **lora_kw)
  cfg.data.seq_len, cfg.train.batch_size = 32, 1
  return cfg


def kernel_bytes(layers: int) -> int:
  """fp32 bytes of `layers` layers' block kernels (q, k, v, o; gate, up, down)."""
  return layers * 4 * (4 * D * D + 3 * D * F)


def step_temp(cfg) -> int:
  tx = optim.optimizer(cfg.optim, 10)
  return device_memory.program_bytes(fit.compile_step(cfg, tx=tx, layout=None)[1])["temp"]


def test_a_qlora_train_step_holds_one_layers_dequantized_kernels():
  """The step as configured (unscanned, no remat: the QLoRA levers are train.fit's, not
  compile_step's): from 2 to 4 layers its temporaries grow by less than LoRA's do plus half the
  two extra layers' fp32 kernels (what holding every dequantized kernel adds: today's QLoRA
  grew by LoRA's growth plus all of it)."""
  grow = {q: step_temp(experiment(4, q)) - step_temp(experiment(2, q)) for q in ("", "nf4")}
  assert grow["nf4"] < grow[""] + kernel_bytes(2) / 2, (grow, kernel_bytes(2))


def forward_temp(layers: int, *, cache: bool) -> int:
  cfg = experiment(layers, "nf4").model
  graphdef, state = nnx.split(models.abstract(cfg))
  tokens = jax.ShapeDtypeStruct((1, 32), jnp.int32)

  def forward(state, tokens):
    model = nnx.merge(graphdef, state)
    if not cache:
      return model(tokens)
    return model(tokens, cache=model.init_cache(1, 32))

  return jax.jit(forward).lower(state, tokens).compile().memory_analysis().temp_size_in_bytes


@pytest.mark.parametrize("cache", [False, True], ids=["evaluation", "decoding"])
def test_a_qlora_forward_holds_one_layers_dequantized_kernels(cache):
  """Evaluation's forward and decoding's (with a KV cache, layer by layer as the engine runs
  it) too: 2 to 4 layers add less than half the two layers' fp32 kernels."""
  grow = forward_temp(4, cache=cache) - forward_temp(2, cache=cache)
  assert grow < kernel_bytes(2) / 2, (grow, kernel_bytes(2))


@pytest.mark.parametrize("scan", [False, True], ids=["unscanned", "scanned"])
def test_a_fresh_qlora_init_quantizes_each_layer_as_it_is_built(monkeypatch, scan):
  """The stack quantizes a layer's kernels as soon as it is built, so the fresh init (`zoo run`
  without init_from builds a QLoRA model op by op) holds one layer's fp32 kernels at a time,
  where building first and quantizing after held every layer's; the values are those of the
  whole fp32 model quantized afterwards (today's QLoRA init), bit for bit."""
  cfg, plain_cfg = experiment(3, "nf4").model, experiment(3, "").model
  cfg.scan = plain_cfg.scan = scan
  shapes = {(D, D), (D, F), (F, D)}
  held = []  # at each quantization: the bytes of the fp32 kernels alive

  def quantize(w, *, kind, _quantize=qlora.quantize):
    live = [a for a in jax.live_arrays() if a.dtype == jnp.float32 and a.shape[-2:] in shapes]
    held.append(sum(a.nbytes for a in live))
    return _quantize(w, kind=kind)

  monkeypatch.setattr(qlora, "quantize", quantize)
  got = nnx.to_flat_state(nnx.state(models.build(cfg, seed=3)))
  one_layer = kernel_bytes(1) + 256 * D * 4  # and the embedding table (vocab 256 x D), built first
  assert len(held) == 3 * 7 and max(held) <= one_layer, (max(held), one_layer)
  held.clear()
  # Today's order: the whole model built in fp32 (its adapters too), then quantized.
  want = nnx.to_flat_state(nnx.state(qlora.apply(models.build(plain_cfg, seed=3), cfg.lora)))
  assert max(held) >= kernel_bytes(3) - kernel_bytes(1)  # what the test would catch
  assert [k for k, _ in got] == [k for k, _ in want]
  for (k, a), (_, b) in zip(got, want, strict=True):
    np.testing.assert_array_equal(np.asarray(a[...]), np.asarray(b[...]), err_msg=str(k))


def test_frozen_embeddings_and_head_are_bf16_unless_asked():
  def dtypes(**lora_kw):
    cfg = llama.config("tiny", num_kv_heads=2)
    cfg.lora = lora.config(rank=4, targets="attn.*,mlp.*", **lora_kw)
    flat = nnx.to_flat_state(nnx.state(models.abstract(cfg), nnx.Param))
    return {".".join(map(str, k)): v.dtype for k, v in flat if k[0] != "blocks"}

  bf16, f32 = jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32)
  got = dtypes(base_quant="nf4")
  assert (got["embed.embedding"], got["lm_head.kernel"], got["norm.scale"]) == (bf16, bf16, f32)
  got = dtypes(base_quant="nf4", frozen_dtype="float32")
  assert (got["embed.embedding"], got["lm_head.kernel"]) == (f32, f32)
  got = dtypes(base_quant="nf4", train="lm_head.*")  # a trained head stays in param_dtype
  assert (got["embed.embedding"], got["lm_head.kernel"]) == (bf16, f32)
  assert set(dtypes(base_quant="").values()) == {f32}  # LoRA as before
  with pytest.raises(UserError, match="frozen_dtype 'int2'"):
    dtypes(base_quant="nf4", frozen_dtype="int2")
  # The merge (export, init_from) gives the plain model in param_dtype.
  cfg = llama.config("tiny", num_kv_heads=2)
  cfg.lora = lora.config(rank=4, targets="attn.*,mlp.*", base_quant="nf4")
  merged_cfg, params = weights.merge_lora(cfg, nnx.state(models.build(cfg), nnx.Param))
  assert {v.dtype for _, v in nnx.to_flat_state(params)} == {f32}


def test_qlora_levers_under_train_fit_auto():
  cfg = experiment(2, "nf4")
  cfg.model.vocab_size = 32768  # a vocabulary the chunked loss is for
  assert fit.qlora_levers(cfg) == {
    "model.remat": "full",
    "model.scan": True,
    "train.loss_chunk": fit.QLORA_LOSS_CHUNK,
  }
  pulled = fit.with_qlora_levers(cfg)
  assert pulled.model.remat == "full" and pulled.model.scan and pulled.train.loss_chunk
  assert fit.parse_fitted(pulled.train.fitted)["model.remat"] == "full"
  assert fit.qlora_levers(pulled) == {}  # a resumed run takes the same step
  cfg.train.fit = "off"
  assert fit.qlora_levers(cfg) == {}
  assert fit.qlora_levers(experiment(2, "")) == {}  # LoRA as configured


def reference_matmul(x, codes, scale, *, kind, dtype, q=None):
  """Today's QLoRA product: the kernel dequantized, then multiplied (autodiff's backward)."""
  return jnp.dot(x, qlora.dequantize(codes, scale, kind=kind, dtype=dtype))


@pytest.mark.parametrize("frozen_dtype", ["float32", ""])
def test_losses_and_gradients_are_todays_qlora(monkeypatch, frozen_dtype):
  """Three steps: the losses and the adapters equal those of the reference product to fp
  tolerance (with the embeddings and head in float32 as today's; in bf16, the default, to
  bf16's)."""
  cfg = experiments.get_config("lm/shakespeare-char:smoke")
  cfg.model.lora = lora.config(
    rank=4, targets="attn.*,mlp.*", base_quant="nf4", frozen_dtype=frozen_dtype
  )
  cfg.optim.warmup_steps = 0
  tx = optim.optimizer(cfg.optim, 10)
  task, trainable = tasks.get("language_model"), lora.trainable(cfg.model)
  tokens = jnp.asarray(np.random.default_rng(0).integers(0, 256, (4, 33)), jnp.int32)
  batch = {"tokens": tokens, "segment_ids": jnp.ones_like(tokens)}

  def run():
    graphdef, state = steps.init_state(cfg, tx)
    step = jax.jit(
      lambda s, b: steps.train_step(s, b, graphdef=graphdef, task=task, tx=tx, trainable=trainable)
    )
    losses = []
    for _ in range(3):
      state, metrics = step(state, batch)
      losses.append(float(metrics["loss"]))
    adapters = nnx.state(nnx.merge(graphdef, state.params), lora.LoRAParam)
    return np.array(losses), [np.asarray(x) for x in jax.tree.leaves(adapters)]

  losses, adapters = run()
  with monkeypatch.context() as m:
    m.setattr(qlora, "matmul", reference_matmul)
    want_losses, want_adapters = run()
  np.testing.assert_allclose(losses, want_losses, rtol=1e-5)
  for got, want in zip(adapters, want_adapters, strict=True):
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-6)
  if frozen_dtype == "":  # bf16 tables against today's fp32 ones: bf16's rounding, no more
    cfg.model.lora.frozen_dtype = "float32"
    with monkeypatch.context() as m:
      m.setattr(qlora, "matmul", reference_matmul)
      fp32_losses, _ = run()
    np.testing.assert_allclose(losses, fp32_losses, rtol=1e-2)
