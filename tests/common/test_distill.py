"""The distill task (common/tasks/distill.py): its divergences against numpy formulas, its loss
as documented, a teacher that gets no gradient and no optimizer state, top-k teacher outputs
written by `zoo data prepare` against the teacher's own log-probabilities, bad input refused
before anything is written, and (slow) 8 devices against one and a resumed run against an
uninterrupted one."""

import functools
import json
import os
import pathlib
import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest
from flax import nnx

from nnx_zoo.common import cli, experiments, models, tasks
from nnx_zoo.common.data import prepare, prepared
from nnx_zoo.common.errors import UserError
from nnx_zoo.common.hub import tiny, weights
from nnx_zoo.common.nn import qlora
from nnx_zoo.common.tasks import distill, losses
from nnx_zoo.common.train import optim
from nnx_zoo.common.train import step as steps

ROOT = pathlib.Path(__file__).resolve().parents[2]


def log_softmax(x):
  x = x - x.max(-1, keepdims=True)
  return x - np.log(np.exp(x).sum(-1, keepdims=True))


def kl(p_log, q_log):
  """KL(p || q) from log-probabilities, the textbook sum."""
  return np.sum(np.exp(p_log) * (p_log - q_log), axis=-1)


@pytest.fixture(scope="module")
def logps():
  rng = np.random.default_rng(0)
  s = log_softmax(rng.normal(size=(3, 5, 11)) * 2)
  t = log_softmax(rng.normal(size=(3, 5, 11)) * 2)
  return s.astype(np.float32), t.astype(np.float32)


def div(s, t, kind, beta=0.5):
  return np.asarray(losses.divergence(jnp.asarray(s), jnp.asarray(t), kind=kind, beta=beta))


def test_divergences_against_numpy(logps):
  s, t = logps
  np.testing.assert_allclose(div(s, t, "forward_kl"), kl(t, s), rtol=1e-5)
  np.testing.assert_allclose(div(s, t, "reverse_kl"), kl(s, t), rtol=1e-5)
  # TRL GKD: beta 0 is the forward KL, beta 1 the reverse KL.
  np.testing.assert_allclose(div(s, t, "jsd", 0.0), kl(t, s), rtol=1e-5)
  np.testing.assert_allclose(div(s, t, "jsd", 1.0), kl(s, t), rtol=1e-5)
  # The Jensen-Shannon divergence at the midpoint: the mean KL of each to their average.
  m = np.log(0.5 * np.exp(s) + 0.5 * np.exp(t))
  np.testing.assert_allclose(div(s, t, "jsd", 0.5), 0.5 * kl(t, m) + 0.5 * kl(s, m), rtol=1e-5)
  # Any beta: beta KL(t || m) + (1 - beta) KL(s || m), m = beta t + (1 - beta) s.
  m = np.log(0.3 * np.exp(t) + 0.7 * np.exp(s))
  np.testing.assert_allclose(div(s, t, "jsd", 0.3), 0.3 * kl(t, m) + 0.7 * kl(s, m), rtol=1e-5)


@pytest.mark.parametrize("kind,beta", [("forward_kl", 0.5), ("reverse_kl", 0.5), ("jsd", 0.0),
                                       ("jsd", 0.5), ("jsd", 0.9), ("jsd", 1.0)])  # fmt: skip
def test_every_divergence_is_zero_when_teacher_is_student(logps, kind, beta):
  s, _ = logps
  np.testing.assert_allclose(div(s, s, kind, beta), 0.0, atol=1e-6)
  assert (div(s, logps[1], kind, beta) > 0).all()


def settings(**kw):
  return distill.config(teacher="unused", **kw)


def rows_batch(V, rng, B=2, L=7):
  tokens = rng.integers(0, V, (B, L)).astype(np.int32)
  segments = np.array([[1] * L, [1] * 4 + [2] * (L - 5) + [0]], np.int32)
  weights = (rng.random((B, L)) > 0.3).astype(np.float32)
  return {"tokens": tokens, "segment_ids": segments, "loss_weights": weights}


