"""CLIP against transformers in fp32: tiny random CLIPModels (argmax and eos-token pooling,
grey images, other activations) loaded and compared on both towers' projected features and on
logits; a conversion exported back and reloaded; the published parameter count, which
transformers computes too."""

import jax.numpy as jnp
import numpy as np
import pytest

from nnx_zoo.common import hub, models
from nnx_zoo.zoo.clip import model as clip

torch = pytest.importorskip("torch")
tf = pytest.importorskip("transformers")

RTOL = 1e-4  # relative to the largest value; measured ~3e-7
V, T = 50, 10
TEXT = dict(
  vocab_size=V, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
  max_position_embeddings=12, initializer_range=0.2, bos_token_id=0, pad_token_id=1,
)  # fmt: skip
VISION = dict(
  hidden_size=48, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
  image_size=16, patch_size=4, initializer_range=0.2,
)  # fmt: skip
CONFIGS = {
  # OpenAI's checkpoints: eos_token_id 2, pooled at the largest id.
  "argmax": dict(text=dict(eos_token_id=2), vision={}),
  # Later ones: pooled at the first eos_token_id.
  "eos-token": dict(text=dict(eos_token_id=V - 7), vision={}),
  "grey-p8-gelu": dict(
    text=dict(eos_token_id=2, hidden_act="gelu"),
    vision=dict(num_channels=1, patch_size=8, image_size=24, hidden_act="gelu"),
  ),
}


def hf_clip(name: str, seed: int = 0):
  torch.manual_seed(seed)
  c = CONFIGS[name]
  config = tf.CLIPConfig(
    text_config={**TEXT, **c["text"]}, vision_config={**VISION, **c["vision"]}, projection_dim=24
  )
  model = tf.CLIPModel(config).eval()
  with torch.no_grad():  # random norm weights and biases, and a logit scale not at its init
    for p in model.parameters():
      if p.ndim <= 1:
        p.add_(0.5 * torch.randn_like(p))
  return model


def inputs(model, seed: int = 0):
  """Images, and tokens with the end token at a different place in each row, then padding."""
  rng = np.random.default_rng(seed)
  v, t = model.config.vision_config, model.config.text_config
  images = rng.random((2, v.image_size, v.image_size, v.num_channels))
  tokens = rng.integers(3, V - 8, (3, T))
  end = V - 1 if t.eos_token_id == 2 else t.eos_token_id
  for row, at in enumerate((T - 1, 4, 6)):
    tokens[row, at], tokens[row, at + 1 :] = end, 1
  return images, tokens


def pixel_values(model, images):
  channels = model.config.vision_config.num_channels
  mean, std = np.array(clip.OPENAI_MEAN[:channels]), np.array(clip.OPENAI_STD[:channels])
  return torch.tensor(((images - mean) / std).transpose(0, 3, 1, 2), dtype=torch.float32)


def assert_close(got, want):
  got, want = np.asarray(got), np.asarray(want)
  assert got.shape == want.shape
  err = np.abs(got - want).max() / np.abs(want).max()
  assert err < RTOL, f"max |ours - transformers| / max |transformers| = {err:.3g}"


def assert_parity(ours, model, images, tokens):
  with torch.no_grad():
    pv, ids = pixel_values(model, images), torch.tensor(tokens)
    want_image = model.get_image_features(pixel_values=pv).pooler_output.numpy()
    want_text = model.get_text_features(input_ids=ids).pooler_output.numpy()
    want_logits = model(input_ids=ids, pixel_values=pv).logits_per_image.numpy()
  images, tokens = jnp.asarray(images, jnp.float32), jnp.asarray(tokens)
  assert_close(ours.encode_image(images), want_image)
  assert_close(ours.encode_text(tokens), want_text)
  assert_close(ours(images, tokens), want_logits)


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.slow
def test_features_and_logits_match_transformers(name, tmp_path):
  model = hf_clip(name)
  model.save_pretrained(tmp_path)
  assert_parity(hub.load(str(tmp_path)), model, *inputs(model))


@pytest.mark.slow
def test_convert_export_and_reload(tmp_path):
  model = hf_clip("eos-token")
  model.save_pretrained(tmp_path / "hf")
  summary = hub.convert_hf(str(tmp_path / "hf"), str(tmp_path / "zoo"))
  assert summary["params"] == model.num_parameters() and summary["family"] == "clip"
  images, tokens = inputs(model)
  assert_parity(hub.load(str(tmp_path / "zoo")), model, images, tokens)
  hub.export_hf(str(tmp_path / "zoo"), str(tmp_path / "export"))
  back = tf.CLIPModel.from_pretrained(tmp_path / "export").eval()
  with torch.no_grad():
    args = dict(input_ids=torch.tensor(tokens), pixel_values=pixel_values(model, images))
    np.testing.assert_array_equal(back(**args).logits_per_image, model(**args).logits_per_image)


def test_argmax_pooling_exports_as_eos_token_2(tmp_path):
  hf = hub.params_module("clip").config_to_hf(clip.config("tiny"))
  assert hf["text_config"]["eos_token_id"] == 2
  hf = hub.params_module("clip").config_to_hf(clip.config("tiny", end_token=257))
  assert hf["text_config"]["eos_token_id"] == 257


PUBLISHED = {"clip-vit-b32": 151_277_313}  # openai/clip-vit-base-patch32


def test_preset_parameter_count():
  assert models.num_params(clip.config("clip-vit-b32")) == PUBLISHED["clip-vit-b32"]


def test_transformers_counts_the_same():
  hf = hub.params_module("clip").config_to_hf(clip.config("clip-vit-b32"))
  config = tf.CLIPConfig(
    text_config=hf["text_config"],
    vision_config=hf["vision_config"],
    projection_dim=hf["projection_dim"],
  )
  with torch.device("meta"):  # shapes only, nothing allocated
    assert tf.CLIPModel(config).num_parameters() == PUBLISHED["clip-vit-b32"]


def test_every_preset_is_checked_or_tiny():
  assert set(clip.PRESETS) - set(PUBLISHED) == {"tiny"}
