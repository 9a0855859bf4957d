"""The run's metrics: metrics.jsonl (docs/DESIGN.md's contract) and TensorBoard event files."""

import json
import os

import jax


class MetricsLog:
  """metrics.jsonl and TensorBoard event files, written by process 0 only."""

  def __init__(self, workdir: str):
    self.active = jax.process_index() == 0
    if self.active:
      from tensorboardX import SummaryWriter

      self.file = open(os.path.join(workdir, "metrics.jsonl"), "a")  # noqa: SIM115 (kept open)
      self.tb = SummaryWriter(os.path.join(workdir, "tensorboard"))

  def write(self, step: int, metrics: dict, split: str = "train"):
    if not self.active:
      return
    record = {"step": step, **({"split": split} if split != "train" else {}), **metrics}
    self.file.write(json.dumps(record) + "\n")
    self.file.flush()
    for k, v in metrics.items():
      if isinstance(v, int | float):  # a label ("weights": "init_from") is for the JSON only
        self.tb.add_scalar(f"{split}/{k}", v, step)

  def scalars(self, step: int, values: dict, *, prefix: str):
    """TensorBoard only: a summary of the run (its goodput), not a line of metrics.jsonl."""
    if not self.active:
      return
    for k, v in values.items():
      self.tb.add_scalar(f"{prefix}/{k}", v, step)

  def close(self):
    if self.active:
      self.file.close()
      self.tb.close()
