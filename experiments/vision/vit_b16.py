"""Training recipe for ViT-B/16 (86.6 M parameters, 1,000 classes) on .npz image files you point to.

Command:   zoo run vision/vit-b16 --workdir runs/vit-b16 \
             --config.data.train_files='train/*.npz' --config.data.eval_files='val/*.npz'
           (fine-tuning google/vit-base-patch16-224 instead: add
            --config.init_from=google/vit-base-patch16-224, and --config.init_reinit='head.*'
            with --config.model.num_labels=N for N classes of your own)
Hardware:  the full model wants an accelerator (about 16 bytes of weights and AdamW state per
           parameter; data parallel over 8 devices by its mesh rule); `vision/vit-b16:smoke`
           runs on one CPU in seconds.
Time:      not measured on accelerators here; the smoke form takes about 15 s on 2 CPU cores.
Expected:  no reference metric: the accuracy depends on your images. The smoke form's loss falls.
Data:      .npz files of `images` [N, 224, 224, 3] (uint8, or floats in [0, 1]) and `labels` [N];
           normalised by the model as HF's ViTImageProcessor does ((x - 0.5) / 0.5).
"""

import ml_collections

from nnx_zoo.common import mesh
from nnx_zoo.common.data import images
from nnx_zoo.common.train import settings
from nnx_zoo.zoo.vit import model as vit


def get_config(arg=None):
  c = ml_collections.ConfigDict()
  c.seed = 0
  c.task = "classifier"  # what it optimises and evaluates (common/tasks/)
  c.init_from = ""
  c.init_reinit = ""  # params of init_from to start fresh instead (globs, e.g. "head.*")

  # Data: your images, already 224x224 RGB; random shifts of up to 8 pixels.
  c.data = images.config(kind="npz", train_files="", eval_files="", augment="shift", max_shift=8)

  # Model: the published ViT-B/16 dimensions (google/vit-base-patch16-224).
  c.model = vit.config("vit-b16")

  # Optimizer: the ViT paper's fine-tuning scale of rates, AdamW.
  c.optim = settings.optim(lr=1e-3, warmup_steps=10_000, b2=0.999, weight_decay=0.1)

  # Training
  c.train = settings.train(steps=100_000, batch_size=512, eval_every=5000, eval_batches=100)
  c.mesh = mesh.config()
  # Mesh rules: the first pattern matching the hardware (`zoo show` says which) sets the mesh;
  # not measured here (no accelerator), the intent of the recipe.
  c.mesh_rules = [
      ("*x8", {"mesh.data": 8}),
  ]

  if arg == "smoke":
    c.mesh_rules = []  # one CPU: the mesh as written
    # Same recipe, tiny: the digits instead of your files, the ViT-B/16 architecture shrunk.
    c.data.update(kind="digits", max_shift=1)
    c.model = vit.config(
        "vit-b16", dim=64, num_layers=2, num_heads=4, hidden_dim=128, image_size=8, patch=4,
        channels=1, pixel_mean=(0.5,), pixel_std=(0.5,), num_labels=10,
    )
    c.train.update(steps=4, batch_size=8, log_every=1, eval_every=4, eval_batches=2,
                   checkpoint_every=2)
  return c
