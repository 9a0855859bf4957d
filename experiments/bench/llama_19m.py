"""Training-speed benchmark: a 19.4 M Llama with a 32k vocab, 8 x 256 tokens a step, AdamW fp32.

Command:   zoo run bench/llama-19m --workdir runs/llama-19m
Hardware:  a 2-core CPU (the step bench/train_vs_torch.py compares with PyTorch).
Time:      30 s for the whole command on 2 shared CPU cores (20 steps and start-up).
Expected:  a speed figure, not a loss: tokens_per_s on every metrics.jsonl line. The loss only
           has to fall (the text uses byte ids 0-255 of the 32000).
Model:     exactly HF LlamaConfig(vocab_size=32000, hidden_size=256, intermediate_size=768,
           num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2, rms_norm_eps=1e-6,
           rope_theta=1e4, tie_word_embeddings=False): 19,400,960 parameters.
Data:      Shakespeare as UTF-8 bytes. The speed of a step does not depend on which ids the rows
           hold (the 32k-way softmax and the [V, D] tables are computed whole either way), so real
           text with the bytes tokenizer stands in for a 32k tokenizer this machine does not have.
"""

import ml_collections

from nnx_zoo.common import mesh
from nnx_zoo.common.data import pipeline, tokenizers
from nnx_zoo.common.train import settings
from nnx_zoo.zoo.llama import model as llama

# The Hugging Face config this experiment's model equals (tests/experiments/test_llama_19m.py),
# which the benchmarks build the PyTorch side from.
HF_CONFIG = dict(
    vocab_size=32000, hidden_size=256, intermediate_size=768, num_hidden_layers=4,
    num_attention_heads=8, num_key_value_heads=2, rms_norm_eps=1e-6, rope_theta=1e4,
    tie_word_embeddings=False,
)


def get_config(arg=None):
  c = ml_collections.ConfigDict()
  c.seed = 0
  c.task = "language_model"  # what it optimises and evaluates (common/tasks/)
  c.init_from = ""
  c.init_reinit = ""  # params of init_from to start fresh instead (globs, e.g. "embed.*,lm_head.*")

  # Data: Shakespeare bytes, rows of 256 tokens (see the docstring for why bytes).
  c.data = pipeline.config(
      kind="shakespeare",
      eval_plays="hamlet,twelfth_night,henry_v",
      tokenizer=tokenizers.config("bytes"),
      seq_len=256,
  )

  # Model: D=256, 4 layers, 8 query heads of 32 sharing 2 KV heads, SwiGLU 768, untied 32k vocab.
  c.model = llama.config(
      "tiny", vocab_size=32000, dim=256, num_layers=4, num_heads=8, num_kv_heads=2,
      hidden_dim=768, norm_eps=1e-6, rope_theta=1e4,
  )

  # Optimizer: AdamW in fp32, as the PyTorch side of the benchmark.
  c.optim = settings.optim(lr=1e-3, warmup_steps=5)

  # Training: tokens_per_s logged every step; no evaluation, one checkpoint at the end.
  # Head + loss 512 tokens at a time: the [2048, 32000] logits never held whole
  # (common/tasks/losses.py); measured 14% faster a step here than 0 (off).
  c.train = settings.train(
      steps=20, batch_size=8, log_every=1, checkpoint_every=20, keep_checkpoints=1,
      loss_chunk=512,
  )
  c.mesh = mesh.config()
  c.mesh_rules = [("cpux1", {})]

  if arg == "smoke":
    c.mesh_rules = []
    c.data.seq_len = 32
    c.model = llama.config("tiny", vocab_size=256)
    c.train.update(steps=4, batch_size=4, eval_every=4, eval_batches=2, checkpoint_every=2)
  return c
