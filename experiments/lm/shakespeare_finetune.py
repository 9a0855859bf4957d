"""lm/shakespeare-char's model fine-tuned on one play (Hamlet), tested on the play's last tenth.

Command:   zoo run lm/shakespeare-finetune --workdir runs/hamlet
           (after `zoo run lm/shakespeare-char --workdir runs/shakespeare`, whose checkpoint it
            starts from; another: --config.init_from=DIR)
Hardware:  a 2-core CPU.
Time:      56 s on 2 CPU cores (100 steps of 32 x 128 bytes, start-up and two evaluations).
Expected:  loss 1.427 nats per character on the last tenth of Hamlet at step 100 (1.434 at step
           50), against 1.615 for the lm/shakespeare-char checkpoint it starts from. LoRA
           (--config.model.lora.rank=8 --config.model.lora.targets='attn.*,mlp.*'
           --config.optim.lr=3e-3, 163,840 adapter weights trained): 1.433.
Data:      Hamlet, held out of lm/shakespeare-char's training: its first 90% trains, its last
           10% is the held-out split (data.eval_fraction).
"""

import ml_collections

from nnx_zoo.common import mesh
from nnx_zoo.common.data import pipeline, tokenizers
from nnx_zoo.common.train import settings
from nnx_zoo.experiments.lm import shakespeare_char
from nnx_zoo.zoo.llama import model as llama


def get_config(arg=None):
  c = ml_collections.ConfigDict()
  c.seed = 0
  c.task = "language_model"  # what it optimises and evaluates (common/tasks/)
  c.init_from = "runs/shakespeare"  # the README's lm/shakespeare-char run
  c.init_reinit = ""

  # Data: one play, held out by position (its end) rather than by play.
  c.data = pipeline.config(
      kind="shakespeare",
      train_plays="hamlet",
      eval_fraction=0.1,
      tokenizer=tokenizers.config("bytes"),
      seq_len=128,
  )

  # Model: lm/shakespeare-char's own, which the checkpoint must fit.
  c.model = shakespeare_char.get_config().model

  # Optimizer: a tenth of the pretraining rate, short warm-up, no decay to speak of.
  c.optim = settings.optim(warmup_steps=10, min_lr_ratio=0.5)

  # Training
  c.train = settings.train(steps=100, eval_every=50, checkpoint_every=100, keep_checkpoints=1)
  c.mesh = mesh.config()
  c.mesh_rules = [("cpux1", {}), ("*x8", {"mesh.data": 8})]

  if arg == "smoke":  # from scratch: a smoke test has no lm/shakespeare-char run to start from
    c.mesh_rules = []
    c.init_from = ""
    c.data.seq_len = 32
    c.model = llama.config("tiny", vocab_size=256)
    c.train.update(steps=4, batch_size=4, log_every=1, eval_every=4, eval_batches=2,
                   checkpoint_every=2)
  return c
