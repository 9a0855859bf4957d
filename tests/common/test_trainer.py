"""common/trainer.py: the loss, the optimizer, determinism, exact resumption, checkpoints and
init_from, on the smoke form of lm/shakespeare-char (a few steps each)."""

import dataclasses
import json
import math
import os
import pathlib
import re

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
import pytest
from flax import nnx

from nnx_zoo.common import config as config_lib
from nnx_zoo.common import experiments, models, parallel
from nnx_zoo.common.data import pipeline
from nnx_zoo.common.errors import UserError
from nnx_zoo.common.hub import checkpoint, weights
from nnx_zoo.common.nn import stacking
from nnx_zoo.common.tasks import losses
from nnx_zoo.common.train import metrics, optim, settings, trainer
from nnx_zoo.common.train import step as steps
from nnx_zoo.zoo.llama import model as llama

ROOT = pathlib.Path(__file__).resolve().parents[2]
SMOKE = "lm/shakespeare-char:smoke"
# A constant schedule after a fixed warm-up does not depend on train.steps, so a run extended
# from 4 to 6 steps must match a 6-step run exactly; evaluation is off to keep the runs short.
BASE = {
  "train.steps": "6",
  "train.checkpoint_every": "2",
  "train.log_every": "1",
  "train.keep_checkpoints": "2",
  "train.eval_every": "0",
  "optim.schedule": "constant",
  "optim.warmup_steps": "2",
}


def smoke_config(overrides: dict | None = None) -> ml_collections.ConfigDict:
  return experiments.get_config(SMOKE, {**BASE, **(overrides or {})})


def train_losses(workdir) -> dict[int, float]:
  """{step: loss} of the training lines of DIR/metrics.jsonl; a step logged twice fails."""
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    records = [json.loads(line) for line in f if line.strip()]
  steps = [r["step"] for r in records if "split" not in r]
  assert len(steps) == len(set(steps)), f"a step was logged twice: {steps}"
  return {r["step"]: r["loss"] for r in records if "split" not in r}


def flat_params(params) -> dict:
  return {k: np.asarray(v.get_value()) for k, v in nnx.to_flat_state(params)}


def assert_params_equal(a, b):
  a, b = flat_params(a), flat_params(b)
  assert a.keys() == b.keys()
  for k in a:
    np.testing.assert_array_equal(a[k], b[k], err_msg=str(k))


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
  """An uninterrupted 6-step run: its workdir."""
  workdir = str(tmp_path_factory.mktemp("reference"))
  trainer.train(smoke_config(), workdir, progress=False)
  return workdir


# The loss


@pytest.fixture(scope="module")
def tiny():
  """The tiny Llama, split into graphdef and params."""
  return nnx.split(models.build(llama.config("tiny"), seed=0), nnx.Param)


def test_loss_sums_masks_document_boundaries_and_padding(tiny):
  graphdef, params = tiny
  tokens = np.random.default_rng(0).integers(0, 256, size=(2, 8)).astype(np.int32)
  # Row 0: two documents, then padding; row 1: one continues from the row before, one starts.
  segments = np.array([[1, 1, 1, 2, 2, 2, 0, 0], [2, 2, 3, 3, 3, 3, 3, 3]], np.int32)
  # Target t (token t + 1) counts when it continues its input's document and is not padding.
  weights = np.array([[1, 1, 0, 1, 1, 0, 0], [1, 0, 1, 1, 1, 1, 1]], np.float64)

  @jax.jit
  def loss_and_logits(params, batch):
    model = nnx.merge(graphdef, params)
    logits = model(batch["tokens"][:, :-1], segment_ids_BT=batch["segment_ids"][:, :-1])
    return losses.loss_sums(model, batch), logits

  batch = {"tokens": jnp.asarray(tokens), "segment_ids": jnp.asarray(segments)}
  (total, count), logits = loss_and_logits(params, batch)

  logits = np.asarray(logits, np.float64)
  m = logits.max(-1, keepdims=True)
  log_z = (m + np.log(np.exp(logits - m).sum(-1, keepdims=True)))[..., 0]
  target_logit = np.take_along_axis(logits, tokens[:, 1:, None], -1)[..., 0]
  want = ((log_z - target_logit) * weights).sum()
  assert float(count) == weights.sum() == 10
  np.testing.assert_allclose(float(total), want, rtol=1e-5)

  # Padding tokens change nothing: neither their targets nor (causally) anything before them.
  padded = dict(batch, tokens=batch["tokens"].at[0, 6:].set(7))
  np.testing.assert_allclose(float(loss_and_logits(params, padded)[0][0]), float(total), rtol=1e-6)


