"""What dynamic sampling's refill gains a step: chat/smollm2-arithmetic-grpo with
grpo.filter_tied_groups, `--steps` steps with grpo.refill on (a round's rows take finished rows'
slots) and off (a round at a time), side by side in one process: the engine steps the rollouts
took (a count, whatever the machine's load), the sampling seconds, and that the rows trained on
are the same.

    pip install -e ".[smollm2]" && python bench/grpo_refill.py [--steps 8]
"""

import argparse
import json
import os
import tempfile

import numpy as np

from nnx_zoo.common import engine, experiments
from nnx_zoo.common.tasks import grpo
from nnx_zoo.common.train import trainer

EXP = "chat/smollm2-arithmetic-grpo"


def run(steps: int, refill: bool) -> dict:
  overrides = {"grpo.filter_tied_groups": "True", "grpo.refill": str(refill),
               "train.steps": str(steps), "train.eval_every": "0",
               "train.checkpoint_every": str(steps)}  # fmt: skip
  cfg = experiments.get_config(EXP, overrides)
  counted, rows = {"engine_steps": 0}, []
  step, complete = engine.Engine.step, grpo.GRPO.complete

  def counting(self):
    counted["engine_steps"] += 1
    return step(self)

  def recording(self, batch, params):
    out = complete(self, batch, params)
    if "advantages" in out:
      rows.append(np.asarray(out["tokens"]))
    return out

  engine.Engine.step, grpo.GRPO.complete = counting, recording
  try:
    with tempfile.TemporaryDirectory() as workdir:
      trainer.train(cfg, workdir, progress=False)
      with open(os.path.join(workdir, "metrics.jsonl")) as f:
        lines = [json.loads(line) for line in f if '"split"' not in line]
  finally:
    engine.Engine.step, grpo.GRPO.complete = step, complete
  return {
    **counted,
    "sample_s": sum(x["sample_s"] for x in lines),
    "rounds": sum(x["sampling_rounds"] for x in lines),
    "rows": rows,
  }


def main():
  p = argparse.ArgumentParser()
  p.add_argument("--steps", type=int, default=8)
  args = p.parse_args()
  on, off = run(args.steps, True), run(args.steps, False)
  same = all(np.array_equal(a, b) for a, b in zip(on["rows"], off["rows"], strict=True))
  print(f"\n{EXP}, filter_tied_groups, {args.steps} steps ({off['rounds']:.0f} rounds of sampling)")
  print("| | engine steps | sampling s |\n|---|---|---|")
  for name, r in (("a round at a time", off), ("refill", on)):
    print(f"| {name} | {r['engine_steps']} | {r['sample_s']:.1f} |")
  print(f"| refill / a round at a time | {on['engine_steps'] / off['engine_steps']:.2f}x | "
        f"{on['sample_s'] / off['sample_s']:.2f}x |")  # fmt: skip
  print(f"the rows trained on: {'the same' if same else 'DIFFERENT'}")


if __name__ == "__main__":
  main()
