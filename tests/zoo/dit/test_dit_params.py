"""DiT against diffusers' DiTTransformer2DModel in fp32: tiny random models of several shapes
(learned sigma, patch sizes, channels, exact GELU, norm eps) loaded and compared on the
prediction; a conversion exported back and reloaded by diffusers; the published parameter
counts, which diffusers computes too (less its per-block copies of the embedders)."""

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from nnx_zoo.common import hub, models
from nnx_zoo.common.errors import UserError
from nnx_zoo.zoo.dit import model as dit

torch = pytest.importorskip("torch")
diffusers = pytest.importorskip("diffusers")

# fp32 on both sides; relative to the largest output (~10-40 with these weights). Measured
# 2e-6 .. 4e-5: the float32 rounding of t * frequency at t = 999 (~6e-5 of a feature, which
# torch's and XLA's float32 exp, each an ulp off at places, do not share) dominates; with
# t <= 17 alone 5e-6.
RTOL = 1e-4
CONFIGS = {
  "8px-p2-learned-sigma": dict(
    num_attention_heads=2, attention_head_dim=8, in_channels=1, out_channels=2, num_layers=2,
    sample_size=8, patch_size=2, num_embeds_ada_norm=10,
  ),
  "8px-p4-rgb-eps1e-6": dict(
    num_attention_heads=4, attention_head_dim=8, in_channels=3, num_layers=3, sample_size=8,
    patch_size=4, num_embeds_ada_norm=5, norm_eps=1e-6,
  ),
  "12px-p2-latents-exact-gelu": dict(
    num_attention_heads=3, attention_head_dim=8, in_channels=4, out_channels=8, num_layers=2,
    sample_size=12, patch_size=2, num_embeds_ada_norm=7, activation_fn="gelu",
  ),
  "6px-p6-one-token": dict(
    num_attention_heads=2, attention_head_dim=4, in_channels=2, num_layers=1, sample_size=6,
    patch_size=6, num_embeds_ada_norm=3,
  ),
}  # fmt: skip


def hf_dit(name: str, seed: int = 0, tie: bool = True):
  """The tiny model with every weight random (diffusers zeroes none, but scale them so the
  adaLN shifts and gates matter), and, if `tie`, block 0's embedders copied into every block,
  as in diffusers' converted checkpoints."""
  torch.manual_seed(seed)
  model = diffusers.DiTTransformer2DModel(**CONFIGS[name]).eval()
  with torch.no_grad():
    for p in model.parameters():
      p.copy_(0.3 * torch.randn_like(p))
    if tie:
      first = model.transformer_blocks[0].norm1.emb.state_dict()
      for block in model.transformer_blocks[1:]:
        block.norm1.emb.load_state_dict(first)
  return model


def inputs(model, batch: int = 4, seed: int = 0):
  c = model.config
  rng = np.random.default_rng(seed)
  x = rng.standard_normal((batch, c.sample_size, c.sample_size, c.in_channels)).astype(np.float32)
  t = np.array([0, 999, 17, 500][:batch])
  labels = np.array([0, c.num_embeds_ada_norm, 1, 2][:batch]) % (c.num_embeds_ada_norm + 1)
  return x, t, labels


def hf_out(model, x, t, labels) -> np.ndarray:
  with torch.no_grad():
    out = model(
      torch.tensor(x.transpose(0, 3, 1, 2)),
      timestep=torch.tensor(t),
      class_labels=torch.tensor(labels),
    ).sample
  return out.numpy().transpose(0, 2, 3, 1)


def err(got, want) -> float:
  got, want = np.asarray(got), np.asarray(want)
  assert got.shape == want.shape, (got.shape, want.shape)
  return float(np.abs(got - want).max() / np.abs(want).max())


@pytest.mark.parametrize("name", list(CONFIGS))
def test_prediction_matches_diffusers(name, tmp_path):
  model = hf_dit(name)
  model.save_pretrained(tmp_path)
  ours = hub.load(str(tmp_path))
  x, t, labels = inputs(model)
  got = nnx.jit(ours)(jnp.asarray(x), jnp.asarray(t), jnp.asarray(labels))  # one compile
  e = err(got, hf_out(model, x, t, labels))
  assert e < RTOL, f"max |ours - diffusers| / max |diffusers| = {e:.3g}"


def test_untied_embedders_are_refused(tmp_path):
  hf_dit("8px-p2-learned-sigma", tie=False).save_pretrained(tmp_path)
  with pytest.raises(UserError, match="differ"):
    hub.load(str(tmp_path))


@pytest.mark.slow
def test_convert_export_and_reload(tmp_path):
  model = hf_dit("12px-p2-latents-exact-gelu")
  model.save_pretrained(tmp_path / "hf")
  summary = hub.convert_hf(str(tmp_path / "hf"), str(tmp_path / "zoo"))
  L = model.config.num_layers
  emb = sum(p.numel() for p in model.transformer_blocks[0].norm1.emb.parameters())
  assert summary["family"] == "dit"
  assert summary["params"] == model.num_parameters() - (L - 1) * emb
  hub.export_hf(str(tmp_path / "zoo"), str(tmp_path / "export"))
  back = diffusers.DiTTransformer2DModel.from_pretrained(tmp_path / "export").eval()
  x, t, labels = inputs(model)
  np.testing.assert_array_equal(hf_out(back, x, t, labels), hf_out(model, x, t, labels))

  def public(config):
    return {k: v for k, v in dict(config).items() if not k.startswith("_")}

  assert public(back.config) == public(model.config)


# The DiT repository's count (its train.py logs it) includes the fixed sin-cos table, which it
# stores as a frozen parameter and the zoo and diffusers compute; the paper's Table 1 rounds to
# millions: 33, 130, 458, 675 (B/2 is 130.5).
PUBLISHED_M = {"dit-s2": 33, "dit-b2": 130, "dit-l2": 458, "dit-xl2": 675}
XL_WITH_POSITIONS = 675_129_632


@pytest.mark.parametrize("preset", sorted(PUBLISHED_M))
def test_preset_parameter_count(preset):
  cfg = dit.config(preset)
  positions = (cfg.image_size // cfg.patch) ** 2 * cfg.dim
  n = models.num_params(cfg)
  assert abs((n + positions) / 1e6 - PUBLISHED_M[preset]) < 1
  if preset == "dit-xl2":
    assert n + positions == XL_WITH_POSITIONS


@pytest.mark.parametrize("preset", sorted(PUBLISHED_M))
def test_diffusers_counts_the_same(preset):
  cfg = dit.config(preset)
  hf = hub.params_module("dit").config_to_hf(cfg)
  hf = {k: v for k, v in hf.items() if not k.startswith("_")}
  with torch.device("meta"):  # shapes only, nothing allocated
    model = diffusers.DiTTransformer2DModel(**hf)
  emb = sum(p.numel() for p in model.transformer_blocks[0].norm1.emb.parameters())
  assert model.num_parameters() - (cfg.num_layers - 1) * emb == models.num_params(cfg)


def test_every_preset_is_checked_or_tiny():
  assert set(dit.PRESETS) - set(PUBLISHED_M) == {"tiny"}
