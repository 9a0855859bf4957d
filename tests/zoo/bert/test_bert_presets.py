"""Every BERT preset builds abstractly with its published parameter count (pooler included),
which transformers computes too."""

import pytest
from flax import nnx

from nnx_zoo.common import models
from nnx_zoo.zoo.bert import model as bert

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

PUBLISHED = {
  "bert-base-uncased": 109_482_240,  # google-bert/bert-base-uncased
  "bert-large-uncased": 335_141_888,  # google-bert/bert-large-uncased
  "all-minilm-l6-v2": 22_713_216,  # sentence-transformers/all-MiniLM-L6-v2
}


@pytest.mark.parametrize("preset", sorted(PUBLISHED))
def test_preset_parameter_count(preset):
  assert models.num_params(bert.config(preset)) == PUBLISHED[preset]


@pytest.mark.parametrize("preset", sorted(PUBLISHED))
def test_transformers_counts_the_same(preset):
  p = bert.PRESETS[preset]
  hf = transformers.BertConfig(
    vocab_size=p["vocab_size"],
    hidden_size=p["dim"],
    num_hidden_layers=p["num_layers"],
    num_attention_heads=p["num_heads"],
    intermediate_size=p["hidden_dim"],
  )
  with torch.device("meta"):  # shapes only, nothing allocated
    assert transformers.BertModel(hf).num_parameters() == PUBLISHED[preset]


def test_every_preset_is_checked_or_tiny():
  assert set(bert.PRESETS) - set(PUBLISHED) == {"tiny"}


def test_every_config_field_changes_the_model():
  """A field nothing reads would leave the parameter tree unchanged (num_heads splits the same
  weights: the parity tests cover it)."""

  def shapes(cfg):
    return {k: v.shape for k, v in nnx.to_flat_state(nnx.state(models.abstract(cfg)))}

  ref = shapes(bert.config("tiny"))
  for field, value in [
    ("vocab_size", 300),
    ("dim", 32),
    ("num_layers", 3),
    ("hidden_dim", 96),
    ("max_len", 32),
    ("type_vocab_size", 1),
    ("pooler", False),
  ]:
    assert shapes(bert.config("tiny", **{field: value})) != ref, field
