"""Pipeline parallelism (common/nn/pipeline.py): the circular schedule, pipelined losses and
gradients against one device's (8 fake CPU devices, in a subprocess), the trainer across
pipeline sizes, and the configs it refuses."""

import json
import shutil

import pytest

from nnx_zoo.common import experiments, parallel
from nnx_zoo.common.errors import UserError
from nnx_zoo.common.nn import pipeline

WORKER = "pipeline_worker.py"  # beside this file
SCHEDULES = [(2, 1, 2), (4, 1, 4), (4, 1, 5), (2, 3, 4), (4, 2, 5), (4, 2, 8)]


@pytest.mark.parametrize("S,R,M", SCHEDULES)
def test_schedule_table_runs_each_item_once_in_layer_order(S, R, M):
  """Every (stage, repeat, micro-batch) once; each micro-batch meets chunks 0..S x R - 1 in
  order, one per iteration, with no stage doing two things at once; (S - 1) bubbles a stage."""
  schedule = pipeline.Schedule(S, R, M)
  table = schedule.table()
  assert sorted((s, r, m) for _, s, r, m in table) == [
    (s, r, m) for s in range(S) for r in range(R) for m in range(M)
  ]
  assert len({(t, s) for t, s, _, _ in table}) == len(table)
  for m in range(M):
    runs = sorted((t, r * S + s) for t, s, r, mb in table if mb == m)
    assert [c for _, c in runs] == list(range(S * R))
    assert all(b[0] > a[0] for a, b in zip(runs, runs[1:], strict=False))
  busy = schedule.iterations * S - len(table)
  assert busy / (schedule.iterations * S) == pytest.approx(schedule.bubble)


def cfg_of(exp="lm/shakespeare-char:smoke", **overrides):
  return experiments.get_config(exp, {k: str(v) for k, v in overrides.items()})


SIZES = {"pipeline": 4, "data": 2, "fsdp": 1, "expert": 1, "context": 1, "tensor": 1}


@pytest.mark.parametrize(
  "overrides,sizes,message",
  [
    (
      {"model.num_layers": 6},
      SIZES,
      "mesh.pipeline=4 x model.pipeline_repeats=1 = 4 chunks do not split model.num_layers=6 "
      "evenly: choose mesh.pipeline from [2, 3, 6] at this model.pipeline_repeats, or "
      "model.num_layers from [4, 8]",
    ),
    (
      {"model.num_layers": 8, "model.pipeline_repeats": 4},
      SIZES,
      "= 16 chunks do not split model.num_layers=8 evenly: choose mesh.pipeline from [2] at this "
      "model.pipeline_repeats, or model.num_layers from [16]",
    ),
    (
      {"model.num_layers": 8, "train.pipeline_microbatches": 2},
      SIZES,
      "train.pipeline_microbatches=2 is fewer than mesh.pipeline=4 stages",
    ),
    (
      {"model.num_layers": 8, "train.pipeline_microbatches": 6, "train.batch_size": 16},
      SIZES,
      "rows of a step",
    ),
    ({"model.num_layers": 8, "model.scan": False}, SIZES, "set model.scan=True"),
    (
      {"model.num_layers": 8},
      {**SIZES, "data": 1, "context": 2},
      "mesh.pipeline=4 with mesh.context=2 is refused",
    ),
  ],
)
def test_bad_pipelines_are_refused_naming_the_fix(overrides, sizes, message):
  cfg = cfg_of(**{"model.scan": True, "train.batch_size": 32, **overrides})
  with pytest.raises(UserError, match="^.*$") as err:
    parallel.check_experiment(cfg, sizes)
  assert message in str(err.value)
  assert "\n" not in str(err.value)


@pytest.mark.parametrize(
  "exp,message",
  [("seq2seq/t5-small:smoke", "encoder-decoder"), ("vision/clip-digits:smoke", "several")],
)
def test_models_of_two_stacks_are_refused(exp, message):
  cfg = experiments.get_config(exp, {})
  with pytest.raises(UserError, match=message):
    parallel.check_pipeline(cfg, {**SIZES, "pipeline": 2})


def test_pipeline_one_is_off_and_the_new_keys_default_to_it():
  cfg = cfg_of()
  assert cfg.mesh.pipeline == 1 and cfg.model.pipeline_repeats == 1
  assert cfg.train.pipeline_microbatches == 0
  assert parallel.pipeline_microbatches(cfg.train, 4) == 8
  parallel.check_pipeline(cfg, {**SIZES, "pipeline": 1})


@pytest.mark.multidevice
@pytest.mark.slow
def test_circulate_runs_every_item_once_in_layer_order_and_keeps_nan_bubbles_out(forced_devices):
  """The traced schedule on toy stages (pipeline-only meshes of 2 and 4 devices): each
  micro-batch meets every chunk once, in order, and comes back as itself; bubbles filled with
  NaN leave the outputs finite."""
  cases = [f"schedule {s} {r} {m}" for s, r, m in SCHEDULES] + ["schedule 4 2 5 nan"]
  for name, got in forced_devices.worker(WORKER, *cases).items():
    assert got == {"order": True, "count": True, "ids": True, "once": True, "finite": True}, name


