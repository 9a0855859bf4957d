"""Training speed of a small Mixtral: the zoo's MoE train step vs transformers'
MixtralForCausalLM in PyTorch (eager and torch.compile), same weights, same batch, alternating.

    pip install -e ".[bench]" && python bench/moe_vs_torch.py [--rounds 5] [--steps 2]

The model: 8 experts, top-2, 4 layers, D 256, expert hidden 768, 8 heads (2 kv), 256-token
vocab, batch 8 x 256, fp32 AdamW with clipping. The zoo step is the trainer's (load-balancing
loss included, as Mixtral's coefficient 0.02; the torch side adds transformers' own
load_balancing_loss_func with the same coefficient through output_router_logits). Prints
tokens/s at each contender's median step time and the ratios, and beside them the zoo's dense
model whose MLP does the same work per token (hidden k * F): what the MoE step would cost with no
routing at all. The MoE layer alone against that dense MLP: bench/moe_layer.py.
"""

import argparse
import os
import statistics
import sys
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as bench/train_vs_torch.py says why

import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
from train_vs_torch import matmul_peak, step_flops, zoo_step  # noqa: E402  (as the dense bench)

from nnx_zoo.common import experiments, hub, models  # noqa: E402
from nnx_zoo.common.hub import hf  # noqa: E402

OVERRIDES = {
  "model.dim": "256",
  "model.mlp.hidden_dim": "768",
  "model.mlp.num_experts": "8",
  "train.batch_size": "8",
  "data.seq_len": "256",
}


def torch_model(cfg, state):
  import torch
  import transformers

  mod = hub.params_module("llama")
  hf_config = transformers.MixtralConfig(
    **{k: v for k, v in mod.config_to_hf(cfg.model, "mixtral").items() if k != "architectures"}
  )
  hf_config._attn_implementation = "sdpa"
  hf_config.output_router_logits = True  # the load-balancing loss, as the zoo step adds it
  model = transformers.MixtralForCausalLM(hf_config).float()
  weights = hf.to_hf(cfg.model, mod, state.params)
  # The in-memory layout is fused (mlp.experts.gate_up_proj): load through save/from_pretrained
  # conversion would need files; build the fused tensors from the per-expert ones here.
  fused = {}
  for name, value in weights.items():
    fused[name] = torch.from_numpy(np.array(value))
  sd = model.state_dict()
  for i in range(cfg.model.num_layers):
    pre = f"model.layers.{i}.block_sparse_moe"
    E = cfg.model.mlp.num_experts
    w1 = [fused.pop(f"{pre}.experts.{e}.w1.weight") for e in range(E)]
    w3 = [fused.pop(f"{pre}.experts.{e}.w3.weight") for e in range(E)]
    w2 = [fused.pop(f"{pre}.experts.{e}.w2.weight") for e in range(E)]
    fused[f"model.layers.{i}.mlp.experts.gate_up_proj"] = torch.stack(
      [torch.cat([a, b], 0) for a, b in zip(w1, w3, strict=True)]
    )
    fused[f"model.layers.{i}.mlp.experts.down_proj"] = torch.stack(w2)
    fused[f"model.layers.{i}.mlp.gate.weight"] = fused.pop(f"{pre}.gate.weight")
  missing = set(sd) - set(fused)
  assert not (set(fused) - set(sd)) and all("rotary" in k for k in missing), missing
  model.load_state_dict(fused, strict=False)
  return model


def torch_step(cfg, model, *, compile_: bool):
  import torch
  import torch.nn.functional as F

  o = cfg.optim
  opt = torch.optim.AdamW(
    [
      {"params": [p for p in model.parameters() if p.ndim >= 2], "weight_decay": o.weight_decay},
      {"params": [p for p in model.parameters() if p.ndim < 2], "weight_decay": 0.0},
    ],
    lr=o.lr,
    betas=(o.b1, o.b2),
    eps=o.eps,
  )

  def loss_fn(inputs, targets):
    out = model(input_ids=inputs, use_cache=False)
    ce = F.cross_entropy(out.logits.reshape(-1, out.logits.shape[-1]), targets.reshape(-1))
    return ce + model.router_aux_loss_coef * out.aux_loss, ce

  if compile_:
    loss_fn = torch.compile(loss_fn)

  def step(tokens):
    loss, ce = loss_fn(tokens[:, :-1], tokens[:, 1:])
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), o.clip_norm)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return ce.detach()

  return step


