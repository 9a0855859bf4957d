"""Qwen2.5-Coder-0.5B-Instruct taught to use a calculator by agentic GRPO: multi-turn episodes in
which it calls `multiply` and `add` (the first call's result feeding the second) to answer
a * b + c, rewarded for the exact result in its final answer, judged on problems it never trains on.

Command:   zoo run chat/qwen-calculator-grpo --workdir runs/qwen-calc \
             --config.init_from=qwen2.5-coder-0.5b-instruct-q4_k_m.gguf
           (the GGUF file, read directly: its model, tokenizer and chat template, which takes
            tools; `zoo eval chat/qwen-calculator-grpo --workdir runs/qwen-calc-base
            --config.init_from=...` gives the base's held-out reward)
Hardware:  a 2-core CPU.
Time:      ~57 minutes to the step-10 evaluation (measured: start-up ~13 minutes, then 2.5 to 5.5
           minutes a step); its 20 steps ~100 minutes. Peak RSS 8.8 GiB.
Expected:  held-out accuracy (greedy episodes on 32 held-out problems: the exact result in the
           final answer, reward/contains_answer) 0.000 for the base, 1.000 at step 10 (measured
           2026-12-07, docs/tools.md, "The recipe"); its final answer is a JSON pseudo-call
           {"name": "print", "arguments": ["N"]} holding the result, not the bare number.
Data:      kind=arithmetic, problems=calculator: "What is a * b + c? Use the tools, then answer
           with the number only." (a of 3 digits, b of 2, c of 4), 20,000 training problems
           and 128 held out (common/data/arithmetic.py, which also holds the two tools).
"""

import ml_collections

from nnx_zoo.common import mesh, models
from nnx_zoo.common.data import pipeline
from nnx_zoo.common.nn import lora
from nnx_zoo.common.tasks import grpo
from nnx_zoo.common.train import settings

TOOLS = "nnx_zoo.common.data.arithmetic:multiply,nnx_zoo.common.data.arithmetic:add"
# The smoke form's ChatML template that takes tools (a tiny random Llama has none of its own).
SMOKE_TEMPLATE = (
  "{% if tools %}<|im_start|>system\n{{ tools | length }} tools<|im_end|>\n{% endif %}"
  "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
  "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def get_config(arg=None):
  c = ml_collections.ConfigDict()
  c.seed = 0
  c.task = "grpo"
  # An episode: the model's turn sampled to its end of turn (64 tokens at most; a call is ~30),
  # its calls (the template's <tool_call> form, or the bare or fenced JSON small models write)
  # run and their results appended as tool messages, until a turn without calls, 4 turns or
  # 320 tokens. The reward: the exact result in the final answer (the held-out accuracy:
  # reward/contains_answer); 0.5 for the result returned by a tool and 0.3 for answering at all
  # (the base calls on and on: 1 to 3 sampled episodes in 16 chain multiply and add right, 1 to
  # 4 answer, none right, so the answer alone ties every group at 0); 0.2 for calls in the
  # template's own format.
  c.grpo = grpo.config(
      group_size=4,
      beta=0.0,
      max_new_tokens=64,
      tools=TOOLS,
      max_turns=4,
      max_episode_tokens=320,
      call_format_reward=0.2,
      filter_tied_groups=True,
      filter_max_rounds=3,
      reward="nnx_zoo.common.tasks.rewards:contains_answer@1.0,"
             "nnx_zoo.common.tasks.rewards:answer_in_tool_result@0.5,"
             "nnx_zoo.common.tasks.rewards:answered@0.3",
  )
  c.model_from = "init_from"  # Qwen2.5-Coder-0.5B-Instruct's model, tokenizer and template
  c.init_from = "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"
  c.init_reinit = ""

  # Data: calculator problems as prompts; the template's tool preamble makes a prompt ~300 tokens.
  c.data = pipeline.config(kind="arithmetic", problems="calculator", format="prompts", seq_len=512)

  # Model: rank-16 adapters on every attention and MLP projection.
  c.model = models.levers(lora=lora.config(rank=16, alpha=32.0, targets="attn.*,mlp.*"))

  # Optimizer: a LoRA rate for a run of 30 steps, short warm-up.
  c.optim = settings.optim(lr=1e-4, warmup_steps=3, min_lr_ratio=0.1, weight_decay=0.0)

  # Training: 2 problems a step, 4 episodes each, from groups whose rewards do not all tie
  # (dynamic sampling, at most 3 rounds: an update of 8 episodes is ~130 s here, a round of
  # sampling ~60 s); the held-out reward (greedy episodes, the first 32 held-out problems)
  # every 10 steps. The loss 256 tokens at a time: the logits of the episodes over Qwen's
  # 151,936-token vocabulary would take GBs.
  c.train = settings.train(steps=20, batch_size=2, log_every=1, eval_every=10, eval_batches=16,
                           checkpoint_every=10, keep_checkpoints=1, loss_chunk=256)
  c.mesh = mesh.config()
  c.mesh_rules = [("cpux1", {}), ("*x8", {"mesh.data": 8})]

  if arg == "smoke":  # a tiny random Llama with a ChatML template that takes tools
    c.mesh_rules = []
    c.init_from = "tiny:llama"
    c.data.update(seq_len=128, chat_template=SMOKE_TEMPLATE)
    c.grpo.update(max_new_tokens=8, max_episode_tokens=32, truncated="keep", filter_max_rounds=2)
    c.train.update(steps=4, batch_size=4, log_every=1, eval_every=4, eval_batches=2,
                   checkpoint_every=2, loss_chunk=0)
  return c
