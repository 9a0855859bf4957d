"""bench/llama-19m is exactly the Hugging Face Llama its docstring names."""

import pytest

from nnx_zoo.common import experiments, models
from nnx_zoo.experiments.bench.llama_19m import HF_CONFIG


def test_parameter_count():
  assert models.num_params(experiments.get_config("bench/llama-19m").model) == 19_400_960


def test_same_model_as_hf_config():
  """The config from HF's own LlamaConfig (common/hub.py's reading of config.json) is ours."""
  transformers = pytest.importorskip("transformers")
  from nnx_zoo.zoo.llama import params

  hf = transformers.LlamaConfig(**HF_CONFIG).to_dict()
  ours = experiments.get_config("bench/llama-19m").model
  theirs = params.config_from_hf(hf, set())
  assert theirs.to_dict() == ours.to_dict()
  torch = pytest.importorskip("torch")
  with torch.device("meta"):  # shapes only, nothing allocated
    hf_model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**HF_CONFIG))
  assert sum(p.numel() for p in hf_model.parameters()) == models.num_params(ours)
