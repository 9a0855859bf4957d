"""Checkpoints: an orbax CheckpointManager (asynchronous, keep-last-N, atomic) over one workdir.

Each step holds three items: `state` (params, optimizer state, step, RNG), `data` (the grain
iterator state) and `meta` (the family and model config: what makes it a zoo checkpoint, so a
model can be rebuilt without the experiment). Orbax writes a step into a temporary directory and
renames it when complete, so a half-written step is never listed as the latest; the temporary
directory a killed save leaves is removed at the next start. Old steps are garbage-collected only
after a newer one is complete. A step whose files are damaged is found at restore, set aside as
`<step>.damaged`, and the newest good one used instead.

A temporary step (`train.checkpoint_minutes`: saved for the time since the last save, not for its
step number; its meta says `"checkpoint": "temporary"`) is kept until a newer permanent one is
complete, and never counts against `keep`: the newest complete step, of either kind, is always
the one a rerun resumes from.
"""

import dataclasses
import glob
import json
import os
import shutil
import time

import grain
import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp
from flax import nnx

from nnx_zoo.common.errors import UserError
from nnx_zoo.common.files import warn
from nnx_zoo.common.nn import stacking


def directory(workdir: str) -> str:
  return os.path.join(os.path.abspath(workdir), "checkpoints")


