"""Contrastive training recipe for CLIP ViT-B/32 (151.3 M parameters) on digit images you point to.

Command:   zoo run vision/clip-vit-b32 --workdir runs/clip-b32 \
             --config.data.train_files='train/*.npz' --config.data.eval_files='val/*.npz'
Hardware:  the full model wants an accelerator (data parallel over 8 devices by its mesh rule:
           the contrastive loss's negatives are the global batch); `vision/clip-vit-b32:smoke`
           runs on one CPU in seconds.
Time:      not measured on accelerators here; the smoke form takes about 20 s on 2 CPU cores.
Expected:  no reference metric. The smoke form's loss falls.
Data:      .npz files of `images` [N, 224, 224, 3] and digit `labels` [N] (0-9: the captions are
           the templates of common/data/images.py, "a handwritten 7", ..., as bytes between a
           start and an end token, which fit OpenAI's vocabulary of 49,408 but are not its BPE;
           so OpenAI's weights, `init_from=openai/clip-vit-base-patch32`, would need its own
           tokenizer, which the caption pipeline does not have yet).
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
  c.init_reinit = ""  # params of init_from to start fresh instead (globs)

  # Data: your images, already 224x224 RGB, each with one of its digit's captions.
  c.data = images.config(kind="npz", train_files="", eval_files="", augment="shift", max_shift=8,
                         caption_len=77)

  # Model: the published dimensions of openai/clip-vit-base-patch32.
  c.model = clip.config("clip-vit-b32")

  # Optimizer: CLIP's (Radford et al. 2021, ViT-B/32): AdamW, b2 0.98, eps 1e-6, decay 0.2.
  c.optim = settings.optim(lr=5e-4, warmup_steps=2000, b2=0.98, eps=1e-6, weight_decay=0.2)

  # Training
  c.train = settings.train(steps=100_000, batch_size=1024, eval_every=5000, eval_batches=20)
  c.mesh = mesh.config()
  # Mesh rules: the first pattern matching the hardware (`zoo show` says which) sets the mesh;
  # not measured here (no accelerator), the intent of the recipe.
  c.mesh_rules = [
      ("*x8", {"mesh.data": 8}),
  ]

  if arg == "smoke":
    c.mesh_rules = []  # one CPU: the mesh as written
    # Same recipe, tiny: the digits instead of your files, the CLIP B/32 architecture shrunk.
    c.data.update(kind="digits", max_shift=1, caption_len=36)
    c.model = clip.config(
        "clip-vit-b32", projection_dim=32,
        text=dict(vocab_size=images.TEXT_VOCAB, dim=64, num_layers=2, num_heads=4,
                  hidden_dim=128, max_len=36),
        vision=dict(dim=64, num_layers=2, num_heads=4, hidden_dim=128, image_size=8, patch=4,
                    channels=1, pixel_mean=(0.5,), pixel_std=(0.5,)),
    )
    c.train.update(steps=4, batch_size=8, log_every=1, eval_every=4, eval_batches=2,
                   checkpoint_every=2)
  return c
