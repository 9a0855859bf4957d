"""A LoRA fine-tuning step of a real checkpoint: the zoo's (`chat/sft` with the model from
init_from, rank 8 on every attention and MLP projection) vs transformers + peft, eager and
torch.compile, and the zoo's full fine-tuning step beside them.

    pip install -e ".[bench]" peft && python bench/lora_vs_torch.py --hf-dir DIR [--rounds 3]

DIR is a Hugging Face directory (SmolLM2-135M-Instruct: README's `zoo convert` path, or any
llama-family one). Every contender trains on the same batch (8 x 256 random tokens), fp32,
AdamW with global-norm clipping, from the same base weights; after a warm-up they run in turn,
`--steps` steps each per round for `--rounds` rounds, so load from other processes hits all of
them alike, and each reports tokens/s at its median step time.
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


def zoo_step(hf_dir: str, rank: int, B: int, T: int):
  """The trainer's own state and jitted step (`zoo run chat/sft`), from the checkpoint's weights."""
  overrides = {"init_from": hf_dir, "model.lora.rank": str(rank), "optim.lr": "1e-4"}
  overrides.update({"data.seq_len": str(T), "train.batch_size": str(B)})
  cfg = experiments.get_config("chat/sft", overrides)
  tx = optim.optimizer(cfg.optim, cfg.train.steps)
  _, shardings = steps.placed_abstract_state(cfg, tx, None)
  state = jax.jit(lambda: steps.init_state(cfg, tx)[1], out_shardings=shardings)()
  params = weights.with_init_from(
    weights.init_params(cfg, state.params), state.params, shardings.params
  )
  state = state.__class__(state.step, params, state.opt_state, state.rng, state.ema)
  return state, steps.make_train_step(cfg, tx=tx, layout=None, shardings=shardings)


def torch_step(hf_dir: str, rank: int, *, compile_: bool):
  import peft
  import torch
  import torch.nn.functional as F
  import transformers

  model = transformers.AutoModelForCausalLM.from_pretrained(
    hf_dir, dtype=torch.float32, attn_implementation="sdpa"
  )
  config = peft.LoraConfig(r=rank, lora_alpha=16, lora_dropout=0.0, target_modules=TARGETS)
  model = peft.get_peft_model(model, config)
  trained = [p for p in model.parameters() if p.requires_grad]
  opt = torch.optim.AdamW(trained, lr=1e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0)

  def loss_fn(inputs, targets):
    logits = model(input_ids=inputs, use_cache=False).logits
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))

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
  p.add_argument("--hf-dir", required=True)
  p.add_argument("--rank", type=int, default=8)
  p.add_argument("--rounds", type=int, default=3)
  p.add_argument("--steps", type=int, default=2, help="steps of each per round")
  p.add_argument("--batch", type=int, default=8)
  p.add_argument("--seq-len", type=int, default=256)
  p.add_argument("--no-compile", action="store_true", help="skip torch.compile")
  p.add_argument("--no-full", action="store_true", help="skip the zoo's full fine-tuning step")
  args = p.parse_args()

  import torch

  threads = len(os.sched_getaffinity(0))
  torch.set_num_threads(threads)
  B, T = args.batch, args.seq_len
  rng = np.random.default_rng(0)
  vocab = experiments.get_config("chat/sft", {"init_from": args.hf_dir}).model.vocab_size
  tokens = rng.integers(0, vocab, (B, T + 1)).astype(np.int32)
  batch = {"tokens": jnp.asarray(tokens), "segment_ids": jnp.ones_like(jnp.asarray(tokens))}
  tokens_t = torch.from_numpy(tokens.astype(np.int64))

  contenders = {}
  state = {}
  for name, rank in (("zoo LoRA", args.rank), ("zoo full", 0)):
    if name == "zoo full" and args.no_full:
      continue
    state[name], step = zoo_step(args.hf_dir, rank, B, T)

    def run(name=name, step=step):
      state[name], metrics = step(state[name], batch)
      return float(metrics["loss"])

    contenders[name] = run
  contenders["peft eager"] = torch_step(args.hf_dir, args.rank, compile_=False)
  if not args.no_compile:
    contenders["peft torch.compile"] = torch_step(args.hf_dir, args.rank, compile_=True)
  for name, run in contenders.items():  # warm-up: compiles
    t = time.perf_counter()
    for _ in range(2):
      loss = run() if name.startswith("zoo") else run(tokens_t)
    print(f"{name}: warm-up {time.perf_counter() - t:.1f} s, loss {loss:.3f}", flush=True)

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
  print(
    f"\n{args.hf_dir}: {B} x {T} tokens a step, fp32, AdamW, LoRA rank {args.rank} on {TARGETS}"
  )
  print(f"threads: {threads}\n\n| step | tokens/s | zoo LoRA / this |\n|---|---|---|")
  for name, v in tps.items():
    print(f"| {name} | {v:.0f} | {tps['zoo LoRA'] / v:.2f}x |")


if __name__ == "__main__":
  main()