class Checkpoints:
  def __init__(self, workdir: str, *, keep: int = 3, read_only: bool = False):
    self.path = directory(workdir)
    self.read_only = read_only
    if not read_only:
      remove_unfinished(self.path)
    # The temporary steps already on disk (an earlier attempt's), then those saved here.
    self.temporary = {step for step in _steps(self.path) if _is_temporary(self.path, step)}
    self.manager = ocp.CheckpointManager(
      self.path,
      options=ocp.CheckpointManagerOptions(
        preservation_policy=KeepPermanent(keep, self.temporary),
        create=not read_only,
        read_only=read_only,
        enable_async_checkpointing=not read_only,
      ),
    )
    self.saved_at = time.monotonic()  # the last save's start (train.checkpoint_minutes)

  def latest_step(self) -> int | None:
    return self.manager.latest_step()

  def save(
    self,
    step: int,
    state,
    *,
    data_iterator=None,
    meta: dict,
    force: bool = False,
    temporary: bool = False,
  ):
    """`data_iterator` None: no data item (a `zoo convert` checkpoint, which holds params only).
    `temporary`: kept only until a newer permanent step is complete (the module's docstring)."""
    if temporary:
      meta = {**meta, "checkpoint": "temporary"}
      self.temporary.add(step)
    items = {"state": ocp.args.StandardSave(state), "meta": ocp.args.JsonSave(meta)}
    if data_iterator is not None:
      items["data"] = grain.checkpoint.CheckpointSave(data_iterator)
    self.saved_at = time.monotonic()
    self.manager.save(step, args=ocp.args.Composite(**items), force=force)

  def restore(self, step: int, abstract_state, *, data_iterator=None):
    """The state at `step` (and the data iterator moved to where it was). A dict restores only
    the entries it names (`{"params": ...}`): the params of any run whatever its optimizer, and
    of a `zoo convert` checkpoint, which holds nothing else.

    The layers are converted to the layout of `abstract_state` where the step stores them
    otherwise (`model.scan` stacks them, common/nn/stacking.py): a checkpoint of a scanned run
    restores into an unscanned model and the reverse, optimizer moments included.

    A train state whose `ema` (train.ema) the step was saved without gets one that starts at
    the restored weights; one saved with an average that the state has none for drops it."""
    paths = self._saved_paths(step)
    saved_ema = any(p[0] == "ema" for p in paths)
    if dataclasses.is_dataclass(abstract_state) and paths:
      wanted = abstract_state.ema is not None
      if saved_ema != wanted:  # train.ema turned on or off since the step was saved
        as_saved = dataclasses.replace(
          abstract_state, ema=abstract_state.params if saved_ema else None
        )
        state = self.restore(step, as_saved, data_iterator=data_iterator)
        if wanted:
          warn(
            f"train.ema is on and step {step} has no average: it starts at the restored weights."
          )
          return dataclasses.replace(state, ema=jax.tree.map(jnp.copy, state.params))
        warn(f"Step {step} holds a moving average of the weights that train.ema=0 drops.")
        return dataclasses.replace(state, ema=None)
    want = stacking.layouts(k for k, _ in nnx.to_flat_state(_params(abstract_state)))
    have = stacking.layouts(p[1:] for p in paths if p and p[0] == "params")
    target = abstract_state if have == want else stacking.relayout(abstract_state, have)
    if isinstance(target, dict):
      restore_args = ocp.checkpoint_utils.construct_restore_args(target)
      args = ocp.args.PyTreeRestore(target, restore_args, partial_restore=True)
      items = {"state": args}
    else:
      items = {"state": ocp.args.StandardRestore(target)}
    state = self.manager.restore(step, args=ocp.args.Composite(**items)).state
    if data_iterator is not None:
      restore_iterator(os.path.join(self.path, str(step), "data"), data_iterator)
    if have == want:
      return state
    state = stacking.relayout(state, want)
    # Placed as the caller asked (the converted arrays are wherever the conversion left them).
    return jax.tree.map(
      lambda x, a: x if getattr(a, "sharding", None) is None else jax.device_put(x, a.sharding),
      state,
      abstract_state,
    )

  def _saved_paths(self, step: int) -> list[tuple]:
    """The path of every array the state of `step` holds, read from its tree (none when the
    tree does not read: restoring it says why)."""
    path = os.path.join(self.path, str(step), "state")
    try:
      tree = ocp.PyTreeCheckpointer().metadata(path).item_metadata.tree
    except Exception:  # damaged: restoring it says so
      return []
    return [
      tuple(int(k) if k.isdigit() else k for k in (str(getattr(e, "key", e)) for e in p))
      for p, _ in jax.tree_util.tree_flatten_with_path(tree)[0]
    ]

  def meta(self, step: int) -> dict:
    return self.manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore())).meta

  def restore_latest(self, abstract_state, *, data_iterator=None, with_data: bool = False):
    """The state of the newest step that restores whole (state, data iterator and meta), or None
    when there is no step. `with_data`: the step must hold a data iterator's state, which
    `restore_data` moves an iterator to later (the trainer restores its weights before it has
    its data).

    A newer step that fails while an older one restores is damaged: a warning names it, and
    unless read-only it is renamed `<step>.damaged` (kept for inspection, never taken again).
    When every step fails, nothing is moved (a changed optimizer config fails that way too).
    """
    failures = {}  # step -> why it did not restore
    for step in sorted(self.manager.all_steps(), reverse=True):
      try:
        state = self.restore(step, abstract_state, data_iterator=data_iterator)
        self.meta(step)
        if with_data:
          iterator_state(os.path.join(self.path, str(step), "data"))
      except Exception as e:  # orbax and tensorstore raise many types for a damaged file
        # The first sentence: tensorstore appends a page of its spec.
        failures[step] = (
          f"{type(e).__name__}: {str(e).split('. See full')[0].splitlines()[0][:200]}"
        )
        continue
      for bad, why in failures.items():
        self.set_aside(bad, why, good=step)
      return state
    if failures:
      raise UserError(
        f"No checkpoint in {self.path} restores:\n  "
        + "\n  ".join(f"step {step}: {why}" for step, why in failures.items())
        + "\nIf the optimizer or model settings changed since they were saved, rerun with "
        "those of the run; if the files are damaged, move them away to start over."
      )
    return None

  def restore_data(self, step: int, data_iterator):
    """Moves `data_iterator` to where `step` left it (`restore_latest(with_data=True)`)."""
    restore_iterator(os.path.join(self.path, str(step), "data"), data_iterator)

  def set_aside(self, step: int, why: str, *, good: int):
    path = os.path.join(self.path, str(step))
    if self.read_only or jax.process_index() != 0:
      warn(f"checkpoint {path} is damaged ({why}); using step {good} instead.")
      return
    aside, n = f"{path}.damaged", 1
    while os.path.exists(aside):  # set aside before, resumed, damaged again: keep both
      n += 1
      aside = f"{path}.damaged{n}"
    os.rename(path, aside)
    self.manager.reload()  # orbax lists steps once; without this it would still count `step`
    warn(f"checkpoint {path} is damaged ({why}); moved it to {aside}, using step {good} instead.")

  def wait(self):
    self.manager.wait_until_finished()

  def close(self):
    self.manager.close()


