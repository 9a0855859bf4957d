"""Training speed of bench/llama-19m: the zoo's train step vs the same model in PyTorch
(transformers' LlamaForCausalLM, eager and torch.compile) and vs a hand-written pure-JAX step.

    pip install -e ".[bench]" && python bench/train_vs_torch.py [--rounds 5] [--steps 2]

All four start from the same weights (the zoo's initialisation, exported to HF names) and train
on the same batch (8 x 256 random tokens of the 32k vocab), fp32, AdamW with global-norm
clipping. After warm-up they run in turn, `--steps` steps each per round (each round starting
one contender later), for `--rounds` rounds, so load from other processes hits all of them
alike; each reports tokens/s at its median step time. The framework's overhead is then measured
on its own: `--pairs` pairs of one zoo step (on the plain loss, as the hand-written step
computes it) and one hand-written step, taking turns; the median of the pairs' ratios, in wall
and in CPU time, with XLA's cost analysis of both. MFU is against this machine's fp32 matmul
peak, measured here with a big jnp matmul, and counts FLOPs as MaxText does: 6 x (matmul params)
x tokens plus attention, the causal half only.
"""

import argparse
import functools
import os
import statistics
import time

# torch's OpenMP threads otherwise spin for a while after each op, taking the cores from
# whichever step runs next; the JAX steps' pool sleeps when idle. Set before torch loads.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import jax
import jax.numpy as jnp
import numpy as np

from nnx_zoo.common import experiments, hub, models, tasks
from nnx_zoo.common.hub import hf
from nnx_zoo.common.train import optim
from nnx_zoo.common.train import step as steps

EXP = "bench/llama-19m"


# The zoo step: the real trainer's state and train_step.


def zoo_step(cfg, loss_chunk: int):
  tx = optim.optimizer(cfg.optim, cfg.train.steps)
  graphdef, state = steps.init_state(cfg, tx)
  step = functools.partial(
    steps.train_step, graphdef=graphdef, task=tasks.of(cfg), tx=tx, loss_chunk=loss_chunk
  )  # as trainer.train builds it for one device
  step = jax.jit(step, donate_argnums=0)
  return state, step


# A hand-written pure-JAX step of the same model (jnp only): the floor the zoo is measured
# against. Matmuls are 2-D ([B*T, D] @ [D, F]), as anyone tuning for XLA:CPU would write them.


def hand_params(state) -> dict:
  p = state.params
  layer = lambda b: {
    "attn_norm": b["attn_norm"]["scale"][...],
    "q": b["attn"]["q"]["kernel"][...],
    "k": b["attn"]["k"]["kernel"][...],
    "v": b["attn"]["v"]["kernel"][...],
    "o": b["attn"]["o"]["kernel"][...],
    "mlp_norm": b["mlp_norm"]["scale"][...],
    "gate": b["mlp"]["gate"]["kernel"][...],
    "up": b["mlp"]["up"]["kernel"][...],
    "down": b["mlp"]["down"]["kernel"][...],
  }
  return {
    "embed": jnp.array(p["embed"]["embedding"][...]),
    "layers": [jax.tree.map(jnp.array, layer(p["blocks"][i])) for i in range(len(p["blocks"]))],
    "norm": jnp.array(p["norm"]["scale"][...]),
    "head": jnp.array(p["lm_head"]["kernel"][...]),
  }


