"""Continued pretraining of any decoder checkpoint on your text: the model and tokenizer come from
init_from; next-token loss on every token of the files.

Command:   zoo run lm/continue --workdir runs/more --config.init_from=ckpt/smol
           --config.data.train_files='corpus/*.txt' --config.data.eval_files=held.txt
           (ckpt/smol: a `zoo convert hf` output, a `zoo run` workdir or a Hugging Face
            directory; a corpus too big to tokenize at start-up: `zoo data prepare`, then
            --config.data.kind=prepared --config.data.path=DIR)
Hardware:  whatever the checkpoint needs; a 135 M model trains on a 2-core CPU.
Time:      depends on the model and data.
Expected:  the held-out loss falls below the base's: `zoo eval lm/continue --workdir NEW
           --config.init_from=...` before training prints the base's.
Data:      .txt, .jsonl (data.text_field), .parquet or datasets directories, packed into rows of
           seq_len + 1 tokens with the tokenizer's end-of-document token between documents.
"""

import ml_collections

from nnx_zoo.common import mesh, models
from nnx_zoo.common.data import pipeline
from nnx_zoo.common.nn import lora
from nnx_zoo.common.train import settings


def get_config(arg=None):
  c = ml_collections.ConfigDict()
  c.seed = 0
  c.task = "language_model"
  # The model and the tokenizer are init_from's (a required key).
  c.model_from = "init_from"
  c.init_from = ""
  c.init_reinit = ""

  # Data: your documents.
  c.data = pipeline.config(kind="files", seq_len=1024)

  # Model: the checkpoint's; only how it trains is set here (models.LEVERS).
  c.model = models.levers(lora=lora.config(rank=0, targets="attn.*,mlp.*"))

  # Optimizer: a tenth of a pretraining rate, short warm-up.
  c.optim = settings.optim(lr=3e-5, warmup_steps=20, min_lr_ratio=0.1)

  # Training
  c.train = settings.train(
      steps=1000, batch_size=8, eval_every=500, checkpoint_every=500, keep_checkpoints=1
  )
  c.mesh = mesh.config()
  c.mesh_rules = [("cpux1", {}), ("*x8", {"mesh.data": 8})]

  if arg == "smoke":  # a tiny random Llama and its tokenizer, on one play
    c.mesh_rules = []
    c.init_from = "tiny:llama"
    c.data.update(kind="shakespeare", train_plays="tempest", eval_fraction=0.1, seq_len=64)
    c.train.update(steps=4, batch_size=4, log_every=1, eval_every=4, eval_batches=2,
                   checkpoint_every=2)
  return c