# The optimizer


def optim_config(**kw) -> ml_collections.ConfigDict:
  cfg = dict(
    lr=1e-3,
    warmup_steps=3,
    schedule="cosine",
    min_lr_ratio=0.1,
    b1=0.9,
    b2=0.95,
    eps=1e-8,
    weight_decay=0.1,
    clip_norm=1.0,
  )
  return ml_collections.ConfigDict({**cfg, **kw})


def test_adamw_decays_matrices_but_not_vectors(tiny):
  _, params = tiny
  lr, wd = 0.1, 0.5
  tx = optim.optimizer(
    optim_config(lr=lr, weight_decay=wd, warmup_steps=0, schedule="constant"), 10
  )
  # With zero gradients Adam's update is exactly 0, so all that moves a param is weight decay.
  zeros = jax.tree.map(jnp.zeros_like, params)
  updates, _ = jax.jit(tx.update)(zeros, tx.init(params), params)
  new, old = flat_params(optax.apply_updates(params, updates)), flat_params(params)
  vectors = sorted(k for k, v in old.items() if v.ndim == 1)
  assert vectors and all(k[-1] == "scale" for k in vectors)  # the norm scales
  for k, v in old.items():
    if v.ndim == 1:
      np.testing.assert_array_equal(new[k], v, err_msg=str(k))
    else:
      np.testing.assert_allclose(new[k], v * (1 - lr * wd), rtol=1e-6, err_msg=str(k))


@pytest.mark.parametrize("fused", [True, False])
def test_adamw_decays_the_same_with_the_layers_stacked(tiny, fused):
  """model.scan stores the norm scales stacked [L, D]: still vectors, not decayed; one step
  from the same gradients gives the per-layer step's params (and moments), stacked."""
  _, params = tiny
  tx = optim.optimizer(optim_config(weight_decay=0.5, warmup_steps=0), 10, fused=fused)
  grads = jax.tree.map(lambda x: jnp.sin(jnp.arange(x.size).reshape(x.shape) + 1.0), params)
  stacked = stacking.stack_layers(params, {(): 1})
  assert any(
    k[0] == "stacked" and v.ndim == 2 and k[-1] == "scale" for k, v in nnx.to_flat_state(stacked)
  )

  def step(params, grads):
    updates, state = tx.update(grads, tx.init(params), params)
    return optax.apply_updates(params, updates), state

  want, want_state = jax.jit(step)(params, grads)
  got, got_state = jax.jit(step)(stacked, stacking.stack_layers(grads, {(): 1}))
  assert_params_equal(stacking.unstack_layers(got), want)
  want_mu = jax.tree.leaves(want_state, is_leaf=lambda x: isinstance(x, nnx.State))
  got_mu = jax.tree.leaves(got_state, is_leaf=lambda x: isinstance(x, nnx.State))
  for g, w in zip(got_mu, want_mu, strict=True):
    if isinstance(w, nnx.State):
      assert_params_equal(stacking.unstack_layers(g), w)