def hand_loss(params, tokens, *, m):
  inputs, targets = tokens[:, :-1], tokens[:, 1:]
  B, T = inputs.shape
  N, K, H = m.attention.num_heads, m.attention.num_kv_heads, m.attention.head_dim
  eps = m.norm.eps

  def rms(x, w):
    return x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + eps) * w

  inv_freq = 1.0 / m.position.theta ** (jnp.arange(0, H, 2, dtype=jnp.float32) / H)
  angles = jnp.arange(T, dtype=jnp.float32)[:, None] * inv_freq
  cos, sin = jnp.cos(angles)[None, :, None, None], jnp.sin(angles)[None, :, None, None]

  def rope(x):
    x1, x2 = jnp.split(x, 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)

  causal = jnp.tril(jnp.ones((T, T), bool))
  x = params["embed"][inputs].reshape(B * T, -1)
  for w in params["layers"]:
    h = rms(x, w["attn_norm"])
    q = rope((h @ w["q"]).reshape(B, T, K, N // K, H))
    k = rope((h @ w["k"]).reshape(B, T, K, 1, H))[:, :, :, 0]
    v = (h @ w["v"]).reshape(B, T, K, H)
    s = jnp.einsum("btkgh,bskh->bkgts", q, k) * H**-0.5
    s = jnp.where(causal, s, jnp.finfo(jnp.float32).min)
    a = jnp.einsum("bkgts,bskh->btkgh", jax.nn.softmax(s, axis=-1), v)
    x = x + a.reshape(B * T, N * H) @ w["o"]
    h = rms(x, w["mlp_norm"])
    x = x + (jax.nn.silu(h @ w["gate"]) * (h @ w["up"])) @ w["down"]
  logits = rms(x, params["norm"]) @ params["head"]
  lse = jax.nn.logsumexp(logits, axis=-1)
  picked = jnp.take_along_axis(logits, targets.reshape(-1, 1), axis=-1)[:, 0]
  return jnp.mean(lse - picked)


def hand_step(cfg, params):
  o = cfg.optim

  @functools.partial(jax.jit, donate_argnums=0)
  def step(state, tokens):
    params, mu, nu, count = state
    loss, grads = jax.value_and_grad(hand_loss)(params, tokens, m=cfg.model)
    norm = jnp.sqrt(sum(jnp.sum(g * g) for g in jax.tree.leaves(grads)))
    scale = jnp.minimum(1.0, o.clip_norm / norm)
    count = count + 1
    mu = jax.tree.map(lambda m, g: o.b1 * m + (1 - o.b1) * g * scale, mu, grads)
    nu = jax.tree.map(lambda v, g: o.b2 * v + (1 - o.b2) * jnp.square(g * scale), nu, grads)

    def update(p, m, v):
      m_hat, v_hat = m / (1 - o.b1**count), v / (1 - o.b2**count)
      decay = o.weight_decay * p if p.ndim >= 2 else 0.0
      return p - o.lr * (m_hat / (jnp.sqrt(v_hat) + o.eps) + decay)

    params = jax.tree.map(update, params, mu, nu)
    return (params, mu, nu, count), loss

  zeros = jax.tree.map(jnp.zeros_like, params)
  return (params, zeros, jax.tree.map(jnp.zeros_like, params), jnp.zeros((), jnp.float32)), step


# PyTorch: transformers' Llama with the zoo's initial weights.


def torch_model(cfg, state):
  import torch
  import transformers

  mod = hub.params_module("llama")
  hf_config = transformers.LlamaConfig(**mod.config_to_hf(cfg.model, "llama"))
  hf_config._attn_implementation = "sdpa"
  model = transformers.LlamaForCausalLM(hf_config).float()
  weights = hf.to_hf(cfg.model, mod, state.params)
  missing, unexpected = model.load_state_dict(
    {k: torch.from_numpy(np.array(v)) for k, v in weights.items()}, strict=False
  )
  # A model with tied embeddings (llama3.2-1b, as bench/gpu_vs_torch.py runs it) has no lm_head
  # of its own: HF ties it to embed_tokens, loaded above.
  tied = ["lm_head.weight"] if hf_config.tie_word_embeddings else []
  assert not unexpected and all("rotary" in k or k in tied for k in missing), (missing, unexpected)
  return model


def torch_step(cfg, model, *, compile_: bool):
  import torch
  import torch.nn.functional as F

  o = cfg.optim
  decay = [p for p in model.parameters() if p.ndim >= 2]
  no_decay = [p for p in model.parameters() if p.ndim < 2]
  opt = torch.optim.AdamW(
    [{"params": decay, "weight_decay": o.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
    lr=o.lr,
    betas=(o.b1, o.b2),
    eps=o.eps,
  )

  def loss_fn(inputs, targets):
    logits = model(input_ids=inputs, use_cache=False).logits
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))

  def opt_step():
    opt.step()

  if compile_:
    loss_fn = torch.compile(loss_fn)
    opt_step = torch.compile(opt_step)

  def step(tokens):
    loss = loss_fn(tokens[:, :-1], tokens[:, 1:])
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), o.clip_norm)
    opt_step()
    opt.zero_grad(set_to_none=True)
    return loss.detach()

  return step


