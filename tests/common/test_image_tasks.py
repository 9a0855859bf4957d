"""The trainer's image tasks on the smoke forms of vision/vit-digits (classification) and
vision/clip-digits (CLIP's contrastive loss, zero-shot accuracy): the losses against numpy, the
data each data kind loads, exact resumption with the image iterator's state in the checkpoint,
and `zoo eval`."""

import json
import os

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from nnx_zoo.common import cli, experiments, mesh, models, parallel, plan, tasks
from nnx_zoo.common.data import images
from nnx_zoo.common.errors import UserError
from nnx_zoo.common.hub import weights
from nnx_zoo.common.tasks import losses
from nnx_zoo.common.train import metrics, trainer
from nnx_zoo.zoo.clip import model as clip

VIT, CLIP = "vision/vit-digits:smoke", "vision/clip-digits:smoke"
# As tests/common/test_trainer.py: a schedule that does not depend on train.steps, no eval.
BASE = {
  "train.steps": "6",
  "train.checkpoint_every": "2",
  "train.log_every": "1",
  "train.keep_checkpoints": "2",
  "train.eval_every": "0",
  "optim.schedule": "constant",
  "optim.warmup_steps": "2",
}


def smoke_config(exp: str, overrides: dict | None = None):
  return experiments.get_config(exp, {**BASE, **(overrides or {})})


def log_softmax(x):
  x = np.asarray(x, np.float64)
  m = x.max(-1, keepdims=True)
  return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


def pictures(n, size=8, channels=1, seed=0):
  return jnp.asarray(np.random.default_rng(seed).random((n, size, size, channels)), jnp.float32)


# The losses


@pytest.mark.slow
def test_image_classification_loss_is_the_weighted_cross_entropy():
  model = models.build(experiments.get_config(VIT).model, seed=0)
  batch = {
    "images": pictures(3),
    "labels": jnp.array([1, 7, 3]),
    "weights": jnp.array([1.0, 1.0, 0.0]),  # the last: a padding row
  }
  total, count = tasks.get("classifier").loss_sums(model, batch)
  logp = log_softmax(model(batch["images"]))
  assert float(count) == 2
  np.testing.assert_allclose(float(total), -(logp[0, 1] + logp[1, 7]), rtol=1e-5)


@pytest.mark.slow
def test_contrastive_task_is_clips_symmetric_loss():
  model = models.build(experiments.get_config(CLIP).model, seed=0)
  texts = ["a handwritten 1", "a handwritten 7", "a photo of the number three"]
  batch = {
    "images": pictures(3),
    "text": jnp.asarray(images.encode_texts(texts, 36)),
    "weights": jnp.ones(3),
  }
  total, count = tasks.get("contrastive").loss_sums(model, batch)

  def unit(x):
    x = np.asarray(x, np.float64)
    return x / np.linalg.norm(x, axis=-1, keepdims=True)

  logits = (
    np.exp(float(model.logit_scale[...]))
    * unit(model.encode_image(batch["images"]))
    @ unit(model.encode_text(batch["text"])).T
  )
  diag = np.arange(3)
  want = -(log_softmax(logits)[diag, diag] + log_softmax(logits.T)[diag, diag]).sum() / 2
  assert float(count) == 3
  np.testing.assert_allclose(float(total), want, rtol=1e-5)


@pytest.mark.slow
def test_zero_shot_logits_are_scaled_cosines_to_the_prompts():
  model = models.build(clip.config("tiny"), seed=0)
  prompts = jnp.asarray(images.encode_texts(images.class_prompts(), 48))
  x = pictures(2, size=32, channels=3)
  got = losses.zero_shot_logits(model, x, prompts)
  image, text = np.asarray(model.encode_image(x)), np.asarray(model.encode_text(prompts))
  cos = (image / np.linalg.norm(image, axis=-1, keepdims=True)) @ (
    text / np.linalg.norm(text, axis=-1, keepdims=True)
  ).T
  np.testing.assert_allclose(got, float(model.logit_scale_value()) * cos, rtol=1e-5, atol=1e-5)


# The data


