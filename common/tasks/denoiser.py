"""The denoiser task (DiT): the diffusion objective on noised images; `zoo generate` draws images
of the given classes with the guided sampler."""

import json
import os

import numpy as np

from nnx_zoo.common import tasks
from nnx_zoo.common.errors import UserError
from nnx_zoo.common.train import diffusion


class Denoiser(tasks.Task):
  name = "denoiser"

  def loss_sums(self, model, batch, *, loss_chunk=0):
    return diffusion.denoise_sums(model, batch)

  def score(self, graphdef, params, cfg):
    """Its samples' class accuracy and novelty (`diffusion.evaluate_samples`)."""
    return diffusion.evaluate_samples(graphdef, params, cfg)

  def generate(self, args, cfg):
    """Images of the given classes into an .npz file."""
    from nnx_zoo.common.hub import weights

    if args.prompt is not None:
      raise UserError(f"{cfg.model.family} generates images: give --labels or --num-per-label.")
    if args.out is None or (args.labels is None) == (args.num_per_label is None):
      raise UserError("Give --out FILE.npz and one of --labels 3,3,7 or --num-per-label N.")
    num_classes = cfg.model.conditioning.num_classes
    if args.labels is not None:
      try:
        labels = np.array([int(x) for x in args.labels.split(",") if x.strip()], np.int32)
      except ValueError:
        raise UserError(f"--labels {args.labels!r}: give comma-separated class ids.") from None
    else:
      if args.num_per_label < 1:
        raise UserError("--num-per-label must be at least 1.")
      labels = np.repeat(np.arange(num_classes, dtype=np.int32), args.num_per_label)
    if not len(labels) or labels.min() < 0 or labels.max() >= num_classes:
      raise UserError(f"--labels must be class ids in 0..{num_classes - 1}.")
    # A `zoo convert` output has no diffusion section: DiT's own schedule, the defaults.
    settings = diffusion.config(**(cfg.diffusion.to_dict() if cfg.get("diffusion") else {}))
    graphdef, params, _ = weights.restore_params(cfg, args.workdir)
    images = diffusion.sample(
      (graphdef, params),
      labels,
      cfg=settings,
      seed=args.seed,
      guidance=args.guidance,
      sample_steps=args.steps,
      eta=args.eta,
    )
    out = args.out if args.out.endswith(".npz") else args.out + ".npz"
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    np.savez(out, images=images.astype(np.float32), labels=labels)
    print(json.dumps({"out": os.path.abspath(out), "images": list(images.shape)}))


tasks.register(Denoiser())