@pytest.mark.parametrize("temperature,alpha", [(1.0, 0.0), (2.0, 0.0), (2.0, 0.3), (0.5, 1.0)])
def test_loss_is_the_documented_mix(temperature, alpha):
  """loss = (1 - alpha) T^2 KL(softmax(t / T) || softmax(s / T)) + alpha CE(s, next token), over
  the weighted targets; the teacher's whole distribution given as its top-V (renormalised over
  every id: the full one)."""
  V, rng = 13, np.random.default_rng(1)
  batch = rows_batch(V, rng)
  s_logits = rng.normal(size=(2, 6, V)).astype(np.float32) * 3
  t_logits = rng.normal(size=(2, 6, V)).astype(np.float32) * 3
  t_logp = log_softmax(t_logits)
  batch["teacher_logps"] = np.pad(t_logp, ((0, 0), (1, 0), (0, 0))).astype(np.float32)
  batch["teacher_ids"] = np.broadcast_to(np.arange(V, dtype=np.int32), (2, 7, V)).copy()
  task = distill.Distill(settings(temperature=temperature, alpha=alpha))
  total, count = task.loss_sums(lambda inputs, **kw: jnp.asarray(s_logits), batch)

  targets = batch["tokens"][:, 1:]
  seg = batch["segment_ids"]
  w = ((seg[:, 1:] == seg[:, :-1]) & (seg[:, :-1] != 0)) * batch["loss_weights"][:, 1:]
  T = temperature
  d = kl(log_softmax(t_logits / T), log_softmax(s_logits / T))
  ce = -np.take_along_axis(log_softmax(s_logits), targets[..., None], -1)[..., 0]
  want = np.sum(((1 - alpha) * T * T * d + alpha * ce) * w)
  assert float(count) == pytest.approx(w.sum())
  assert float(total) == pytest.approx(want, rel=1e-5)


def test_top_k_is_renormalised_over_the_teacher_ids():
  V, K, rng = 13, 4, np.random.default_rng(2)
  batch = rows_batch(V, rng)
  s_logits = rng.normal(size=(2, 6, V)).astype(np.float32)
  t_logp = log_softmax(rng.normal(size=(2, 6, V)))
  ids = np.argsort(-t_logp, -1)[..., :K].astype(np.int32)
  batch["teacher_logps"] = np.pad(np.take_along_axis(t_logp, ids, -1), ((0, 0), (1, 0), (0, 0)))
  batch["teacher_ids"] = np.pad(ids, ((0, 0), (1, 0), (0, 0)))
  task = distill.Distill(settings())
  d, _, _ = task._terms(lambda inputs, **kw: jnp.asarray(s_logits), batch)
  want = kl(log_softmax(np.take_along_axis(t_logp, ids, -1)),
            log_softmax(np.take_along_axis(s_logits, ids, -1)))  # fmt: skip
  np.testing.assert_allclose(np.asarray(d), want, rtol=1e-5, atol=1e-6)


@pytest.fixture(scope="module")
def smoke_cfg():
  return experiments.get_config("chat/distill:smoke")


