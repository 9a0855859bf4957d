"""DPO of any decoder checkpoint against itself: the model, tokenizer and chat template come from
init_from, which is also the reference model; your preference pairs say which reply is better.

Command:   zoo run chat/dpo --workdir runs/dpo --config.init_from=runs/sft
           --config.data.train_files=pairs.jsonl --config.data.eval_files=held.jsonl
           (runs/sft: a chat/sft run, a `zoo convert hf` output or a Hugging Face directory;
            LoRA: --config.model.lora.rank=8, the reference then being the base itself)
Hardware:  whatever the checkpoint needs; a 135 M model trains on a 2-core CPU.
Time:      depends on the model and data; chat/smollm2-shakespeare-dpo is this recipe on
           SmolLM2-135M and the plays (its docstring has the figures).
Expected:  held-out reward accuracy above 0.5 and preference accuracy above the base's: `zoo
           eval chat/dpo --workdir NEW --config.init_from=...` before training prints the base's.
Data:      records {"prompt": messages, "chosen": reply, "rejected": reply} (a reply: a string
           or an assistant message), rendered with the checkpoint's chat template.
"""

import ml_collections

from nnx_zoo.common import mesh, models
from nnx_zoo.common.data import pipeline
from nnx_zoo.common.nn import lora
from nnx_zoo.common.tasks import preference
from nnx_zoo.common.train import settings


def get_config(arg=None):
  c = ml_collections.ConfigDict()
  c.seed = 0
  c.task = "dpo"  # the DPO loss against the init_from weights (common/tasks/preference.py)
  c.preference = preference.config(beta=0.1)
  # The model, the tokenizer and the chat template are init_from's (a required key).
  c.model_from = "init_from"
  c.init_from = ""
  c.init_reinit = ""

  # Data: pairs of replies to one prompt, one pair a row.
  c.data = pipeline.config(kind="files", format="preference", seq_len=1024)

  # Model: the checkpoint's; only how it trains is set here (models.LEVERS).
  c.model = models.levers(lora=lora.config(rank=0, targets="attn.*,mlp.*"))

  # Optimizer: TRL's DPO rate for full fine-tuning, short warm-up, no weight decay.
  c.optim = settings.optim(lr=1e-6, warmup_steps=10, min_lr_ratio=0.1, weight_decay=0.0)

  # Training
  c.train = settings.train(
      steps=300, batch_size=8, eval_every=150, checkpoint_every=150, keep_checkpoints=1
  )
  c.mesh = mesh.config()
  c.mesh_rules = [("cpux1", {}), ("*x8", {"mesh.data": 8})]

  if arg == "smoke":  # a tiny random Llama with a ChatML tokenizer, on the plays' pairs
    c.mesh_rules = []
    c.init_from = "tiny:llama"
    c.data.update(kind="shakespeare", train_plays="tempest", eval_plays="hamlet", seq_len=128)
    c.train.update(steps=4, batch_size=4, log_every=1, eval_every=4, eval_batches=2,
                   checkpoint_every=2)
  return c