def test_warmup_cosine_schedule_equals_optax_reference():
  lr, end, warmup, steps = 1e-3, 1e-4, 3, 10
  got = optim.schedule(optim_config(), steps)
  ref = optax.warmup_cosine_decay_schedule(0.0, lr, warmup, steps, end)
  for t in [0, 1, 2, 3, 5, 8, 10, 12]:
    want = (
      lr * t / warmup
      if t < warmup
      else (end + (lr - end) * 0.5 * (1 + math.cos(math.pi * min(t - warmup, 7) / 7)))
    )
    np.testing.assert_allclose(float(got(t)), float(ref(t)), rtol=1e-6, atol=1e-12)
    np.testing.assert_allclose(float(got(t)), want, rtol=1e-5, atol=1e-12)


def test_linear_and_constant_schedules():
  lr, end = 1e-3, 1e-4
  linear = optim.schedule(optim_config(schedule="linear"), 10)
  constant = optim.schedule(optim_config(schedule="constant"), 10)
  for t in [0, 1, 2, 3, 6, 10, 12]:
    warm = lr * t / 3
    np.testing.assert_allclose(
      float(linear(t)),
      warm if t < 3 else lr + (end - lr) * min(t - 3, 7) / 7,
      rtol=1e-5,
      atol=1e-12,
    )
    np.testing.assert_allclose(float(constant(t)), warm if t < 3 else lr, rtol=1e-5, atol=1e-12)
  # A warm-up longer than the run is cut so that the last step reaches the peak.
  np.testing.assert_allclose(float(optim.schedule(optim_config(warmup_steps=100), 4)(3)), lr)
  with pytest.raises(UserError, match="exponential"):
    optim.schedule(optim_config(schedule="exponential"), 10)


# Held-out evaluation


def recorded(data):
  """`data` whose held-out batches are kept, as they are read, in the list returned beside it."""
  seen, eval_batches = [], data.eval_batches

  def recording(*args, **kw):
    for batch in eval_batches(*args, **kw):
      seen.append(batch)
      yield batch

  return dataclasses.replace(data, eval_batches=recording), seen


def test_eval_batch_size_changes_the_batches_not_the_held_out_metrics():
  """train.eval_batch_size: the same held-out rows (the first 16) in 2 batches of 8 as in 4 of
  the train batch's 4 give the same loss; a size the mesh's batch axes do not divide is refused
  in one line before anything runs."""
  graphdef, params = nnx.split(models.build(smoke_config().model, seed=0), nnx.Param)
  got = {}
  for size, batches in ((0, 4), (8, 2)):
    over = {"train.batch_size": "4", "train.eval_batch_size": str(size),
            "train.eval_batches": str(batches)}  # fmt: skip
    cfg = smoke_config(over)
    data, seen = recorded(trainer.load_data(cfg, train=False))
    got[size] = trainer.evaluate(params, data, graphdef=graphdef, cfg=cfg)["loss"]
    assert [len(b["tokens"]) for b in seen] == [size or 4] * batches
  assert got[8] == pytest.approx(got[0], rel=1e-6)
  cfg = smoke_config({"train.eval_batch_size": "6"})
  with pytest.raises(UserError, match=r"train.eval_batch_size=6 is not divisible by data x fsdp"):
    parallel.check_experiment(cfg, {"data": 4, "fsdp": 1, "expert": 1, "tensor": 1})


# Runs


@pytest.mark.slow
def test_same_seed_gives_identical_losses(reference, tmp_path):
  trainer.train(smoke_config(), str(tmp_path / "again"), progress=False)
  want = train_losses(reference)
  assert list(want) == [1, 2, 3, 4, 5, 6]
  assert train_losses(tmp_path / "again") == want
  trainer.train(
    smoke_config({"seed": "1", "train.steps": "1"}), str(tmp_path / "seed1"), progress=False
  )
  assert train_losses(tmp_path / "seed1")[1] != want[1]


