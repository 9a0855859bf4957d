"""Checkpoints: an orbax CheckpointManager (asynchronous, keep-last-N, atomic) over one workdir.

Each step holds three items: `state` (params, optimizer state, step, RNG), `data` (the grain
iterator state) and `meta` (the family and model config: what makes it a zoo checkpoint, so a
model can be rebuilt without the experiment). Orbax writes a step into a temporary directory and
renames it when complete, so a half-written step is never listed as the latest.
"""

import os

import grain
import orbax.checkpoint as ocp

from common.errors import UserError


def directory(workdir: str) -> str:
  return os.path.join(os.path.abspath(workdir), "checkpoints")


class Checkpoints:
  def __init__(self, workdir: str, *, keep: int = 3, read_only: bool = False):
    self.path = directory(workdir)
    self.manager = ocp.CheckpointManager(
      self.path,
      options=ocp.CheckpointManagerOptions(
        max_to_keep=keep,
        create=not read_only,
        read_only=read_only,
        enable_async_checkpointing=not read_only,
      ),
    )

  def latest_step(self) -> int | None:
    return self.manager.latest_step()

  def save(self, step: int, state, *, data_iterator, meta: dict, force: bool = False):
    self.manager.save(
      step,
      args=ocp.args.Composite(
        state=ocp.args.StandardSave(state),
        data=grain.checkpoint.CheckpointSave(data_iterator),
        meta=ocp.args.JsonSave(meta),
      ),
      force=force,
    )

  def restore(self, step: int, abstract_state, *, data_iterator=None):
    """The state at `step` (and the data iterator moved to where it was)."""
    items = {"state": ocp.args.StandardRestore(abstract_state)}
    if data_iterator is not None:
      items["data"] = grain.checkpoint.CheckpointRestore(data_iterator)
    return self.manager.restore(step, args=ocp.args.Composite(**items)).state

  def meta(self, step: int) -> dict:
    return self.manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore())).meta

  def wait(self):
    self.manager.wait_until_finished()

  def close(self):
    self.manager.close()


def open_latest(workdir: str) -> tuple["Checkpoints", int]:
  """A read-only view of a workdir's checkpoints and its latest step; UserError if it has none."""
  if not os.path.isdir(directory(workdir)):
    raise UserError(
      f"{workdir!r} has no checkpoints/ directory: give the --workdir of a `zoo run`."
    )
  ckpts = Checkpoints(workdir, read_only=True)
  step = ckpts.latest_step()
  if step is None:
    raise UserError(f"{directory(workdir)} holds no complete checkpoint yet: train first.")
  return ckpts, step
