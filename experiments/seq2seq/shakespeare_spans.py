"""A small T5 pretrained by span corruption on Shakespeare's bytes, three plays held out.

Command:   zoo run seq2seq/shakespeare-spans --workdir runs/t5
Hardware:  a 2-core CPU (no accelerator needed).
Time:      20 min on the shared 2-core CPU while other jobs kept its load average at 11-19
           (4.5 min of CPU time, user + sys; 2,200-2,700 input tokens/s).
Expected:  held-out loss 2.45 nats per target token at step 600 (2.52 at step 300), the
           targets being the sentinels and the dropped bytes of Hamlet, Twelfth Night and
           Henry V, which training never sees; the training loss is 2.5 from step 400 on.
Sample:    zoo generate --workdir runs/t5 --prompt "To be, or not to be, that is the
           <extra_id_0>: whether" --temperature 0 (at this size: sentinels and " the").
"""

import ml_collections

from nnx_zoo.common import mesh
from nnx_zoo.common.data import spans, tokenizers
from nnx_zoo.common.train import settings
from nnx_zoo.zoo.t5 import model as t5


def get_config(arg=None):
  c = ml_collections.ConfigDict()
  c.seed = 0
  c.task = "seq2seq"  # what it optimises and evaluates (common/tasks/)
  c.init_from = ""
  c.init_reinit = ""  # params of init_from to start fresh instead (globs, e.g. "lm_head.*")

  # Data: the plays as bytes, cut into rows of 106; 15% of each row dropped in spans of 3 on
  # average, each span replaced by one of the 32 sentinel ids above the bytes (287, 286, ...):
  # inputs of 96, targets (the sentinels and the spans they replaced) of 22. Held out by play,
  # as lm/shakespeare-char.
  c.data = spans.config(
      eval_plays="hamlet,twelfth_night,henry_v",
      tokenizer=tokenizers.config("bytes"),
      seq_len=96,
      noise_density=0.15,
      mean_span=3.0,
      extra_ids=32,
  )

  # Model: T5 v1.1's arrangement (gated GELU, untied head), 2 + 2 layers, D=128, 4 heads of
  # 32; 1.06 M parameters.
  c.model = t5.config(
      "tiny", vocab_size=288, dim=128, num_layers=2, num_decoder_layers=2, num_heads=4,
      head_dim=32, hidden_dim=384, num_buckets=32, max_distance=128,
  )

  # Optimizer
  c.optim = settings.optim(lr=2e-3)

  # Training
  c.train = settings.train(steps=600, eval_every=300, checkpoint_every=300)
  c.mesh = mesh.config()
  # Mesh rules: the first pattern matching the hardware (`zoo show` says which) sets the mesh.
  c.mesh_rules = [
      ("cpux1", {}),
      ("*x8", {"mesh.data": 8}),  # eight devices of any kind: data parallel
  ]

  if arg == "smoke":
    c.mesh_rules = []  # one CPU: the mesh as written
    c.data.seq_len = 32
    c.model = t5.config("tiny", vocab_size=288)
    c.train.update(steps=4, batch_size=4, log_every=1, eval_every=4, eval_batches=2,
                   checkpoint_every=2)
  return c