@pytest.mark.slow
def test_logged_lr_follows_the_schedule(reference):
  cfg = smoke_config()
  lr_at = optim.schedule(cfg.optim, cfg.train.steps)
  with open(os.path.join(reference, "metrics.jsonl")) as f:
    records = [json.loads(line) for line in f]
  assert [r["lr"] for r in records] == [float(lr_at(r["step"] - 1)) for r in records]
  assert all(r["tokens_per_s"] > 0 and r["targets"] > 0 for r in records)


@pytest.mark.slow
def test_resume_extending_steps_is_exact(reference, tmp_path):
  workdir = str(tmp_path / "run")
  trainer.train(smoke_config({"train.steps": "4"}), workdir, progress=False)
  assert list(train_losses(workdir)) == [1, 2, 3, 4]
  trainer.train(smoke_config({"train.steps": "6"}), workdir, progress=False)
  assert train_losses(workdir) == train_losses(reference)  # every step, bitwise
  cfg = smoke_config()
  _, params, step = weights.restore_params(cfg, workdir)
  _, want, want_step = weights.restore_params(cfg, reference)
  assert step == want_step == 6
  assert_params_equal(params, want)


class Crash(Exception):
  pass


@pytest.mark.slow
def test_resume_after_a_crash_is_exact(reference, tmp_path, monkeypatch):
  """Same config, killed during step 5 (after the step-4 checkpoint), then rerun."""
  write = metrics.MetricsLog.write

  def crashing_write(self, step, metrics, split="train"):
    if step == 5:
      raise Crash
    write(self, step, metrics, split)

  workdir = str(tmp_path / "run")
  with monkeypatch.context() as m:
    m.setattr(metrics.MetricsLog, "write", crashing_write)
    with pytest.raises(Crash):
      trainer.train(smoke_config(), workdir, progress=False)
  assert list(train_losses(workdir)) == [1, 2, 3, 4]
  trainer.train(smoke_config(), workdir, progress=False)
  assert train_losses(workdir) == train_losses(reference)
  assert_params_equal(
    weights.restore_params(smoke_config(), workdir)[1],
    weights.restore_params(smoke_config(), reference)[1],
  )


@pytest.mark.slow
def test_checkpoints_keep_last_n_with_data_state_and_meta(reference):
  ckpt_dir = checkpoint.directory(reference)
  steps = sorted(int(d) for d in os.listdir(ckpt_dir) if d.isdigit())
  assert steps == [4, 6]  # saved at 2, 4, 6; keep_checkpoints=2
  for step in steps:
    items = os.listdir(os.path.join(ckpt_dir, str(step)))
    assert {"state", "data", "meta"} <= set(items)
    data_files = os.listdir(os.path.join(ckpt_dir, str(step), "data"))
    assert any(f.startswith("process_0") for f in data_files), data_files
  cfg = smoke_config()
  ckpts, latest = checkpoint.open_latest(reference)
  try:
    meta = ckpts.meta(latest)
  finally:
    ckpts.close()
  assert latest == 6
  assert meta["family"] == "llama"
  assert meta["model"] == json.loads(json.dumps(cfg.model.to_dict()))
  # The model can be rebuilt from the meta alone (what makes it a zoo checkpoint).
  models.abstract(ml_collections.ConfigDict(meta["model"]))


@pytest.mark.slow
def test_checkpoint_holds_the_data_iterator_state(reference):
  """Restoring the step-6 data state gives the batch the run would have seen at step 7."""
  cfg = smoke_config()
  rows = pipeline.load_split(cfg.data, "train")
  fresh = pipeline.train_iterator(rows, batch_size=cfg.train.batch_size, seed=cfg.seed)
  want = [next(fresh) for _ in range(7)][-1]
  restored = pipeline.train_iterator(rows, batch_size=cfg.train.batch_size, seed=cfg.seed)
  ckpts, step = checkpoint.open_latest(reference)
  try:
    tx = optim.optimizer(cfg.optim, cfg.train.steps)
    ckpts.restore(step, steps.abstract_state(cfg, tx), data_iterator=restored)
  finally:
    ckpts.close()
  got = next(restored)
  for k in want:
    np.testing.assert_array_equal(got[k], want[k])


