"""Greedy output through `zoo serve` against `zoo generate`'s engine call and transformers'
`generate` on the same GGUF weights, token for token, on prompts of the plays.

  python bench/serve_parity.py --gguf .venv/.../SmolLM2-135M-Instruct.Q4_1.gguf --prompts 8
"""

import argparse
import os
import socket
import subprocess
import tempfile
import time

import httpx
import jax
import numpy as np
import torch
import transformers

from nnx_zoo.common import engine
from nnx_zoo.common.data import pipeline
from nnx_zoo.common.hub import weights


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--gguf", required=True)
  ap.add_argument("--prompts", type=int, default=8)
  ap.add_argument("--new", type=int, default=32)
  args = ap.parse_args()
  work = tempfile.mkdtemp()
  ckpt = os.path.join(work, "zoo")
  subprocess.run(["zoo", "convert", "gguf", args.gguf, "--out", ckpt], check=True,
                 capture_output=True)  # fmt: skip
  folder, name = os.path.split(os.path.abspath(args.gguf))
  tok = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=name)
  hf = transformers.AutoModelForCausalLM.from_pretrained(folder, gguf_file=name).eval()
  words = pipeline.read_shakespeare(["macbeth"])[0].split()[3000:]
  texts = [" ".join(words[i * 97 : i * 97 + 30]) for i in range(args.prompts)]
  ids = [tok(t)["input_ids"] for t in texts]

  with torch.no_grad():
    greedy = dict(max_new_tokens=args.new, do_sample=False, eos_token_id=None, pad_token_id=0)
    want = [hf.generate(torch.tensor([p]), **greedy)[0, len(p) :].tolist() for p in ids]
  model = weights.load(ckpt)
  zoo = [np.asarray(engine.generate(model, np.asarray([p]), max_new_tokens=args.new,
                                    rng=jax.random.key(0), temperature=0))[0, len(p):].tolist()
         for p in ids]  # fmt: skip

  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
  argv = ["zoo", "serve", "--workdir", ckpt, "--port", str(port), "--slots", str(args.prompts),
          "--max-len", "256"]  # fmt: skip
  server = subprocess.Popen(argv, stderr=subprocess.DEVNULL)
  url = f"http://127.0.0.1:{port}"
  try:
    for _ in range(600):
      try:
        if httpx.get(url + "/health").status_code == 200:
          break
      except httpx.HTTPError:
        pass
      time.sleep(1)
    body = {"prompt": ids, "max_tokens": args.new, "temperature": 0, "logprobs": 0}
    r = httpx.post(url + "/v1/completions", json=body, timeout=600).json()
  finally:
    server.terminate()
    server.wait()
  served = [None] * len(ids)
  for choice in r["choices"]:
    served[choice["index"]] = choice["text"]
  same_hf = sum(a == b for a, b in zip(zoo, want, strict=True))
  same_served = sum(tok.decode(w) == s for w, s in zip(want, served, strict=True))
  print(f"{args.prompts} prompts, {args.new} greedy tokens each:")
  print(f"  engine (zoo generate) = transformers generate: {same_hf}/{len(ids)} token for token")
  print(f"  zoo serve text = transformers generate's text: {same_served}/{len(ids)}")
  for i, (w, s) in enumerate(zip(want, served, strict=True)):
    if tok.decode(w) != s:
      print(f"  differs at prompt {i}: {tok.decode(w)!r} vs {s!r}")


if __name__ == "__main__":
  main()
