"""One GPU, the zoo's train step against transformers in PyTorch (docs/gpu.md's H200 run).

    pip install -e ".[cuda,bench]" && python bench/gpu_vs_torch.py [--json out.json]
    python bench/gpu_vs_torch.py --tiny --no-compile     # tiny shapes: runs anywhere, in seconds
    python bench/gpu_vs_torch.py summary DIR             # .ci/gpu's parts -> one table + JSON

Rows (each fails alone: its error is the row's note, the others still run):
- "dense": the 1.24 B Llama (`llama3.2-1b` preset), batch 8 x 2048, bf16 compute with fp32
  params and AdamW, `model.scan`, no remat: the zoo step with each attention impl that applies
  (`auto` first), then transformers' LlamaForCausalLM (sdpa attention) with bf16 autocast and
  fused AdamW, eager and under torch.compile, from the same weights and on the same batch;
- "moe": a Mixtral-shaped MoE of about 0.9 B active (2.6 B total) parameters, the zoo (auto)
  against transformers' MixtralForCausalLM, the same way;
- "long": the 1.24 B Llama at T = 8192 (batch 2), the zoo with `auto`.
Columns: step time (median of --steps after --warmup), tokens/s, model TFLOP/s (MaxText's count,
bench/train_vs_torch.step_flops: 6 x matmul params x tokens + causal attention; an MoE counted as
the dense model of its active MLP work), MFU against the bf16 [n, n] matmul peaks measured in the
same run by jnp and by torch, and peak memory (the zoo: the compiled step's arguments + outputs +
temporaries from XLA's memory analysis; torch: torch.cuda.max_memory_allocated).
"""

import argparse
import json
import os
import statistics
import sys
import time
import traceback

# jax and torch share the GPU in this process: jax takes memory as it needs it instead of 75% at
# start (set before train_vs_torch imports jax), and the torch rows run first (see `bench`).
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

sys.path.insert(0, os.path.dirname(__file__))
from train_vs_torch import step_flops, zoo_step  # noqa: E402

IMPLS = ("auto", "cudnn", "flash", "xla")


def parse_args(argv=None) -> argparse.Namespace:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--tiny", action="store_true", help="tiny shapes (CPU, tests)")
  p.add_argument("--parts", default="dense,moe,long", help="comma-separated: dense, moe, long")
  p.add_argument("--impls", default="", help="attention impls of the dense rows (default: all)")
  p.add_argument("--steps", type=int, default=0, help="timed steps (default 5; tiny 2)")
  p.add_argument("--warmup", type=int, default=2)
  p.add_argument("--no-torch", action="store_true", help="the zoo rows only")
  p.add_argument("--no-compile", action="store_true", help="skip torch.compile")
  p.add_argument("--json", default="", help="write the result here")
  args = p.parse_args(argv)
  args.parts = [x for x in args.parts.split(",") if x]
  unknown = set(args.parts) - {"dense", "moe", "long"}
  if unknown:
    p.error(f"unknown parts {sorted(unknown)}")
  args.impls = [x for x in args.impls.split(",") if x]
  if set(args.impls) - set(IMPLS):
    p.error(f"--impls takes {', '.join(IMPLS)}")
  args.steps = args.steps or (2 if args.tiny else 5)
  return args


# ---------------------------------------------------------------------------------------------
# Configs


def configs(tiny: bool) -> dict:
  """{part: (cfg, dense_equivalent_cfg)}: the experiment's config with the part's model (the
  second is what step_flops counts: for an MoE, the dense model of the same active MLP work)."""
  import copy

  from nnx_zoo.common import experiments
  from nnx_zoo.zoo.llama import model as llama

  def cfg_for(model, B, T):
    cfg = experiments.get_config("bench/llama-19m")
    cfg.model = model
    cfg.model.update(dtype="bfloat16", scan=True, remat="none")
    cfg.train.batch_size, cfg.data.seq_len = B, T
    return cfg

  if tiny:
    small = dict(vocab_size=512, dim=64, num_layers=2, num_heads=4, num_kv_heads=2, hidden_dim=128)
    dense = cfg_for(llama.config("llama3.2-1b", **small), 2, 64)
    moe = cfg_for(llama.config("mixtral-8x7b", **small), 2, 64)
    long = cfg_for(llama.config("llama3.2-1b", **small), 1, 128)
  else:
    dense = cfg_for(llama.config("llama3.2-1b"), 8, 2048)
    # Mixtral's shape (8 experts, top 2, GQA 4:1 kv heads) at ~0.9 B active: what fits an 80 GB
    # GPU with fp32 AdamW state (2.6 B params x 16 bytes = 42 GB) and a batch of 8 x 2048.
    moe = cfg_for(
      llama.config(
        "mixtral-8x7b", dim=2048, num_layers=12, num_heads=16, num_kv_heads=4, hidden_dim=4096
      ),
      8,
      2048,
    )
    long = cfg_for(llama.config("llama3.2-1b"), 2, 8192)
  moe_dense = copy.deepcopy(moe)
  mlp = moe.model.mlp
  moe_dense.model.mlp = llama.config("tiny", hidden_dim=mlp.top_k * mlp.hidden_dim).mlp
  return {"dense": (dense, dense), "moe": (moe, moe_dense), "long": (long, long)}