@pytest.mark.parametrize("scan", [False, True])
@pytest.mark.slow
def test_init_from_loads_the_source_params(reference, tmp_path, scan):
  """Into the same model, or one that stores its layers stacked (model.scan: the source's
  per-layer weights are stacked)."""
  cfg = smoke_config({"init_from": reference, "seed": "5", "train.steps": "1"})
  cfg.model.scan = scan
  _, source, _ = weights.restore_params(smoke_config(), reference)
  tx = optim.optimizer(cfg.optim, cfg.train.steps)
  graphdef, fresh = steps.init_state(cfg, tx)
  assert ("stacked" in fresh.params) == scan
  loaded = weights.init_params(cfg, fresh.params)  # one tree per layer
  assert_params_equal(loaded, source)
  source = stacking.match_layers(source, fresh.params)

  # The first step of a run with init_from starts from those params: its loss is theirs.
  workdir = str(tmp_path / "finetune")
  trainer.train(cfg, workdir, progress=False)
  rows = pipeline.load_split(cfg.data, "train")
  batch = next(pipeline.train_iterator(rows, batch_size=cfg.train.batch_size, seed=cfg.seed))
  loss = jax.jit(lambda p, b: losses.loss_sums(nnx.merge(graphdef, p), b))
  total, count = loss(source, batch)
  fresh_total, _ = loss(fresh.params, batch)
  got = train_losses(workdir)[1]
  np.testing.assert_allclose(got, float(total / count), rtol=1e-5)
  assert abs(got - float(fresh_total / count)) > 1e-3  # not the fresh init's loss


@pytest.mark.slow
def test_init_from_a_different_shape_lists_the_mismatched_keys(reference, tmp_path):
  cfg = smoke_config({"init_from": reference, "model.mlp.hidden_dim": "96"})
  with pytest.raises(UserError, match="does not fit") as e:
    trainer.train(cfg, str(tmp_path / "other"), progress=False)
  message = str(e.value)
  assert reference in message
  for layer in (0, 1):
    for name in ("gate", "up"):
      assert f"blocks.{layer}.mlp.{name}.kernel: checkpoint (64, 128) vs model (64, 96)" in message
    assert f"blocks.{layer}.mlp.down.kernel: checkpoint (128, 64) vs model (96, 64)" in message
  assert "attn" not in message  # only what differs


def test_init_from_a_missing_path_is_a_user_error(tmp_path):
  cfg = smoke_config({"init_from": str(tmp_path / "nope")})
  with pytest.raises(UserError, match=re.escape(str(tmp_path / "nope"))):
    weights.init_params(cfg, None)


@pytest.mark.slow
def test_resume_with_other_memory_levers(reference, tmp_path):
  """model.remat and model.scan change how the model is computed, not what it is: a run resumes
  with other values, or from a config saved before model.scan existed, with the same losses."""
  workdir = str(tmp_path / "run")
  trainer.train(smoke_config({"train.steps": "4"}), workdir, progress=False)
  path = os.path.join(workdir, "config.json")
  with open(path) as f:
    saved = json.load(f)
  del saved["model"]["scan"]
  with open(path, "w") as f:
    json.dump(saved, f)
  levers = {"model.scan": "True", "model.remat": "save_dots"}
  trainer.train(smoke_config(levers), workdir, progress=False)
  got, want = train_losses(workdir), train_losses(reference)
  assert list(got) == list(want)
  for step, loss in want.items():
    assert got[step] == pytest.approx(loss, rel=1e-5), step
  assert weights.restore_params(smoke_config(), workdir)[2] == 6  # loads with the levers off


# The moving average of the weights (train.ema). A decay of 0.3 is capped by (1 + t) / (10 + t)
# at steps 1 and 2 (0.18, 0.25) and not after (0.31 at step 3), so both branches are checked.
EMA = {"train.ema": "0.3", "train.eval_every": "6"}


