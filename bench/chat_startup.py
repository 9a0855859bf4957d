"""`zoo chat`'s start-up, a fresh process each time, contenders side by side.

Each contender is a `zoo` executable (this checkout's by default; pass `--zoo` several times to
compare checkouts installed in their own venvs) with its own fresh persistent cache
(NNX_ZOO_CACHE). Round 0 is each one's first invocation (it compiles and fills its cache); the
rounds after it are second invocations (they read it). The contenders take turns within each
round, so load from other processes hits all alike.

Two ways to ask, each timed:
- `--messages` (one answer to a conversation file): the wall time of the whole process;
- turn by turn (`--typing S`): the time until the `> ` prompt shows, and the time from a line
  written S seconds after it (someone typing) to its answer.

Prints one JSON line per invocation, then the medians of the later rounds per contender.

  python bench/chat_startup.py --workdir ckpt/smol                  # this checkout
  python bench/chat_startup.py --workdir ckpt/smol --zoo old/.venv/bin/zoo --zoo .venv/bin/zoo
  python bench/chat_startup.py --workdir ckpt/smol --typing 4       # turn by turn
"""

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

QUESTION = "What is the capital of France?"


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--workdir", required=True, help="a converted checkpoint or a zoo run")
  parser.add_argument("--zoo", action="append", help="a zoo executable (repeat to compare)")
  parser.add_argument("--rounds", type=int, default=5, help="second invocations per contender")
  parser.add_argument("--typing", type=float, help="turn by turn: seconds before the line")
  args = parser.parse_args()
  zoos = args.zoo or [shutil.which("zoo") or os.path.join(os.path.dirname(sys.executable), "zoo")]
  scratch = tempfile.mkdtemp(prefix="chat_startup_")
  messages = os.path.join(scratch, "messages.json")
  with open(messages, "w") as f:
    json.dump([{"role": "user", "content": QUESTION}], f)
  command = ["chat", "--workdir", args.workdir, "--temperature", "0", "--max-new-tokens", "40"]
  results = {zoo: [] for zoo in zoos}
  for turn in range(args.rounds + 1):
    for i, zoo in enumerate(zoos):
      env = os.environ | {"NNX_ZOO_CACHE": os.path.join(scratch, str(i))}
      if args.typing is None:
        result = one_answer([zoo, *command, "--messages", messages], env)
      else:
        result = turn_by_turn([zoo, *command], env, args.typing)
      results[zoo].append(result)
      print(json.dumps({"zoo": zoo, "round": turn, **result}), flush=True)
  for zoo, rounds in results.items():
    medians = {
      f"later_median_{k}": round(statistics.median(r[k] for r in rounds[1:]), 2)
      for k in rounds[0]
      if k != "answer"
    }
    print(json.dumps({"zoo": zoo, "first": rounds[0], **medians}))
  shutil.rmtree(scratch, ignore_errors=True)


def one_answer(argv, env) -> dict:
  start = time.perf_counter()
  done = subprocess.run(argv, env=env, capture_output=True, text=True)
  wall = time.perf_counter() - start
  if done.returncode:
    sys.exit(f"{argv[0]} failed:\n{done.stderr[-2000:]}")
  return {"wall_s": round(wall, 2), "answer": done.stdout.strip()[:60]}


def turn_by_turn(argv, env, typing: float) -> dict:
  start = time.perf_counter()
  pipe = subprocess.PIPE
  proc = subprocess.Popen(argv, env=env, stdin=pipe, stdout=pipe, stderr=pipe)
  seen = b""
  while not seen.endswith(b"> "):
    byte = proc.stderr.read(1)
    if not byte:
      sys.exit(f"{argv[0]} ended before its prompt:\n{seen[-2000:].decode(errors='replace')}")
    seen += byte
  prompt = time.perf_counter() - start
  time.sleep(typing)
  sent = time.perf_counter()
  proc.stdin.write(QUESTION.encode() + b"\n")
  proc.stdin.flush()
  answer = proc.stdout.readline().decode().strip()
  answered = time.perf_counter() - sent
  proc.stdin.write(b"\n")
  proc.stdin.close()
  proc.wait()
  return {"prompt_s": round(prompt, 2), "answer_s": round(answered, 2), "answer": answer[:60]}


if __name__ == "__main__":
  main()
