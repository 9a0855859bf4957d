"""Qwen2.5-Coder-0.5B-Instruct taught to use a calculator by agentic GRPO: multi-turn episodes in
which it calls `multiply` and `add` (the first call's result feeding the second) to answer
a * b + c, rewarded for the exact result in its final answer, judged on problems it never trains on.

Command:   zoo run chat/qwen-calculator-grpo --workdir runs/qwen-calc \
             --config.init_from=qwen2.5-coder-0.5b-instruct-q4_k_m.gguf
           (the GGUF file, read directly: its model, tokenizer and chat template, which takes
            tools; `zoo eval chat/qwen-calculator-grpo --workdir runs/qwen-calc-base
            --config.init_from=...` gives the base's held-out reward)
Hardware:  a 2-core CPU.
Time:      not yet run to its 60 steps here: one step is 4 problems x 4 episodes of up to
           4 turns (docs/tools.md, "The recipe").
Expected:  the base's greedy held-out accuracy (the exact result in the final answer) is 0.000
           on 32 held-out problems (it calls multiply again and again; docs/tools.md); the
           trained model's is not yet measured.
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
  # An episode: the model's turn sampled to its end of turn, its calls (the template's
  # <tool_call> form, or the bare or fenced JSON small models write) run and their results
  # appended as tool messages, until a turn without calls, 4 turns or 384 tokens. The reward:
  # the exact result in the final answer (the held-out accuracy: reward/contains_answer), 0.5
  # for the result returned by a tool (the base chains multiply and add right in some sampled
  # episodes, then calls on instead of answering: without it every group ties at 0), and 0.2
  # for calls in the template's own format.
  c.grpo = grpo.config(
      group_size=4,
      beta=0.0,
      max_new_tokens=96,
      tools=TOOLS,
      max_turns=4,
      max_episode_tokens=384,
      call_format_reward=0.2,
      reward="nnx_zoo.common.tasks.rewards:contains_answer@1.0,"
             "nnx_zoo.common.tasks.rewards:answer_in_tool_result@0.5",
  )
  c.model_from = "init_from"  # Qwen2.5-Coder-0.5B-Instruct's model, tokenizer and template
  c.init_from = "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"
  c.init_reinit = ""

  # Data: calculator problems as prompts; the template's tool preamble makes a prompt ~300 tokens.
  c.data = pipeline.config(kind="arithmetic", problems="calculator", format="prompts", seq_len=512)

  # Model: rank-16 adapters on every attention and MLP projection.
  c.model = models.levers(lora=lora.config(rank=16, alpha=32.0, targets="attn.*,mlp.*"))

  # Optimizer: a LoRA rate, short warm-up.
  c.optim = settings.optim(lr=3e-5, warmup_steps=5, min_lr_ratio=0.1, weight_decay=0.0)

  # Training: 4 problems a step, 4 episodes each; the held-out reward (greedy episodes, the
  # first 32 held-out problems) every 20 steps. The loss 256 tokens at a time: the logits of
  # 16 episodes over Qwen's 151,936-token vocabulary would take GBs.
  # A step is minutes here (its first: 222 s of sampling 16 episodes, measured), longer than
  # the hang watchdog's default limit of 300 s: an hour before a step counts as hung.
  c.train = settings.train(steps=60, batch_size=4, log_every=1, eval_every=20, eval_batches=8,
                           checkpoint_every=20, keep_checkpoints=1, loss_chunk=256,
                           watchdog_s=3600.0)
  c.mesh = mesh.config()
  c.mesh_rules = [("cpux1", {}), ("*x8", {"mesh.data": 8})]

  if arg == "smoke":  # a tiny random Llama with a ChatML template that takes tools
    c.mesh_rules = []
    c.init_from = "tiny:llama"
    c.data.update(seq_len=128, chat_template=SMOKE_TEMPLATE)
    c.grpo.update(max_new_tokens=8, max_episode_tokens=32, truncated="keep")
    c.train.update(steps=4, batch_size=4, log_every=1, eval_every=4, eval_batches=2,
                   checkpoint_every=2, loss_chunk=0)
  return c