@pytest.mark.slow
def test_teacher_gets_no_gradient_and_no_optimizer_state(smoke_cfg):
  cfg = smoke_cfg
  task = tasks.of(cfg)
  tx = optim.optimizer(cfg.optim, cfg.train.steps)
  graphdef, state = steps.init_state(cfg, tx)
  _, teacher = weights.init_from_params(task.teacher.run_config())
  # The optimizer's state is the student's: AdamW's two moments of each of its weights, and
  # nothing of the teacher's (which has twice the layers).
  size = lambda tree: sum(x.size for x in jax.tree.leaves(tree) if x.ndim >= 1)  # noqa: E731
  assert size(state.opt_state) == 2 * size(state.params)
  assert size(teacher) > size(state.params)
  rng = np.random.default_rng(0)
  batch = rows_batch(cfg.model.vocab_size, rng, L=9)
  batch[tasks.FROZEN] = teacher

  def objective(params, frozen):
    total, _ = task.loss_sums(nnx.merge(graphdef, params), {**batch, tasks.FROZEN: frozen})
    return total

  g_student, g_teacher = jax.jit(jax.grad(objective, argnums=(0, 1)))(state.params, teacher)
  assert all(float(jnp.abs(g).max()) == 0.0 for g in jax.tree.leaves(g_teacher))
  assert any(float(jnp.abs(g).max()) > 0.0 for g in jax.tree.leaves(g_student))
  # The step differentiates the params only: its gradients are the student's tree.
  step = jax.jit(lambda p, b: steps.sums_and_grads(p, b, graphdef=graphdef, task=task))
  sums, grads = step(state.params, batch)
  assert jax.tree.structure(grads) == jax.tree.structure(state.params)
  assert float(sums["aux"]["teacher_kl"]) > 0


@pytest.mark.slow
@pytest.mark.parametrize("form", ["teacher", "top_k"])
def test_a_chunked_head_gives_the_same_loss_and_gradients(smoke_cfg, form, chunked_like_whole):
  """train.loss_chunk (5 tokens at a time, chunks straddling rows and the padded end): the loss
  (JSD and next-token, mixed) and every student gradient are the whole logits', against the
  teacher's forward pass (its head chunked beside the student's) and against prepared top-k."""
  cfg = smoke_cfg
  graphdef, params = nnx.split(models.build(cfg.model, seed=0), nnx.Param)
  rng = np.random.default_rng(5)
  batch = rows_batch(cfg.model.vocab_size, rng, L=9)
  if form == "teacher":
    teacher = tasks.of(cfg).teacher
    _, batch[tasks.FROZEN] = weights.init_from_params(teacher.run_config())
    task = distill.Distill(settings(loss="jsd", alpha=0.3, temperature=2.0), teacher)
  else:
    batch["teacher_ids"] = rng.integers(0, cfg.model.vocab_size, (2, 9, 4)).astype(np.int32)
    batch["teacher_logps"] = log_softmax(rng.normal(size=(2, 9, 4))).astype(np.float32)
    task = distill.Distill(settings(loss="jsd", alpha=0.3, temperature=2.0))

  def loss(params, chunk):
    return task.loss_sums(nnx.merge(graphdef, params), batch, loss_chunk=chunk)[0]

  chunked_like_whole(loss, params, 5, rtol=1e-5)


@pytest.fixture(scope="module")
def quantized_teachers(smoke_cfg):
  """The smoke teacher's abstract model and params in its own dtype and with each teacher_quant."""
  out = {}
  for quant in ("", "int8", "nf4"):
    cfg = ml_collections.ConfigDict(smoke_cfg.to_dict())
    cfg.distill.teacher_quant = quant
    teacher = tasks.of(cfg).teacher
    out[quant] = (teacher.abstract(), teacher.params())
  return out