def main():
  p = argparse.ArgumentParser()
  p.add_argument("--rounds", type=int, default=5)
  p.add_argument("--steps", type=int, default=2)
  p.add_argument("--no-compile", action="store_true")
  args = p.parse_args()
  import torch

  torch.set_num_threads(len(os.sched_getaffinity(0)))
  cfg = experiments.get_config("lm/shakespeare-moe", OVERRIDES)
  B, T = cfg.train.batch_size, cfg.data.seq_len
  tokens = np.random.default_rng(0).integers(0, cfg.model.vocab_size, (B, T + 1), np.int32)
  batch = {"tokens": jnp.asarray(tokens), "segment_ids": jnp.ones((B, T + 1), jnp.int32)}
  tokens_t = torch.from_numpy(tokens.astype(np.int64))

  def zoo_runner(cfg):
    """(the initial train state, a function that runs one step and returns its loss)."""
    state, step = zoo_step(cfg, 0)
    holder = [state]

    def run():
      holder[0], m = step(holder[0], batch)
      return float(m["loss"])

    return state, run

  runners = {}
  state, runners["zoo"] = zoo_runner(cfg)
  # The ceiling for the MoE step: the zoo's dense model whose MLP does the same work per token
  # (hidden k * F), the routing overhead's absence.
  dense = {k: v for k, v in OVERRIDES.items() if k != "model.mlp.num_experts"}
  dense["model.mlp.kind"] = "dense"
  dense["model.mlp.hidden_dim"] = str(cfg.model.mlp.top_k * cfg.model.mlp.hidden_dim)
  dense_cfg = experiments.get_config("lm/shakespeare-moe", dense)
  _, runners["zoo dense k*F"] = zoo_runner(dense_cfg)
  for name, compile_ in [("torch eager", False)] + (
    [] if args.no_compile else [("torch.compile", True)]
  ):
    f = torch_step(cfg, torch_model(cfg, state), compile_=compile_)
    runners[name] = lambda f=f: float(f(tokens_t))
  print(
    f"Mixtral-style: {models.num_params(cfg.model):,} params "
    f"({models.num_active_params(cfg.model):,} active), {cfg.model.mlp.num_experts} experts "
    f"top-{cfg.model.mlp.top_k}, batch {B} x {T}, fp32 AdamW"
  )
  for name, run in runners.items():
    t = time.perf_counter()
    loss = run()
    run()
    print(f"  warm-up {name:14s} {time.perf_counter() - t:6.1f} s, first loss {loss:.5f}")
  times = {name: [] for name in runners}
  order = list(runners.items())
  for r in range(args.rounds):
    for name, run in order[r % len(order) :] + order[: r % len(order)]:
      run()
      for _ in range(args.steps):
        t = time.perf_counter()
        run()
        times[name].append(time.perf_counter() - t)
  tps = {name: B * T / statistics.median(ts) for name, ts in times.items()}
  print(f"{'contender':16s} {'tokens/s':>10s} {'step ms':>9s}")
  for name, ts in times.items():
    print(f"{name:16s} {tps[name]:10.0f} {1e3 * statistics.median(ts):9.1f}")
  for other in runners:
    if other not in ("zoo", "zoo dense k*F"):
      print(f"zoo / {other}: {tps['zoo'] / tps[other]:.2f}x")
  print(f"zoo MoE step / zoo dense k*F step (time): {tps['zoo dense k*F'] / tps['zoo']:.2f}x")
  # What a router and grouped matmul costing nothing would give: the dense step against torch's.
  print(
    f"with free routing (zoo dense k*F / torch eager): "
    f"{tps['zoo dense k*F'] / tps['torch eager']:.2f}x"
  )
  # The floor under any implementation: the step's matmul FLOPs (those of the dense model of the
  # same work per token, MaxText's count as bench/train_vs_torch.py's MFU) at this machine's fp32
  # matmul peak. A ratio to torch eager above `ceiling` would need matmuls faster than the peak.
  flops = step_flops(dense_cfg, B, T)
  peak = matmul_peak()
  floor = flops / peak
  ceiling = statistics.median(times["torch eager"]) / floor
  print(
    f"floor: {flops / 1e9:.1f} GFLOP a step at the {peak / 1e9:.0f} GFLOP/s fp32 matmul peak = "
    f"{1e3 * floor:.0f} ms: MFU zoo {floor / statistics.median(times['zoo']):.0%}, torch eager "
    f"{1 / ceiling:.0%}; no step here beats {ceiling:.2f}x torch eager"
  )


if __name__ == "__main__":
  main()
