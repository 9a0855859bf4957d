"""The grpo task: its advantages and loss against the formulas in numpy (DeepSeekMath's GRPO with
TRL's loss types), the in-loop sampler against `engine.generate`, the reward functions' checks,
a short run through the trainer, and a resumed run's rollouts against an unbroken one's."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from nnx_zoo.common import engine, experiments, models, report, tasks
from nnx_zoo.common.errors import UserError
from nnx_zoo.common.hub import weights
from nnx_zoo.common.nn import lora
from nnx_zoo.common.tasks import grpo, rewards
from nnx_zoo.common.train import trainer

# A reward a program checks, for the runs below (loaded as `FILE.py:NAME`): the share of the
# reply's characters that are the record's `letter`.
REWARDS_PY = """
def share_of_letter(prompts, completions, letter, **_):
  out = []
  for c, l in zip(completions, letter):
    text = c[0]["content"]
    out.append(text.count(l) / max(len(text), 1))
  return out
"""


def smoke(tmp_path, **overrides):
  """chat/grpo:smoke on prompts written to tmp_path, rewarded by `share_of_letter`."""
  prompts = [
    {"prompt": [{"role": "user", "content": f"Say {'ab'[i % 2]} {i} times"}], "letter": "ab"[i % 2]}
    for i in range(12)
  ]
  for name, part in (("train", prompts[:8]), ("eval", prompts[8:])):
    with open(tmp_path / f"{name}.jsonl", "w") as f:
      f.writelines(json.dumps(p) + "\n" for p in part)
  (tmp_path / "rewards.py").write_text(REWARDS_PY)
  base = {
    "data.kind": "files",
    "data.train_files": str(tmp_path / "train.jsonl"),
    "data.eval_files": str(tmp_path / "eval.jsonl"),
    "grpo.reward": f"{tmp_path / 'rewards.py'}:share_of_letter",
  }
  return experiments.get_config("chat/grpo:smoke", {**base, **overrides})


# The formulas


def test_advantages_equal_the_formula():
  r = np.array([1.0, 0.0, 0.5, 0.5, 2.0, 2.0, 2.0, 2.0, -1.0, 3.0, 0.0, 1.0])
  want = []
  for group in r.reshape(3, 4):
    mean = sum(group) / 4
    std = np.sqrt(sum((x - mean) ** 2 for x in group) / 3)  # unbiased, as torch.std
    want += [(x - mean) / (std + 1e-4) for x in group]
  np.testing.assert_allclose(grpo.advantages(r, 4), want, rtol=1e-12)
  assert np.all(grpo.advantages(r, 4)[4:8] == 0)  # a group whose rewards tie teaches nothing
  centred = r - np.repeat(r.reshape(3, 4).mean(1), 4)
  np.testing.assert_allclose(grpo.advantages(r, 4, "none"), centred, rtol=1e-12)
  np.testing.assert_allclose(grpo.advantages(r, 4, "batch"), centred / (r.std(ddof=1) + 1e-4))


def numpy_token_logps(logits, tokens, temperature):
  """log softmax(logits / temperature)[next token], numpy, float64: [R, L - 1]."""
  z = logits.astype(np.float64) / temperature
  z = z - z.max(-1, keepdims=True)
  logp = z - np.log(np.exp(z).sum(-1, keepdims=True))
  return np.take_along_axis(logp, tokens[:, 1:, None], axis=-1)[..., 0]


@pytest.fixture(scope="module")
def fixed():
  """A tiny model and fixed completion rows: 4 rows of a prompt of 3-5 tokens, then a completion
  of 2-6 tokens, then padding; advantages, old and reference log-probabilities made up."""
  cfg = experiments.get_config("chat/grpo:smoke")
  model = models.build(cfg.model, seed=0)
  rng = np.random.default_rng(0)
  R, L = 4, 12
  prompt, kept = np.array([3, 5, 4, 3]), np.array([2, 6, 4, 5])
  t = np.arange(L)[None]
  segment_ids = (t < (prompt + kept)[:, None]).astype(np.int32)
  batch = {
    "tokens": rng.integers(1, 256, (R, L)).astype(np.int32) * segment_ids,
    "segment_ids": segment_ids,
    "loss_weights": ((t >= prompt[:, None]) & (segment_ids > 0)).astype(np.float32),
    "advantages": np.array([1.5, -0.5, 0.0, -1.0], np.float32),
  }
  logits = np.asarray(model(batch["tokens"][:, :-1]))  # one segment a row, from position 0
  return cfg, model, batch, logits


@pytest.mark.parametrize("loss_type", ["dapo", "grpo", "dr_grpo"])
@pytest.mark.parametrize("beta", [0.0, 0.1])
def test_loss_equals_the_formula(fixed, loss_type, beta):
  cfg, model, batch, logits = fixed
  settings = grpo.config(loss_type=loss_type, beta=beta, temperature=0.7, epsilon=0.2,
                         max_new_tokens=6)  # fmt: skip
  task = grpo.GRPO(settings)
  logp = numpy_token_logps(logits, batch["tokens"], 0.7)
  rng = np.random.default_rng(1)
  # Old log-probabilities apart from the policy's by up to +-0.4: ratios on both sides of the
  # clip; a reference elsewhere again.
  old = logp + rng.uniform(-0.4, 0.4, logp.shape)
  ref = logp + rng.uniform(-1.0, 1.0, logp.shape)
  batch = dict(batch, old_logps=old.astype(np.float32), reference=ref.astype(np.float32))
  w = batch["loss_weights"][:, 1:] * (batch["segment_ids"][:, 1:] > 0)
  ratio = np.exp(logp - old)
  a = batch["advantages"][:, None].astype(np.float64)
  loss = -np.minimum(ratio * a, np.clip(ratio, 0.8, 1.2) * a)
  if beta:
    loss = loss + beta * (np.exp(ref - logp) - (ref - logp) - 1)
  if loss_type == "dapo":
    want, want_count = (loss * w).sum(), w.sum()
  elif loss_type == "grpo":
    want, want_count = ((loss * w).sum(1) / w.sum(1)).sum(), len(w)
  else:
    want, want_count = (loss * w).sum(), len(w) * 6
  total, count = task.loss_sums(model, batch)
  assert float(count) == want_count
  np.testing.assert_allclose(float(total), want, rtol=2e-5)


def test_a_chunked_head_gives_the_same_loss_and_gradients(fixed, chunked_like_whole):
  """train.loss_chunk (the head 5 tokens at a time, a chunk straddling rows and the padded
  end): the loss and every parameter's gradient those of the whole logits, old log-probs and a
  reference given (ratios on both sides of the clip)."""
  cfg, model, batch, logits = fixed
  task = grpo.GRPO(grpo.config(beta=0.1, temperature=0.7, max_new_tokens=6))
  logp = numpy_token_logps(logits, batch["tokens"], 0.7)
  rng = np.random.default_rng(3)
  batch = dict(batch, old_logps=(logp + rng.uniform(-0.4, 0.4, logp.shape)).astype(np.float32),
               reference=(logp + rng.uniform(-1, 1, logp.shape)).astype(np.float32))  # fmt: skip
  graphdef, params = nnx.split(model, nnx.Param)

  def loss(params, chunk):
    return task.loss_sums(nnx.merge(graphdef, params), batch, loss_chunk=chunk)[0]

  chunked_like_whole(loss, params, 5)


def test_ratio_is_one_without_old_logps(fixed):
  """num_iterations 1 (TRL's default): pi_old is the policy detached, so the loss is -A a token
  and its gradient is -A * grad log pi."""
  cfg, model, batch, _ = fixed
  task = grpo.GRPO(grpo.config(max_new_tokens=6))
  total, count = task.loss_sums(model, batch)
  w = batch["loss_weights"][:, 1:] * (batch["segment_ids"][:, 1:] > 0)
  want = -(batch["advantages"][:, None] * w).sum()
  np.testing.assert_allclose(float(total), want, rtol=1e-6, atol=1e-6)


# The sampler


def test_rollouts_at_temperature_0_equal_generate():
  """`continue_rows` (prompts of different lengths left-aligned, one prefill, the rest forced)
  at temperature 0 gives each prompt the tokens `engine.generate` (`zoo generate`) does."""
  cfg = experiments.get_config("chat/grpo:smoke")
  model = models.build(cfg.model, seed=0)
  graphdef, params = nnx.split(model)
  rng = np.random.default_rng(0)
  lengths = np.array([3, 7, 5, 10])
  P, N = 10, 6
  prompts = rng.integers(0, 256, (4, P)).astype(np.int32) * (np.arange(P)[None] < lengths[:, None])
  keys = jax.vmap(jax.random.key)(jnp.arange(4, dtype=jnp.uint32))
  out = engine.continue_rows(
    params, prompts, lengths, keys, graphdef=graphdef, prefill=3, max_new_tokens=N, temperature=0.0
  )
  out = np.asarray(out)
  for b, n in enumerate(lengths):
    want = engine.generate(model, prompts[b : b + 1, :n], max_new_tokens=N, rng=jax.random.key(0),
                             temperature=0)  # fmt: skip
    np.testing.assert_array_equal(out[b, : n + N], np.asarray(want)[0])


def test_rollout_rows_do_not_depend_on_their_neighbours():
  """A row's sampled tokens come from its own key: the same alone as beside other rows."""
  cfg = experiments.get_config("chat/grpo:smoke")
  graphdef, params = nnx.split(models.build(cfg.model, seed=0))
  prompts = np.tile(np.arange(1, 9, dtype=np.int32), (3, 1))
  lengths = np.array([8, 5, 6])
  keys = jax.vmap(jax.random.key)(jnp.array([7, 8, 9], jnp.uint32))
  kw = dict(graphdef=graphdef, prefill=5, max_new_tokens=5, temperature=1.0)
  both = np.asarray(engine.continue_rows(params, prompts, lengths, keys, **kw))
  alone = np.asarray(engine.continue_rows(params, prompts[1:2], lengths[1:2], keys[1:2], **kw))
  np.testing.assert_array_equal(both[1, : 5 + 5], alone[0, : 5 + 5])  # its prompt, its 5 tokens


def test_rollouts_end_early_once_every_row_has_stopped():
  """With stop ids, each row's tokens up to its first stop are those of the full loop, and the
  row holds the first stop id after it (here each row's first new token is a stop: the engine
  decodes nothing more)."""
  cfg = experiments.get_config("chat/grpo:smoke")
  graphdef, params = nnx.split(models.build(cfg.model, seed=0))
  rng = np.random.default_rng(1)
  lengths = np.array([4, 9, 6])
  prompts = rng.integers(1, 256, (3, 9)).astype(np.int32) * (np.arange(9)[None] < lengths[:, None])
  keys = jax.vmap(jax.random.key)(jnp.arange(3, dtype=jnp.uint32))
  kw = dict(graphdef=graphdef, prefill=4, max_new_tokens=6, temperature=0.0)
  full = np.asarray(engine.continue_rows(params, prompts, lengths, keys, **kw))
  first = full[np.arange(3), lengths]  # each row's first new token
  stops = tuple(sorted({int(t) for t in first}))
  early = np.asarray(engine.continue_rows(params, prompts, lengths, keys, stop_ids=stops, **kw))
  for b, n in enumerate(lengths):
    np.testing.assert_array_equal(early[b, : n + 1], full[b, : n + 1])
    assert (early[b, n + 1 :] == stops[0]).all()


def test_completions_end_at_the_end_of_turn():
  stops = [np.array([60, 124, 101]), np.array([0])]
  assert grpo.end_of(np.array([5, 6, 60, 124, 101, 9]), stops) == (2, 5)
  assert grpo.end_of(np.array([5, 0, 60, 124, 101]), stops) == (1, 2)  # the first stop
  assert grpo.end_of(np.array([5, 6, 60, 124]), stops) is None  # cut inside it: truncated


# Rewards


def test_reward_specs_load_with_weights(tmp_path):
  (tmp_path / "mine.py").write_text(REWARDS_PY)
  spec = f"nnx_zoo.common.tasks.rewards:exact_answer@2, {tmp_path / 'mine.py'}:share_of_letter"
  loaded = rewards.load(spec)
  assert [(r.name, r.weight) for r in loaded] == [("exact_answer", 2.0), ("share_of_letter", 1.0)]
  for bad, says in [
    ("", "needs a reward"),
    ("nnx_zoo.common.tasks.rewards", "names no function"),
    ("nnx_zoo.common.tasks.rewards:nothing", "has no function 'nothing'"),
    (f"{tmp_path / 'none.py'}:f", "is not a file"),
    ("nnx_zoo.common.tasks.rewards:exact_answer@x", "not a number"),
  ]:
    with pytest.raises(UserError, match=says):
      rewards.load(bad)


def test_bad_rewards_stop_with_the_function_named():
  def raises(prompts, completions, **_):
    raise KeyError("answer")

  def short(prompts, completions, **_):
    return [1.0]

  def nan(prompts, completions, **_):
    return [1.0, float("nan")]

  def none(prompts, completions, **_):
    return [None, 1.0]

  prompts, completions = [[], []], [[{"role": "assistant", "content": "x"}]] * 2
  for fn, says in [
    (raises, "reward raises raised KeyError"),
    (short, "reward short returned 1 values for 2 completions"),
    (nan, "reward nan returned nan for completion 1"),
    (none, "reward none returned None for completion 0"),
  ]:
    with pytest.raises(UserError, match=says):
      rewards.score([rewards.Reward(fn.__name__, fn)], prompts, completions, {})
  ok = rewards.Reward("exact_answer", rewards.exact_answer)
  got = rewards.score([ok], prompts, completions, {"answer": [" x ", "y"]})
  np.testing.assert_array_equal(got, [[1.0, 0.0]])


# Training


def test_refuses_what_it_cannot_train(tmp_path):
  cfg = smoke(tmp_path, **{"grpo.group_size": "1"})
  with pytest.raises(UserError, match="group needs 2"):
    tasks.of(cfg)
  cfg = smoke(tmp_path, **{"data.format": "chat"})
  with pytest.raises(UserError, match="data.format=prompts"):
    tasks.of(cfg)
  cfg = smoke(tmp_path, **{"grpo.beta": "0.1"})
  cfg.init_from = ""  # a KL to a reference that is not there (a config that declares its model)
  with pytest.raises(UserError, match="init_from"):
    trainer.train(cfg, str(tmp_path / "run"), progress=False)


@pytest.mark.slow
def test_a_raising_reward_stops_the_run_and_keeps_the_checkpoint(tmp_path):
  """The reward fails at step 3: the run stops with its error, step 2's checkpoint stays."""
  (tmp_path / "flaky.py").write_text(
    "calls = []\n"
    "def flaky(prompts, completions, **_):\n"
    "  calls.append(1)\n"
    "  if len(calls) == 3:\n"
    "    raise ValueError('no answer key')\n"
    "  return [0.0] * len(completions)\n"
  )
  cfg = smoke(tmp_path, **{"grpo.reward": f"{tmp_path / 'flaky.py'}:flaky", "train.steps": "4"})
  with pytest.raises(UserError, match="reward flaky raised ValueError: no answer key"):
    trainer.train(cfg, str(tmp_path / "run"), progress=False)
  assert "2" in os.listdir(tmp_path / "run" / "checkpoints")


def rollouts(monkeypatch, stop_at=None) -> list[np.ndarray]:
  """The completion rows of every training step from now on (their tokens); with `stop_at`,
  the run stops (a UserError) as that many steps have been sampled."""
  seen = []
  complete = grpo.GRPO.complete

  def recording(self, batch, params):
    if stop_at is not None and len(seen) == stop_at and "seed" in batch:
      raise UserError("stopped by the test")
    out = complete(self, batch, params)
    if "advantages" in out:
      seen.append(np.asarray(out["tokens"]))
    return out

  monkeypatch.setattr(grpo.GRPO, "complete", recording)
  return seen


@pytest.mark.slow
def test_trains_and_logs_its_rewards(tmp_path, monkeypatch):
  """A few steps through the trainer: the training lines carry the rewards (total and by
  function), the completions' length, the share truncated and the times (Task.step_metrics);
  the eval lines the greedy replies' mean reward; each step's rows are groups of 4 completions
  of one prompt."""
  seen = rollouts(monkeypatch)
  cfg = smoke(tmp_path)
  last = trainer.train(cfg, str(tmp_path / "run"), progress=False)
  assert np.isfinite(last["loss"])
  with open(tmp_path / "run" / "metrics.jsonl") as f:
    lines = [json.loads(line) for line in f]
  train = [r for r in lines if "split" not in r]
  evals = [r for r in lines if r.get("split") == "eval"]
  for r in train:
    for key in ("reward", "reward_std", "reward/share_of_letter", "completion_length",
                "truncated", "clip_ratio", "sample_s", "train_s", "reward_s"):  # fmt: skip
      assert key in r and np.isfinite(r[key]), (key, r)
    assert 0 <= r["reward"] <= 1 and r["completion_length"] <= cfg.grpo.max_new_tokens
    assert r["clip_ratio"] == 0  # one update per rollout: the ratio is 1
  assert {"reward", "reward/share_of_letter", "completion_length"} <= set(evals[-1])
  assert evals[-1]["prompts"] == 4 and evals[-1]["loss"] == -evals[-1]["reward"]
  assert len(seen) == cfg.train.steps
  B, G = cfg.train.batch_size, cfg.grpo.group_size
  for tokens in seen:
    assert tokens.shape == (B * G, cfg.data.seq_len + cfg.grpo.max_new_tokens)
    prompts = tokens[:, :10].reshape(B, G, 10)  # each group shares its prompt's start
    assert (prompts == prompts[:, :1]).all()


@pytest.mark.slow
def test_a_resumed_run_draws_the_same_rollouts(tmp_path, monkeypatch):
  """4 steps straight, against 2 steps, stop, and 2 more resumed from the checkpoint: steps 3
  and 4 sample the same tokens, bit for bit."""
  cfg = smoke(tmp_path, **{"train.steps": "4", "train.checkpoint_every": "2"})
  straight = rollouts(monkeypatch)
  trainer.train(cfg, str(tmp_path / "straight"), progress=False)
  monkeypatch.undo()
  seen = rollouts(monkeypatch, stop_at=2)
  with pytest.raises(UserError, match="stopped by the test"):
    trainer.train(cfg, str(tmp_path / "resumed"), progress=False)
  monkeypatch.undo()
  rest = rollouts(monkeypatch)
  trainer.train(cfg, str(tmp_path / "resumed"), progress=False)
  seen += rest
  assert len(seen) == 4
  for a, b in zip(straight, seen, strict=True):
    np.testing.assert_array_equal(a, b)
  assert not np.array_equal(straight[2], straight[3])  # steps do draw anew


# A worker run in a subprocess (its own device count): trains chat/grpo:smoke with the overrides
# given as JSON, and prints each step's rollout tokens and the metrics lines.
WORKER = """
import json, os, sys
import numpy as np
from nnx_zoo.common import experiments
from nnx_zoo.common.tasks import grpo
from nnx_zoo.common.train import trainer
seen, complete = [], grpo.GRPO.complete
def recording(self, batch, params):
  out = complete(self, batch, params)
  if "advantages" in out:
    seen.append(np.asarray(out["tokens"]).tolist())
  return out
grpo.GRPO.complete = recording
cfg = experiments.get_config("chat/grpo:smoke", json.loads(sys.argv[1]))
trainer.train(cfg, sys.argv[2], progress=False)
with open(os.path.join(sys.argv[2], "metrics.jsonl")) as f:
  print(json.dumps({"tokens": seen, "lines": [json.loads(line) for line in f]}))
"""


@pytest.mark.slow
@pytest.mark.multidevice
def test_a_data_x_fsdp_mesh_steps_as_one_device(tmp_path):
  """On 8 fake CPU devices, mesh data=2 x fsdp=4 (the rollouts sampled with the params sharded
  as the step stores them, the rows split over the batch axes): the same rollouts, rewards,
  losses and gradient norms as one device's, step by step."""
  import subprocess
  import sys

  cfg = smoke(tmp_path, **{"train.batch_size": "8", "train.steps": "2"})
  overrides = {
    "data.kind": "files",
    "data.train_files": cfg.data.train_files,
    "data.eval_files": cfg.data.eval_files,
    "grpo.reward": cfg.grpo.reward,
    "train.batch_size": "8",
    "train.steps": "2",
    "train.eval_every": "2",
  }
  out = {}
  for devices, mesh in ((1, {}), (8, {"mesh.data": "2", "mesh.fsdp": "4"})):
    env = {**os.environ, "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}"}
    args = [json.dumps({**overrides, **mesh}), str(tmp_path / f"run{devices}")]
    proc = subprocess.run([sys.executable, "-P", "-c", WORKER, *args], env=env,
                          capture_output=True, text=True)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    out[devices] = json.loads(proc.stdout.strip().splitlines()[-1])
  one, eight = out[1], out[8]
  assert len(one["tokens"]) == 2
  np.testing.assert_array_equal(np.array(one["tokens"]), np.array(eight["tokens"]))
  for a, b in zip(one["lines"], eight["lines"], strict=True):
    assert a["step"] == b["step"] and a.get("split") == b.get("split")
    for key in ("reward", "reward/share_of_letter", "completion_length", "truncated"):
      assert a[key] == b[key], key
    for key in ("loss", "grad_norm"):
      if key in a:
        assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-7), key