def test_int8_teacher_is_its_kernels_quantized_and_nf4_is_a_seventh_of_the_bytes(
  quantized_teachers,
):
  (model32, params32), (model8, params8) = quantized_teachers[""], quantized_teachers["int8"]
  flat32, flat8 = dict(nnx.to_flat_state(params32)), dict(nnx.to_flat_state(params8))
  kernels = [k for k in flat32 if qlora.is_kernel(k)]
  assert kernels and all(flat8[k][...].dtype == jnp.int8 for k in kernels)
  for k in kernels:  # each weight within half a step of int8 absmax scaling (per 64 input rows)
    w = np.asarray(flat32[k][...])
    half_step = np.repeat(np.abs(w.reshape(-1, 64, w.shape[-1])).max(axis=1) / 255, 64, axis=0)
    model = nnx.merge(nnx.graphdef(model8), params8)
    lin = functools.reduce(getattr, map(str, k[:-1]), model)
    got = np.asarray(qlora.dequantize(lin.kernel[...], lin.kernel_scale[...], kind="int8",
                                      dtype=jnp.float32))  # fmt: skip
    assert np.all(np.abs(got - w) <= half_step * (1 + 1e-4)), k
  # Everything else is the fp32 teacher's.
  for k, v in flat32.items():
    if k not in kernels:
      np.testing.assert_array_equal(np.asarray(flat8[k][...]), np.asarray(v[...]))
  # The logits within quantization error of the fp32 teacher's (measured: 0.4% of the largest).
  x = jnp.asarray(np.random.default_rng(0).integers(0, 320, (2, 16)), jnp.int32)
  want = np.asarray(nnx.merge(nnx.graphdef(model32), params32)(x))
  got = np.asarray(nnx.merge(nnx.graphdef(model8), params8)(x))
  err = np.abs(got - want).max()
  assert 0 < err < 0.02 * np.abs(want).max()
  # The blocks' kernels' bytes (with their scales) against fp32's.
  for quant, bound in (("int8", 0.28), ("nf4", 0.16)):
    stored, fp32 = qlora.base_bytes(quantized_teachers[quant][1])
    assert fp32 == 4 * sum(flat32[k].size for k in kernels)
    assert stored <= bound * fp32, (quant, stored / fp32)


@pytest.mark.slow
def test_quantized_teacher_gets_no_gradient(smoke_cfg, quantized_teachers):
  cfg = ml_collections.ConfigDict(smoke_cfg.to_dict())
  cfg.distill.teacher_quant = "nf4"
  task = tasks.of(cfg)
  tx = optim.optimizer(cfg.optim, cfg.train.steps)
  graphdef, state = steps.init_state(cfg, tx)
  teacher = quantized_teachers["nf4"][1]
  batch = rows_batch(cfg.model.vocab_size, np.random.default_rng(0), L=9)

  def objective(params, frozen):
    total, _ = task.loss_sums(nnx.merge(graphdef, params), {**batch, tasks.FROZEN: frozen})
    return total

  grad = jax.jit(jax.grad(objective, argnums=(0, 1), allow_int=True))
  g_student, g_teacher = grad(state.params, teacher)
  floats = [g for g in jax.tree.leaves(g_teacher) if g.dtype != jax.dtypes.float0]
  assert floats and all(float(jnp.abs(g).max()) == 0.0 for g in floats)
  assert any(float(jnp.abs(g).max()) > 0.0 for g in jax.tree.leaves(g_student))
  step = jax.jit(lambda p, b: steps.sums_and_grads(p, b, graphdef=graphdef, task=task))
  sums, grads = step(state.params, {**batch, tasks.FROZEN: teacher})
  assert jax.tree.structure(grads) == jax.tree.structure(state.params)
  assert float(sums["aux"]["teacher_kl"]) > 0


def test_student_layers_are_the_teachers(tmp_path):
  cfg = experiments.get_config(
    "chat/distill:smoke",
    {"init_from": "tiny:llama4", "distill.student_layers": "1,3"},
  )
  assert cfg.model.num_layers == 2
  _, student = weights.init_from_params(cfg)
  _, teacher = weights.read("tiny:llama4")
  s, t = dict(nnx.to_flat_state(student)), dict(nnx.to_flat_state(teacher))
  for key, value in s.items():
    source = ("blocks", (1, 3)[key[1]], *key[2:]) if key[0] == "blocks" else key
    np.testing.assert_array_equal(np.asarray(value[...]), np.asarray(t[source][...]))
  assert weights.select_layers("every:2", 30) == tuple(range(0, 30, 2))


@pytest.fixture(scope="module")
def prepared_dir(smoke_cfg, tmp_path_factory):
  """The smoke form's data prepared, with its teacher's top-k outputs (one process)."""
  cfg = smoke_cfg
  out = str(tmp_path_factory.mktemp("prepared") / "one")
  prepare.prepare(cfg.data, out, workers=1, progress=False)
  done = tasks.of(cfg).after_prepare(cfg, out, progress=False)
  assert done["teacher_sources"] == 2 and done["teacher_top_k"] == cfg.distill.top_k
  return out