def copied_params(params) -> dict:
  """flat_params as copies: the train step donates the state, so no view of it may be kept."""
  return {k: np.array(v, copy=True) for k, v in flat_params(params).items()}


def hand_ema(history: list[dict], decay: float) -> dict:
  """The average written out in float64: the initial weights, then at step t = 1, 2, ...
  e = d e + (1 - d) p_t with d = min(decay, (1 + t) / (10 + t))."""
  ema = {k: v.astype(np.float64) for k, v in history[0].items()}
  for t, params in enumerate(history[1:], start=1):
    d = min(decay, (1 + t) / (10 + t))
    ema = {k: d * ema[k] + (1 - d) * params[k] for k in ema}
  return ema


@pytest.mark.slow
def test_ema_step_averages_the_params_of_every_step():
  cfg = smoke_config(EMA)
  tx = optim.optimizer(cfg.optim, cfg.train.steps)
  _, state = steps.init_state(cfg, tx)
  shardings = steps.placed_abstract_state(cfg, tx, None)[1]
  step_fn = steps.make_train_step(cfg, tx=tx, layout=None, shardings=shardings)
  batches = trainer.load_data(cfg).iterator
  history = [copied_params(state.params)]
  for _ in range(6):
    state, _ = step_fn(state, next(batches))
    history.append(copied_params(state.params))
  want, got = hand_ema(history, 0.3), flat_params(state.ema)
  assert got.keys() == want.keys()
  for k in want:
    np.testing.assert_allclose(got[k], want[k], rtol=1e-5, atol=1e-7, err_msg=str(k))
  # Not trivially the last params: the average lags behind them.
  assert any(np.abs(got[k] - history[-1][k]).max() > 1e-4 for k in want)


@pytest.fixture(scope="module")
def ema_run(tmp_path_factory):
  """The reference run with train.ema: its workdir."""
  workdir = str(tmp_path_factory.mktemp("ema"))
  trainer.train(smoke_config(EMA), workdir, progress=False)
  return workdir


def saved_weights(cfg, workdir) -> dict:
  """The raw params and the average of `workdir`'s latest checkpoint."""
  abstract = nnx.state(models.abstract(cfg.model), nnx.Param)
  ckpts, step = checkpoint.open_latest(workdir)
  try:
    return ckpts.restore(step, {"params": abstract, "ema": abstract})
  finally:
    ckpts.close()


@pytest.mark.slow
def test_ema_is_evaluated_and_read_back_without_changing_training(reference, ema_run):
  assert train_losses(ema_run) == train_losses(reference)  # the average never feeds back
  cfg = smoke_config(EMA)
  saved = saved_weights(cfg, ema_run)
  assert_params_equal(saved["params"], weights.restore_params(smoke_config(), reference)[1])
  # zoo eval, zoo generate (restore_params), hub.load, export and init_from (read) take the
  # average, not the raw params.
  assert_params_equal(weights.restore_params(cfg, ema_run)[1], saved["ema"])
  assert_params_equal(weights.read(ema_run)[1], saved["ema"])
  assert any(
    np.abs(a - b).max() > 1e-4
    for a, b in zip(
      flat_params(saved["ema"]).values(), flat_params(saved["params"]).values(), strict=True
    )
  )
  # The logged evaluation is the average's.
  with open(os.path.join(ema_run, "metrics.jsonl")) as f:
    logged = [json.loads(line) for line in f if '"eval"' in line]
  assert [r["step"] for r in logged] == [6]
  graphdef = nnx.graphdef(models.abstract(cfg.model))
  data = trainer.load_data(cfg, train=False)
  for params, equal in ((saved["ema"], True), (saved["params"], False)):
    loss = trainer.evaluate(params, data, graphdef=graphdef, cfg=cfg)["loss"]
    assert (loss == pytest.approx(logged[0]["loss"], rel=1e-6)) == equal