def impls_for(platform: str, asked: list[str]) -> list[str]:
  """The attention impls the dense rows run: `auto` first, then each that applies here (cuDNN
  and the Triton kernel on a GPU only; on a CPU the kernel runs interpreted, too slow to time)."""
  here = {"gpu": list(IMPLS), "tpu": ["auto", "flash", "xla"]}.get(platform, ["auto", "xla"])
  return [i for i in here if not asked or i in asked]


# ---------------------------------------------------------------------------------------------
# Measuring


def time_steps(run, *, warmup: int, steps: int) -> float:
  """Median seconds of `steps` calls of `run` (which blocks until its step is done)."""
  for _ in range(warmup):
    run()
  times = []
  for _ in range(steps):
    t = time.perf_counter()
    run()
    times.append(time.perf_counter() - t)
  return statistics.median(times)


def jnp_matmul_peak(n: int, reps: int = 5) -> float:
  """FLOP/s of the best of `reps` bf16 [n, n] @ [n, n] matmuls in jnp."""
  import jax
  import jax.numpy as jnp

  a = jax.random.normal(jax.random.key(0), (n, n), jnp.bfloat16)
  f = jax.jit(lambda a: a @ a)
  f(a).block_until_ready()
  best = min(_timed(lambda: f(a).block_until_ready()) for _ in range(reps))
  return 2 * n**3 / best


def torch_matmul_peak(n: int, device: str, reps: int = 5) -> float:
  """FLOP/s of the best of `reps` bf16 [n, n] @ [n, n] matmuls in torch on `device`."""
  import torch

  a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
  sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
  (a @ a), sync()

  def once():
    a @ a
    sync()

  best = min(_timed(once) for _ in range(reps))
  return 2 * n**3 / best


def _timed(f) -> float:
  t = time.perf_counter()
  f()
  return time.perf_counter() - t


def zoo_row(cfg, flops_cfg, *, impl: str, warmup: int, steps: int) -> dict:
  """The zoo's jitted train step (one device), as bench/train_vs_torch.py builds it."""
  import jax.numpy as jnp
  import numpy as np

  cfg.model.attention.impl = impl
  B, T = cfg.train.batch_size, cfg.data.seq_len
  tokens = np.random.default_rng(0).integers(0, cfg.model.vocab_size, (B, T + 1), np.int32)
  batch = {"tokens": jnp.asarray(tokens), "segment_ids": jnp.ones((B, T + 1), jnp.int32)}
  state, step = zoo_step(cfg, cfg.train.get("loss_chunk", 0))
  mem = step.lower(state, batch).compile().memory_analysis()
  holder = [state]

  def run():
    holder[0], m = step(holder[0], batch)
    return float(m["loss"])

  seconds = time_steps(run, warmup=warmup, steps=steps)
  peak = None
  if mem is not None:
    peak = (
      mem.argument_size_in_bytes
      + mem.output_size_in_bytes
      + mem.temp_size_in_bytes
      - mem.alias_size_in_bytes
    )
  return row(f"zoo {impl}", seconds, B * T, step_flops(flops_cfg, B, T), peak)