@pytest.mark.slow
def test_prepared_top_k_are_the_teachers_own_log_probs(smoke_cfg, prepared_dir):
  """`zoo data prepare` of a distill experiment: each token's top-k teacher log-probabilities
  and ids, equal to the teacher's own (its forward pass over each document alone) at those ids,
  the ids its k most likely; a rerun redoes nothing."""
  cfg, out = smoke_cfg, prepared_dir
  assert tasks.of(cfg).after_prepare(cfg, out, progress=False)["teacher_sources"] == 0

  run = experiments.get_config("chat/distill:smoke", {"data.kind": "prepared", "data.path": out})
  assert prepared.reads_teacher(run)
  split = prepared.Split(out, "eval")
  split.attach_teacher(cfg.distill.top_k)
  rows = prepared.PackedRows(split, cfg.data.seq_len + 1, pad_last=True)
  teacher = weights.load(cfg.distill.teacher)
  forward = jax.jit(lambda tokens: jax.nn.log_softmax(teacher(tokens)[0], -1))
  checked = 0
  for r in (0, 3, len(rows) - 1):
    row = rows.read(np.array([r]))
    seg = row["segment_ids"][0]
    for s in (1, 2):
      at = np.flatnonzero(seg == s)
      if len(at) < 2:
        continue
      own = np.asarray(forward(jnp.asarray(row["tokens"][0, at][None])))  # [n, V]
      ids, got = row["teacher_ids"][0, at[1:]], row["teacher_logps"][0, at[1:]]
      want = np.take_along_axis(own[:-1], ids, -1)
      np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
      top = np.sort(own[:-1], -1)[:, ::-1][:, : ids.shape[1]]
      np.testing.assert_allclose(got, top, rtol=1e-4, atol=1e-4)
      checked += 1
  assert checked


@pytest.mark.slow
def test_each_host_writes_its_share_of_the_teacher_outputs(smoke_cfg, prepared_dir, tmp_path):
  """Two hosts (process 0 and 1 of 2) into one directory write what one process writes."""
  cfg, out = smoke_cfg, str(tmp_path / "two")
  prepare.prepare(cfg.data, out, workers=1, progress=False)
  for process in (0, 1):
    done = tasks.of(cfg).after_prepare(
      cfg, out, num_processes=2, process_id=process, progress=False
    )
    assert done["teacher_sources"] == 1
  names = sorted(n for n in os.listdir(os.path.join(prepared_dir, "shards")) if "teacher" in n)
  assert names == sorted(n for n in os.listdir(os.path.join(out, "shards")) if "teacher" in n)
  for name in names:
    one, two = (pathlib.Path(d, "shards", name).read_bytes() for d in (prepared_dir, out))
    assert one == two, name


@pytest.mark.slow
@pytest.mark.parametrize(
  "override,message",
  [({"data.seq_len": "64"}, "rows of 129 tokens, top 16\\)"),
   ({"distill.teacher": "tiny:llama"}, "of another teacher")],
)  # fmt: skip
def test_a_run_reads_the_outputs_of_its_own_rows_and_teacher_only(prepared_dir, override, message):
  with pytest.raises(UserError, match=message):
    prepared.reads_teacher(
      experiments.get_config(
        "chat/distill:smoke", {"data.kind": "prepared", "data.path": prepared_dir, **override}
      )
    )


# Bad input: one line, exit 2, nothing written


@pytest.fixture(scope="module")
def other_tokenizer(tmp_path_factory):
  """tiny:llama4 with one token of its tokenizer renamed (id 100)."""
  out = tmp_path_factory.mktemp("other") / "teacher"
  shutil.copytree(tiny.checkpoint("tiny:llama4"), out)
  path = out / "tokenizer.json"
  tok = json.loads(path.read_text())
  vocab = tok["model"]["vocab"]
  old = next(k for k, v in vocab.items() if v == 100)
  vocab["zzq"] = vocab.pop(old)
  tok["model"]["merges"] = [m for m in tok["model"]["merges"] if old not in "".join(m)]
  path.write_text(json.dumps(tok))
  return str(out)


