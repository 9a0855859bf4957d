"""Pretraining recipe for t5-small (60.5 M parameters): span corruption in T5's tokenizer.

Command:   zoo run seq2seq/t5-small --workdir runs/t5-small \
             --config.data.tokenizer.path=spiece.model
Hardware:  an accelerator for the full model (a few GB with AdamW state); `seq2seq/t5-small:smoke`
           runs on one CPU in seconds.
Time:      not measured on accelerators here; the smoke form takes about 10 s on 2 CPU cores.
Expected:  no reference metric measured here (no accelerator, and T5's tokenizer is not shipped
           offline). The smoke form's loss falls.
Data:      the plays in T5's sentencepiece vocabulary (spiece.model, 32,000 ids; its 100
           sentinels are data.extra_ids above them, as T5's <extra_id_N>), inputs of 512 tokens
           as T5's pretraining, three plays held out.
"""

import ml_collections

from nnx_zoo.common import mesh
from nnx_zoo.common.data import spans, tokenizers
from nnx_zoo.common.train import settings
from nnx_zoo.zoo.t5 import model as t5


def get_config(arg=None):
  c = ml_collections.ConfigDict()
  c.seed = 0
  c.task = "seq2seq"  # what it optimises and evaluates (common/tasks/)
  c.init_from = ""
  c.init_reinit = ""  # params of init_from to start fresh instead (globs, e.g. "lm_head.*")

  # Data: T5's objective (15% noise, mean span 3) with its inputs length and 100 sentinels.
  c.data = spans.config(
      eval_plays="hamlet,twelfth_night,henry_v",
      tokenizer=tokenizers.config("sentencepiece"),
      seq_len=512,
      noise_density=0.15,
      mean_span=3.0,
      extra_ids=100,
  )

  # Model: the published t5-small dimensions (ReLU, tied head, decoder output scaled).
  c.model = t5.config("t5-small")

  # Optimizer: AdamW in place of T5's Adafactor.
  c.optim = settings.optim(lr=1e-3, warmup_steps=10_000, weight_decay=0.0)

  # Training: T5's batch of 128 rows of 512 tokens.
  c.train = settings.train(steps=100_000, batch_size=128, eval_every=5000, eval_batches=20,
                           checkpoint_every=5000)
  c.mesh = mesh.config()
  # Mesh rules: not measured here (no accelerator), the intent of the recipe.
  c.mesh_rules = [
      ("cpu*", {}),
      ("*x8", {"mesh.data": 8}),
  ]

  if arg == "smoke":
    c.mesh_rules = []  # one CPU: the mesh as written
    # Same recipe, tiny: bytes (and 32 sentinels above them) instead of T5's tokenizer.
    c.data.update(seq_len=32, extra_ids=32)
    c.data.tokenizer = tokenizers.config("bytes")
    # The t5-small arrangement (ReLU, tied and scaled head) in tiny shapes.
    c.model = t5.config(
        "t5-small", vocab_size=288, dim=64, num_layers=2, num_heads=4, head_dim=16,
        hidden_dim=128, num_buckets=16, max_distance=32,
    )
    c.optim.warmup_steps = 2
    c.train.update(steps=4, batch_size=4, log_every=1, eval_every=4, eval_batches=2,
                   checkpoint_every=2)
  return c