@pytest.mark.slow
def test_data_show_prints_the_first_steps_completions_with_their_rewards(tmp_path, monkeypatch):
  """`zoo data show` of a grpo experiment: its first prompts, each with the group_size
  completions the run's first step samples (the same texts), each with the reward the function
  gives it; --split eval: one greedy completion a prompt."""
  cfg = smoke(tmp_path, **{"train.steps": "1", "train.eval_every": "0"})
  shown = [
    json.loads(line) for line in report.show(cfg, split="train", count=2, as_json=True).splitlines()
  ]
  G = cfg.grpo.group_size
  assert [len(m["completions"]) for m in shown] == [G, G]
  for m in shown:
    letter = m["prompt"][0]["content"].split()[1]  # "Say a 3 times": its record's letter
    for c in m["completions"]:
      text = c["text"]
      assert c["reward"] == pytest.approx(text.count(letter) / max(len(text), 1), abs=1e-6)
      assert c["rewards"] == {"share_of_letter": pytest.approx(c["reward"], abs=1e-6)}
  text = report.show(cfg, split="train", count=1, as_json=False)
  assert text.startswith("════ prompt 0") and "──── completion 3: reward" in text

  sampled = []
  score = grpo.GRPO._score

  def recording(self, out, lengths_R, index_R, valid, training):
    rows, scored, texts = score(self, out, lengths_R, index_R, valid, training)
    if training:
      sampled.append(texts)
    return rows, scored, texts

  monkeypatch.setattr(grpo.GRPO, "_score", recording)
  trainer.train(cfg, str(tmp_path / "run"), progress=False)
  assert [c["text"] for m in shown for c in m["completions"]] == sampled[0][: 2 * G]

  held_out = [
    json.loads(line) for line in report.show(cfg, split="eval", count=3, as_json=True).splitlines()
  ]
  assert [len(m["completions"]) for m in held_out] == [1, 1, 1]