# Measuring


def matmul_peak(n: int = 2048, reps: int = 5) -> float:
  """FLOP/s of the best of `reps` fp32 [n, n] @ [n, n] matmuls (jnp, this process's threads)."""
  a = jax.random.normal(jax.random.key(0), (n, n), jnp.float32)
  f = jax.jit(lambda a: a @ a)
  f(a).block_until_ready()
  best = float("inf")
  for _ in range(reps):
    t = time.perf_counter()
    f(a).block_until_ready()
    best = min(best, time.perf_counter() - t)
  return 2 * n**3 / best


def cost(step, *args) -> dict:
  """XLA's cost analysis of a jitted step compiled for these arguments (FLOPs, bytes accessed)."""
  return step.lower(*args).compile().cost_analysis()


def step_flops(cfg, B: int, T: int) -> float:
  """MaxText's count: 3 x (2 x weight-matmul FLOPs) + 3 x attention (causal: half of QK and PV).
  The input embedding is a lookup, not a matmul, so it is not counted."""
  m = cfg.model
  N, K, H, D, F, V = (
    m.attention.num_heads,
    m.attention.num_kv_heads,
    m.attention.head_dim,
    m.dim,
    m.mlp.hidden_dim,
    m.vocab_size,
  )
  weights_per_token = m.num_layers * (D * (N + 2 * K) * H + N * H * D + 3 * D * F) + D * V
  attention = m.num_layers * 4 * B * T * T * N * H / 2
  return 3 * (2 * weights_per_token * B * T + attention)


