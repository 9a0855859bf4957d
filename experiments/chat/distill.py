"""Distillation of any decoder checkpoint into another of the same tokenizer: the student (from
init_from, as chat/sft) learns the teacher's token distributions on your conversations' assistant
turns, and (on-policy, GKD) on its own replies.

Command:   zoo run chat/distill --workdir runs/distill --config.init_from=ckpt/small
           --config.distill.teacher=ckpt/large
           --config.data.train_files=chats.jsonl --config.data.eval_files=held.jsonl
           (a student of the teacher's own layers: --config.init_from=ckpt/large
            --config.distill.student_layers=every:2; on-policy: --config.distill.lmbda=0.5;
            the teacher's top-k written once: `zoo data prepare chat/distill --out DIR ...`,
            then --config.data.kind=prepared --config.data.path=DIR)
Hardware:  whatever the teacher and the student need together; 135 M models run on a 2-core CPU.
Time:      depends on the models and data; chat/smollm2-distill is this recipe on SmolLM2-135M
           and the plays (its docstring has the figures).
Expected:  the held-out teacher_kl falls below the student's before training (`zoo eval
           chat/distill --workdir NEW --config.init_from=... --config.distill.teacher=...`
           before training prints it).
Data:      JSONL (or Parquet, ...) records with a `messages` list of {role, content}, rendered
           with the student's chat template; the loss on the assistant's tokens.
"""

import ml_collections

from nnx_zoo.common import mesh, models
from nnx_zoo.common.data import pipeline
from nnx_zoo.common.nn import lora
from nnx_zoo.common.tasks import distill
from nnx_zoo.common.train import settings


def get_config(arg=None):
  c = ml_collections.ConfigDict()
  c.seed = 0
  c.task = "distill"  # the student learns the teacher's distributions (common/tasks/distill.py)
  # The teacher (required) and the loss: forward KL at temperature 1, no next-token term, on the
  # data alone (lmbda 0).
  c.distill = distill.config(teacher="", loss="forward_kl", temperature=1.0, alpha=0.0, lmbda=0.0)
  # The student's model, tokenizer and chat template are init_from's (a required key).
  c.model_from = "init_from"
  c.init_from = ""
  c.init_reinit = ""

  # Data: your conversations; the loss on the assistant's turns.
  c.data = pipeline.config(kind="files", format="chat", seq_len=1024)

  # Model: the checkpoint's; only how it trains is set here (models.LEVERS).
  c.model = models.levers(lora=lora.config(rank=0, targets="attn.*,mlp.*"))

  # Optimizer: an SFT rate for full fine-tuning, short warm-up, no weight decay.
  c.optim = settings.optim(lr=5e-5, warmup_steps=10, min_lr_ratio=0.1, weight_decay=0.0)

  # Training
  c.train = settings.train(
      steps=500, batch_size=8, eval_every=250, checkpoint_every=250, keep_checkpoints=1
  )
  c.mesh = mesh.config()
  c.mesh_rules = [("cpux1", {}), ("*x8", {"mesh.data": 8})]

  if arg == "smoke":  # a tiny random Llama taught by a deeper one of its tokenizer, on the plays
    c.mesh_rules = []
    c.init_from = "tiny:llama"
    c.distill.teacher = "tiny:llama4"
    c.data.update(kind="shakespeare", train_plays="tempest", eval_plays="hamlet", seq_len=128)
    c.train.update(steps=4, batch_size=4, log_every=1, eval_every=4, eval_batches=2,
                   checkpoint_every=2)
  return c