@pytest.mark.slow
def test_resume_with_ema_is_exact(ema_run, tmp_path):
  workdir = str(tmp_path / "run")
  trainer.train(smoke_config({**EMA, "train.steps": "4"}), workdir, progress=False)
  trainer.train(smoke_config(EMA), workdir, progress=False)
  assert train_losses(workdir) == train_losses(ema_run)
  cfg = smoke_config(EMA)
  got, want = saved_weights(cfg, workdir), saved_weights(cfg, ema_run)
  assert_params_equal(got["params"], want["params"])
  assert_params_equal(got["ema"], want["ema"])  # the average was saved and restored, bitwise


@pytest.mark.slow
def test_train_ema_turned_on_or_off_at_resume(reference, ema_run, tmp_path):
  """A run saved without train.ema resumes with it, its average starting at the restored
  weights; one saved with it resumes without it, the average dropped. Training is that of the
  uninterrupted run either way (the average never feeds back)."""
  cfg = smoke_config(EMA)
  on = str(tmp_path / "on")
  trainer.train(smoke_config({"train.steps": "4"}), on, progress=False)
  tx = optim.optimizer(cfg.optim, cfg.train.steps)
  ckpts = checkpoint.Checkpoints(on, read_only=True)
  try:
    state = ckpts.restore(4, steps.placed_abstract_state(cfg, tx, None)[0])
  finally:
    ckpts.close()
  assert_params_equal(state.ema, state.params)
  trainer.train(cfg, on, progress=False)
  assert train_losses(on) == train_losses(reference)
  saved = saved_weights(cfg, on)  # step 6 holds the average, and readers take it
  assert_params_equal(weights.restore_params(cfg, on)[1], saved["ema"])

  off = str(tmp_path / "off")
  trainer.train(smoke_config({**EMA, "train.steps": "4"}), off, progress=False)
  trainer.train(smoke_config(), off, progress=False)
  assert train_losses(off) == train_losses(reference)
  assert_params_equal(
    weights.restore_params(smoke_config(), off)[1], saved_weights(cfg, on)["params"]
  )


@pytest.mark.slow
def test_resume_and_load_across_scan(reference, tmp_path):
  """model.scan stores the layers stacked: a run saved scanned resumes unscanned (params and
  AdamW moments converted) with the losses of the uninterrupted run, and each setting loads
  the other's checkpoint with the same weights."""
  workdir = str(tmp_path / "run")
  trainer.train(smoke_config({"model.scan": "True", "train.steps": "4"}), workdir, progress=False)
  cfg = smoke_config({"model.scan": "True"})
  _, stacked, _ = weights.restore_params(cfg, workdir)  # step 4, saved stacked
  assert "stacked" in stacked and "blocks" not in stacked
  _, per_layer, _ = weights.restore_params(smoke_config(), workdir)
  assert_params_equal(stacking.unstack_layers(stacked), per_layer)
  trainer.train(smoke_config(), workdir, progress=False)  # steps 5 and 6 unscanned
  got, want = train_losses(workdir), train_losses(reference)
  assert list(got) == list(want)
  for step, loss in want.items():
    assert got[step] == pytest.approx(loss, rel=1e-5), step
  _, stacked, step = weights.restore_params(cfg, workdir)  # step 6, saved per layer
  assert step == 6 and "stacked" in stacked
  _, want_params, _ = weights.restore_params(smoke_config(), reference)
  got_params = flat_params(stacking.unstack_layers(stacked))
  for k, v in flat_params(want_params).items():
    np.testing.assert_allclose(got_params[k], v, rtol=1e-4, atol=1e-6, err_msg=str(k))


# Model configs saved before the shared stack (mlp.kind was the activation; no norm_placement,
# embed_scale, final_softcap, layer pattern, attention.scale or norm.offset).
NEW_KEYS = ("norm_placement", "embed_scale", "final_softcap", "layer_pattern", "layer_kinds")


