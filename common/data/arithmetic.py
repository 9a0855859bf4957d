"""Arithmetic problems as prompts whose answers a program checks (`data.kind="arithmetic"`,
`data.format="prompts"`): what a GRPO run's reward can score with no data files. Each record is
{"prompt": messages, "answer": str}; a fixed draw of 128 problems is held out and never trained
on. `data.problems` picks the set:

- "sums": every pair (a, b) with 10 <= a, b <= 99, "What is a + b?";
- "calculator": "What is a * b + c?" (a of 3 digits, b of 2, c of 4), to be solved with the
  calculator tools below (`multiply`, then `add` on its result): two calls whose results feed
  each other. 20,000 training problems of a fixed draw.
"""

import random

LOW, HIGH = 10, 99
HELD_OUT = 128
PROBLEMS = ("sums", "calculator")
CALCULATOR_TRAIN = 20_000


def records(split: str, problems: str = "sums") -> list[dict]:
  """The records of `split` ("train": every problem but the held-out ones, in a fixed shuffled
  order; "eval": the held-out problems)."""
  if problems == "calculator":
    return _calculator(split)
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


def _calculator(split: str) -> list[dict]:
  rng = random.Random(1)
  seen, triples = set(), []
  while len(triples) < HELD_OUT + CALCULATOR_TRAIN:
    t = (rng.randint(100, 999), rng.randint(10, 99), rng.randint(1000, 9999))
    if t not in seen:
      seen.add(t)
      triples.append(t)
  chosen = triples[:HELD_OUT] if split == "eval" else triples[HELD_OUT:]
  return [
    {
      "prompt": [
        {
          "role": "user",
          "content": f"What is {a} * {b} + {c}? Use the tools, then answer with the number only.",
        }
      ],
      "answer": str(a * b + c),
    }
    for a, b, c in chosen
  ]


# The calculator's tools (grpo.tools="nnx_zoo.common.data.arithmetic:multiply,...").


def add(a: int, b: int) -> int:
  """Adds two integers.

  Args:
    a: The first number.
    b: The second number.
  """
  return a + b


def multiply(a: int, b: int) -> int:
  """Multiplies two integers.

  Args:
    a: The first factor.
    b: The second factor.
  """
  return a * b