@pytest.mark.slow
def test_reference_is_init_from_and_under_lora_the_base(tmp_path):
  """grpo.beta > 0: `complete` adds the init_from model's log-probabilities of the completion
  rows (sampled with the params it is given); under LoRA, the base's (the params with their
  adapters at zero), however far the adapters have moved. A run logs the KL (0 while the
  policy is the reference)."""
  start = smoke(tmp_path, **{"train.steps": "1"})
  trainer.train(start, str(tmp_path / "start"), progress=False)
  overrides = {"grpo.beta": "0.1", "init_from": str(tmp_path / "start")}
  cfg = smoke(tmp_path, **overrides)
  data = trainer.load_data(cfg)
  batch = {k: np.asarray(v) for k, v in next(data.iterator).items()}
  graphdef, loaded = weights.init_from_params(cfg)

  def logps(rows):
    return np.asarray(grpo.token_logps(nnx.merge(graphdef, loaded), rows, cfg.grpo.temperature))

  task = tasks.of(cfg).prepare(data, cfg=cfg)
  fresh = nnx.state(models.build(cfg.model, seed=3), nnx.Param)  # not the reference
  rows = task.complete(batch, fresh)
  np.testing.assert_allclose(rows["reference"], logps(rows), rtol=1e-5, atol=1e-6)

  lora_cfg = smoke(tmp_path, **overrides, **{"model.lora.rank": "4"})
  task = tasks.of(lora_cfg).prepare(data, cfg=lora_cfg)
  assert task._reference._params is None  # no second copy of the base
  lora_graphdef, lora_loaded = weights.init_from_params(lora_cfg)
  adapters, base = nnx.split_state(lora_loaded, lora.LoRAParam, ...)
  moved = nnx.merge_state(jax.tree.map(lambda x: x + 0.5, adapters), base)
  rows = task.complete(batch, moved)
  moved_logps = grpo.token_logps(nnx.merge(lora_graphdef, moved), rows)
  assert np.abs(np.asarray(moved_logps) - logps(rows)).max() > 0.1  # the adapters do move it
  np.testing.assert_allclose(rows["reference"], logps(rows), rtol=1e-5, atol=1e-6)

  run = smoke(tmp_path, **overrides, **{"train.steps": "1"})
  trainer.train(run, str(tmp_path / "run"), progress=False)
  with open(tmp_path / "run" / "metrics.jsonl") as f:
    line = json.loads(f.readline())
  assert 0 <= line["kl"] < 1e-5


