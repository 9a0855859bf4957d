"""The classification task: a class for each row of tokens or each image (cross-entropy against
the labels; mixed images against both of theirs); evaluated by loss and accuracy."""

import jax.numpy as jnp
import numpy as np

from nnx_zoo.common import tasks
from nnx_zoo.common.errors import UserError
from nnx_zoo.common.tasks import language_model, losses


class Classifier(tasks.Task):
  name = "classifier"

  def loss_sums(self, model, batch, *, loss_chunk=0):
    return losses.classify_sums(model, batch)

  def eval_sums(self, model, batch, *, prompts=None):
    logits_BC, ce_B, weights_B = losses.classify_rows(model, batch)
    return scored(logits_BC, ce_B, weights_B, batch["labels"])

  def summary(self, sums):
    count = max(sums["count"], 1.0)
    return {
      "loss": sums["total"] / count,
      "accuracy": sums["correct"] / count,
      "examples": int(sums["count"]),
    }

  def batch_shapes(self, cfg):
    B = cfg.train.batch_size
    if "image_size" in cfg.model:
      return image_shapes(cfg)
    return {**tasks.token_rows(B, cfg.data.seq_len), "labels": ((B,), np.int32)}

  def generate(self, args, cfg):
    not_a_decoder(args, cfg)


def scored(logits_BC, ce_B, weights_B, labels_B) -> dict:
  """The held-out sums of a classifier's batch: loss, weight and correct predictions."""
  right_B = (jnp.argmax(logits_BC, -1) == labels_B).astype(jnp.float32)
  return {
    "total": jnp.sum(ce_B * weights_B),
    "count": jnp.sum(weights_B),
    "correct": jnp.sum(right_B * weights_B),
  }


def image_shapes(cfg) -> dict:
  """Labelled images [B, H, W, C] float32 with labels and weights [B] (and, mixed, the
  partners' labels and shares)."""
  B, size = cfg.train.batch_size, cfg.model.image_size
  shapes = {
    "images": ((B, size, size, cfg.model.get("channels", 3)), np.float32),
    "labels": ((B,), np.int32),
    "weights": ((B,), np.float32),
  }
  if cfg.data.get("mix", "none") != "none":  # mixed training images: a second label each
    shapes.update({"mix_labels": ((B,), np.int32), "mix": ((B,), np.float32)})
  return shapes


def not_a_decoder(args, cfg):
  """`zoo generate` of a model that writes nothing: the arguments' errors, then its own."""
  if args.audio is not None:
    language_model.check_prompt(args, cfg)
  raise UserError(f"{cfg.model.family} is an encoder: `zoo generate` needs a decoder.")


tasks.register(Classifier())
