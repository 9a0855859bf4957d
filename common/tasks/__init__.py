"""Tasks: what a run optimises and evaluates, named once in the config (`task`).

A task is one object (a `Task` subclass in a module of this package) that says, for every family
that can be trained on it: the global batch's shapes (what `zoo plan` compiles), the summed
training loss, the held-out sums and their summary, what `zoo eval` scores beyond them, and what
`zoo generate` does with a run of it. The trainer, the step, the planner and the CLI call it and
never guess the task from a batch's keys or a dataset's name. Adding a task is one module that
calls `register(...)` when imported, plus its name in `MODULES` below (CONTRIBUTING.md,
"Adding a task").

A config saved before `task` existed (a workdir's config.json, a `zoo convert` output) names
none: `of(cfg)` infers it once from what such a config holds (`infer`).
"""

import importlib

import jax
import numpy as np

from nnx_zoo.common import models
from nnx_zoo.common.errors import UserError, suggest

# The modules that register the built-in tasks.
MODULES = (
  "nnx_zoo.common.tasks.language_model",
  "nnx_zoo.common.tasks.seq2seq",
  "nnx_zoo.common.tasks.classifier",
  "nnx_zoo.common.tasks.contrastive",
  "nnx_zoo.common.tasks.denoiser",
  "nnx_zoo.common.tasks.speech",
  "nnx_zoo.common.tasks.preference",
  "nnx_zoo.common.tasks.grpo",
  "nnx_zoo.common.tasks.distill",
)

# The batch key under which a task hands the step a frozen model's params (the distill task's
# teacher, `complete`): placed and split over the mesh as params are, not as rows; whole in every
# micro-batch; never differentiated, and no optimizer state (common/train/step.py).
FROZEN = "frozen_params"


class Task:
  """The interface every task implements (`name` and `loss_sums` at least)."""

  name: str = ""
  # The model's rows in one example of the batch: a preference pair is two (`zoo plan` counts
  # a step's tokens as train.batch_size x this x the row's length).
  rows_per_example: int = 1
  # The run's model is a decoder language model (pretrained, SFT, DPO, distilled, GRPO): `zoo
  # generate`, `zoo chat`, `zoo serve` and `zoo lm-eval` talk to it (`decoder_task`).
  decoder: bool = False

  def loss_sums(self, model, batch: dict, *, loss_chunk: int = 0) -> tuple[jax.Array, jax.Array]:
    """The batch's summed training loss and the count it is the mean over."""
    raise NotImplementedError

  def eval_sums(self, model, batch: dict, *, prompts=None) -> dict:
    """Sums of a held-out batch: `total` and `count` at least (`prompts`: a data kind's
    class prompts, for a model classified by them)."""
    total, count = self.loss_sums(model, batch)
    return {"total": total, "count": count}

  def summary(self, sums: dict) -> dict:
    """The held-out metrics from the sums of every batch."""
    count = max(sums["count"], 1.0)
    return {"loss": sums["total"] / count, "examples": int(count)}

  def score(self, graphdef, params, cfg) -> dict:
    """What `zoo eval` measures beyond the held-out sums (a denoiser: its samples)."""
    return {}

  def batch_shapes(self, cfg) -> dict[str, tuple[tuple[int, ...], type]]:
    """{key: (shape, dtype)} of a global training batch, as the data kinds feed it."""
    raise UserError(f"`zoo plan` does not know the batches of the {self.name} task yet.")

  def context_rows(self, batch: dict):
    """The rows `mesh.context` splits (a language model's next-token rows), or None: the task
    has no token rows to split."""
    return None

  def configure(self, cfg) -> "Task":
    """The task as `cfg` sets it up (its own config section, checked): `of(cfg)` returns it."""
    return self

  def prepare(self, data, *, cfg, layout=None) -> "Task":
    """What the task sets up once before training or evaluating (dpo: its reference model);
    the task itself, ready for `complete`."""
    return self

  def complete(self, batch: dict, params) -> dict:
    """The batch (placed on the mesh) with what the task computes from it before a train or
    eval step (dpo: the reference model's log-probabilities); the batch itself by default."""
    return batch

  def complete_train(self, batch: dict, params) -> dict:
    """`complete` of a training batch (the trainer's loop calls this one; evaluation calls
    `complete`): the distill task's on-policy batches are its student's own samples."""
    return self.complete(batch, params)

  def show(self, cfg) -> list[str]:
    """Lines `zoo show` prints beyond the model's (distill: the teacher and the student)."""
    return []

  def after_prepare(self, cfg, out: str, *, num_processes: int = 1, process_id: int = 0,
                    progress: bool = True) -> dict:  # fmt: skip
    """What `zoo data prepare` writes beside the tokens in `out` (distill: the teacher's top-k
    log-probabilities), and its summary; nothing by default."""
    return {}

  def step_metrics(self) -> dict:
    """What the task measured on the host since it was last asked (grpo: its rollouts' rewards
    and times), merged into each training line of metrics.jsonl; none by default."""
    return {}

  def samples(self, data, *, cfg, split: str, count: int) -> list[dict] | None:
    """What `zoo data show` prints for a task that makes its rows from the data's (grpo: the
    first prompts' completions, sampled from the weights a run starts from, with their rewards);
    None: the data's token rows."""
    return None

  def generate(self, args, cfg) -> None:
    """`zoo generate --workdir W` of a run of this task (prints or writes what it makes); a
    decoder's continues the prompt, as a language model's."""
    if self.decoder and self.name != "language_model":
      return get("language_model").generate(args, cfg)
    raise UserError(f"`zoo generate` has nothing to make for a {self.name} model.")


def decoder_task(cfg, command: str, workdir: str) -> Task:
  """The run's task, refused in one line unless its model is a decoder LM (`command` talks to
  one)."""
  task = of(cfg)
  if not task.decoder:
    raise UserError(f"`{command}` talks to a decoder LM; {workdir} holds a {task.name} model.")
  return task


_TASKS: dict[str, Task] = {}
_imported = False


def register(task: Task) -> Task:
  held = _TASKS.get(task.name)
  if held is not None and type(held).__module__ != type(task).__module__:
    raise ValueError(
      f"Task {task.name!r} is registered by {type(held).__module__} already: give "
      f"{type(task).__module__}'s another name."
    )
  _TASKS[task.name] = task
  return task


def names() -> tuple[str, ...]:
  global _imported
  if not _imported:
    for module in MODULES:
      importlib.import_module(module)
    _imported = True
  return tuple(sorted(_TASKS))


def get(name: str) -> Task:
  known = names()
  if name not in known:
    raise UserError(f"Unknown task {name!r}.{suggest(name, known)} Known: {', '.join(known)}.")
  return _TASKS[name]


def of(cfg) -> Task:
  """The task of a config: its `task`, or for a config saved before that key,
  `models.infer_task(cfg)`."""
  return get(cfg.get("task") or models.infer_task(cfg)).configure(cfg)


def token_rows(B: int, T: int) -> dict:
  """Shapes of packed token rows and their segment ids, [B, T]."""
  return {k: ((B, T), np.int32) for k in ("tokens", "segment_ids")}
