"""The Llama family's config.json mapping, both ways, on the fields each model type has: what the
parity tests in tests/common/test_hub.py do not reach with one tiny model each."""

import pytest

from nnx_zoo.common.errors import UserError
from nnx_zoo.zoo.llama import model as llama
from nnx_zoo.zoo.llama import params

BASE = dict(
  vocab_size=128,
  hidden_size=64,
  num_hidden_layers=2,
  num_attention_heads=4,
  num_key_value_heads=2,
  intermediate_size=96,
)


def from_hf(model_type, **fields):
  return params.config_from_hf({"model_type": model_type, **BASE, **fields})


def test_transformers_4_rope_fields():
  """4.x writes rope_theta and rope_scaling (with `type` in older files); 5.x rope_parameters."""
  old = from_hf("llama", rope_theta=5e5, rope_scaling={"type": "linear", "factor": 2.0})
  new = from_hf("llama", rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 5e5})
  assert old.position.to_dict() == new.position.to_dict()
  assert old.position.theta == 5e5 and old.position.scaling.to_dict() == {
    "kind": "linear",
    "factor": 2.0,
  }


def test_llama3_rope_takes_original_length_from_max_position_embeddings():
  rope = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}
  cfg = from_hf("llama", max_position_embeddings=8192, rope_scaling=rope)
  assert cfg.position.scaling.original_max_len == 8192


@pytest.mark.parametrize(
  "fields,match",
  [
    (dict(rope_scaling={"rope_type": "dynamic", "factor": 2.0}), "RoPE type 'dynamic'"),
    (dict(rope_scaling={"rope_type": "yarn", "factor": 2.0, "attention_factor": 2.0}), "fields"),
    (dict(rope_parameters={"rope_type": "default", "partial_rotary_factor": 0.5}), "partial"),
    (dict(hidden_act="gelu"), "hidden_act"),
  ],
)
def test_unsupported_fields_are_named(fields, match):
  with pytest.raises(UserError, match=match):
    from_hf("llama", **fields)


def test_windows():
  assert from_hf("mistral", sliding_window=None).attention.window == 0  # Mistral v0.2+
  assert from_hf("mistral").attention.window == 4096  # MistralConfig's default
  assert from_hf("qwen2", use_sliding_window=False, sliding_window=16).attention.window == 0
  every = dict(use_sliding_window=True, sliding_window=16, max_window_layers=0)
  assert from_hf("qwen2", **every).attention.window == 16
  with pytest.raises(UserError, match="some layers only"):
    from_hf("qwen3", use_sliding_window=True, sliding_window=16, max_window_layers=1)


def test_biases_by_model_type():
  qwen2 = from_hf("qwen2")
  assert qwen2.attention.qkv_bias and not qwen2.attention.out_bias
  llama_b = from_hf("llama", attention_bias=True, mlp_bias=True)
  assert llama_b.attention.qkv_bias and llama_b.attention.out_bias and llama_b.mlp.use_bias
  qwen3 = from_hf("qwen3")
  assert qwen3.attention.qk_norm == "rms" and qwen3.attention.head_dim == 128  # Qwen3's default


@pytest.mark.parametrize(
  "overrides,model_type",
  [
    ({}, "llama"),
    (dict(window=8), "mistral"),
    (dict(qkv_bias=True), "qwen2"),
    (dict(qk_norm="rms"), "qwen3"),
    (dict(qkv_bias=True, out_bias=True, mlp_bias=True), "llama"),
  ],
)
def test_export_picks_the_class_with_these_settings(overrides, model_type):
  hf = params.config_to_hf(llama.config("tiny", **overrides))
  assert hf["model_type"] == model_type
  assert params.config_from_hf(hf).to_dict() == llama.config("tiny", **overrides).to_dict()


def test_export_keeps_the_source_class_when_it_fits():
  cfg = llama.config("tiny")  # a Mistral without a window fits Llama and Mistral alike
  assert params.config_to_hf(cfg, "mistral")["architectures"] == ["MistralForCausalLM"]
  assert params.config_to_hf(cfg, "qwen2")["model_type"] == "llama"  # Qwen2 needs q/k/v bias


def test_export_refuses_what_no_class_has():
  with pytest.raises(UserError, match="No HF Llama-family model"):
    params.config_to_hf(llama.config("tiny", qkv_bias=True, out_bias=True, window=8))
