"""The data side's targets, measured side by side in one run on this host.

  python bench/data_pipeline.py [--small 5e6 --large 5e8] [--skip-prepare] [--skip-startup]
                                [--gpt2-mb 40 --bytes-mb 400]

1. Prepare: `zoo data prepare`'s tokens/s with GPT-2's BPE and MB/s with bytes, over 8 JSONL
   shards of the plays' paragraphs (40 and 400 MB), with 1 worker and with every core.
2. Start-up: from `zoo run` to its first step done, and the peak resident memory, on a prepared
   corpus of `--small` and of `--large` tokens (synthetic ids written straight into shards, the
   same experiment otherwise), and their ratios (targets: at most 1.2x and 1.1x).
3. Pipeline: packed rows a second on one core (`PackedRows.read` of shuffled global batches).
"""

import argparse
import json
import os
import re
import resource
import subprocess
import sys
import tempfile
import time

import numpy as np

from nnx_zoo.common.data import pipeline, prepare, prepared, tokenizers


def paragraphs_corpus(folder: str, megabytes: float, shards: int) -> float:
  """JSONL shards of the plays' paragraphs (repeated until `megabytes`); returns their MB."""
  texts = pipeline.read_shakespeare(pipeline.shakespeare_plays())
  paragraphs = [p for t in texts for p in re.split(r"\n\s*\n", t) if p.strip()]
  lines = [json.dumps({"text": p}) + "\n" for p in paragraphs]
  per_shard = megabytes * 1e6 / shards
  os.makedirs(folder, exist_ok=True)
  total = 0
  for s in range(shards):
    size, i = 0, s
    with open(os.path.join(folder, f"part-{s:03d}.jsonl"), "w") as f:
      while size < per_shard:
        f.write(lines[i % len(lines)])
        size += len(lines[i % len(lines)])
        i += shards
    total += size
  return total / 1e6


def bench_prepare(workdir: str, megabytes: dict[str, float]) -> list[dict]:
  """Each tokenizer over its own corpus size (bytes are fast: a bigger corpus, or the workers'
  start-up is most of what is timed)."""
  results = []
  for kind, size in megabytes.items():
    corpus = os.path.join(workdir, f"corpus-{kind}")
    mb = paragraphs_corpus(corpus, size, shards=8)
    cfg = pipeline.config(
      kind="files", train_files=f"{corpus}/*.jsonl", tokenizer=tokenizers.config(kind)
    )
    for workers in (1, os.cpu_count()):
      out = os.path.join(workdir, f"prepared-{kind}-{workers}")
      r = prepare.prepare(cfg, out, workers=workers, progress=False)
      results.append(
        {
          "tokenizer": kind,
          "workers": workers,
          "MB": round(mb, 1),
          "seconds": r["seconds"],
          "M_tokens_per_s": round(r["tokens"] / r["seconds"] / 1e6, 2),
          "MB_per_s": round(mb / r["seconds"], 1),
        }
      )
      print(json.dumps(results[-1]), flush=True)
  return results


