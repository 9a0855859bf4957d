"""The reward curve of a GRPO run as a PNG: each step's mean reward of its sampled completions
(and a moving average), and the held-out greedy reward at each evaluation.

    pip install -e ".[bench]" && python bench/plot_rewards.py WORKDIR OUT.png [--base R]

--base: the start's held-out reward (`zoo eval` before training), drawn at step 0.
"""

import argparse
import json
import os


def main():
  p = argparse.ArgumentParser()
  p.add_argument("workdir")
  p.add_argument("out")
  p.add_argument("--base", type=float, help="the held-out reward before training")
  p.add_argument("--window", type=int, default=5)
  args = p.parse_args()
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  with open(os.path.join(args.workdir, "metrics.jsonl")) as f:
    lines = [json.loads(line) for line in f]
  train = [x for x in lines if "split" not in x and "reward" in x]
  held = [x for x in lines if x.get("split") == "eval" and x["step"] > 0]
  steps, reward = [x["step"] for x in train], [x["reward"] for x in train]
  w = args.window
  smooth = [sum(reward[max(0, i - w + 1) : i + 1]) / len(reward[max(0, i - w + 1) : i + 1])
            for i in range(len(reward))]  # fmt: skip
  fig, ax = plt.subplots(figsize=(7, 4), dpi=120)
  ax.plot(steps, reward, color="0.75", lw=1, label="sampled completions (a step's mean)")
  ax.plot(steps, smooth, color="C0", lw=2, label=f"the same, mean of {w} steps")
  held_steps = [x["step"] for x in held]
  held_reward = [x["reward"] for x in held]
  if args.base is not None:
    held_steps, held_reward = [0, *held_steps], [args.base, *held_reward]
  ax.plot(held_steps, held_reward, "o-", color="C3", lw=2, label="held out, greedy")
  ax.set_xlabel("step")
  ax.set_ylabel("mean reward")
  ax.set_title(os.path.basename(os.path.normpath(args.workdir)))
  ax.grid(alpha=0.3)
  ax.legend(loc="upper left", fontsize=8)
  fig.tight_layout()
  fig.savefig(args.out)


if __name__ == "__main__":
  main()