@pytest.mark.slow
def test_trains_a_hugging_face_checkpoint_with_its_chatml_template(tmp_path):
  """init_from a Hugging Face directory (the tiny random Llama with a BPE tokenizer and ChatML,
  as SmolLM2-Instruct has): its template renders the prompts, its one-token <|im_end|> ends the
  completions (and the sampler's loop), and it is the reference of a KL (0 at the start); the
  run's model then answers `zoo chat` and `zoo generate`."""
  tiny = pytest.importorskip("nnx_zoo.common.hub.tiny")
  path = tiny.checkpoint("tiny:llama")
  src = weights.source(path)
  cfg = smoke(tmp_path, **{"grpo.beta": "0.04", "data.chat_template": "", "data.seq_len": "32"})
  cfg.model, cfg.data.tokenizer, cfg.init_from = src.model, src.tokenizer, path
  task = tasks.of(cfg).prepare(trainer.load_data(cfg), cfg=cfg)
  end = task._tokenizer.encode_chat("<|im_end|>")[0]
  assert len(end) == 1 and end[0] in task._sampling["stop_ids"]
  trainer.train(cfg, str(tmp_path / "run"), progress=False)
  with open(tmp_path / "run" / "metrics.jsonl") as f:
    lines = [json.loads(line) for line in f]
  assert lines[0]["kl"] < 1e-6 and all(np.isfinite(r["loss"]) for r in lines)
  assert lines[-1]["split"] == "eval" and 0 <= lines[-1]["reward"] <= 1
  # The run's model is a decoder: `zoo chat` and `zoo generate` talk to it.
  from nnx_zoo.common import cli

  (tmp_path / "m.json").write_text(json.dumps([{"role": "user", "content": "2 + 3?"}]))
  run = str(tmp_path / "run")
  options = ["--temperature", "0", "--max-new-tokens", "4"]
  assert cli.main(["chat", "--workdir", run, "--messages", str(tmp_path / "m.json"), *options]) == 0
  assert cli.main(["generate", "--workdir", run, "--prompt", "2 + 3 =", *options]) == 0


