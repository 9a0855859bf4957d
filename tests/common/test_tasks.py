"""common/tasks/: the task is named in the config, inferred once for configs saved before it,
and a task defined outside the zoo trains through the one trainer."""

import json
import os

import jax.numpy as jnp
import pytest

from nnx_zoo.common import cli, experiments, parallel, tasks
from nnx_zoo.common.errors import UserError
from nnx_zoo.common.hub import weights
from nnx_zoo.common.tasks import losses
from nnx_zoo.common.train import trainer


def test_every_experiment_names_a_task_that_inference_agrees_with():
  """The inference that reads old configs gives each experiment's declared task."""
  for name in experiments.REGISTRY:
    # An experiment whose model is its init_from's resolves it in its smoke form (tiny:llama).
    takes_init_from = experiments.get_config(name, resolve=False).get("model_from")
    cfg = experiments.get_config(f"{name}:smoke" if takes_init_from else name)
    assert cfg.task in tasks.names(), name
    without = cfg.copy_and_resolve_references()
    del without["task"]
    # The same task (a configured one, dpo with its beta, is a copy of the registered one).
    assert type(tasks.of(without)) is type(tasks.get(cfg.task)), name


def test_an_unknown_task_is_refused_with_the_nearest_name():
  with pytest.raises(UserError, match="Unknown task 'clasifier'. Did you mean: classifier"):
    experiments.get_config("lm/shakespeare-char:smoke", {"task": "clasifier"})


class FirstHalf(tasks.Task):
  """A toy task: next-token cross-entropy on the first half of each row's targets only."""

  name = "first_half"

  def loss_sums(self, model, batch, *, loss_chunk=0):
    rows = losses.next_token_rows(batch)
    T = rows["targets"].shape[1]
    weights = rows["weights"] * (jnp.arange(T) < T // 2)
    logits = model(
      rows["inputs"], positions_BT=rows["positions"], segment_ids_BT=rows["segment_ids"]
    )
    ce = parallel.cross_entropy(logits, rows["targets"])
    return jnp.sum(ce * weights), jnp.sum(weights)

  def summary(self, sums):
    return {"loss": sums["total"] / max(sums["count"], 1.0), "half_targets": int(sums["count"])}


def test_a_task_defined_in_a_test_file_trains_and_evaluates(tmp_path, capsys):
  tasks.register(FirstHalf())
  cfg = experiments.get_config(
    "lm/shakespeare-char:smoke",
    {"task": "first_half", "train.steps": "2", "train.eval_every": "2", "train.log_every": "1"},
  )
  workdir = str(tmp_path / "run")
  trainer.train(cfg, workdir, progress=False)
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    lines = [json.loads(line) for line in f]
  train_lines = [r for r in lines if "split" not in r]
  (ev,) = [r for r in lines if r.get("split") == "eval"]
  assert [r["step"] for r in train_lines] == [1, 2]
  # Half the targets of every row: about half of what the language model counts on the same rows.
  assert "perplexity" not in ev
  lm = experiments.get_config("lm/shakespeare-char:smoke")
  graphdef, params, _ = weights.restore_params(lm, workdir)
  data = trainer.load_data(lm, train=False)
  whole = trainer.evaluate(params, data, graphdef=graphdef, cfg=lm)
  assert 0.4 < ev["half_targets"] / whole["targets"] < 0.6
  # Its runs generate nothing: the interface's default says so.
  assert cli.main(["generate", "--workdir", workdir, "--prompt", "x"]) == 2
  assert "nothing to make for a first_half model" in capsys.readouterr().err