@pytest.mark.parametrize(
  "override,message",
  [
    ("distill.teacher=", "distill.teacher is empty"),
    ("distill.student_layers=0,7", "names layer 7, and the checkpoint has 2 layers"),
    ("distill.loss=kl", "Unknown distill.loss 'kl'"),
    ("distill.lmbda=1.5", "distill.lmbda=1.5 is outside [0, 1]"),
    ("distill.teacher_quant=int3", "Unknown distill.teacher_quant 'int3'"),
    ("distill.teacher=OTHER", "(320 ids) and the student's (320 ids) differ, first at id 100"),
  ],
)
def test_bad_input_is_one_line_and_writes_nothing(
  capsys, tmp_path, other_tokenizer, override, message
):
  workdir = tmp_path / "run"
  override = override.replace("OTHER", other_tokenizer)
  rc = cli.main(["run", "chat/distill:smoke", "--workdir", str(workdir), f"--config.{override}"])
  err = capsys.readouterr().err.strip()
  assert rc == 2 and message in err and len(err.splitlines()) == 1, err
  assert not workdir.exists()


# Slow: 8 devices against one, a resumed run against an uninterrupted one


def zoo(args, devices: int = 1, **kw):
  env = {**os.environ, "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}"}
  code = "import sys; from nnx_zoo.common import cli; sys.exit(cli.main(sys.argv[1:]))"
  proc = subprocess.run(
    [sys.executable, "-P", "-c", code, *args], cwd=ROOT, env=env, capture_output=True, text=True
  )
  assert proc.returncode == 0, proc.stderr[-3000:]


def metrics(workdir) -> list[dict]:
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    return [json.loads(line) for line in f]


SHARDED = ["--quiet", "--config.train.batch_size=8", "--config.train.steps=2",
           "--config.train.eval_every=2"]  # fmt: skip


@pytest.fixture(scope="module")
def one_device(tmp_path_factory):
  workdir = tmp_path_factory.mktemp("one") / "run"
  zoo(["run", "chat/distill:smoke", *SHARDED, "--workdir", str(workdir)])
  return metrics(workdir)


@pytest.mark.slow
@pytest.mark.multidevice
@pytest.mark.parametrize("mesh", ["data=2,fsdp=4", "data=2,fsdp=2,tensor=2"])
def test_sharded_equals_one_device(one_device, tmp_path, mesh):
  """data 2 x fsdp 4 (and with the vocabulary split over tensor 2) on 8 devices: the teacher
  placed and split as the student's params are."""
  sizes = [f"--config.mesh.{kv}" for kv in mesh.split(",")]
  zoo(["run", "chat/distill:smoke", *SHARDED, "--workdir", str(tmp_path / "eight"), *sizes],
      devices=8)  # fmt: skip
  one, eight = one_device, metrics(tmp_path / "eight")
  assert len(one) == len(eight) == 3
  for a, b in zip(one, eight, strict=True):
    # A training line's teacher_kl is the mean of the devices' means (the aux channel's): the
    # loss and the held-out sums are over all the tokens.
    for key in ("loss", "grad_norm", "next_token_loss", *(("teacher_kl",) if "split" in a else ())):
      if key in a:
        assert b[key] == pytest.approx(a[key], rel=2e-5), (key, a, b)


@pytest.mark.slow
def test_int8_teacher_run_is_the_fp32_teachers_within_quantization_error(one_device, tmp_path):
  """The run's path (the teacher read quantized, placed, dequantized in the step): its losses
  and held-out KL within 1% of the run with the fp32 teacher."""
  workdir = tmp_path / "int8"
  zoo(["run", "chat/distill:smoke", *SHARDED, "--workdir", str(workdir),
       "--config.distill.teacher_quant=int8"])  # fmt: skip
  quantized = metrics(workdir)
  assert len(quantized) == len(one_device)
  for a, b in zip(one_device, quantized, strict=True):
    for key in ("loss", "teacher_kl", "next_token_loss"):
      if key in a:
        assert b[key] == pytest.approx(a[key], rel=1e-2), (key, a, b)
        assert b[key] != a[key] or key == "next_token_loss", key  # the teacher did change


