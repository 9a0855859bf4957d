"""Chat SFT of any decoder checkpoint: the model, tokenizer and chat template come from init_from;
the loss is on the assistant's turns of your conversations.

Command:   zoo run chat/sft --workdir runs/sft --config.init_from=ckpt/smol
           --config.data.train_files=chats.jsonl --config.data.eval_files=held.jsonl
           (ckpt/smol: a `zoo convert hf` output, a `zoo run` workdir or a Hugging Face
            directory; LoRA: --config.model.lora.rank=8 --config.optim.lr=2e-4)
Hardware:  whatever the checkpoint needs; a 135 M model fine-tunes on a 2-core CPU.
Time:      depends on the model and data; chat/smollm2-shakespeare is this recipe on SmolLM2-135M
           and the plays (its docstring has the figures).
Expected:  the held-out loss on the assistant's tokens falls below the base's: `zoo eval
           chat/sft --workdir NEW --config.init_from=...` before training prints the base's.
Data:      JSONL (or Parquet, ...) records with a `messages` list of {role, content}
           (data.messages_field), rendered with the checkpoint's chat template
           (data.chat_template overrides it); data.kind=prepared for `zoo data prepare`d ones.
"""

import ml_collections

from nnx_zoo.common import mesh, models
from nnx_zoo.common.data import pipeline
from nnx_zoo.common.nn import lora
from nnx_zoo.common.train import settings


def get_config(arg=None):
  c = ml_collections.ConfigDict()
  c.seed = 0
  c.task = "language_model"  # next-token loss, weighed by the data's loss weights
  # The model, the tokenizer and the chat template are init_from's (a required key).
  c.model_from = "init_from"
  c.init_from = ""
  c.init_reinit = ""

  # Data: your conversations; the loss on the assistant's turns.
  c.data = pipeline.config(kind="files", format="chat", seq_len=1024)

  # Model: the checkpoint's; only how it trains is set here (models.LEVERS). Full fine-tuning;
  # rank > 0 trains adapters on every attention and MLP projection instead.
  c.model = models.levers(lora=lora.config(rank=0, targets="attn.*,mlp.*"))

  # Optimizer: TRL's SFT rate for full fine-tuning, short warm-up, no weight decay.
  c.optim = settings.optim(lr=2e-5, warmup_steps=10, min_lr_ratio=0.1, weight_decay=0.0)

  # Training
  c.train = settings.train(
      steps=500, batch_size=8, eval_every=250, checkpoint_every=250, keep_checkpoints=1
  )
  c.mesh = mesh.config()
  c.mesh_rules = [("cpux1", {}), ("*x8", {"mesh.data": 8})]

  if arg == "smoke":  # a tiny random Llama with a ChatML tokenizer, on the plays' dialogue
    c.mesh_rules = []
    c.init_from = "tiny:llama"
    c.data.update(kind="shakespeare", train_plays="tempest", eval_plays="hamlet", seq_len=128)
    c.train.update(steps=4, batch_size=4, log_every=1, eval_every=4, eval_batches=2,
                   checkpoint_every=2)
  return c
