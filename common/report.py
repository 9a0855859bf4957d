"""`zoo data show` and `zoo data bench`: the rows a run would see, and how fast they come. Above the
trainer, beside the CLI: it reads the data as the trainer does, and runs it to measure its rate."""

import json
import os
import statistics
import tempfile
import time

import numpy as np

from nnx_zoo.common import tasks
from nnx_zoo.common.data import tokenizers
from nnx_zoo.common.errors import UserError
from nnx_zoo.common.tasks import losses
from nnx_zoo.common.train import trainer


def _rows_of(batch: dict) -> dict:
  """A batch as the model reads it: a language model's packed rows become their next-token rows
  (inputs, targets, weights, segment_ids, positions); other token batches stay as they are."""
  if np.ndim(batch.get("tokens")) == 3:  # preference pairs [B, 2, T]: chosen, rejected rows
    keys = ("tokens", "segment_ids", "loss_weights")
    batch = {k: np.reshape(batch[k], (-1, np.shape(batch[k])[-1])) for k in keys}
  if {"tokens", "segment_ids"} <= set(batch) and "labels" not in batch:
    return dict(losses.next_token_rows(batch))
  if not all(np.issubdtype(np.asarray(v).dtype, np.integer) for v in batch.values()):
    raise UserError(
      "`zoo data show` prints token rows; this experiment's rows are images or audio: look at "
      "its data with its own tools."
    )
  return dict(batch)


def rows(cfg, *, split: str = "train", count: int = 4, data=None) -> list[dict]:
  """The first `count` rows of `split` the trainer would see (the training batches in the
  order a fresh run draws them), each a dict of lists of ints. `data`: `trainer.load_data`'s."""
  if split not in ("train", "eval"):
    raise UserError(f"--split {split!r}: use train or eval.")
  data = data or trainer.load_data(cfg, train=split == "train")
  if split == "train":
    batches = iter(data.iterator)
  else:
    if data.eval is None:
      raise UserError("This experiment has no held-out split: set data.eval_files.")
    held_out = data.eval.values() if isinstance(data.eval, dict) else [data.eval]
    batches = (
      b for part in held_out for b in data.eval_batches(part, batch_size=cfg.train.batch_size)
    )
  out = []
  for batch in batches:
    batch = _rows_of({k: np.asarray(v) for k, v in batch.items()})
    for i in range(len(next(iter(batch.values())))):
      out.append(
        {
          k: np.asarray(v[i]).astype(np.int64 if k != "weights" else float).tolist()
          for k, v in batch.items()
        }
      )
      if len(out) == count:
        return out
  return out


def render(row: dict, tokenizer) -> str:
  """A row as text: each document of the row after a rule, the targets that carry no loss
  (weight 0) between ⟦ and ⟧."""
  if "inputs" not in row:
    return json.dumps(row)
  lines, segment, run, free = [], None, [], None

  def flush():
    if run:
      text = tokenizer.decode(run)
      lines.append(f"⟦{text}⟧" if free else text)

  for target, weight, seg in zip(row["targets"], row["weights"], row["segment_ids"], strict=True):
    is_free = weight == 0
    if seg != segment:
      flush()
      run, free = [], is_free
      lines.append(f"\n──── segment {seg} {'(padding) ' if seg == 0 else ''}" + "─" * 20 + "\n")
      segment = seg
    elif is_free != free:
      flush()
      run, free = [], is_free
    run.append(target)
  flush()
  return "".join(lines)


def show(cfg, *, split: str, count: int, as_json: bool) -> str:
  """The first `count` rows of `split` as the model reads them: each row's text, or (a task that
  makes its rows from the data's, grpo) what the task makes of them (`Task.samples`)."""
  if split not in ("train", "eval"):
    raise UserError(f"--split {split!r}: use train or eval.")
  data = trainer.load_data(cfg, train=split == "train")
  made = tasks.of(cfg).samples(data, cfg=cfg, split=split, count=count)
  if made is not None:
    if as_json:
      return "\n".join(json.dumps(m) for m in made)
    return "\n".join(render_samples(m, i) for i, m in enumerate(made))
  found = rows(cfg, split=split, count=count, data=data)
  if as_json:
    return "\n".join(json.dumps(r) for r in found)
  tokenizer = tokenizers.load(cfg.data.tokenizer) if "tokenizer" in cfg.data else None
  out = []
  for i, r in enumerate(found):
    out.append(f"════ row {i} " + "═" * 40)
    out.append(render(r, tokenizer) if tokenizer is not None else json.dumps(r))
  return "\n".join(out)


def render_samples(made: dict, i: int) -> str:
  """A prompt and its scored completions (`Task.samples`) as text."""
  out = [f"════ prompt {i} " + "═" * 40]
  out += [f"{m['role']}: {m['content']}" for m in made["prompt"]]
  for j, c in enumerate(made["completions"]):
    each = ", ".join(f"{k} {v:.3f}" for k, v in c["rewards"].items())
    cut = ", truncated" if c["truncated"] else ""
    out.append(f"──── completion {j}: reward {c['reward']:.3f} ({each}), {c['tokens']} tokens{cut}")
    out.append(c["text"])
  return "\n".join(out)


def pipeline_rate(cfg, *, batches: int = 50) -> dict:
  """The training pipeline's batches and tokens a second on this host (after one batch to
  start it)."""
  data = trainer.load_data(cfg)
  it = data.iterator
  next(it)
  start = time.perf_counter()
  for _ in range(batches):
    next(it)
  seconds = time.perf_counter() - start
  tokens = batches * cfg.train.batch_size * data.tokens_per_row
  return {"batches": batches, "seconds": seconds, "tokens_per_s": tokens / seconds}


def trainer_rate(cfg, *, steps: int = 5) -> dict:
  """What the trainer consumes: tokens a step and its measured steps a second, from a short
  run in a temporary workdir (the first step, which compiles, is not counted)."""
  cfg = cfg.copy_and_resolve_references()
  cfg.init_from = ""
  cfg.train.update(steps=steps + 1, log_every=1, eval_every=0, checkpoint_every=10**9)
  with tempfile.TemporaryDirectory() as workdir:
    trainer.train(cfg, workdir, progress=False)
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
      lines = [json.loads(line) for line in f]
  rates = [m["tokens_per_s"] for m in lines if m.get("split") != "eval" and m["step"] > 1]
  return {"steps": len(rates), "tokens_per_s": statistics.median(rates)}


def bench(cfg, *, batches: int = 50, steps: int = 5) -> dict:
  feed = pipeline_rate(cfg, batches=batches)
  need = trainer_rate(cfg, steps=steps)
  return {
    "pipeline_tokens_per_s": round(feed["tokens_per_s"]),
    "trainer_tokens_per_s": round(need["tokens_per_s"]),
    "ratio": round(feed["tokens_per_s"] / need["tokens_per_s"], 2),
    "tokens_per_step": cfg.train.batch_size * cfg.data.seq_len,
  }
