"""ViT against transformers in fp32: tiny random ViTForImageClassification models of several
shapes loaded and compared on logits; a conversion exported back and reloaded; the published
parameter counts, which transformers computes too."""

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from nnx_zoo.common import hub, models
from nnx_zoo.zoo.vit import model as vit

torch = pytest.importorskip("torch")
tf = pytest.importorskip("transformers")

# fp32 on both sides; relative to the largest logit (measured ~5e-7 of ~1.5).
RTOL = 1e-4
SMALL = dict(
  hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
  initializer_range=0.2,  # attention far from uniform, so a wrong mask or position shows
)  # fmt: skip
# Image and patch sizes (one channel, a patch of the whole image), activations and biases.
CONFIGS = {
  "16px-p4": dict(image_size=16, patch_size=4, num_labels=3),
  "24px-p8-gray": dict(image_size=24, patch_size=8, num_channels=1, num_labels=5),
  "12px-p12-tanh-gelu-no-qkv-bias": dict(
    image_size=12, patch_size=12, hidden_act="gelu_new", qkv_bias=False, num_labels=2
  ),
  "20px-p2": dict(image_size=20, patch_size=2, num_labels=4),
}


def hf_vit(name: str, seed: int = 0):
  """The tiny model with random norm weights and biases, so a weight the conversion skips or
  swaps shows in the logits."""
  torch.manual_seed(seed)
  model = tf.ViTForImageClassification(tf.ViTConfig(**SMALL, **CONFIGS[name])).eval()
  with torch.no_grad():
    for p in model.parameters():
      if p.ndim == 1:
        p.add_(0.5 * torch.randn_like(p))
  return model


def images(model, batch: int = 3, seed: int = 0) -> np.ndarray:
  c = model.config
  return np.random.default_rng(seed).random((batch, c.image_size, c.image_size, c.num_channels))


def hf_logits(model, images_BHWC) -> np.ndarray:
  """HF's logits of our images: normalised as its ViTImageProcessor does, channels first."""
  pixel_values = ((images_BHWC - 0.5) / 0.5).transpose(0, 3, 1, 2)
  with torch.no_grad():
    return model(torch.tensor(pixel_values, dtype=torch.float32)).logits.numpy()


def assert_close(got, want):
  got, want = np.asarray(got), np.asarray(want)
  assert got.shape == want.shape
  err = np.abs(got - want).max() / np.abs(want).max()
  assert err < RTOL, f"max |ours - transformers| / max |transformers| = {err:.3g}"


@pytest.mark.parametrize("name", list(CONFIGS))
def test_logits_match_transformers(name, tmp_path):
  model = hf_vit(name)
  model.save_pretrained(tmp_path)
  ours = hub.load(str(tmp_path))
  x = images(model)
  assert_close(nnx.jit(ours)(jnp.asarray(x, jnp.float32)), hf_logits(model, x))  # one compile


@pytest.mark.slow
def test_convert_export_and_reload(tmp_path):
  model = hf_vit("24px-p8-gray")
  model.save_pretrained(tmp_path / "hf")
  summary = hub.convert_hf(str(tmp_path / "hf"), str(tmp_path / "zoo"))
  assert summary["params"] == model.num_parameters() and summary["family"] == "vit"
  x = images(model)
  assert_close(hub.load(str(tmp_path / "zoo"))(jnp.asarray(x, jnp.float32)), hf_logits(model, x))
  hub.export_hf(str(tmp_path / "zoo"), str(tmp_path / "export"))
  back = tf.AutoModelForImageClassification.from_pretrained(tmp_path / "export").eval()
  assert type(back) is tf.ViTForImageClassification
  np.testing.assert_array_equal(hf_logits(back, x), hf_logits(model, x))


def test_encoder_without_a_head_loads(tmp_path):
  """A ViTModel (its pooler dropped) gives the encoder: HF's last hidden state."""
  torch.manual_seed(0)
  model = tf.ViTModel(tf.ViTConfig(**SMALL, image_size=16, patch_size=4)).eval()
  model.save_pretrained(tmp_path)
  ours = hub.load(str(tmp_path))
  x = images(model)
  with torch.no_grad():
    pixel_values = torch.tensor(((x - 0.5) / 0.5).transpose(0, 3, 1, 2), dtype=torch.float32)
    want = model(pixel_values).last_hidden_state.numpy()
  assert_close(ours.encode(jnp.asarray(x, jnp.float32)), want)


PUBLISHED = {
  "vit-b16": 86_567_656,  # google/vit-base-patch16-224 (ViTForImageClassification)
  "vit-l16": 304_326_632,  # google/vit-large-patch16-224
}


@pytest.mark.parametrize("preset", sorted(PUBLISHED))
def test_preset_parameter_count(preset):
  assert models.num_params(vit.config(preset)) == PUBLISHED[preset]


@pytest.mark.parametrize("preset", sorted(PUBLISHED))
def test_transformers_counts_the_same(preset):
  hf = hub.params_module("vit").config_to_hf(vit.config(preset))
  with torch.device("meta"):  # shapes only, nothing allocated
    model = tf.ViTForImageClassification(tf.ViTConfig(**hf))
  assert model.num_parameters() == PUBLISHED[preset]


def test_every_preset_is_checked_or_tiny():
  assert set(vit.PRESETS) - set(PUBLISHED) == {"tiny"}