def test_each_data_kind_loads_its_pipeline():
  data = trainer.load_data(experiments.get_config(VIT, {"data.mix": "none"}))
  batch = next(data.iterator)
  assert set(batch) == {"images", "labels", "weights"} and batch["images"].shape == (8, 8, 8, 1)
  assert data.prompts is None and len(data.eval) == images.DIGITS_HELD_OUT
  for mix in ("none", "cutmix"):  # `zoo plan` compiles the step for the batch zoo run feeds
    cfg = experiments.get_config(VIT, {"data.mix": mix})
    batch = next(trainer.load_data(cfg).iterator)
    layout = parallel.make_layout(mesh.resolve(cfg.mesh, 1))
    shapes = {k: (v.shape, v.dtype) for k, v in plan.abstract_batch(cfg, layout).items()}
    assert shapes == {k: (v.shape, v.dtype) for k, v in batch.items()}
  assert {"mix_labels", "mix"} <= set(batch)
  with pytest.raises(UserError, match="data.mix='cutmix' mixes a classifier's labels"):
    trainer.load_data(experiments.get_config("diffusion/dit-digits:smoke", {"data.mix": "cutmix"}))

  data = trainer.load_data(experiments.get_config(CLIP))
  batch = next(data.iterator)
  assert set(batch) == {"images", "labels", "weights", "captions", "text"}
  for label, caption, text in zip(batch["labels"], batch["captions"], batch["text"], strict=True):
    assert bytes(t for t in text if 0 < t < 256).decode() == images.captions(label)[caption]
  assert data.prompts.shape == (10, 36)

  text = trainer.load_data(experiments.get_config("lm/shakespeare-char:smoke"), train=False)
  assert text.iterator is None and "tokens" in next(text.eval_batches(text.eval, batch_size=2))


def test_caption_tokens_and_their_length():
  tokens = images.encode_texts(["a 7"], 6)
  assert tokens.tolist() == [[images.TEXT_START, 97, 32, 55, images.TEXT_END, 0]]
  assert images.TEXT_END == images.TEXT_VOCAB - 1  # the largest id: CLIP pools at the argmax
  from nnx_zoo.zoo.clip import model as clip

  assert clip.PRESETS["tiny"]["text"]["vocab_size"] == images.TEXT_VOCAB
  with pytest.raises(Exception, match="data.caption_len=4"):
    images.encode_texts(["a 7"], 4)


def test_affine_augmentation():
  image = images.digits()[0][5]
  same = images.affine(image, angle=0.0, scale=1.0, dy=0.0, dx=0.0)
  np.testing.assert_allclose(same, image, atol=1e-6)
  moved = images.affine(image, angle=0.0, scale=1.0, dy=1.0, dx=-2.0)
  np.testing.assert_allclose(moved, images.shift(image, 1, -2), atol=1e-6)
  turned = images.affine(image, angle=12.0, scale=0.9, dy=0.5, dx=0.3)
  assert turned.shape == image.shape and turned.min() >= 0 and turned.max() <= 1
  assert np.abs(turned - image).max() > 0.1


# Runs


def train_losses(workdir) -> dict[int, float]:
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    records = [json.loads(line) for line in f if line.strip()]
  return {r["step"]: r["loss"] for r in records if "split" not in r}


class Crash(Exception):
  pass


@pytest.mark.slow
@pytest.mark.parametrize("exp", [VIT, CLIP])
def test_resume_after_a_crash_is_exact(exp, tmp_path, monkeypatch):
  """Killed during step 5 (after the step-4 checkpoint) and rerun: the same losses and params
  as an uninterrupted run, so the resumed iterator drew the same images, augmentations and
  captions."""
  reference = str(tmp_path / "reference")
  trainer.train(smoke_config(exp), reference, progress=False)
  write = metrics.MetricsLog.write

  def crashing_write(self, step, values, split="train"):
    if step == 5:
      raise Crash
    write(self, step, values, split)

  workdir = str(tmp_path / "run")
  with monkeypatch.context() as m:
    m.setattr(metrics.MetricsLog, "write", crashing_write)
    with pytest.raises(Crash):
      trainer.train(smoke_config(exp), workdir, progress=False)
  assert list(train_losses(workdir)) == [1, 2, 3, 4]
  trainer.train(smoke_config(exp), workdir, progress=False)
  assert train_losses(workdir) == train_losses(reference)
  got = weights.restore_params(smoke_config(exp), workdir)[1]
  want = weights.restore_params(smoke_config(exp), reference)[1]
  for (key, a), (_, b) in zip(nnx.to_flat_state(got), nnx.to_flat_state(want), strict=True):
    np.testing.assert_array_equal(np.asarray(a.get_value()), np.asarray(b.get_value()), str(key))


@pytest.mark.slow
@pytest.mark.parametrize("exp", [VIT, CLIP])
def test_zoo_eval_reports_accuracy(exp, tmp_path, capsys):
  workdir = str(tmp_path / "run")
  flags = ["--config.train.steps=2", "--config.train.eval_every=0"]
  assert cli.main(["run", exp, "--workdir", workdir, "--quiet", *flags]) == 0
  capsys.readouterr()
  assert cli.main(["eval", exp, "--workdir", workdir, *flags]) == 0
  printed = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    logged = json.loads(f.read().strip().splitlines()[-1])
  assert logged["split"] == "eval" and logged["step"] == 2
  assert logged["accuracy"] == printed["accuracy"] and 0 <= logged["accuracy"] <= 1
  assert logged["examples"] == 16  # train.eval_batches=2 of 8
