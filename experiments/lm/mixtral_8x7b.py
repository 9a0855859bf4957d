"""Pretraining recipe for mixtral-8x7b (46.7 B parameters, 12.9 B active) on your text files.

Command:   zoo data prepare lm/mixtral-8x7b --out prepared/mixtral-8x7b \
             --config.data.train_files='web/*.parquet' --config.data.tokenizer.path=tokenizer.json
           zoo run lm/mixtral-8x7b --workdir runs/mixtral-8x7b --config.data.kind=prepared \
             --config.data.path=prepared/mixtral-8x7b --config.data.tokenizer.path=tokenizer.json
Hardware:  the full model needs accelerators (about 16 bytes of weights and AdamW state per
           parameter, sharded with mesh.fsdp); `lm/mixtral-8x7b:smoke` runs on one CPU in seconds.
Time:      not measured on accelerators here; the smoke form takes about 10 s on 2 CPU cores.
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
from nnx_zoo.zoo.llama import model as llama


def get_config(arg=None):
  c = ml_collections.ConfigDict()
  c.seed = 0
  c.task = "language_model"  # what it optimises and evaluates (common/tasks/)
  c.init_from = ""
  c.init_reinit = ""  # params of init_from to start fresh instead (globs, e.g. "embed.*,lm_head.*")

  # Data: your corpus, in the model's own tokenizer (Mixtral's tokenizer.json, kind hf).
  c.data = pipeline.config(
      kind="files",
      train_files="",
      eval_files="",
      tokenizer=tokenizers.config("hf"),
      seq_len=4096,
  )

  # Model: the published mixtral-8x7b dimensions (a mixture of experts: `zoo show` prints the
  # active parameters too). On 8+ devices, --config.mesh.expert splits the experts.
  c.model = llama.config("mixtral-8x7b")
  c.model.dtype = "bfloat16"

  # Optimizer
  c.optim = settings.optim(warmup_steps=2000)

  # Training
  c.train = settings.train(steps=100_000, batch_size=512, eval_every=1000, eval_batches=50)
  c.mesh = mesh.config(fsdp=-1)
  # Mesh rules: the first pattern matching the hardware (`zoo show` says which) sets the mesh
  # and memory levers; not measured here (no accelerator), the intent of the recipe.
  c.mesh_rules = [
      ("cpu*", {"mesh.fsdp": -1}),
      # GPUs: 1 and 8 of 80 GB and of 141 GB, sized by arithmetic (common/mesh.gpu_rules).
      *mesh.gpu_rules(c.model, batch_size=c.train.batch_size, seq_len=c.data.seq_len),
      # TPU, 64-chip slices: micro-batches per generation, sized with `zoo plan`.
      *mesh.tpu_rules(v5p=2, v4=8, v6e=8),
      # 64 v5e chips' 16 GiB do not hold the step (zoo plan: 25.9 GiB a chip, 15.3 on 128).
      *mesh.tpu_rules(v5e=16, chips=128),
  ]

  if arg == "smoke":
    c.mesh_rules = []  # one CPU: the mesh as written
    # Same recipe, tiny: bytes of Shakespeare instead of your corpus and tokenizer.
    c.data.update(kind="shakespeare", eval_plays="tempest", seq_len=32)
    c.data.tokenizer = tokenizers.config("bytes")
    # The mixtral-8x7b architecture (its router, GQA ratio, norms, RoPE) in tiny shapes.
    c.model = llama.config(
        "mixtral-8x7b", vocab_size=256, dim=64, num_layers=2, hidden_dim=32,
        num_heads=4, num_kv_heads=2, head_dim=16, num_experts=4,
    )
    c.model.dtype = "float32"
    c.train.update(steps=4, batch_size=4, log_every=1, eval_every=4, eval_batches=2,
                   checkpoint_every=2)
    c.mesh.update(data=1, fsdp=1, tensor=1)
  return c
