"""lm/shakespeare-char's model taught to answer in a scene: chat SFT on the plays as dialogue,
the loss on the assistant's turns only, evaluated on three plays it never saw.

Command:   zoo run chat/shakespeare-dialogue --workdir runs/dialogue
           (after `zoo run lm/shakespeare-char --workdir runs/shakespeare`, whose checkpoint it
            starts from; another: --config.init_from=DIR)
Hardware:  a 2-core CPU.
Time:      22 min on 2 CPU cores shared with other jobs (15.6 CPU-min: 300 steps of 16 rows of
           385 bytes, start-up and two evaluations).
Expected:  held-out loss 1.366 nats per byte on the assistant's tokens (46,891 of them; 1.419 at
           step 150), against 4.418 for the lm/shakespeare-char checkpoint it starts from on the
           same tokens and format, and 1.369 when trained on every token
           (--config.data.loss_on=all, the same steps and time).
Data:      every scene of the 39 training plays cut into conversations of about 288 characters
           (common/data/dialogue.py): a system line naming the play, the scene and the speaker
           who is the assistant, the others' speeches as the user's turns (named), the speaker's
           own as the assistant's; held out: Hamlet, Twelfth Night, Henry V, as in
           lm/shakespeare-char. Rendered by the template below, one byte a token.
Talk:      zoo chat --workdir runs/dialogue
"""

import ml_collections

from nnx_zoo.common import mesh
from nnx_zoo.common.data import pipeline, tokenizers
from nnx_zoo.common.train import settings
from nnx_zoo.experiments.lm import shakespeare_char
from nnx_zoo.zoo.llama import model as llama

# A chat template for a byte tokenizer (which has none of its own): tags as plain text, the
# assistant's reply and its end-of-turn tag marked as what the loss covers.
TEMPLATE = (
  "{% for m in messages %}"
  "{% if m.role == 'assistant' %}<|assistant|>"
  "{% generation %}{{ m.content }}<|end|>{% endgeneration %}{{ '\\n' }}"
  "{% else %}<|{{ m.role }}|>{{ m.content }}{{ '\\n' }}{% endif %}"
  "{% endfor %}"
  "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def get_config(arg=None):
  c = ml_collections.ConfigDict()
  c.seed = 0
  c.task = "language_model"  # next-token loss, weighed by the data's loss weights
  c.init_from = "runs/shakespeare"  # the README's lm/shakespeare-char run
  c.init_reinit = ""

  # Data: the plays as dialogue; the loss on the assistant's tokens (data.loss_on="all": on
  # every token, the ablation).
  c.data = pipeline.config(
      kind="shakespeare",
      format="chat",
      chat_template=TEMPLATE,
      eval_plays="hamlet,twelfth_night,henry_v",
      tokenizer=tokenizers.config("bytes"),
      seq_len=384,
  )

  # Model: lm/shakespeare-char's own, which the checkpoint must fit.
  c.model = shakespeare_char.get_config().model

  # Optimizer: a third of the pretraining rate, short warm-up.
  c.optim = settings.optim(lr=1e-3, warmup_steps=20, min_lr_ratio=0.1)

  # Training
  c.train = settings.train(
      steps=300, batch_size=16, eval_every=150, checkpoint_every=150, keep_checkpoints=1
  )
  c.mesh = mesh.config()
  c.mesh_rules = [("cpux1", {}), ("*x8", {"mesh.data": 8})]

  if arg == "smoke":  # from scratch: a smoke test has no lm/shakespeare-char run to start from
    c.mesh_rules = []
    c.init_from = ""
    c.data.seq_len = 128
    c.data.train_plays = "tempest"
    c.model = llama.config("tiny", vocab_size=256)
    c.train.update(steps=4, batch_size=4, log_every=1, eval_every=4, eval_batches=2,
                   checkpoint_every=2)
  return c