def test_the_shipped_rewards():
  texts = ("85", " 85 ", "it is 85.", "8", "x")
  completions = [[{"role": "assistant", "content": t}] for t in texts]
  answer = ["85"] * 5
  assert rewards.exact_answer(None, completions, answer) == [1.0, 1.0, 0.0, 0.0, 0.0]
  assert rewards.contains_answer(None, completions, answer) == [1.0, 1.0, 1.0, 0.0, 0.0]
  assert rewards.number_only(None, completions) == [1.0, 1.0, 0.0, 1.0, 0.0]
  # An episode: the final reply is its last assistant message; a tool's result counts apart.
  call = {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "add"}}]}
  episodes = [
    [call, {"role": "tool", "content": "85"}, {"role": "assistant", "content": "85"}],
    [call, {"role": "tool", "content": "85"}, call],  # computed, never answered
    [{"role": "assistant", "content": "85"}, call, {"role": "tool", "content": "9"}],
  ]
  answer = ["85"] * 3
  assert rewards.contains_answer(None, episodes, answer) == [1.0, 0.0, 0.0]
  assert rewards.answer_in_tool_result(None, episodes, answer) == [1.0, 1.0, 0.0]
  # Answered: the last reply calls nothing and says something, right or not.
  silent = [call, {"role": "tool", "content": "85"}, {"role": "assistant", "content": " "}]
  assert rewards.answered(None, episodes + [silent]) == [1.0, 0.0, 0.0, 0.0]
  assert rewards.answered(None, completions) == [1.0] * 5


