"""T5 against transformers in fp32: random tiny T5ForConditionalGeneration models of several
configurations (ReLU and gated GELU, tied and untied heads, with and without the output scale,
encoder and decoder of different depths) are converted, compared on logits, exported and
reloaded."""

import numpy as np
import pytest

from nnx_zoo.common import hub

torch = pytest.importorskip("torch")
tf = pytest.importorskip("transformers")

B, S, T, V = 2, 13, 9, 96
SMALL = dict(
  vocab_size=V,
  d_model=64,
  d_ff=96,
  num_heads=4,
  d_kv=16,
  relative_attention_num_buckets=8,  # few buckets and a short reach: the log buckets are used
  relative_attention_max_distance=12,
  dropout_rate=0.0,
)
# name -> (config kwargs, whether the head gets its own weights, as v1.1 checkpoints have)
ARCHS = {
  # The original T5: ReLU, tied head, decoder output scaled by d_model ** -0.5.
  "relu-tied": (dict(SMALL, num_layers=2, feed_forward_proj="relu"), False),
  # v1.1 / FLAN-T5: gated GELU, its own lm_head, no scale; a decoder deeper than the encoder.
  "gated-untied": (
    dict(
      SMALL,
      num_layers=2,
      num_decoder_layers=3,
      feed_forward_proj="gated-gelu",
      tie_word_embeddings=False,
    ),
    True,
  ),
  # tie_word_embeddings=False alone: transformers 5 still ties, but drops the scale. Heads of
  # 8 x 4 = 32 != d_model.
  "gated-tied-unscaled": (
    dict(
      SMALL,
      d_kv=8,
      num_layers=1,
      num_decoder_layers=2,
      feed_forward_proj="gated-gelu",
      tie_word_embeddings=False,
    ),
    False,
  ),
  # Its own lm_head and the scale; an encoder deeper than the decoder.
  "relu-untied-scaled": (dict(SMALL, num_layers=3, num_decoder_layers=1), True),
}


def hf_model(name: str, seed: int = 0):
  """The tiny model with random norm weights (one at init), so a weight the conversion skips or
  swaps shows in the outputs; an untied head gets its own random weights."""
  torch.manual_seed(seed)
  kw, untied = ARCHS[name]
  model = tf.T5ForConditionalGeneration(tf.T5Config(**kw)).eval()
  with torch.no_grad():
    for _, p in model.named_parameters():
      if p.ndim == 1:
        p.add_(0.5 * torch.randn_like(p))
    if untied:
      model.lm_head.weight = torch.nn.Parameter(torch.randn(V, kw["d_model"]))
  return model


def inputs(seed: int = 0):
  """Source tokens with a padded row (the mask as HF's attention_mask), decoder tokens."""
  rng = np.random.default_rng(seed)
  mask = np.ones((B, S), np.int64)
  mask[1, -5:] = 0
  return rng.integers(0, V, (B, S)), mask, rng.integers(0, V, (B, T))


def logits_of(model, tokens, mask, decoder_tokens) -> np.ndarray:
  with torch.no_grad():
    out = model(
      input_ids=torch.tensor(tokens),
      attention_mask=torch.tensor(mask),
      decoder_input_ids=torch.tensor(decoder_tokens),
    )
  return out.logits.numpy()


def zoo_logits(model, tokens, mask, decoder_tokens) -> np.ndarray:
  return np.asarray(model(tokens, decoder_tokens, segment_ids_BS=mask))


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


@pytest.mark.slow
def test_convert_matches_transformers(converted):
  name, model, tmp, summary = converted
  assert summary["params"] == model.num_parameters()
  ours = hub.load(str(tmp / "zoo"))
  untied = ARCHS[name][1]
  assert (ours.lm_head is not None) == untied
  assert bool(ours.output_scale) == model.config.scale_decoder_outputs
  x = inputs()
  got, want = zoo_logits(ours, *x), logits_of(model, *x)
  # Padded source positions are masked from every decoder token: all logits are real.
  rel = assert_close(got, want, name)
  print(f"{name}: relative max diff {rel:.2e}")


def test_export_reloads_in_transformers(converted):
  name, model, tmp, _ = converted
  hub.export_hf(str(tmp / "zoo"), str(tmp / "export"))
  back = tf.T5ForConditionalGeneration.from_pretrained(tmp / "export").eval()
  untied = ARCHS[name][1]
  assert (back.lm_head.weight is not back.shared.weight) == untied
  assert back.config.scale_decoder_outputs == model.config.scale_decoder_outputs
  for key in ("num_layers", "num_decoder_layers", "feed_forward_proj", "d_kv"):
    assert getattr(back.config, key) == getattr(model.config, key), key
  x = inputs(1)
  assert_close(logits_of(back, *x), logits_of(model, *x), name)
