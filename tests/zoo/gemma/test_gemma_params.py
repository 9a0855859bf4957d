"""Gemma 2 and Gemma 3 (text) against transformers in fp32: random tiny models of several
configurations are converted, compared on logits, exported and reloaded."""

import numpy as np
import pytest

from nnx_zoo.common import hub

torch = pytest.importorskip("torch")
tf = pytest.importorskip("transformers")

B, T, V = 2, 24, 128
SMALL = dict(
  vocab_size=V,
  hidden_size=64,
  intermediate_size=96,
  num_attention_heads=4,
  num_key_value_heads=2,
  head_dim=16,
  initializer_range=0.2,  # attention far from uniform, so a wrong mask or position shows
  attn_implementation="eager",  # sdpa may skip the attention soft-cap
)
# Sliding windows shorter than T, soft-caps low enough to bite, query_pre_attn_scalar != head_dim.
ARCHS = {
  "gemma2": lambda: tf.Gemma2ForCausalLM(
    tf.Gemma2Config(
      **SMALL,
      num_hidden_layers=4,
      sliding_window=5,
      query_pre_attn_scalar=24,
      attn_logit_softcapping=3.0,
      final_logit_softcapping=2.0,
    )
  ),
  "gemma2-odd-layers-no-caps": lambda: tf.Gemma2ForCausalLM(
    tf.Gemma2Config(
      **SMALL,
      num_hidden_layers=3,
      sliding_window=7,
      attn_logit_softcapping=None,
      final_logit_softcapping=None,
    )
  ),
  "gemma3": lambda: tf.Gemma3ForCausalLM(
    tf.Gemma3TextConfig(
      **SMALL,
      num_hidden_layers=7,  # one whole 5:1 pattern and one sliding layer more
      sliding_window=6,
      rope_parameters={
        "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
        "sliding_attention": {"rope_type": "default", "rope_theta": 10.0},
      },
    )
  ),
  "gemma3-softcap-pattern-3": lambda: tf.Gemma3ForCausalLM(
    tf.Gemma3TextConfig(
      **SMALL,
      num_hidden_layers=6,
      sliding_window=4,
      layer_types=["sliding_attention", "sliding_attention", "full_attention"] * 2,
      attn_logit_softcapping=4.0,
      final_logit_softcapping=3.0,
      query_pre_attn_scalar=32,
    )
  ),
}


def hf_model(name: str, seed: int = 0):
  """The tiny model with random norm weights (zero at init), so a weight the conversion skips
  or swaps shows in the outputs."""
  torch.manual_seed(seed)
  model = ARCHS[name]().eval()
  with torch.no_grad():
    for _, p in model.named_parameters():
      if p.ndim == 1:
        p.add_(0.5 * torch.randn_like(p))
  return model


def logits_of(model, tokens) -> np.ndarray:
  with torch.no_grad():
    return model(torch.tensor(tokens)).logits.numpy()


def assert_close(got, want, name):
  rel = float(np.abs(got - want).max() / np.abs(want).max())
  assert rel < 1e-4, f"{name}: max |ours - transformers| / max |transformers| = {rel:.2e}"
  return rel


@pytest.fixture(scope="module", params=list(ARCHS))
def converted(request, tmp_path_factory):
  name = request.param
  tmp = tmp_path_factory.mktemp(name)
  model = hf_model(name)
  model.save_pretrained(tmp / "hf")
  summary = hub.convert_hf(str(tmp / "hf"), str(tmp / "zoo"))
  return name, model, tmp, summary


def test_convert_matches_transformers(converted):
  name, model, tmp, summary = converted
  assert summary["params"] == model.num_parameters()
  tokens = np.random.default_rng(0).integers(0, V, (B, T))
  ours = np.asarray(hub.load(str(tmp / "zoo"))(tokens))
  rel = assert_close(ours, logits_of(model, tokens), name)
  print(f"{name}: relative max diff {rel:.2e}")


def test_export_reloads_in_transformers(converted):
  name, model, tmp, _ = converted
  hub.export_hf(str(tmp / "zoo"), str(tmp / "export"))
  back = tf.AutoModelForCausalLM.from_pretrained(tmp / "export", attn_implementation="eager")
  assert type(back) is type(model)
  tokens = np.random.default_rng(1).integers(0, V, (B, T))
  assert_close(logits_of(back.eval(), tokens), logits_of(model, tokens), name)
  for key in ("layer_types", "sliding_window", "query_pre_attn_scalar", "rope_parameters"):
    assert getattr(back.config, key) == getattr(model.config, key), key


def test_a_scanned_checkpoint_loads_with_the_pattern_stacked(tmp_path, scanned_copy):
  """Gemma 2's local/global pattern stored stacked (one stack per slot, model.scan): the
  checkpoint loads with transformers' logits and exports tensors that reload in transformers
  with them."""
  model = hf_model("gemma2")  # 4 layers: 2 repetitions of (sliding, full)
  model.save_pretrained(tmp_path / "hf")
  hub.convert_hf(str(tmp_path / "hf"), str(tmp_path / "zoo"))
  scanned = scanned_copy(tmp_path / "zoo", tmp_path / "scanned")
  ours = hub.load(scanned)
  assert len(ours.stacked) == 2
  tokens = np.random.default_rng(0).integers(0, V, (B, T))
  assert_close(np.asarray(ours(tokens)), logits_of(model, tokens), "gemma2 scanned")
  hub.export_hf(scanned, str(tmp_path / "export"))
  back = tf.AutoModelForCausalLM.from_pretrained(tmp_path / "export", attn_implementation="eager")
  assert_close(logits_of(back.eval(), tokens), logits_of(model, tokens), "gemma2 scanned export")