@pytest.mark.slow
def test_rows_fit_the_longest_prompt_with_the_same_rollouts_and_loss(tmp_path, monkeypatch):
  """At data.seq_len=128 on short prompts, a step's rows are the longest prompt's bucket plus
  max_new_tokens, not 128 + max_new_tokens; the rollouts, their rewards and advantages are those
  of rows of the full width (the bucket forced up to seq_len), and so is the loss."""
  cfg = smoke(tmp_path, **{"data.seq_len": "128"})
  data = trainer.load_data(cfg)
  batch = {k: np.asarray(v) for k, v in next(data.iterator).items()}
  params = nnx.state(models.build(cfg.model, seed=0), nnx.Param)
  N = cfg.grpo.max_new_tokens
  task = tasks.of(cfg).prepare(data, cfg=cfg)
  rows = {k: np.asarray(v) for k, v in task.complete(batch, params).items()}
  longest = int(batch["segment_ids"].sum(axis=1).max())
  assert rows["tokens"].shape[1] == engine.bucket(longest, minimum=64) + N == 64 + N
  monkeypatch.setattr(engine, "PROMPT_BUCKET", 1024)  # the bucket capped at seq_len: before
  task = tasks.of(cfg).prepare(data, cfg=cfg)
  full = {k: np.asarray(v) for k, v in task.complete(batch, params).items()}
  assert full["tokens"].shape[1] == 128 + N
  L = rows["tokens"].shape[1]
  for k in ("tokens", "segment_ids", "loss_weights"):
    np.testing.assert_array_equal(full[k][:, :L], rows[k])
    assert not full[k][:, L:].any()
  np.testing.assert_array_equal(full["advantages"], rows["advantages"])
  model = models.build(cfg.model, seed=0)
  (got, count), (want, want_count) = (task.loss_sums(model, r) for r in (rows, full))
  assert float(count) == float(want_count) > 0
  np.testing.assert_allclose(float(got), float(want), rtol=1e-6, atol=1e-7)


# The levers (issue 57): each against its formula in numpy on the fixed rows, then through the
# trainer.


def numpy_levers_loss(logp, batch, s):
  """The grpo loss with every lever, in numpy (float64): (total, count, metrics)."""
  w = batch["loss_weights"][:, 1:] * (batch["segment_ids"][:, 1:] > 0)
  old = batch.get("old_logps", logp).astype(np.float64)
  log_ratio = logp - old
  if s.importance_sampling_level == "sequence":
    log_ratio = (log_ratio * w).sum(1, keepdims=True) / np.maximum(w.sum(1, keepdims=True), 1)
  ratio = np.exp(log_ratio)
  a = batch["advantages"][:, None].astype(np.float64)
  clipped = np.clip(ratio, 1 - s.epsilon, 1 + (s.epsilon_high or s.epsilon))
  loss = -np.minimum(ratio * a, clipped * a) * np.ones_like(w)
  metrics = {"clip_ratio": ((ratio * a > clipped * a) * w).sum() / w.sum()}
  if "sampler_logps" in batch:
    d = old - batch["sampler_logps"]
    metrics["sampler_kl"] = ((np.exp(d) - d - 1) * w).sum() / w.sum()
    if s.sampler_correction != "none":
      is_ratio, cap = np.exp(d), s.sampler_correction_cap
      if s.sampler_correction == "token_truncate":
        loss = loss * np.minimum(is_ratio, cap)
      else:
        loss = loss * np.where(is_ratio > cap, 0.0, is_ratio)
      metrics["sampler_capped"] = ((is_ratio > cap) * w).sum() / w.sum()
  if s.beta:
    ref = batch["reference"]
    loss = loss + s.beta * (np.exp(ref - logp) - (ref - logp) - 1)
  if s.loss_type == "dapo":
    return (loss * w).sum(), w.sum(), metrics
  if s.loss_type == "grpo":
    return ((loss * w).sum(1) / w.sum(1)).sum(), len(w), metrics
  return (loss * w).sum(), len(w) * s.max_new_tokens, metrics


LEVERS = {
  "clip-higher": dict(epsilon_high=0.28),
  "gspo": dict(importance_sampling_level="sequence"),
  "gspo grpo clip-higher": dict(importance_sampling_level="sequence", epsilon_high=0.28,
                                loss_type="grpo"),  # fmt: skip
  "tis": dict(sampler_correction="token_truncate", sampler_correction_cap=1.2),
  "tis mu=1": dict(sampler_correction="token_truncate", sampler_correction_cap=1.2),
  "masked is": dict(sampler_correction="token_mask", sampler_correction_cap=1.2),
  "mismatch only": dict(sampler_dtype="bfloat16"),
  "all": dict(epsilon_high=0.28, importance_sampling_level="sequence", beta=0.1,
              sampler_correction="token_truncate", sampler_correction_cap=1.2, loss_type="dr_grpo"),
}  # fmt: skip