def to_old_form(model: dict) -> dict:
  model = json.loads(json.dumps(model))
  for key in NEW_KEYS:
    model.pop(key, None)
  model["attention"].pop("scale")
  model["norm"].pop("offset", None)
  model["mlp"]["kind"] = model["mlp"].pop("activation")
  return model


def test_upgrade_reads_an_old_model_config_as_today():
  cfg = smoke_config().model
  old = to_old_form(cfg.to_dict())
  assert old["mlp"]["kind"] == "swiglu" and "norm_placement" not in old
  assert config_lib.differences(models.upgrade(old), cfg) == []
  # A BERT config's placement is its family's (post), not the Llama default.
  bert = models.family_module("bert").config("tiny")
  assert models.upgrade(to_old_form(bert.to_dict())).norm_placement == "post"


@pytest.mark.slow
def test_a_run_saved_before_the_shared_stack_resumes_and_loads(reference, tmp_path):
  """A workdir whose config.json and checkpoint meta hold the old model config resumes with the
  same losses, and `zoo eval`/`zoo generate`/`hub.load` read its checkpoint."""
  from nnx_zoo.common import hub

  workdir = str(tmp_path / "run")
  trainer.train(smoke_config({"train.steps": "4"}), workdir, progress=False)
  paths = [os.path.join(workdir, "config.json")]
  paths += [
    os.path.join(workdir, "checkpoints", step, "meta", "metadata")
    for step in os.listdir(os.path.join(workdir, "checkpoints"))
  ]
  for path in paths:
    with open(path) as f:
      saved = json.load(f)
    saved["model"] = to_old_form(saved["model"])
    with open(path, "w") as f:
      json.dump(saved, f)
  trainer.train(smoke_config(), workdir, progress=False)
  assert train_losses(workdir) == train_losses(reference)
  with open(paths[0]) as f:
    old_cfg = ml_collections.ConfigDict(json.load(f))
  old_cfg.model = to_old_form(old_cfg.model.to_dict())
  _, params, step = weights.restore_params(old_cfg, workdir)
  assert step == 6
  model = hub.load(workdir)
  assert model(jnp.zeros((1, 4), jnp.int32)).shape == (1, 4, 256)


@pytest.mark.parametrize("key", sorted(settings.TRAIN) + [f"optim.{k}" for k in settings.OPTIM])
def test_every_experiment_accepts_every_trainer_key(key):
  """The trainer's keys are declared once (common/train/settings.py): every registered
  experiment takes an override of each, e.g. --config.train.loss_chunk=512."""
  from nnx_zoo.experiments import REGISTRY

  group, _, key = key.rpartition(".")
  group = group or "train"
  defaults = settings.TRAIN if group == "train" else settings.OPTIM
  value = str(defaults[key])
  for name in REGISTRY:
    cfg = experiments.get_config(name, {f"{group}.{key}": value}, resolve=False)
    assert cfg[group][key] == defaults[key], name


def test_settings_refuse_an_unknown_key_with_a_suggestion():
  with pytest.raises(UserError, match="Did you mean: loss_chunk"):
    settings.train(loss_chunks=4)


def test_an_experiment_file_without_trainer_keys_gets_the_defaults(tmp_path):
  """A copied experiment file that builds its own train dict (as before settings existed)
  still accepts every trainer key."""
  path = tmp_path / "mine.py"
  path.write_text(
    (ROOT / "experiments" / "lm" / "shakespeare_char.py")
    .read_text()
    .replace(
      "c.train = settings.train(steps=900, eval_every=450, checkpoint_every=300)",
      "c.train = ml_collections.ConfigDict(dict(steps=900, batch_size=32, "
      "checkpoint_every=300, log_every=10, eval_every=450))",
    )
  )
  cfg = experiments.get_config(str(path), {"train.loss_chunk": "64"})
  assert cfg.train.loss_chunk == 64 and cfg.train.micro_batches == 1