def torch_row(cfg, flops_cfg, *, compile_: bool, moe: bool, warmup: int, steps: int) -> dict:
  """transformers' model (sdpa attention) from the zoo's initial weights, bf16 autocast and fused
  AdamW where there is a GPU; fp32 on a CPU (bf16 autocast there measures nothing useful)."""
  import moe_vs_torch  # bench/ is on sys.path (above)
  import numpy as np
  import torch
  import torch.nn.functional as F
  import train_vs_torch

  from nnx_zoo.common.train import optim
  from nnx_zoo.common.train import step as steps_lib

  device = "cuda" if torch.cuda.is_available() else "cpu"
  tx = optim.optimizer(cfg.optim, cfg.train.steps)
  import jax

  with jax.default_device(jax.devices("cpu")[0]):  # the zoo's initial weights, off the GPU
    _, state = steps_lib.init_state(cfg, tx)
  model = (moe_vs_torch if moe else train_vs_torch).torch_model(cfg, state).to(device)
  del state
  o = cfg.optim
  opt = torch.optim.AdamW(
    model.parameters(), lr=o.lr, betas=(o.b1, o.b2), eps=o.eps, fused=device == "cuda"
  )

  def loss_fn(inputs, targets):
    with torch.autocast(device, dtype=torch.bfloat16, enabled=device == "cuda"):
      logits = model(input_ids=inputs, use_cache=False).logits
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))

  if compile_:
    loss_fn = torch.compile(loss_fn)
  B, T = cfg.train.batch_size, cfg.data.seq_len
  rng = np.random.default_rng(0)
  tokens = torch.from_numpy(rng.integers(0, cfg.model.vocab_size, (B, T + 1))).to(device)
  sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)

  def run():
    loss = loss_fn(tokens[:, :-1], tokens[:, 1:])
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), o.clip_norm)
    opt.step()
    opt.zero_grad(set_to_none=True)
    sync()

  if device == "cuda":
    torch.cuda.reset_peak_memory_stats()
  seconds = time_steps(run, warmup=warmup, steps=steps)
  peak = torch.cuda.max_memory_allocated() if device == "cuda" else None
  name = "torch.compile" if compile_ else "torch eager"
  return row(name, seconds, B * T, step_flops(flops_cfg, B, T), peak)


def row(name: str, seconds: float, tokens: int, flops: float, peak_bytes) -> dict:
  return {
    "name": name,
    "step_ms": 1e3 * seconds,
    "tokens_per_s": tokens / seconds,
    "model_tflops": flops / seconds / 1e12,
    "peak_gib": None if peak_bytes is None else peak_bytes / 2**30,
  }


def add_mfu(rows: list[dict], peaks: dict) -> list[dict]:
  """Each row's MFU against each measured bf16 matmul peak (FLOP/s)."""
  for r in rows:
    for who, peak in peaks.items():
      if "model_tflops" in r and peak:
        r[f"mfu_vs_{who}"] = r["model_tflops"] * 1e12 / peak
  return rows


def guarded(part: str, name: str, f) -> dict:
  """f()'s row, or a row saying why it failed (its first line: an OOM reads as one)."""
  try:
    return {"part": part, **f()}
  except Exception as e:  # noqa: BLE001  (each row fails alone; the others still run)
    first = (str(e).strip().splitlines() or [type(e).__name__])[0][:300]
    traceback.print_exc()
    return {"part": part, "name": name, "error": f"{type(e).__name__}: {first}"}


# ---------------------------------------------------------------------------------------------
# Output


def _fmt(value, spec: str) -> str:
  return "-" if value is None else format(value, spec)


def format_table(result: dict) -> str:
  """The rows as one Markdown table, after a line saying where they ran."""
  peaks = result.get("peaks", {})
  lines = [
    f"{result.get('device', '?')}; jax {result.get('jax', '?')}, torch {result.get('torch', '-')}; "
    + ", ".join(
      f"bf16 matmul peak {k} {_fmt(v and v / 1e12, '.2f')} TFLOP/s" for k, v in peaks.items()
    ),
    "",
    "| part | step | ms | tokens/s | model TFLOP/s | MFU (jnp peak) | MFU (torch peak) | peak GiB |"
    " note |",
    "|---|---|---|---|---|---|---|---|---|",
  ]
  for r in result["rows"]:
    lines.append(
      f"| {r['part']} | {r['name']} | {_fmt(r.get('step_ms'), '.0f')} | "
      f"{_fmt(r.get('tokens_per_s'), '.0f')} | {_fmt(r.get('model_tflops'), '.1f')} | "
      f"{_fmt(r.get('mfu_vs_jnp'), '.0%')} | {_fmt(r.get('mfu_vs_torch'), '.0%')} | "
      f"{_fmt(r.get('peak_gib'), '.1f')} | {r.get('error', '')} |"
    )
  return "\n".join(lines)


def write_json(result: dict, path: str):
  with open(path, "w") as f:
    json.dump(result, f, indent=2)
    f.write("\n")


def summarize(directory: str) -> dict:
  """.ci/gpu's parts (DIR/*.json, each {"part", "ok", ...}) as one result: the bench's rows
  included if DIR/bench.json exists."""
  parts, bench = [], None
  for name in sorted(os.listdir(directory)):
    if not name.endswith(".json") or name == "summary.json":
      continue
    with open(os.path.join(directory, name)) as f:
      data = json.load(f)
    if name == "bench.json":
      bench = data
    else:
      parts.append(data)
  return {"parts": parts, "bench": bench}


