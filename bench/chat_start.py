"""`zoo chat`'s start-up, one-shot, this checkout against another (an older commit's checkout, as
a worktree), side by side, alternating: the seconds from the command to its answer, the second
and later starts (programs traced and compiled by the first, read from the persistent cache).

  git worktree add /tmp/old_zoo 52f1108
  python bench/chat_start.py --workdir ckpt/smollm2 --old-root /tmp/old_zoo
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time


def shim(root: str) -> str:
  """A folder whose `nnx_zoo` is `root`'s folders (what setup.py maps), to put on PYTHONPATH."""
  where = tempfile.mkdtemp()
  os.makedirs(os.path.join(where, "nnx_zoo"))
  for folder in ("common", "zoo", "experiments", "kernels"):
    os.symlink(os.path.join(root, folder), os.path.join(where, "nnx_zoo", folder))
  return where


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--workdir", required=True)
  ap.add_argument("--old-root", required=True)
  ap.add_argument("--new-root", help="default: this checkout (a tree being edited changes the "
                  "programs' keys, so measure a worktree of the commit)")  # fmt: skip
  ap.add_argument("--rounds", type=int, default=3)
  args = ap.parse_args()
  messages = os.path.join(tempfile.mkdtemp(), "m.json")
  with open(messages, "w") as f:
    json.dump([{"role": "user", "content": "Name a play by Shakespeare."}], f)
  argv = [sys.executable, "-c", "import sys; from nnx_zoo.common import cli; sys.exit(cli.main())",
          "chat", "--workdir", args.workdir, "--messages", messages, "--temperature", "0",
          "--max-new-tokens", "32"]  # fmt: skip
  new = dict(os.environ, PYTHONPATH=shim(args.new_root)) if args.new_root else dict(os.environ)
  envs = {"this checkout": new, "old": dict(os.environ, PYTHONPATH=shim(args.old_root))}
  seconds = {name: [] for name in envs}
  answers = {}
  for round_ in range(args.rounds + 1):  # the first round fills the caches: not counted
    for name, env in envs.items():
      start = time.perf_counter()
      out = subprocess.run(argv, env=env, capture_output=True, text=True)
      took = time.perf_counter() - start
      if out.returncode:
        sys.exit(f"{name}: {out.stderr[-2000:]}")
      answers[name] = out.stdout.strip()
      if round_:
        seconds[name].append(took)
      print(f"round {round_} {name}: {took:.1f} s", flush=True)
  for name, s in seconds.items():
    print(f"{name}: median {statistics.median(s):.2f} s of {s}")
  new, old = (statistics.median(s) for s in seconds.values())
  print(f"this checkout / old: {new / old:.2f}x; same answer: {len(set(answers.values())) == 1}")
  print(answers)


if __name__ == "__main__":
  main()
