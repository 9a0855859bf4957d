"""A GRPO step on a real checkpoint: the zoo's (chat/smollm2-arithmetic-grpo's settings, its own
compiled sampler in the loop) vs TRL's GRPOTrainer (transformers' `generate` in the loop), on
the same CPU, weights, prompts, group size, completion length, rewards and LoRA.

    pip install -e ".[bench]" peft trl && python bench/grpo_vs_trl.py --hf-dir DIR [--steps 6]

DIR is a Hugging Face directory (SmolLM2-135M-Instruct). Each side trains `--warmup` steps
(compilation), then `--steps` steps, timed one by one; the median step time is reported with
its split between sampling and the rest. The two run one after the other, so run it on a quiet
machine.
"""

import argparse
import json
import os
import statistics
import tempfile
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from nnx_zoo.common import experiments
from nnx_zoo.common.data import arithmetic
from nnx_zoo.common.tasks import rewards
from nnx_zoo.common.train import trainer

EXP = "chat/smollm2-arithmetic-grpo"
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def zoo(hf_dir: str, steps: int) -> dict:
  overrides = {"init_from": hf_dir, "train.steps": str(steps), "train.eval_every": "0"}
  overrides["train.checkpoint_every"] = str(steps)
  cfg = experiments.get_config(EXP, overrides)
  with tempfile.TemporaryDirectory() as workdir:
    trainer.train(cfg, workdir, progress=False)
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
      lines = [json.loads(line) for line in f if '"split"' not in line]
  return cfg, [
    {"step": x["sample_s"] + x["reward_s"] + x["train_s"], "sample": x["sample_s"]} for x in lines
  ]


def trl(hf_dir: str, cfg, steps: int) -> list[dict]:
  import datasets
  import peft
  import torch
  import transformers
  import trl as trl_lib

  torch.set_num_threads(len(os.sched_getaffinity(0)))
  torch.manual_seed(0)
  g = cfg.grpo
  records = arithmetic.records("train")[: steps * cfg.train.batch_size * 2]
  data = datasets.Dataset.from_list(records)
  model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
  times, sample = [], []

  class Timer(transformers.TrainerCallback):
    def on_step_begin(self, *_, **__):
      self.t = time.perf_counter()

    def on_step_end(self, *_, **__):
      times.append(time.perf_counter() - self.t)

  def contains_answer(prompts, completions, answer, **_):
    return rewards.contains_answer(prompts, completions, answer)

  def number_only(prompts, completions, **_):
    return rewards.number_only(prompts, completions)

  generate = transformers.GenerationMixin.generate

  def timed_generate(self, *args, **kwargs):
    t = time.perf_counter()
    out = generate(self, *args, **kwargs)
    sample.append(time.perf_counter() - t)
    return out

  transformers.GenerationMixin.generate = timed_generate
  with tempfile.TemporaryDirectory() as out:
    args = trl_lib.GRPOConfig(
      output_dir=out,
      per_device_train_batch_size=cfg.train.batch_size * g.group_size,
      num_generations=g.group_size,
      max_completion_length=g.max_new_tokens,
      max_steps=steps,
      learning_rate=cfg.optim.lr,
      beta=g.beta,
      temperature=g.temperature,
      mask_truncated_completions=g.truncated == "mask",
      reward_weights=[1.0, 0.5],
      logging_steps=1,
      report_to="none",
      save_strategy="no",
      use_cpu=True,
      bf16=False,
      seed=0,
    )
    lora = peft.LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules=TARGETS)
    trainer_ = trl_lib.GRPOTrainer(
      model=model,
      reward_funcs=[contains_answer, number_only],
      args=args,
      train_dataset=data,
      peft_config=lora,
      callbacks=[Timer()],
    )
    trainer_.train()
  transformers.GenerationMixin.generate = generate
  return [{"step": t, "sample": s} for t, s in zip(times, sample, strict=False)]


def main():
  p = argparse.ArgumentParser()
  p.add_argument("--hf-dir", required=True)
  p.add_argument("--warmup", type=int, default=2)
  p.add_argument("--steps", type=int, default=6)
  args = p.parse_args()
  total = args.warmup + args.steps
  cfg, ours = zoo(args.hf_dir, total)
  theirs = trl(args.hf_dir, cfg, total)
  rows = {"zoo": ours[args.warmup :], "TRL GRPOTrainer": theirs[args.warmup :]}
  g = cfg.grpo
  print(
    f"\n{args.hf_dir}: {cfg.train.batch_size} prompts x {g.group_size} completions of at most "
    f"{g.max_new_tokens} tokens a step, LoRA rank 8, fp32; median of {args.steps} steps after "
    f"{args.warmup}\n"
  )
  print("| | s a step | of it sampling | steps/s | zoo / this |\n|---|---|---|---|---|")
  median = {n: statistics.median(x["step"] for x in r) for n, r in rows.items()}
  for name, r in rows.items():
    sampling = statistics.median(x["sample"] for x in r)
    print(
      f"| {name} | {median[name]:.2f} | {sampling:.2f} | {1 / median[name]:.3f} | "
      f"{median[name] / median['zoo']:.2f}x |"
    )


if __name__ == "__main__":
  main()
