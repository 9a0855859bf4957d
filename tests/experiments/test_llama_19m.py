"""bench/llama-19m is exactly the Hugging Face Llama its docstring names."""

import pytest

from common import experiments, models

HF_CONFIG = dict(
  vocab_size=32000,
  hidden_size=256,
  intermediate_size=768,
  num_hidden_layers=4,
  num_attention_heads=8,
  num_key_value_heads=2,
  rms_norm_eps=1e-6,
  rope_theta=1e4,
  tie_word_embeddings=False,
)


def test_parameter_count():
  assert models.num_params(experiments.get_config("bench/llama-19m").model) == 19_400_960


def test_same_model_as_hf_config():
  """The config from HF's own LlamaConfig (common/hub.py's reading of config.json) is ours."""
  transformers = pytest.importorskip("transformers")
  from zoo.llama import params

  hf = transformers.LlamaConfig(**HF_CONFIG).to_dict()
  ours = experiments.get_config("bench/llama-19m").model
  theirs = params.config_from_hf(hf, set())
  assert theirs.to_dict() == ours.to_dict()
  torch = pytest.importorskip("torch")
  with torch.device("meta"):  # shapes only, nothing allocated
    hf_model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**HF_CONFIG))
  assert sum(p.numel() for p in hf_model.parameters()) == models.num_params(ours)
