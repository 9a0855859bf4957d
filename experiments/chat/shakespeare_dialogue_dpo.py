"""chat/shakespeare-dialogue's SFT model tuned by DPO to prefer the speaker's true reply over a
reply of about its length from elsewhere in the play, judged on three plays it never saw.

Command:   zoo run chat/shakespeare-dialogue-dpo --workdir runs/dialogue-dpo
           (after `zoo run chat/shakespeare-dialogue --workdir runs/dialogue`, its starting
            point and its reference model; another: --config.init_from=DIR)
Hardware:  a 2-core CPU.
Time:      7.6 min on 2 CPU cores (13.4 CPU-min: 80 steps of 16 pairs of 2 x 385 bytes, each
           batch's reference forward, one evaluation).
Expected:  not what DPO is for yet: held-out preference accuracy 0.490 on 635 pairs of unseen
           plays at step 80, reward accuracy 0.518, loss 0.698 (log 2 = 0.693 at the start),
           against the SFT model's own 0.480. Neither model tells the true reply from another
           speaker's at this size: a judge counting the words a reply shares with its prompt
           gets 0.615 (bench/dialogue_signal.py, docs/chat.md "Measured").
Data:      the conversations of chat/shakespeare-dialogue, each cut before its last assistant
           turn: that turn is the chosen reply, the rejected one the closest in length of 8
           speeches drawn from the same play (common/data/dialogue.py); held out by play.
"""


from nnx_zoo.common.tasks import preference
from nnx_zoo.experiments.chat import shakespeare_dialogue


def get_config(arg=None):
  c = shakespeare_dialogue.get_config(arg)
  c.task = "dpo"  # the DPO loss against the init_from weights (common/tasks/preference.py)
  c.init_from = "runs/dialogue" if arg != "smoke" else ""
  c.preference = preference.config(beta=0.1)
  c.data.format = "preference"

  c.optim.update(lr=1e-4, warmup_steps=10, min_lr_ratio=0.1)
  c.train.update(steps=80, batch_size=16, eval_every=80, checkpoint_every=80)
  if arg == "smoke":
    c.train.update(steps=4, batch_size=4, eval_every=4, checkpoint_every=2)
  return c
