"""Shared prefixes copied between slots, against each slot reading its own prompt, side by side
in one run, alternating: the agentic recipe's rollout (chat/qwen-calculator-grpo: 4 problems x
4 episodes, each prompt ~320 tokens of which ~300 are the tools' preamble every episode shares)
on one engine with `share_prefixes` on and off. Prints each round's wall time, the prompt tokens
the engine read (prefill) and whether the episodes' tokens are the same.

  python bench/engine_prefixes.py --model /path/to/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf
"""

import argparse
import statistics
import time

import jax

from nnx_zoo.common import experiments, tasks
from nnx_zoo.common.hub import weights
from nnx_zoo.common.tasks import episodes
from nnx_zoo.common.train import trainer


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--model", required=True, help="the recipe's init_from (its GGUF file)")
  ap.add_argument("--experiment", default="chat/qwen-calculator-grpo")
  ap.add_argument("--problems", type=int, default=4)
  ap.add_argument("--rounds", type=int, default=2)
  args = ap.parse_args()
  cfg = experiments.get_config(args.experiment, {"init_from": args.model})
  task = tasks.of(cfg)
  task.prepare(trainer.load_data(cfg), cfg=cfg)
  _, params = weights.init_from_params(cfg)
  params = task._sampler_params(params)
  records, _ = task._split("train")
  G = task.s.group_size
  starts = [(r["prompt"], {"answer": r["answer"]}, jax.random.key(100 * i + g))
            for i, r in enumerate(records[: args.problems]) for g in range(G)]  # fmt: skip
  settings = episodes.settings_of(task.s)
  read = {}

  def play(share: bool):
    make = episodes.engine_for(task._graphdef, params, settings, share_prefixes=share)
    t = time.perf_counter()
    played = task.agent.run(starts, settings, engine_for=make, max_prompt=cfg.data.seq_len)
    seconds = time.perf_counter() - t
    prompt = sum(ep.prompt_len for ep in played)
    read[share] = sum(ep.reread_tokens for ep in played)
    return seconds, [ep.tokens for ep in played], prompt

  play(True)  # compiles the programs both use
  play(False)
  times = {True: [], False: []}
  tokens = {}
  for _ in range(args.rounds):
    for share in (True, False):
      seconds, tokens[share], prompt = play(share)
      times[share].append(seconds)
  same = sum(a == b for a, b in zip(tokens[True], tokens[False], strict=True))
  on, off = statistics.median(times[True]), statistics.median(times[False])
  print(f"{len(starts)} episodes ({args.problems} problems x {G}), {prompt} prompt tokens in all")
  print(f"  shared  {on:7.1f} s a rollout (median of {args.rounds}), prompt and context tokens "
        f"read: {read[True]}")  # fmt: skip
  print(f"  apart   {off:7.1f} s, read: {read[False]}")
  print(f"  ratio apart/shared {off / on:.2f}x; the same tokens in {same}/{len(starts)} episodes")


if __name__ == "__main__":
  main()
