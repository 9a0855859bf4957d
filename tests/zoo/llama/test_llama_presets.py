"""Every Llama preset builds abstractly and has its published parameter count."""

import pytest
from flax import nnx

from nnx_zoo.common import models
from nnx_zoo.zoo.llama import model as llama

# Published counts: the sum of the tensor sizes in each model's safetensors on the Hugging Face hub.
PUBLISHED = {
  "llama2-7b": 6_738_415_616,  # meta-llama/Llama-2-7b-hf
  "llama3-8b": 8_030_261_248,  # meta-llama/Meta-Llama-3-8B
  "llama3.2-1b": 1_235_814_400,  # meta-llama/Llama-3.2-1B (tied embeddings)
  "mistral-7b": 7_241_732_096,  # mistralai/Mistral-7B-v0.1
  "qwen2.5-0.5b": 494_032_768,  # Qwen/Qwen2.5-0.5B (QKV bias, tied)
  "qwen3-0.6b": 596_049_920,  # Qwen/Qwen3-0.6B (QK-norm, tied)
  # Mixtures of experts: transformers' counts (MixtralForCausalLM, Qwen3MoeForCausalLM).
  "mixtral-8x7b": 46_702_792_704,  # mistralai/Mixtral-8x7B-v0.1
  "qwen3-30b-a3b": 30_532_122_624,  # Qwen/Qwen3-30B-A3B
}
# Parameters one token computes with (the experts count top_k / num_experts).
ACTIVE = {"mixtral-8x7b": 12_879_925_248, "qwen3-30b-a3b": 3_353_032_704}


@pytest.mark.parametrize("preset", sorted(PUBLISHED))
def test_preset_parameter_count(preset):
  assert models.num_params(llama.config(preset)) == PUBLISHED[preset]


@pytest.mark.parametrize("preset", sorted(ACTIVE))
def test_moe_preset_active_parameters(preset):
  assert models.num_active_params(llama.config(preset)) == ACTIVE[preset]


def test_every_preset_is_checked_or_tiny():
  assert set(llama.PRESETS) - set(PUBLISHED) == {"tiny"}


def test_every_config_field_changes_the_model():
  """A field nothing reads would leave the parameter tree unchanged: each structural field must
  change the shapes (the runtime-only fields are covered by the layer tests)."""

  def shapes(cfg):
    return {k: v.shape for k, v in nnx.to_flat_state(nnx.state(models.abstract(cfg)))}

  ref = shapes(llama.config("tiny"))
  for field, value in [
    ("vocab_size", 300),
    ("dim", 32),
    ("num_layers", 3),
    ("num_heads", 8),
    ("num_kv_heads", 1),
    ("hidden_dim", 96),
    ("qkv_bias", True),
    ("qk_norm", "rms"),
    ("tie_embeddings", True),
  ]:
    assert shapes(llama.config("tiny", **{field: value})) != ref, field