def synthetic(out: str, tokens: int, *, doc_len: int = 2000, shard_tokens: int = 50_000_000):
  """A prepared directory of `tokens` random byte ids in documents of about `doc_len`, as
  `zoo data prepare` with the bytes tokenizer writes it (without tokenizing anything)."""
  shards = os.path.join(out, "shards")
  os.makedirs(shards, exist_ok=True)
  rng = np.random.default_rng(0)
  entries, left, n = [], tokens, 0
  while left:
    size = min(left, shard_tokens)
    key = f"synthetic-{n:04d}"
    writer = prepare._ShardWriter(shards, key, "train", np.dtype(np.uint8))
    for start in range(0, size, 5_000_000):
      chunk = rng.integers(32, 127, min(5_000_000, size - start), dtype=np.uint8)
      lengths = np.full(-(-len(chunk) // doc_len), doc_len, np.int64)
      lengths[-1] = len(chunk) - doc_len * (len(lengths) - 1)
      writer.add(chunk, lengths)
    counts = writer.close()
    entry = {
      "source": {"path": key},
      "rule": {"split": "train"},
      "text_field": "text",
      "splits": {"train": counts},
    }
    with open(os.path.join(shards, f"{key}.json"), "w") as f:
      json.dump(entry, f)
    entries.append({"key": key, "path": key})
    left -= size
    n += 1
  cfg = tokenizers.config("bytes")
  manifest = {
    "format": prepare.FORMAT,
    "tokenizer": tokenizers.identity(cfg),
    "dtype": "uint8",
    "sources": entries,
  }
  with open(os.path.join(out, prepare.MANIFEST), "w") as f:
    json.dump(manifest, f)


STARTUP = """
import json, resource, sys, time
t0 = time.perf_counter()
from nnx_zoo.common import experiments
from nnx_zoo.common.train import trainer
cfg = experiments.get_config("lm/shakespeare-char", {
  "data.kind": "prepared", "data.path": sys.argv[1], "train.steps": "1", "train.eval_every": "0",
  "train.checkpoint_every": "1000"})
trainer.train(cfg, sys.argv[2], progress=False)
print(json.dumps({"seconds": time.perf_counter() - t0,
                  "peak_rss_MB": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
"""


def bench_startup(workdir: str, small: int, large: int) -> dict:
  out = {}
  for name, tokens in (("small", small), ("large", large)):
    path = os.path.join(workdir, f"synthetic-{name}")
    t0 = time.perf_counter()
    synthetic(path, tokens)
    print(f"wrote {tokens:,} tokens in {time.perf_counter() - t0:.1f} s", flush=True)
    out[name] = path
  runs = {}
  for repeat in range(2):  # alternated, so a slow moment of the machine hits both
    for name in ("small", "large"):
      run_dir = tempfile.mkdtemp(dir=workdir)
      result = subprocess.run(
        [sys.executable, "-c", STARTUP, out[name], run_dir], capture_output=True, text=True
      )
      if result.returncode:
        raise SystemExit(result.stderr[-3000:])
      runs.setdefault(name, []).append(json.loads(result.stdout.strip().splitlines()[-1]))
      print(name, repeat, runs[name][-1], flush=True)
  best = {n: {k: min(r[k] for r in rs) for k in rs[0]} for n, rs in runs.items()}
  return {
    "small_tokens": small,
    "large_tokens": large,
    **{f"{n}_{k}": round(v, 2) for n, b in best.items() for k, v in b.items()},
    "startup_ratio": round(best["large"]["seconds"] / best["small"]["seconds"], 3),
    "memory_ratio": round(best["large"]["peak_rss_MB"] / best["small"]["peak_rss_MB"], 3),
    "paths": out,
  }


def bench_rows(path: str, *, batch_size: int = 64, seq_len: int = 1024, batches: int = 200):
  rows = prepared.PackedRows(prepared.Split(path, "train"), seq_len + 1, pad_last=False)
  it = prepared.train_iterator({"": rows}, {"": 1.0}, batch_size=batch_size, seed=0)
  next(it)
  t0 = time.perf_counter()
  for _ in range(batches):
    next(it)
  seconds = time.perf_counter() - t0
  return {
    "batch": [batch_size, seq_len + 1],
    "M_tokens_per_s_one_core": round(batches * batch_size * (seq_len + 1) / seconds / 1e6, 2),
  }


def main():
  p = argparse.ArgumentParser()
  p.add_argument("--small", type=float, default=5e6)
  p.add_argument("--large", type=float, default=5e8)
  p.add_argument("--gpt2-mb", type=float, default=40, help="corpus prepared with GPT-2 BPE")
  p.add_argument("--bytes-mb", type=float, default=400, help="corpus prepared as bytes")
  p.add_argument("--skip-prepare", action="store_true")
  p.add_argument("--skip-startup", action="store_true")
  args = p.parse_args()
  resource.setrlimit(resource.RLIMIT_NOFILE, (4096, 4096))
  with tempfile.TemporaryDirectory() as workdir:
    report = {}
    if not args.skip_prepare:
      report["prepare"] = bench_prepare(workdir, {"gpt2": args.gpt2_mb, "bytes": args.bytes_mb})
    if not args.skip_startup:
      report["startup"] = bench_startup(workdir, int(args.small), int(args.large))
      report["rows"] = bench_rows(report["startup"]["paths"]["large"])
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
  main()
