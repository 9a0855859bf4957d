"""Start-up of `zoo run EXP` to its first step done, with train.fit's check (the step compiled
ahead of time, measured, then run: common/train/fit.py) against the step compiled at its first
call as before the check (fit.fitted_step replaced by make_train_step), side by side in
alternating subprocesses, no persistent compilation cache.

  python bench/fit_startup.py [EXP] [ROUNDS]     # default lm/shakespeare-char, 2 rounds
"""

import json
import os
import subprocess
import sys

CODE = r"""
import sys, tempfile, time
t0 = time.perf_counter()
from nnx_zoo.common import experiments
from nnx_zoo.common.train import fit, trainer
from nnx_zoo.common.train import step as steps
if sys.argv[2] == "before":
  def before(cfg, *, tx, layout, example=None):
    _, shardings = steps.placed_abstract_state(cfg, tx, layout)
    return cfg, steps.make_train_step(cfg, tx=tx, layout=layout, shardings=shardings)
  fit.fitted_step = before
cfg = experiments.get_config(sys.argv[1], {"train.steps": "1", "train.eval_every": "0"})
trainer.train(cfg, tempfile.mkdtemp(), progress=False)
print("SECONDS", time.perf_counter() - t0)
"""


def main():
  exp = sys.argv[1] if len(sys.argv) > 1 else "lm/shakespeare-char"
  rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 2
  env = {**os.environ, "JAX_COMPILATION_CACHE_DIR": ""}
  out = {"before": [], "after": []}
  for _ in range(rounds):
    for which in out:
      r = subprocess.run(
        [sys.executable, "-c", CODE, exp, which], capture_output=True, text=True, env=env
      )
      line = [x for x in r.stdout.splitlines() if x.startswith("SECONDS")]
      if not line:
        sys.exit(r.stderr[-3000:])
      out[which].append(round(float(line[0].split()[1]), 2))
      print(which, out[which][-1], flush=True)
  ratio = sum(out["after"]) / sum(out["before"])
  print(json.dumps({"experiment": exp, **out, "after/before": round(ratio, 3)}))


if __name__ == "__main__":
  main()