@pytest.mark.parametrize("lever", LEVERS)
def test_levers_loss_equals_the_formula(fixed, lever):
  """Clip-higher, GSPO's sequence-level ratio, the sampler correction (truncated or masked
  importance sampling, its weights capped) and the mismatch's KL: the loss and the logged
  measures against numpy, with old log-probs (num_iterations > 1) apart from the policy's by up
  to +-0.7 and the sampler's apart from those by up to +-0.5 (weights above the cap)."""
  from nnx_zoo.common.nn import aux

  cfg, model, batch, logits = fixed
  settings = grpo.config(temperature=1.0, max_new_tokens=6, **LEVERS[lever])
  logp = numpy_token_logps(logits, batch["tokens"], 1.0)
  rng = np.random.default_rng(2)
  # Each row's tokens moved by up to +-0.4 around a shift of the row's: its sequence ratio
  # beyond the clip on its advantage's side (rows 0 and 3) or not.
  shift = np.array([[-0.35], [0.1], [0.0], [0.35]])
  old = logp + rng.uniform(-0.4, 0.4, logp.shape) + shift
  batch = dict(batch, reference=(logp + rng.uniform(-1, 1, logp.shape)).astype(np.float32))
  if lever != "tis mu=1":
    batch["old_logps"] = old.astype(np.float32)
  trainer_logps = batch.get("old_logps", logp)
  if "sampler" in " ".join(LEVERS[lever]):
    sampler = trainer_logps + rng.uniform(-0.5, 0.5, logp.shape)
    batch["sampler_logps"] = sampler.astype(np.float32)
  want, want_count, want_metrics = numpy_levers_loss(logp, batch, settings)
  with aux.collect() as entries:
    total, count = grpo.GRPO(settings).loss_sums(model, batch)
  got = {k: float(v) for k, v in aux.means(entries).items()}
  assert float(count) == want_count
  np.testing.assert_allclose(float(total), want, rtol=2e-5, atol=1e-6)
  for k, v in want_metrics.items():
    assert got[k] == pytest.approx(v, rel=1e-4, abs=1e-6), k
  if "sampler_capped" in want_metrics:
    assert 0 < want_metrics["sampler_capped"] < 1  # the cap binds on some tokens, not all
  if lever in ("clip-higher", "gspo"):
    assert want_metrics["clip_ratio"] > 0


def test_soft_overlong_punishment_equals_dapo():
  """DAPO eq. 13 with L_max = 16, L_cache = 4: 0 to 12 tokens, then -1/4 a token to -1 at 16."""
  lengths = np.arange(0, 17)
  want = [0.0 if n <= 12 else (12 - n) / 4 for n in lengths]
  np.testing.assert_allclose(grpo.soft_overlong(lengths, 16, 4), want)
  assert grpo.soft_overlong(np.array([16]), 16, 16)[0] == -1.0  # the whole window


def test_batch_advantages_take_the_given_std():
  """scale_rewards="batch" over several processes: each centres on its groups' means and
  divides by the std of every process's rewards, which is the single process's division."""
  r = np.random.default_rng(0).normal(size=16)
  whole = grpo.advantages(r, 4, "batch")
  halves = [grpo.advantages(h, 4, "batch", batch_std=r.std(ddof=1)) for h in (r[:8], r[8:])]
  np.testing.assert_array_equal(np.concatenate(halves), whole)


def lever_run(tmp_path, name, overrides, *, stop_at=None):
  """chat/grpo:smoke with `overrides` in tmp_path/name: the batches each update trained on
  (host arrays) and the metrics lines; with `stop_at`, stopped (a UserError) as that many
  updates have been completed."""
  seen = []
  complete = grpo.GRPO.complete

  def recording(self, batch, params):
    if stop_at is not None and len(seen) == stop_at and "seed" in batch:
      raise UserError("stopped by the test")
    out = complete(self, batch, params)
    if "advantages" in out:
      seen.append({k: np.asarray(v) for k, v in out.items()})
    return out

  grpo.GRPO.complete = recording
  try:
    cfg = smoke(tmp_path, **overrides)
    if stop_at is None:
      trainer.train(cfg, str(tmp_path / name), progress=False)
    else:
      with pytest.raises(UserError, match="stopped by the test"):
        trainer.train(cfg, str(tmp_path / name), progress=False)
  finally:
    grpo.GRPO.complete = complete
  with open(tmp_path / name / "metrics.jsonl") as f:
    lines = [json.loads(line) for line in f]
  return seen, [r for r in lines if "split" not in r]


@pytest.mark.slow
def test_several_updates_on_one_rollout_clip_and_resume_between_them(tmp_path):
  """num_iterations=2: updates 1 and 2 train on one rollout (the same rows, the old log-probs
  the trainer's on the rollout's weights), update 3 samples anew; update 1's ratios are 1 and
  none is clipped, update 2's are not (epsilon 0.01 at a high rate: some clip). Stopped after
  update 1 and resumed, updates 2 to 4 are the unbroken run's, bit for bit."""
  overrides = {
    "grpo.num_iterations": "2", "grpo.epsilon": "0.01", "optim.lr": "3e-3",
    "optim.warmup_steps": "0", "optim.schedule": "constant", "train.checkpoint_every": "1",
    "train.eval_every": "0",
  }  # fmt: skip
  seen, lines = lever_run(tmp_path, "straight", overrides)
  assert len(seen) == 4 and [r["step"] for r in lines] == [1, 2, 3, 4]
  for k in ("tokens", "old_logps", "advantages"):
    np.testing.assert_array_equal(seen[0][k], seen[1][k])
  assert not np.array_equal(seen[1]["tokens"], seen[2]["tokens"])
  assert lines[0]["clip_ratio"] == 0 and lines[2]["clip_ratio"] == 0
  assert lines[1]["clip_ratio"] > 0 and lines[3]["clip_ratio"] > 0
  assert "reward" in lines[0] and "reward" not in lines[1]  # a rollout is logged once
  first = lever_run(tmp_path, "resumed", overrides, stop_at=1)[0]
  rest, resumed = lever_run(tmp_path, "resumed", overrides)
  assert len(first) == 1 and len(rest) == 3
  for a, b in zip(seen[1:], rest, strict=True):
    for k in a:
      np.testing.assert_array_equal(a[k], b[k])
  assert [r["step"] for r in resumed] == [1, 2, 3, 4]  # the first attempt's line, then these
  for a, b in zip(lines[1:], resumed[1:], strict=True):
    assert [a[k] for k in ("loss", "grad_norm", "clip_ratio")] == [
      b[k] for k in ("loss", "grad_norm", "clip_ratio")
    ]