def main():
  p = argparse.ArgumentParser()
  p.add_argument("--rounds", type=int, default=5)
  p.add_argument("--steps", type=int, default=2, help="steps of each per round")
  p.add_argument("--warmup", type=int, default=2)
  p.add_argument("--pairs", type=int, default=30, help="zoo/hand-JAX step pairs for the overhead")
  p.add_argument("--no-compile", action="store_true", help="skip torch.compile")
  args = p.parse_args()

  import torch

  threads = len(os.sched_getaffinity(0))  # what XLA:CPU's thread pool uses
  torch.set_num_threads(threads)
  cfg = experiments.get_config(EXP)
  B, T = cfg.train.batch_size, cfg.data.seq_len
  tokens = np.random.default_rng(0).integers(0, cfg.model.vocab_size, (B, T + 1), np.int32)
  batch = {"tokens": jnp.asarray(tokens), "segment_ids": jnp.ones((B, T + 1), jnp.int32)}
  tokens_t = torch.from_numpy(tokens.astype(np.int64))

  # The experiment's step (train.loss_chunk as it sets it), and the same with the plain loss,
  # which is what the hand-written step computes: the framework's overhead is measured on that.
  chunk = cfg.train.get("loss_chunk", 0)
  zoo_state, zoo = zoo_step(cfg, chunk)
  plain_state, zoo_plain = zoo_step(cfg, 0)
  hand_state, hand = hand_step(cfg, hand_params(zoo_state))
  runners, first_loss = {}, {}
  holder = {"zoo": zoo_state, "zoo plain": plain_state, "hand": hand_state}

  def run_zoo():
    holder["zoo"], m = zoo(holder["zoo"], batch)
    return float(m["loss"])

  def run_zoo_plain():
    holder["zoo plain"], m = zoo_plain(holder["zoo plain"], batch)
    return float(m["loss"])

  def run_hand():
    holder["hand"], loss = hand(holder["hand"], batch["tokens"])
    return float(loss)

  runners[f"zoo (chunk {chunk})"], runners["zoo (chunk 0)"] = run_zoo, run_zoo_plain
  runners["hand-JAX"] = run_hand
  kinds = [("torch eager", False)] + ([] if args.no_compile else [("torch.compile", True)])
  for name, compile_ in kinds:
    f = torch_step(cfg, torch_model(cfg, zoo_state), compile_=compile_)
    runners[name] = lambda f=f: float(f(tokens_t))

  print(f"{EXP}: {models.num_params(cfg.model):,} params, batch {B} x {T}, fp32 AdamW")
  print(f"threads: JAX {threads} (XLA:CPU pool), torch {torch.get_num_threads()}")
  for name, run in runners.items():  # warm-up (compiles); the first loss is the same model's
    t = time.perf_counter()
    first_loss[name] = run()
    for _ in range(args.warmup - 1):
      run()
    print(
      f"  warm-up {name:16s} {time.perf_counter() - t:6.1f} s, first loss {first_loss[name]:.5f}"
    )
  times, peaks = {name: [] for name in runners}, []
  order = list(runners.items())
  for r in range(args.rounds):
    # Each round starts one contender later, so none always follows the same other one.
    for name, run in order[r % len(order) :] + order[: r % len(order)]:
      run()  # not timed: the first step after another contender's pays for the switch
      for _ in range(args.steps):
        t = time.perf_counter()
        run()
        times[name].append(time.perf_counter() - t)
    peaks.append(matmul_peak())  # in each round too: under the same load as the steps

  # The framework's overhead: the zoo step on the plain loss against the hand-written step, one
  # step of each in turn (their order swapped every pair), so each pair's ratio sees one load.
  # Wall time, and the CPU time of this process's threads, which other processes on the machine
  # disturb less.
  wall, cpu = [], []
  pair = [("zoo", run_zoo_plain), ("hand", run_hand)]
  for i in range(args.pairs):
    took = {}
    for name, run in pair if i % 2 == 0 else pair[::-1]:
      t, c = time.perf_counter(), time.process_time()
      run()
      took[name] = time.perf_counter() - t, time.process_time() - c
    wall.append(took["zoo"][0] / took["hand"][0] - 1)
    cpu.append(took["zoo"][1] / took["hand"][1] - 1)

  peak = statistics.median(peaks)
  flops = step_flops(cfg, B, T)
  naive = 6 * models.num_params(cfg.model) * B * T
  print(f"fp32 matmul peak (jnp 2048^3, best of 5, median over rounds): {peak / 1e9:.1f} GFLOP/s")
  print(
    f"FLOPs per step: {flops / 1e9:.1f} G (MaxText count; 6 x all params x tokens would be "
    f"{naive / 1e9:.1f} G)"
  )
  print(f"\n| {'step':16s} | tokens/s | step ms | MFU |")
  print("|---|---|---|---|")
  tps = {}
  for name, ts in times.items():
    med = statistics.median(ts)
    tps[name] = B * T / med
    print(f"| {name:16s} | {tps[name]:8.0f} | {med * 1e3:7.0f} | {flops / med / peak:.0%} |")
  print()
  z = tps[f"zoo (chunk {chunk})"]
  print(f"zoo / torch eager:   {z / tps['torch eager']:.2f}x   (target >= 1.2x)")
  if "torch.compile" in tps:
    print(f"zoo / torch.compile: {z / tps['torch.compile']:.2f}x   (target >= 1.0x)")
  print("zoo (chunk 0) overhead vs hand-written JAX, same plain loss   (target <= 3%):")
  for what, ratios in [("wall time", wall), ("CPU time", cpu)]:
    q1, med, q3 = np.percentile(ratios, [25, 50, 75])
    print(
      f"  {what:9s} {med:+.1%}   (median of {len(ratios)} paired steps; quartiles "
      f"{q1:+.1%} .. {q3:+.1%})"
    )
  zoo_cost, hand_cost = (
    cost(zoo_plain, holder["zoo plain"], batch),
    cost(hand, holder["hand"], batch["tokens"]),
  )
  more = {k: zoo_cost[k] / hand_cost[k] - 1 for k in ("bytes accessed", "flops")}
  print(
    f"  compiled: bytes accessed {more['bytes accessed']:+.1%}, FLOPs {more['flops']:+.1%}"
    "   (XLA's cost analysis)"
  )
  print(f"chunked loss vs plain: {z / tps['zoo (chunk 0)']:.2f}x")


if __name__ == "__main__":
  main()
