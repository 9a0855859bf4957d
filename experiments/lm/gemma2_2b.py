"""Pretraining recipe for gemma2-2b (2.61 B parameters) on text files you point to.

Command:   zoo data prepare lm/gemma2-2b --out prepared/gemma2-2b \
             --config.data.train_files='web/*.parquet' --config.data.tokenizer.path=tokenizer.json
           zoo run lm/gemma2-2b --workdir runs/gemma2-2b --config.data.kind=prepared \
             --config.data.path=prepared/gemma2-2b --config.data.tokenizer.path=tokenizer.json
Hardware:  the full model needs accelerators (about 16 bytes of weights and AdamW state per
           parameter, sharded with mesh.fsdp); planned with `zoo plan` to fit a 64-chip slice
           of v4, v5e, v5p and v6e (docs/tpu.md's table; never run on a TPU);
           `lm/gemma2-2b:smoke` runs on one CPU in seconds.
Time:      not measured on accelerators here; the smoke form took 32 s (gemma2) and 38 s
           (gemma3) in all on 2 CPU cores shared with other jobs.
Expected:  no reference metric: the loss depends on your corpus. The smoke form's loss falls.
Data:      tokenized once by `zoo data prepare` (a worker per core; several hosts share the
           sources with --num-processes N --process-id I) from .txt, .jsonl, .jsonl.gz or
           .parquet files or datasets save_to_disk directories (field `text`), comma-separated
           globs; the run streams the shards, each host reading its rows (data.mixture weighs
           several prepared corpora). A small corpus can skip the first command: `zoo run` with
           data.train_files tokenizes it at start-up.
"""

import ml_collections

from nnx_zoo.common import mesh
from nnx_zoo.common.data import pipeline, tokenizers
from nnx_zoo.common.train import settings
from nnx_zoo.zoo.gemma import model as gemma


def get_config(arg=None):
  c = ml_collections.ConfigDict()
  c.seed = 0
  c.task = "language_model"  # what it optimises and evaluates (common/tasks/)
  c.init_from = ""
  c.init_reinit = ""  # params of init_from to start fresh instead (globs, e.g. "embed.*,lm_head.*")

  # Data: your corpus, in the model's own tokenizer (Gemma 2's tokenizer.json, kind hf).
  c.data = pipeline.config(
      kind="files",
      train_files="",
      eval_files="",
      tokenizer=tokenizers.config("hf"),
      seq_len=8192,
  )

  # Model: the published gemma2-2b dimensions: sliding-window (4,096) and global layers
  # alternating, soft-capped.
  c.model = gemma.config("gemma2-2b")
  c.model.dtype = "bfloat16"

  # Optimizer
  c.optim = settings.optim(warmup_steps=2000)

  # Training
  c.train = settings.train(steps=100_000, batch_size=512, eval_every=1000, eval_batches=50)
  # A 256k vocab: the output head and loss a chunk of tokens at a time, never [tokens, vocab]
  # logits whole (1 MB a token in fp32; `zoo plan` measured them overflowing every 64-chip slice).
  c.train.loss_chunk = 4096
  c.mesh = mesh.config(fsdp=-1)
  # Mesh rules: the first pattern matching the hardware (`zoo show` says which) sets the mesh
  # and memory levers; not measured here (no accelerator), the intent of the recipe.
  c.mesh_rules = [
      ("cpu*", {"mesh.fsdp": -1}),
      # GPUs: 1 and 8 of 80 GB and of 141 GB, sized by arithmetic (common/mesh.gpu_rules).
      *mesh.gpu_rules(c.model, batch_size=c.train.batch_size, seq_len=c.data.seq_len),
      # TPU, 64-chip slices: micro-batches per generation, sized with `zoo plan`; FSDP over every
      # chip (a model this small gains nothing from splitting heads over `tensor`).
      *mesh.tpu_rules(v5p=1, v4=2, v6e=2, v5e=4, max_tensor=1),
      ("tpu-v5p*", {"mesh.fsdp": -1, "model.remat": "save_dots"}),
  ]

  if arg == "smoke":
    c.mesh_rules = []  # one CPU: the mesh as written
    # Same recipe, tiny: bytes of Shakespeare instead of your corpus and tokenizer.
    c.data.update(kind="shakespeare", eval_plays="tempest", seq_len=32)
    c.data.tokenizer = tokenizers.config("bytes")
    # The gemma2-2b architecture (its layer pattern, norms, soft-caps, RoPE) in tiny shapes,
    # with a window shorter than the rows so the sliding layers differ from the global ones.
    c.model = gemma.config(
        "gemma2-2b", vocab_size=256, dim=64, hidden_dim=128, num_heads=4, num_kv_heads=2,
        head_dim=16, window=8, query_pre_attn_scalar=16, num_layers=4,
    )
    c.model.dtype = "float32"
    c.train.update(steps=4, batch_size=4, log_every=1, eval_every=4, eval_batches=2,
                   checkpoint_every=2, loss_chunk=64)
    c.mesh.update(data=1, fsdp=1, tensor=1)
  return c
