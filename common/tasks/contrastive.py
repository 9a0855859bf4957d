"""The contrastive task (CLIP): each image scored against every caption of the global batch;
evaluated zero-shot, each held-out image classified by its similarity to the class prompts."""

import jax.numpy as jnp
import optax

from nnx_zoo.common import tasks
from nnx_zoo.common.tasks import classifier, losses


class Contrastive(tasks.Task):
  name = "contrastive"

  def loss_sums(self, model, batch, *, loss_chunk=0):
    return losses.contrastive_sums(model, batch)

  def eval_sums(self, model, batch, *, prompts=None):
    logits_BC = losses.zero_shot_logits(model, batch["images"], prompts)
    ce_B = optax.softmax_cross_entropy_with_integer_labels(logits_BC, batch["labels"])
    return classifier.scored(logits_BC, ce_B, batch["weights"].astype(jnp.float32), batch["labels"])

  summary = classifier.Classifier.summary

  def generate(self, args, cfg):
    classifier.not_a_decoder(args, cfg)


tasks.register(Contrastive())
