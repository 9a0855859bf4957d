"""A small CLIP learns the digits from captions alone, and classifies the held-out 360 zero-shot.

Command:   zoo run vision/clip-digits --workdir runs/clip-digits
           (then `zoo eval vision/clip-digits --workdir runs/clip-digits` for the accuracy alone)
Hardware:  a 2-core CPU (no accelerator needed).
Time:      18 min on 2 CPU cores shared with other jobs (load average 15-19, vision/vit-digits
           running alongside; 4.2 min of user CPU); about 0.5 s a step.
Expected:  zero-shot accuracy 0.931 (loss 0.291) on the last 360 digits at step 2,000, 0.928 at
           step 1,500, 0.903 at step 1,000 (chance 0.1); `zoo eval` reproduces it.
Data:      the 1,797 8x8 grey digits of `sklearn.datasets.load_digits`; the first 1,437 train,
           each paired at every step with one of its six templated captions ("a handwritten 7",
           "a scan of a handwritten seven", ...), drawn at random, as bytes between a start and
           an end token. No labels are trained on: the last 360 images are classified by which
           class prompt ("a photo of the number seven") their features are closest to.
"""

import ml_collections

from nnx_zoo.common import mesh
from nnx_zoo.common.data import images
from nnx_zoo.common.train import settings
from nnx_zoo.zoo.clip import model as clip


def get_config(arg=None):
  c = ml_collections.ConfigDict()
  c.seed = 0
  c.task = "contrastive"  # what it optimises and evaluates (common/tasks/)
  c.init_from = ""
  c.init_reinit = ""  # params of init_from to start fresh instead (globs, e.g. "logit_scale")

  # Data: 8x8 digits with random rotations, scalings and shifts; captions of up to 36 bytes.
  c.data = images.config(kind="digits", augment="affine", caption_len=36)

  # Model: a ViT over 2x2 patches (4 layers, D=64) and a causal text tower over bytes (2
  # layers, D=64), both projected to 64.
  c.model = clip.config(
      "tiny", projection_dim=64,
      text=dict(vocab_size=images.TEXT_VOCAB, dim=64, num_layers=2, num_heads=4, hidden_dim=256,
                max_len=36),
      vision=dict(dim=64, num_layers=4, num_heads=4, hidden_dim=256, image_size=8, patch=2,
                  channels=1, pixel_mean=(0.5,), pixel_std=(0.5,)),
  )

  # Optimizer
  c.optim = settings.optim(lr=3e-3, warmup_steps=200, b2=0.99, weight_decay=0.05)

  # Training: 64 pairs a step, every one a negative of the others.
  c.train = settings.train(steps=2000, batch_size=64, log_every=50, eval_every=500,
                           checkpoint_every=1000, keep_checkpoints=1)
  c.mesh = mesh.config()
  # Mesh rules: the first pattern matching the hardware (`zoo show` says which) sets the mesh.
  c.mesh_rules = [
      ("cpux1", {}),
      ("*x8", {"mesh.data": 8}),  # eight devices of any kind: data parallel, global negatives
  ]

  if arg == "smoke":
    c.mesh_rules = []  # one CPU: the mesh as written
    c.model = clip.config(
        "tiny", text=dict(vocab_size=images.TEXT_VOCAB, max_len=36),
        vision=dict(image_size=8, patch=4, channels=1, pixel_mean=(0.5,), pixel_std=(0.5,)),
    )
    c.train.update(steps=4, batch_size=8, log_every=1, eval_every=4, eval_batches=2,
                   checkpoint_every=2)
  return c