@pytest.mark.slow
def test_resume_is_exact(tmp_path):
  """The on-policy form (a student of the teacher's layers, lmbda 0.75): stopped after step 2 and
  resumed, the same batches, samples and losses as straight through."""
  common = ["chat/smollm2-distill:smoke", "--quiet", "--config.train.checkpoint_every=2",
            "--config.distill.lmbda=0.75"]  # fmt: skip
  zoo(["run", *common, "--workdir", str(tmp_path / "straight")])
  # The same run as it stood after step 2: its last checkpoint and log lines removed.
  shutil.copytree(tmp_path / "straight", tmp_path / "resumed")
  shutil.rmtree(tmp_path / "resumed" / "checkpoints" / "4")
  kept = [m for m in metrics(tmp_path / "resumed") if m["step"] <= 2 and "split" not in m]
  (tmp_path / "resumed" / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in kept))
  zoo(["run", *common, "--workdir", str(tmp_path / "resumed")])
  straight = [m for m in metrics(tmp_path / "straight") if m["step"] > 2]
  resumed = [m for m in metrics(tmp_path / "resumed") if m["step"] > 2]
  assert straight and len(straight) == len(resumed)
  for a, b in zip(straight, resumed, strict=True):
    for key in ("loss", "teacher_kl", "on_policy", "reply_length", "targets"):
      assert a.get(key) == b.get(key), (key, a, b)
  assert any(m.get("on_policy") == 1.0 for m in metrics(tmp_path / "straight"))


@pytest.mark.slow
def test_on_policy_rows_are_prompt_and_reply_masked_after_the_end_of_turn():
  """A sampled row: its prompt (up to the first assistant token) as it was, the student's reply
  after it, weighted, and nothing past the reply's end of turn (segment 0, weight 0)."""
  cfg = experiments.get_config("chat/smollm2-distill:smoke", {"distill.lmbda": "1.0"})
  from nnx_zoo.common.train import trainer

  data = trainer.load_data(cfg)
  task = tasks.of(cfg).prepare(data, cfg=cfg)
  host = next(data.iterator)
  params = nnx.state(models.build(cfg.model, seed=0), nnx.Param)
  rows, _ = task._replies(host, params, seed=3)
  N, stops = cfg.distill.max_new_tokens, [list(s) for s in task._stops]
  for r in range(len(host["tokens"])):
    w = rows["loss_weights"][r]
    if not w.any():
      continue
    start, end = int(np.argmax(w > 0)), int(np.flatnonzero(w)[-1]) + 1
    first = np.flatnonzero((host["segment_ids"][r] == 1) & (host["loss_weights"][r] > 0))
    assert start == first[first > 0][0]  # the prompt ends where the first assistant turn starts
    np.testing.assert_array_equal(rows["tokens"][r, :start], host["tokens"][r, :start])
    assert (w[start:end] == 1).all() and end - start <= N
    assert (rows["segment_ids"][r, :end] == 1).all() and not rows["segment_ids"][r, end:].any()
    assert not rows["tokens"][r, end:].any()
    reply = rows["tokens"][r, start:end].tolist()
    ends = [stop for stop in stops if reply[len(reply) - len(stop) :] == stop]
    assert ends or end - start == N  # cut after its end of turn, or as long as allowed


def test_on_policy_draw_is_the_batch_and_seed():
  tokens = np.arange(12, dtype=np.int32).reshape(3, 4)
  a = distill.on_policy_draw(tokens, 0).random()
  assert a == distill.on_policy_draw(tokens.copy(), 0).random()
  assert a != distill.on_policy_draw(tokens, 1).random()
  assert a != distill.on_policy_draw(tokens[::-1], 0).random()
