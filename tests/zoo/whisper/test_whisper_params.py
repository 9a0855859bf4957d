"""Whisper against transformers in fp32: random tiny WhisperForConditionalGeneration models
(encoder and decoder of different depths, random biases and norms) are converted, compared on
encoder states and decoder logits, exported and reloaded."""

import json

import jax
import numpy as np
import pytest

from nnx_zoo.common import engine, hub
from nnx_zoo.common.errors import UserError

torch = pytest.importorskip("torch")
tf = pytest.importorskip("transformers")

B, MELS, FRAMES, T, V = 2, 16, 60, 7, 96
ARCHS = {
  "2x3": dict(encoder_layers=2, decoder_layers=3),
  "3x1": dict(encoder_layers=3, decoder_layers=1, d_model=48, encoder_attention_heads=3,
              decoder_attention_heads=3, encoder_ffn_dim=80, decoder_ffn_dim=80),
}  # fmt: skip
# |ours - transformers| / max |transformers| on logits and encoder states (measured: ~1e-6).
RTOL = 1e-4


def hf_model(name: str, seed: int = 0):
  """A tiny model with random biases and norm weights (zero and one at init), so a tensor the
  conversion skips or swaps shows in the outputs."""
  torch.manual_seed(seed)
  kw = dict(
    vocab_size=V,
    num_mel_bins=MELS,
    d_model=64,
    encoder_attention_heads=4,
    decoder_attention_heads=4,
    encoder_ffn_dim=96,
    decoder_ffn_dim=96,
    max_source_positions=FRAMES // 2,
    max_target_positions=16,
    decoder_start_token_id=3,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
  )
  model = tf.WhisperForConditionalGeneration(tf.WhisperConfig(**{**kw, **ARCHS[name]})).eval()
  with torch.no_grad():
    for n, p in model.named_parameters():
      if p.ndim == 1:
        p.add_(0.5 * torch.randn_like(p))
      elif "embed_positions" not in n or "decoder" in n:
        p.mul_(3.0)  # attention far from uniform
  return model


def inputs(seed: int = 0):
  rng = np.random.default_rng(seed)
  features = rng.standard_normal((B, MELS, FRAMES)).astype(np.float32)
  return features, rng.integers(0, V, (B, T))


def hf_outputs(model, features, decoder_tokens):
  with torch.no_grad():
    out = model(
      input_features=torch.tensor(features), decoder_input_ids=torch.tensor(decoder_tokens)
    )
  return out.encoder_last_hidden_state.numpy(), out.logits.numpy()


def zoo_outputs(model, features, decoder_tokens):
  frames = np.transpose(features, (0, 2, 1))  # HF's [B, mels, T] -> ours [B, T, mels]
  return np.asarray(model.encode(frames)), np.asarray(model(frames, decoder_tokens))


def rel_diff(got, want) -> float:
  return float(np.abs(got - want).max() / np.abs(want).max())


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
  # transformers counts the encoder's fixed sinusoids, a frozen weight; the zoo computes them.
  D, S = model.config.d_model, model.config.max_source_positions
  assert summary["params"] + S * D == model.num_parameters()
  ours = hub.load(str(tmp / "zoo"))
  x = inputs()
  (enc, logits), (want_enc, want_logits) = zoo_outputs(ours, *x), hf_outputs(model, *x)
  assert enc.shape == want_enc.shape and logits.shape == want_logits.shape
  assert rel_diff(enc, want_enc) < RTOL, rel_diff(enc, want_enc)
  assert rel_diff(logits, want_logits) < RTOL, rel_diff(logits, want_logits)
  print(
    f"{name}: encoder {rel_diff(enc, want_enc):.1e}, logits {rel_diff(logits, want_logits):.1e}"
  )


@pytest.mark.slow
def test_export_reloads_in_transformers(converted):
  name, model, tmp, _ = converted
  hub.export_hf(str(tmp / "zoo"), str(tmp / "export"))
  back = tf.WhisperForConditionalGeneration.from_pretrained(tmp / "export").eval()
  for key in ("encoder_layers", "decoder_layers", "num_mel_bins", "decoder_start_token_id"):
    assert getattr(back.config, key) == getattr(model.config, key), key
  x = inputs(1)
  for got, want in zip(hf_outputs(back, *x), hf_outputs(model, *x), strict=True):
    assert rel_diff(got, want) < RTOL


@pytest.mark.slow
def test_greedy_generation_equals_transformers(converted):
  """The zoo's cached greedy decoding writes what transformers' own decoding loop does (its
  model run on the whole prefix each step, no generation config in the way)."""
  _, model, tmp, _ = converted
  ours = hub.load(str(tmp / "zoo"))
  features, _ = inputs(2)
  got = engine.generate_seq2seq(
    ours, np.transpose(features, (0, 2, 1)), max_new_tokens=8, rng=jax.random.key(0),
    temperature=0.0,
  )  # fmt: skip
  tokens = torch.full((B, 1), model.config.decoder_start_token_id)
  with torch.no_grad():
    for _ in range(8):
      logits = model(input_features=torch.tensor(features), decoder_input_ids=tokens).logits
      tokens = torch.cat([tokens, logits[:, -1].argmax(-1, keepdim=True)], dim=1)
  np.testing.assert_array_equal(np.asarray(got), tokens[:, 1:].numpy())


def test_wrong_sinusoids_refused(tmp_path):
  model = hf_model("2x3")
  with torch.no_grad():
    model.model.encoder.embed_positions.weight.add_(1.0)
  model.save_pretrained(tmp_path / "hf")
  with pytest.raises(UserError, match="sinusoids"):
    hub.convert_hf(str(tmp_path / "hf"), str(tmp_path / "zoo"))


def test_unsupported_settings_refused(tmp_path):
  model = hf_model("2x3")
  model.save_pretrained(tmp_path / "hf")
  cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
  cfg["decoder_ffn_dim"] = 80
  (tmp_path / "hf" / "config.json").write_text(json.dumps(cfg))
  with pytest.raises(UserError, match="decoder_ffn_dim"):
    hub.convert_hf(str(tmp_path / "hf"), str(tmp_path / "zoo"))
