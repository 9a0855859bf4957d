"""The data kind registry: `data.kind` in a config names a `Kind`, which a module of
common/data/ registers, as `model.family` names a family (common/models.py).

A kind loads its splits as the trainer uses them (`Data`) and checks them against the model
config; the trainer calls `load` and names no kind. Adding a kind is one new module that calls
`register(Kind(...))` when imported, plus its name in `MODULES` below: the registry imports
those on first use, so importing this file stays cheap, and a kind's module imports this one
without a cycle.
"""

import dataclasses
import importlib
from collections.abc import Callable, Iterator

import ml_collections
import numpy as np

from nnx_zoo.common.errors import UserError, suggest

# The modules that register the built-in kinds (their `data.kind`s in the comments).
MODULES = (
  "nnx_zoo.common.data.pipeline",  # shakespeare, files, shakespeare_genre
  "nnx_zoo.common.data.spans",  # shakespeare_spans
  "nnx_zoo.common.data.images",  # digits, npz
  "nnx_zoo.common.data.speech",  # spoken_digits
  "nnx_zoo.common.data.prepared",  # prepared (`zoo data prepare`'s shards, mixtures of them)
)


@dataclasses.dataclass
class Data:
  """A data kind's splits as the trainer uses them."""

  iterator: Iterator | None  # endless training batches (a grain iterator: its state is saved)
  eval: object | None  # the held-out split; None when the data has none
  eval_batches: Callable[..., Iterator]  # (split, *, batch_size, max_batches) -> batches
  tokens_per_row: int  # a batch row's tokens for tokens_per_s (an image counts as one)
  prompts: np.ndarray | None = None  # CLIP: the class prompts' tokens, for zero-shot accuracy
  # A held-out metric computed from the params beyond the loss, (graphdef, params) -> dict
  # (speech: the word error rate of greedy transcripts).
  score: Callable[..., dict] | None = None


@dataclasses.dataclass(frozen=True)
class Kind:
  """A `data.kind`: `load(cfg, *, train, batch_size, share) -> Data` (the training iterator only
  when `train`, each batch this process's `share` of its rows, see `pipeline.process_slice`),
  and `check(cfg)`, which raises a UserError where the data does not fit `cfg.model` (run
  before `load`)."""

  name: str
  load: Callable[..., Data]
  check: Callable[[ml_collections.ConfigDict], None] | None = None


_KINDS: dict[str, Kind] = {}
_imported = False


def register(kind: Kind) -> Kind:
  """Adds `kind` under its name. A module imported again (an experiment file run twice)
  replaces its own kinds; a name another module holds is refused."""
  held = _KINDS.get(kind.name)
  if held is not None and _module(held) != _module(kind):
    raise ValueError(
      f"Data kind {kind.name!r} is registered by {_module(held)} already, so "
      f"{_module(kind)} cannot take it: give it another name."
    )
  _KINDS[kind.name] = kind
  return kind


def _module(kind: Kind) -> str | None:
  return getattr(kind.load, "__module__", None)


def _import_builtins():
  global _imported
  if not _imported:
    for module in MODULES:
      importlib.import_module(module)
    _imported = True


def names() -> tuple[str, ...]:
  """Every registered kind, sorted."""
  _import_builtins()
  return tuple(sorted(_KINDS))


def get(name: str) -> Kind:
  """The kind registered as `name`; an unknown one is a UserError with the closest names."""
  known = names()
  if name not in known:
    raise UserError(
      f"Unknown data kind {name!r} (data.kind).{suggest(name, known)} Known: {', '.join(known)}."
    )
  return _KINDS[name]


def check_vocab(cfg, ids: int, what: str):
  """A kind's check that the model's vocabulary holds the `ids` its data uses (`what`: "The
  tokenizer has", "The data uses ... ids (...)": the start of the error, before the count)."""
  if ids > cfg.model.vocab_size and cfg.get("model_from"):  # the vocabulary is the checkpoint's
    raise UserError(
      f"{what.format(ids=ids)} but the init_from model's vocabulary has {cfg.model.vocab_size}: "
      "give a tokenizer that fits it (leave data.tokenizer unset: the checkpoint's own)."
    )
  if ids > cfg.model.vocab_size:
    raise UserError(
      f"{what.format(ids=ids)} but model.vocab_size is {cfg.model.vocab_size}: set "
      f"--config.model.vocab_size={ids} or more."
    )


def check(cfg):
  """The checks of `cfg.data.kind` against `cfg.model` (its tokenizer's size, its chat template),
  which the trainer runs before it writes anything."""
  kind = get(cfg.data.kind)
  if kind.check is not None:
    kind.check(cfg)


def load(cfg, *, train: bool, batch_size: int, share: slice | None, checked: bool = False) -> Data:
  """The data of `cfg.data.kind`, checked against `cfg.model` first (unless the caller has:
  `checked`). `train=False`: the held-out split only (`zoo eval`)."""
  if not checked:
    check(cfg)
  return get(cfg.data.kind).load(cfg, train=train, batch_size=batch_size, share=share)