@dataclasses.dataclass
class KeepPermanent:
  """Orbax's preservation policy for the zoo's steps: the newest `keep` permanent ones (all of
  them where `keep` is 0 or None), and every temporary one newer than the newest permanent."""

  keep: int | None
  temporary: set

  def should_preserve(self, checkpoints, *, context) -> list[bool]:
    steps = [c.step for c in checkpoints]
    permanent = sorted(s for s in steps if s not in self.temporary)
    kept = set(permanent[-self.keep :] if self.keep else permanent)
    newest = permanent[-1] if permanent else -1
    return [s in kept or (s in self.temporary and s > newest) for s in steps]


def _steps(path: str) -> list[int]:
  return sorted(int(n) for n in os.listdir(path) if n.isdigit()) if os.path.isdir(path) else []


def _is_temporary(path: str, step: int) -> bool:
  """Whether the meta of `step` marks it temporary (a step whose meta does not read is not)."""
  try:
    with open(os.path.join(path, str(step), "meta", "metadata")) as f:
      return json.load(f).get("checkpoint") == "temporary"
  except (OSError, ValueError, AttributeError):
    return False


def restore_iterator(path: str, iterator):
  """Moves a data iterator to where the step at `path` left it. Each process saved its own
  state (grain's `process_I-of-N.json`), but the zoo's iterators all hold the index of the next
  global batch, the same on every process: a step saved by N processes resumes on any number,
  reading the state this process would have saved, or else process 0's."""
  iterator.set_state(iterator_state(path))
  if hasattr(iterator, "start_prefetch"):  # as grain's own handler does after set_state
    iterator.start_prefetch()


def iterator_state(path: str) -> dict:
  """The data iterator state saved at `path` (a step's `data`) that this process resumes from
  (`restore_iterator`); a ValueError where there is none."""
  index, count = jax.process_index(), jax.process_count()
  own = os.path.join(path, f"process_{index}-of-{count}.json")
  saved = sorted(glob.glob(os.path.join(path, "process_*-of-*.json")))
  if not os.path.exists(own):
    if not saved:
      raise ValueError(f"{path} holds no data iterator state")
    own = next((p for p in saved if os.path.basename(p).startswith("process_0-")), saved[0])
  with open(own) as f:
    return json.load(f)


def _params(state):
  """The model's weights in a (partial) train state: its params, or a `train.ema` run's
  average where only that is asked for."""
  if isinstance(state, dict):
    return state["params"] if "params" in state else state["ema"]
  return state.params


def has_steps(workdir: str) -> bool:
  """Whether the workdir holds a finished checkpoint step (a directory named by its number)."""
  path = directory(workdir)
  return os.path.isdir(path) and any(name.isdigit() for name in os.listdir(path))


def remove_unfinished(path: str):
  """Deletes the temporary directories of saves that a kill interrupted: orbax renames a step
  into place only when it is complete, so these never hold a usable checkpoint."""
  if jax.process_index() != 0 or not os.path.isdir(path):
    return
  for name in sorted(os.listdir(path)):
    if ocp.path.step.TMP_DIR_SUFFIX in name:
      shutil.rmtree(os.path.join(path, name), ignore_errors=True)
      warn(f"removed {os.path.join(path, name)}, the unfinished save of an interrupted run.")


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
