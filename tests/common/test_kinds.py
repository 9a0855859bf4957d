"""The data kind registry (common/data/kinds.py): an unknown kind is named with the closest
ones, a kind registered by one module alone trains through the trainer, and every experiment's
kind is registered."""

import importlib
import json
import math

import numpy as np
import pytest

from nnx_zoo.common import experiments
from nnx_zoo.common.data import kinds, pipeline
from nnx_zoo.common.errors import UserError
from nnx_zoo.common.train import trainer
from nnx_zoo.experiments import REGISTRY

SMOKE = "lm/shakespeare-char:smoke"  # a tiny Llama on rows of 32 + 1 bytes


def test_an_unknown_kind_is_named_with_the_closest_ones():
  with pytest.raises(UserError, match=r"'shakespear'.*Did you mean: shakespeare.*Known: "):
    kinds.get("shakespear")
  cfg = experiments.get_config(SMOKE, {"data.kind": "shakespear"})
  with pytest.raises(UserError, match=r"Unknown data kind 'shakespear'.*Did you mean"):
    trainer.load_data(cfg)


# A kind of this file alone: random token rows held in memory, and a check that counts its calls.

TOY = "toy_rows_for_test"
checked = []


def toy_check(cfg):
  checked.append(cfg.data.kind)
  if cfg.model.vocab_size < 256:
    raise UserError(f"The toy rows use 256 ids but model.vocab_size is {cfg.model.vocab_size}.")


def toy_load(cfg, *, train: bool, batch_size: int, share) -> kinds.Data:
  assert checked, "check runs before load"
  tokens = np.random.default_rng(0).integers(0, 256, (16, cfg.data.seq_len + 1), np.int32)
  rows = pipeline.Rows({"tokens": tokens, "segment_ids": np.ones_like(tokens)}, "toy")
  iterator = None
  if train:
    iterator = pipeline.train_iterator(rows, batch_size=batch_size, seed=cfg.seed, share=share)
  return kinds.Data(iterator, rows, pipeline.eval_batches, cfg.data.seq_len)


kinds.register(kinds.Kind(TOY, toy_load, toy_check))


def test_a_kind_registered_by_one_module_trains(tmp_path):
  overrides = {"data.kind": TOY, "train.steps": "2", "train.eval_every": "2"}
  cfg = experiments.get_config(SMOKE, overrides)
  assert TOY in kinds.names()
  checked.clear()
  last = trainer.train(cfg, str(tmp_path), progress=False)
  assert checked == [TOY]
  assert math.isfinite(last["loss"]) and math.isfinite(last["eval_loss"])
  with open(tmp_path / "metrics.jsonl") as f:
    records = [json.loads(line) for line in f if line.strip()]
  assert [r["step"] for r in records if "split" not in r] == [1, 2]
  assert [r["step"] for r in records if r.get("split") == "eval"] == [2]

  cfg = experiments.get_config(SMOKE, {**overrides, "model.vocab_size": "128"})
  with pytest.raises(UserError, match="toy rows use 256 ids"):
    trainer.load_data(cfg)


def test_a_name_another_module_holds_is_refused():
  with pytest.raises(ValueError, match="registered by nnx_zoo.common.data.pipeline"):
    kinds.register(kinds.Kind("shakespeare", toy_load))


def forms() -> list[str]:
  """Every registered experiment with each of its arguments."""
  out = []
  for name, module in REGISTRY.items():
    args = getattr(importlib.import_module(module), "ARGS", ("smoke",))
    out += [name] + [f"{name}:{arg}" for arg in args]
  return out


@pytest.mark.parametrize("form", forms())
def test_every_experiments_kind_is_registered(form):
  kind = experiments.get_config(form, resolve=False).data.kind
  assert kinds.get(kind).name == kind
