"""GRPO of any chat checkpoint on prompts whose replies a program scores: online RL, the
completions sampled by the zoo's own compiled sampler on the weights being trained
(common/tasks/grpo.py); the model, tokenizer and chat template come from init_from.

Command:   zoo run chat/grpo --workdir runs/grpo --config.init_from=ckpt/smol
           --config.data.train_files=prompts.jsonl --config.data.eval_files=held.jsonl
           --config.grpo.reward=my_rewards.py:correct@1.0,my_rewards.py:short@0.2
           (ckpt/smol: a `zoo convert` output, a `zoo run` workdir, a Hugging Face directory or
            a .gguf file; LoRA: --config.model.lora.rank=8; a KL to the start:
            --config.grpo.beta=0.04)
Hardware:  whatever the checkpoint needs; a 135 M model trains on a 2-core CPU.
Time:      depends on the model and data: the rollouts dominate, group_size x batch_size x
           max_new_tokens sampled tokens a step (metrics.jsonl: sample_s, reward_s, train_s);
           chat/smollm2-arithmetic-grpo is this recipe on SmolLM2-135M (its docstring has the
           figures).
Expected:  the held-out mean reward of greedy replies (`reward` in the eval lines) rising above
           the start's: `zoo eval chat/grpo --workdir NEW --config.init_from=...` before
           training prints the start's. The levers stay at the plain step here; on
           chat/smollm2-arithmetic-grpo, dynamic sampling with two updates a rollout
           (--config.grpo.filter_tied_groups=True --config.grpo.num_iterations=2) learnt
           faster for 1.12x the CPU (docs/grpo.md, "The levers, measured").
Data:      JSONL records {"prompt": messages, ...any fields}; the fields reach the rewards as
           keyword lists (an `answer` for nnx_zoo.common.tasks.rewards:exact_answer or
           :contains_answer). A reward: reward(prompts, completions, **fields) -> list[float].
"""

import ml_collections

from nnx_zoo.common import mesh, models
from nnx_zoo.common.data import pipeline
from nnx_zoo.common.nn import lora
from nnx_zoo.common.tasks import grpo
from nnx_zoo.common.train import settings


def get_config(arg=None):
  c = ml_collections.ConfigDict()
  c.seed = 0
  c.task = "grpo"
  c.grpo = grpo.config(
      group_size=4,
      beta=0.0,  # TRL's default: no reference model
      max_new_tokens=64,
      reward="nnx_zoo.common.tasks.rewards:contains_answer",
  )
  # The model, the tokenizer and the chat template are init_from's (a required key).
  c.model_from = "init_from"
  c.init_from = ""
  c.init_reinit = ""

  # Data: prompt records, rendered with the chat template and its generation prompt,
  # left-aligned in seq_len tokens.
  c.data = pipeline.config(kind="files", format="prompts", seq_len=256)

  # Model: the checkpoint's; only how it trains is set here (models.LEVERS).
  c.model = models.levers(lora=lora.config(rank=0, targets="attn.*,mlp.*"))

  # Optimizer: TRL's GRPO rate for full fine-tuning.
  c.optim = settings.optim(lr=1e-6, warmup_steps=10, min_lr_ratio=0.1, weight_decay=0.0)

  # Training: batch_size prompts a step, each sampled group_size times.
  c.train = settings.train(
      steps=200, batch_size=8, eval_every=50, checkpoint_every=50, keep_checkpoints=1
  )
  c.mesh = mesh.config()
  c.mesh_rules = [("cpux1", {}), ("*x8", {"mesh.data": 8})]

  if arg == "smoke":  # a tiny random Llama with a ChatML tokenizer, on sums (no files)
    c.mesh_rules = []
    c.init_from = "tiny:llama"
    c.data.update(kind="arithmetic", seq_len=64)
    c.grpo.update(max_new_tokens=8, truncated="keep")  # a random model never ends its turn
    c.optim.lr = 1e-4
    c.train.update(steps=4, batch_size=4, log_every=1, eval_every=4, eval_batches=2,
                   checkpoint_every=2)
  return c
