"""bench/padding.py's count of the tokens a DPO step computes and the real ones among them,
against a count written here from the rows' segment ids."""

import importlib.util
import json
import pathlib

import numpy as np
import pytest

from nnx_zoo.common import experiments
from nnx_zoo.common.train import trainer

ROOT = pathlib.Path(__file__).resolve().parents[2]


def load():
  spec = importlib.util.spec_from_file_location("padding", ROOT / "bench" / "padding.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


@pytest.mark.slow  # loads the data four times: about 20 s here under load
def test_counts_of_one_pair_a_row_and_packed(tmp_path):
  bench = load()
  with open(tmp_path / "train.jsonl", "w") as f:
    for i in range(24):
      word = "w" * (i % 7 + 1)
      f.write(json.dumps({"prompt": [{"role": "user", "content": f"echo {word}"}],
                          "chosen": word, "rejected": word.upper()}) + "\n")  # fmt: skip
  over = {"data.kind": "files", "data.train_files": str(tmp_path / "train.jsonl")}
  over.update({"data.eval_plays": "", "train.batch_size": "2"})
  got = {}
  for layout in ("one", "packed"):
    cfg = experiments.get_config(
      "chat/shakespeare-dialogue-dpo:smoke", {**over, "data.pairs_per_row": layout}
    )
    got[layout] = bench.measure(cfg, 3)
    batches = trainer.load_data(cfg).iterator
    seg = np.stack([next(batches)["segment_ids"] for _ in range(3)])
    assert got[layout]["computed"] == seg.size
    assert got[layout]["real"] == (seg > 0).sum()
    assert got[layout]["pairs"] == sum(seg.max(axis=(2, 3)).ravel() // 2)
  assert got["one"]["pairs"] == 6 < got["packed"]["pairs"]
  assert (
    got["one"]["real"] / got["one"]["computed"] < got["packed"]["real"] / got["packed"]["computed"]
  )