def format_summary(summary: dict) -> str:
  lines = ["| part | ok | result |", "|---|---|---|"]
  for p in summary["parts"]:
    detail = ", ".join(f"{k} {v}" for k, v in p.items() if k not in ("part", "ok"))
    lines.append(f"| {p['part']} | {'yes' if p.get('ok') else 'NO'} | {detail} |")
  if summary["bench"] is not None:
    lines += ["", format_table(summary["bench"])]
  else:
    lines += ["", "bench: no result (see its log)"]
  return "\n".join(lines)


# ---------------------------------------------------------------------------------------------


def _free_torch_memory():
  """A finished torch row's model and optimizer, collected and handed back to the driver, so
  the jax rows after it have the GPU."""
  import gc

  import torch

  gc.collect()
  if torch.cuda.is_available():
    torch.cuda.empty_cache()


def bench(args, on_row=None) -> dict:
  """The result; `on_row(result so far)` after each row."""
  import jax

  platform = jax.default_backend()
  result = {
    "device": f"{jax.devices()[0].device_kind} ({platform})",
    "jax": jax.__version__,
    "tiny": args.tiny,
    "peaks": {},
    "rows": [],
  }
  n = 256 if args.tiny else 8192
  try:
    result["peaks"]["jnp"] = jnp_matmul_peak(n)
  except Exception as e:  # noqa: BLE001
    result["peaks"]["jnp"] = None
    result["peak_errors"] = [f"jnp: {e}"]
  torch_device = None
  if not args.no_torch:
    try:
      import torch

      result["torch"] = torch.__version__
      torch_device = "cuda" if torch.cuda.is_available() else "cpu"
      result["peaks"]["torch"] = torch_matmul_peak(n, torch_device)
    except Exception as e:  # noqa: BLE001
      result["peaks"]["torch"] = None
      result.setdefault("peak_errors", []).append(f"torch: {e}")
  kw = dict(warmup=args.warmup, steps=args.steps)
  cfgs = configs(args.tiny)
  torch_kinds = [] if args.no_torch else [False] + ([] if args.no_compile else [True])
  # What runs, in display order: per part the zoo (auto first), then torch. The torch rows run
  # first: torch hands its cached memory back (empty_cache), jax's allocator keeps what it took.
  plan = []
  for part in args.parts:
    cfg, flops_cfg = cfgs[part]
    impls = impls_for(platform, args.impls) if part == "dense" else ["auto"]
    for impl in impls:

      def zoo_run(impl=impl, cfg=cfg, flops_cfg=flops_cfg):
        return zoo_row(cfg, flops_cfg, impl=impl, **kw)

      plan.append((part, f"zoo {impl}", zoo_run))
    if part == "long":
      continue  # the zoo's long-context row only (the T = 8192 row of docs/gpu.md)
    for compile_ in torch_kinds:
      name = "torch.compile" if compile_ else "torch eager"

      def torch_run(compile_=compile_, cfg=cfg, flops_cfg=flops_cfg, moe=part == "moe"):
        return torch_row(cfg, flops_cfg, compile_=compile_, moe=moe, **kw)

      plan.append((part, name, torch_run))
  done = {}
  for i in sorted(range(len(plan)), key=lambda i: not plan[i][1].startswith("torch")):
    part, name, run = plan[i]
    done[i] = guarded(part, name, run)
    if name.startswith("torch"):
      _free_torch_memory()
    result["rows"] = [done[k] for k in sorted(done)]
    if on_row is not None:  # a partial result survives a timeout of the whole run
      on_row({**result, "rows": add_mfu([dict(r) for r in result["rows"]], result["peaks"])})
  add_mfu(result["rows"], result["peaks"])
  return result


def main(argv=None):
  argv = sys.argv[1:] if argv is None else argv
  if argv[:1] == ["summary"]:
    directory = argv[1]
    summary = summarize(directory)
    print(format_summary(summary))
    write_json(summary, os.path.join(directory, "summary.json"))
    return 0 if all(p.get("ok") for p in summary["parts"]) and summary["bench"] else 1
  args = parse_args(argv)
  result = bench(
    args, on_row=(lambda partial: write_json(partial, args.json)) if args.json else None
  )
  print(format_table(result))
  if args.json:
    write_json(result, args.json)
  return 0 if all("error" not in r for r in result["rows"]) else 1


if __name__ == "__main__":
  sys.exit(main())