MODEL_CASES = [
  "p4 d2 R1 M4",
  "p4 d2 R2 M8 drop_path",
  "p4 d2 R2 M5 nan bubbles",
  "p2 f2 t2 R2 M4",
  "p2 e2 d2 qwen3-moe",
  "p2 f2 d2 R2 gemma2",
  "p2 f2 t2 R2 lora",
]


@pytest.fixture(scope="module")
def model_results(forced_devices):
  return forced_devices.worker(WORKER, *MODEL_CASES)


@pytest.mark.multidevice
@pytest.mark.slow
@pytest.mark.parametrize("case", MODEL_CASES)
def test_pipelined_loss_and_gradients_equal_one_device(model_results, case):
  """pN: stages; d, f, e, t: data, fsdp, expert, tensor; R repeats, M micro-batches. drop_path:
  stochastic depth at 0.5, the draws of one device; nan bubbles: the bubbles' activations start
  as NaN; qwen3-moe: its load balancing over each micro-batch's rows, against one device run in
  the same slices; gemma2: a layer pattern of two; lora: adapters on every projection, the
  base weights frozen (stacked, in the stages too), whose small gradients differ from one
  device's by 1.8e-5 on data 2 x fsdp 2 x tensor 2 without a pipeline as with one."""
  got = model_results[case]
  tolerance = 5e-5 if "lora" in case else 1e-5
  assert got["finite"]
  assert got["loss"] < 1e-5
  assert all(v < 1e-5 for v in got["aux"].values()), got["aux"]
  bad = {k: v for k, v in got["grads"].items() if v > tolerance}
  assert not bad


def zoo_args(workdir, steps: int, mesh: dict, **overrides) -> list[str]:
  """`zoo run` of the smoke experiment with 4 layers, stacked, rematerialised, in 2 slices of
  8 rows, with stochastic depth; logging every step at a constant rate."""
  config = {
    "model.num_layers": 4,
    "model.scan": True,
    "model.remat": "full",
    "model.drop_path": 0.1,
    "train.micro_batches": 2,
    "train.pipeline_microbatches": 4,
    "train.batch_size": 16,
    "train.steps": steps,
    "train.log_every": 1,
    "train.eval_every": 0,
    "optim.schedule": "constant",
    "optim.warmup_steps": 2,
    **{f"mesh.{k}": v for k, v in mesh.items()},
    **overrides,
  }
  args = ["-m", "nnx_zoo.common.cli", "run", "lm/shakespeare-char:smoke", "--workdir", str(workdir)]
  return args + [f"--config.{k}={v}" for k, v in config.items()] + ["--quiet"]


ONE = {"pipeline": 1, "data": 1}
P4D2 = {"pipeline": 4, "data": 2}
P2D2F2 = {"pipeline": 2, "data": 2, "fsdp": 2}


def zoo_run(forced, workdir, steps, mesh, **overrides):
  devices = 1 if mesh == ONE else 8
  forced.succeed(zoo_args(workdir, steps, mesh, **overrides), devices)


def losses(workdir) -> dict[int, float]:
  lines = [json.loads(x) for x in (workdir / "metrics.jsonl").read_text().splitlines()]
  return {x["step"]: x["loss"] for x in lines if "split" not in x}


@pytest.mark.multidevice
@pytest.mark.slow
def test_trainer_on_pipeline_4_x_data_2_equals_one_device_and_resumes_across_pipeline_sizes(
  tmp_path, forced_devices
):
  """Three steps (micro-batches, remat, stochastic depth) on pipeline 4 x data 2 equal one
  device's; saved at step 3, the run goes on to step 5 on one device, and one saved on one
  device goes on on pipeline 2 x data 2 x fsdp 2 with two repeats: every loss equals the
  uninterrupted one-device run's."""
  straight = tmp_path / "straight"
  zoo_run(forced_devices, straight, 5, ONE)
  want = losses(straight)
  for name, first, then, extra in [
    ("p4 then one", P4D2, ONE, {}),
    ("one then p2", ONE, P2D2F2, {"model.pipeline_repeats": 2, "train.pipeline_microbatches": 2}),
  ]:
    workdir = tmp_path / name.replace(" ", "-")
    zoo_run(forced_devices, workdir, 3, first)
    zoo_run(forced_devices, workdir, 5, then, **extra)
    got = losses(workdir)
    assert sorted(got) == [1, 2, 3, 4, 5], name
    for step, loss in got.items():
      assert loss == pytest.approx(want[step], rel=1e-5), (name, step)
  shutil.rmtree(tmp_path)


@pytest.mark.multidevice
@pytest.mark.slow
def test_zoo_run_refuses_a_pipeline_in_one_line_with_exit_code_2(tmp_path, forced_devices):
  proc = forced_devices.run(
    zoo_args(tmp_path / "x", 1, {"pipeline": 8, "data": 1}, **{"model.num_layers": 6})
  )
  assert proc.returncode == 2
  assert "model.num_layers=6" in proc.stderr and "Traceback" not in proc.stderr
  assert len(proc.stderr.strip().splitlines()) == 1
