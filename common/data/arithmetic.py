"""Sums of two numbers as prompts whose answers a program checks (`data.kind="arithmetic"`,
`data.format="prompts"`): what a GRPO run's reward can score with no data files. Every pair
(a, b) with 10 <= a, b <= 99 is one record {"prompt": messages, "answer": "a + b"}; a fixed
draw of 128 pairs is held out and never trained on."""

import random

LOW, HIGH = 10, 99
HELD_OUT = 128


def records(split: str) -> list[dict]:
  """The records of `split` ("train": every pair but the held-out ones, in a fixed shuffled
  order; "eval": the held-out pairs)."""
  pairs = [(a, b) for a in range(LOW, HIGH + 1) for b in range(LOW, HIGH + 1)]
  random.Random(0).shuffle(pairs)
  chosen = pairs[:HELD_OUT] if split == "eval" else pairs[HELD_OUT:]
  return [
    {
      "prompt": [{"role": "user", "content": f"What is {a} + {b}? Answer with the number only."}],
      "answer": str(a + b),
    }
    for a, b in chosen
  ]