# Ties every group of a prompt asking for "a" (a constant), scores the others by their text.
TIES_PY = """
def ties_a(prompts, completions, letter, **_):
  return [0.5 if l == "a" else float(sum(map(ord, c[0]["content"])) % 5)
          for c, l in zip(completions, letter)]
"""


@pytest.mark.slow
def test_dynamic_sampling_drops_tied_groups_refills_and_resumes(tmp_path):
  """filter_tied_groups on a reward that ties every "a" prompt's group: no trained group ties
  (each has advantages), the batch is refilled from more prompts (some step takes 2 rounds, its
  prompts logged), never more than filter_max_rounds; a batch left short trains on its filled
  groups, the rest of its rows empty. Stopped after 2 steps and resumed: the same rows, bit for
  bit. The rounds' rows refilled into the slots finished rows free (grpo.refill, the default)
  are those of a round at a time, bit for bit."""
  (tmp_path / "ties.py").write_text(TIES_PY)
  overrides = {
    "grpo.reward": f"{tmp_path / 'ties.py'}:ties_a", "grpo.filter_tied_groups": "True",
    "grpo.filter_max_rounds": "2", "train.eval_every": "0",
  }  # fmt: skip
  seen, lines = lever_run(tmp_path, "straight", overrides)
  G = 4
  rounds = [r["sampling_rounds"] for r in lines]
  assert max(rounds) == 2 and all(1 <= n <= 2 for n in rounds)
  for r in lines:
    assert r["sampled_prompts"] == 4 * r["sampling_rounds"]
  assert any(r["tied_groups"] > 0 for r in lines)
  for rows, line in zip(seen, lines, strict=True):
    groups = rows["advantages"].reshape(-1, G)
    filled = (rows["segment_ids"].reshape(-1, G, rows["segment_ids"].shape[1]) > 0).any((1, 2))
    assert filled.sum() == 4 - line["unfilled_groups"]
    assert (np.abs(groups[filled]).max(axis=1) > 0).all()  # no tied group trained
    assert not rows["loss_weights"].reshape(4, -1)[~filled].any()  # empty rows: no loss
  first = lever_run(tmp_path, "resumed", overrides, stop_at=2)[0]
  rest = lever_run(tmp_path, "resumed", overrides)[0]
  for a, b in zip(seen, first + rest, strict=True):
    for k in a:
      np.testing.assert_array_equal(a[k], b[k])
  rounds_at_a_time = lever_run(tmp_path, "rounds", {**overrides, "grpo.refill": "False"})[0]
  for a, b in zip(seen, rounds_at_a_time, strict=True):
    for k in a:
      np.testing.assert_array_equal(a[k], b[k])


@pytest.mark.slow
def test_a_bfloat16_sampler_under_an_fp32_step_logs_its_mismatch_and_caps_the_weights(tmp_path):
  """grpo.sampler_dtype=bfloat16 (the engine computes in bf16 on a bf16 copy of the weights)
  under the fp32 step: the rows carry the sampler's log-probs; the logged KL between sampler and
  trainer is above 0 (and above an fp32 sampler's); with the cap at 1, the truncated weights of
  the tokens the trainer likes better than the sampler are capped (sampler_capped > 0)."""
  base = {
    "train.eval_every": "0", "train.steps": "2", "grpo.sampler_correction": "token_truncate",
    "grpo.sampler_correction_cap": "1.0",
  }  # fmt: skip
  bf16, lines = lever_run(tmp_path, "bf16", {**base, "grpo.sampler_dtype": "bfloat16"})
  fp32, fp32_lines = lever_run(tmp_path, "fp32", base)
  assert all("sampler_logps" in rows for rows in bf16)
  for r, f in zip(lines, fp32_lines, strict=True):
    assert r["sampler_kl"] > 0 and r["sampler_kl"] > 10 * f["sampler_kl"]
    assert 0 < r["sampler_capped"] < 1
  # The sampler's log-probs of its tokens sit where the trainer's are: each row's completion.
  rows = bf16[0]
  w = rows["loss_weights"][:, 1:] > 0
  assert (rows["sampler_logps"][w] < 0).all() and not rows["sampler_logps"][~w].any()


def test_zoo_eval_takes_a_run_that_draws_on_the_prompt_stream(tmp_path):
  """`zoo eval` loads the held-out split alone: a run with dynamic sampling or several updates a
  rollout (which draw on the training prompts' stream) is evaluated, not refused."""
  cfg = smoke(tmp_path, **{"grpo.filter_tied_groups": "True", "grpo.num_iterations": "2"})
  held_out = trainer.load_data(cfg, train=False)
  assert held_out.iterator is None
  tasks.of(cfg).prepare(held_out, cfg=cfg)
