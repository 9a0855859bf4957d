"""A distillation step: the zoo's (chat/distill: the teacher's forward pass inside the jitted
train step) vs TRL's GKDTrainer, on the same CPU, student, teacher, conversations, batch size,
loss (generalized JSD, beta 0.5, temperature 1, off-policy: lmbda 0) and learning rate.

    pip install -e ".[bench]" && python bench/distill_vs_trl.py [--student DIR --teacher DIR]
        [--steps 8 --warmup 2 --batch-size 8 --seq-len 256]

DIR: Hugging Face directories of one tokenizer (the defaults: tiny:llama taught by tiny:llama4,
made on first use; for SmolLM2, `zoo export hf` of a converted checkpoint). Each side trains
`--warmup` steps (compilation), then `--steps` steps, timed one by one; the median step time and
the tokens a step reads (the zoo packs rows of seq_len + 1 tokens; TRL pads each batch to its
longest conversation, cut at the same length) are reported, and their ratios. The two run one
after the other: run it on a quiet machine. A measurement, not a target: on a CPU the step's
training half is bounded as bench/RESULTS.md's notes on train_vs_torch.py say.
"""

import argparse
import json
import os
import statistics
import tempfile
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

from nnx_zoo.common import experiments
from nnx_zoo.common.data import dialogue, pipeline
from nnx_zoo.common.hub import weights
from nnx_zoo.common.train import trainer

EXP = "chat/distill"
PLAY = "tempest"


def settings(args) -> dict:
  return {
    "init_from": args.student,
    "distill.teacher": args.teacher,
    "distill.loss": "jsd",
    "distill.beta": "0.5",
    "distill.temperature": "1.0",
    "distill.lmbda": "0.0",
    "data.kind": "shakespeare",
    "data.train_plays": PLAY,
    "data.eval_plays": "hamlet",
    "data.seq_len": str(args.seq_len),
    "train.batch_size": str(args.batch_size),
    "train.steps": str(args.warmup + args.steps),
    "train.log_every": "1",
    "train.eval_every": "0",
    "train.checkpoint_every": str(args.warmup + args.steps),
    "optim.lr": "5e-5",
    "optim.warmup_steps": "0",
  }


def zoo(args) -> tuple[list[float], float]:
  cfg = experiments.get_config(EXP, settings(args))
  with tempfile.TemporaryDirectory() as workdir:
    trainer.train(cfg, workdir, progress=False)
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
      lines = [json.loads(line) for line in f if '"split"' not in line]
  times = [cfg.train.batch_size / x["examples_per_s"] for x in lines][args.warmup :]
  return times, float(cfg.train.batch_size * (cfg.data.seq_len + 1))


def trl(args) -> tuple[list[float], float]:
  import datasets
  import torch
  import transformers

  try:  # trl >= 1.x keeps GKD under experimental (1.16: trl/experimental/gkd)
    from trl.experimental.gkd import GKDConfig, GKDTrainer
  except ImportError:
    from trl import GKDConfig, GKDTrainer

  torch.set_num_threads(len(os.sched_getaffinity(0)))
  torch.manual_seed(0)
  path = os.path.join(pipeline.shakespeare_dir(), f"{PLAY}_gut.txt")
  with open(path, encoding="utf-8") as f:
    budget = dialogue.budget(args.seq_len)
    records = dialogue.records(PLAY, f.read(), fmt="chat", budget=budget)
  n = (args.warmup + args.steps) * args.batch_size
  data = datasets.Dataset.from_list([{"messages": m} for m in (records * 4)[:n]])
  student, teacher = weights.locate(args.student), weights.locate(args.teacher)
  tokenizer = transformers.AutoTokenizer.from_pretrained(student)
  times, tokens = [], []

  class Timer(transformers.TrainerCallback):
    def on_step_begin(self, *_, **__):
      self.start = time.perf_counter()

    def on_step_end(self, *_, **__):
      times.append(time.perf_counter() - self.start)

  config = GKDConfig(
    output_dir=tempfile.mkdtemp(),
    per_device_train_batch_size=args.batch_size,
    max_steps=args.warmup + args.steps,
    learning_rate=5e-5,
    lr_scheduler_type="constant",
    lmbda=0.0,
    beta=0.5,
    temperature=1.0,
    max_length=args.seq_len + 1,
    report_to=[],
    logging_steps=1,
    save_strategy="no",
    use_cpu=True,
    dataloader_num_workers=0,
    bf16=False,
  )
  trainer_ = GKDTrainer(
    model=transformers.AutoModelForCausalLM.from_pretrained(student, dtype=torch.float32),
    teacher_model=transformers.AutoModelForCausalLM.from_pretrained(teacher, dtype=torch.float32),
    args=config,
    train_dataset=data,
    processing_class=tokenizer,
    callbacks=[Timer()],
  )
  collate = trainer_.data_collator
  for i in range(0, n, args.batch_size):
    tokens.append(collate([data[j] for j in range(i, i + args.batch_size)])["input_ids"].numel())
  trainer_.train()
  return times[args.warmup :], statistics.mean(tokens)


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--student", default="tiny:llama")
  parser.add_argument("--teacher", default="tiny:llama4")
  parser.add_argument("--steps", type=int, default=8)
  parser.add_argument("--warmup", type=int, default=2)
  parser.add_argument("--batch-size", type=int, default=8)
  parser.add_argument("--seq-len", type=int, default=256)
  args = parser.parse_args()
  zoo_times, zoo_tokens = zoo(args)
  trl_times, trl_tokens = trl(args)
  z, t = statistics.median(zoo_times), statistics.median(trl_times)
  result = {
    "student": args.student,
    "teacher": args.teacher,
    "batch_size": args.batch_size,
    "seq_len": args.seq_len,
    "zoo_step_s": round(z, 4),
    "trl_step_s": round(t, 4),
    "trl_over_zoo_step": round(t / z, 3),
    "zoo_tokens_per_step": zoo_tokens,
    "trl_tokens_per_step": trl_tokens,
    "zoo_over_trl_tokens_per_s": round((zoo_tokens / z) / (trl_tokens / t), 3),
  }
  print(json.dumps(result))


if __name__ == "__main__":
  main()
