"""How much of chat/shakespeare-dialogue-dpo's preference its pairs let a judge see: the true
reply against another speaker's of about its length, told apart by the context alone.

Two judges, side by side on the same pairs:

  * words: the reply sharing more distinct words (4 letters or more) with the context wins
    (a tie counts a half). On the recipe's own pairs (the prompt as the recipe gives it: the
    system line and the conversation's earlier turns), and on every speech of every scene
    against a reply drawn the recipe's way, with the scene's last N characters before it as
    the context (N = 300, 1000, 3000): what a longer prompt could add.
  * a model (--workdir, a run of chat/shakespeare-dialogue or its DPO): how often it finds the
    chosen reply likelier (the recipe's preference accuracy), and how much likelier the chosen
    reply is after its own prompt than after another pair's (the context gain, in nats; with
    none, the model does not read the prompt). And whether it copies at all: its loss on the
    second copy of a passage said twice, against the first's (a model that reads its context
    finds the second nearly free).

  python bench/dialogue_signal.py [--workdir runs/dialogue] [--plays hamlet,twelfth_night,...]
"""

import argparse
import random
import re

import numpy as np

from nnx_zoo.common import experiments
from nnx_zoo.common.data import chat, dialogue, pipeline, tokenizers

_WORD = re.compile(r"[A-Za-z']{4,}")


def words(text: str) -> set[str]:
  return {w.lower() for w in _WORD.findall(text)}


def judge(context: str, chosen: str, rejected: str) -> float:
  """1 where the chosen reply shares more words with the context, 0 where the rejected does,
  0.5 on a tie."""
  seen = words(context)
  a, b = len(words(chosen) & seen), len(words(rejected) & seen)
  return 1.0 if a > b else 0.0 if a < b else 0.5


def scene_pairs(play: str, text: str, context_chars: int, seed: int = 0):
  """(context, chosen, rejected) for every speech of every scene but the first: the scene's last
  `context_chars` characters before it, the speech, another speaker's speech of about its length
  from the play (drawn as dialogue.preference_pairs draws)."""
  rng = random.Random(f"{seed}:{play}")
  scenes = dialogue.scenes(text)
  pool = [(who, s) for _, speeches in scenes for who, s in speeches if len(s) >= 10]
  for _, speeches in scenes:
    for i in range(1, len(speeches)):
      me, chosen = speeches[i]
      drawn = rng.sample(pool, min(16, len(pool)))
      candidates = [s for who, s in drawn if who != me and s != chosen][:8]
      if candidates:
        rejected = min(candidates, key=lambda s: abs(len(s) - len(chosen)))
        context = "\n".join(f"{who}: {s}" for who, s in speeches[:i])[-context_chars:]
        yield context, chosen, rejected


def model_judge(workdir: str, cfg, pairs: list[dict]) -> dict:
  """The model's preference accuracy on `pairs` and its context gain: log p(chosen | its
  prompt) - log p(chosen | another pair's prompt)."""
  import jax

  from nnx_zoo.common.hub import weights
  from nnx_zoo.common.tasks import preference

  model = weights.load(workdir)
  template, tokenizer = chat.template(cfg.data), tokenizers.load(cfg.data.tokenizer)
  row_len = cfg.data.seq_len + 1
  logps = jax.jit(lambda b: preference.sequence_logps(model, b))
  others = np.random.default_rng(1).permutation(len(pairs))

  def encode(prompt, reply):
    messages = prompt + [{"role": "assistant", "content": reply}]
    ids, weights_ = chat.encode(template, tokenizer, messages, where="bench")
    return ids[:row_len], chat.final_turn(weights_)[:row_len]

  rows = []
  for i, pair in enumerate(pairs):
    other = pairs[others[i]]["prompt"]
    rows += [encode(pair["prompt"], pair["chosen"]), encode(pair["prompt"], pair["rejected"])]
    rows.append(encode(other, pair["chosen"]))
  rows += rows[-1:] * (len(rows) % 2)  # sequence_logps reads rows two at a time
  out = []
  for start in range(0, len(rows), 32):
    chunk = rows[start : start + 32]
    batch = pipeline.pair_rows([ids for ids, _ in chunk], [w for _, w in chunk], row_len)
    out.append(np.asarray(logps(batch)).reshape(-1))
  chosen, rejected, elsewhere = np.concatenate(out)[: 3 * len(pairs)].reshape(-1, 3).T
  gain = chosen - elsewhere
  return {
    "preference_accuracy": float(np.mean(chosen > rejected)),
    "context_gain_median": float(np.median(gain)),
    "context_gain_positive": float(np.mean(gain > 0)),
    **copying(model, tokenizer, pairs),
  }


def copying(model, tokenizer, pairs: list[dict], length: int = 150) -> dict:
  """Mean loss a token on the first and on the second copy of each `length`-token passage (the
  pairs' chosen replies run together, cut into passages) said twice in a row."""
  import jax

  text = "\n".join(pair["chosen"] for pair in pairs)
  ids = np.asarray(tokenizer.encode(text), np.int32)
  passages = ids[: len(ids) // length * length].reshape(-1, length)[:32]
  rows = np.concatenate([passages, passages], axis=1)
  logp = jax.nn.log_softmax(model(rows[:, :-1]).astype(np.float32), axis=-1)
  nll = -np.take_along_axis(np.asarray(logp), rows[:, 1:, None], axis=-1)[..., 0]
  return {
    "first_copy": float(nll[:, : length - 1].mean()),
    "second_copy": float(nll[:, length:].mean()),
  }


def main():
  p = argparse.ArgumentParser()
  p.add_argument("--exp", default="chat/shakespeare-dialogue-dpo")
  p.add_argument("--workdir", default="", help="a chat model to judge with too")
  p.add_argument("--plays", default="", help="comma-separated (default: the held-out plays)")
  args = p.parse_args()
  cfg = experiments.get_config(args.exp)
  plays = (args.plays or cfg.data.eval_plays).split(",")
  texts = pipeline.read_shakespeare(plays)
  budget = dialogue.budget(cfg.data.seq_len)
  pairs = [
    pair
    for play, text in zip(plays, texts, strict=True)
    for pair in dialogue.preference_pairs(play, text, budget=budget)
  ]
  print(f"{len(pairs)} pairs of the recipe, {', '.join(plays)}")

  def prompt_text(prompt):
    return "\n".join(m["content"] for m in prompt)

  scores = [judge(prompt_text(q["prompt"]), q["chosen"], q["rejected"]) for q in pairs]
  print(f"  words judge, the recipe's prompt          accuracy {np.mean(scores):.3f}")
  for n in (300, 1000, 3000):
    scores = [
      judge(*triple)
      for play, text in zip(plays, texts, strict=True)
      for triple in scene_pairs(play, text, n)
    ]
    print(f"  words judge, the scene's last {n:>4} chars   accuracy {np.mean(scores):.3f}"
          f" ({len(scores)} speeches)")  # fmt: skip
  if args.workdir:
    r = model_judge(args.workdir, cfg, pairs)
    print(
      f"  {args.workdir}: preference accuracy {r['preference_accuracy']:.3f}; the chosen reply "
      f"after its own prompt against another's: median gain {r['context_gain_median']:+.2f} "
      f"nats, higher in {r['context_gain_positive']:.1%} of pairs; a passage said twice: "
      f"{r['first_copy']:.2f} nats a token on the first copy, {r['second_copy']:.2f} on the second"
    )


if __name__ == "__main__":
  main()
