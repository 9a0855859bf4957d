"""Every GPT-2 preset builds abstractly with its published parameter count, which transformers
computes too."""

import pytest
from flax import nnx

from nnx_zoo.common import models
from nnx_zoo.zoo.gpt2 import model as gpt2

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

# Published counts (openai-community/gpt2*; tied embeddings counted once).
PUBLISHED = {
  "gpt2": 124_439_808,
  "gpt2-medium": 354_823_168,
  "gpt2-large": 774_030_080,
  "gpt2-xl": 1_557_611_200,
}


@pytest.mark.parametrize("preset", sorted(PUBLISHED))
def test_preset_parameter_count(preset):
  assert models.num_params(gpt2.config(preset)) == PUBLISHED[preset]


@pytest.mark.parametrize("preset", ["gpt2", "gpt2-xl"])
def test_transformers_counts_the_same(preset):
  p = gpt2.PRESETS[preset]
  hf = transformers.GPT2Config(
    vocab_size=p["vocab_size"],
    n_embd=p["dim"],
    n_layer=p["num_layers"],
    n_head=p["num_heads"],
    n_positions=p["max_len"],
  )
  with torch.device("meta"):  # shapes only, nothing allocated
    assert transformers.GPT2LMHeadModel(hf).num_parameters() == PUBLISHED[preset]


def test_every_preset_is_checked_or_tiny():
  assert set(gpt2.PRESETS) - set(PUBLISHED) == {"tiny"}


def test_every_config_field_changes_the_model():
  """A field nothing reads would leave the parameter tree unchanged (num_heads splits the same
  weights: the parity tests cover it)."""

  def shapes(cfg):
    return {k: v.shape for k, v in nnx.to_flat_state(nnx.state(models.abstract(cfg)))}

  ref = shapes(gpt2.config("tiny"))
  for field, value in [
    ("vocab_size", 300),
    ("dim", 32),
    ("num_layers", 3),
    ("max_len", 64),
    ("hidden_dim", 96),
    ("tie_embeddings", False),
  ]:
    assert shapes(gpt2.config("tiny", **{field: value})) != ref, field
