"""`zoo plan`: topology names, the levers it names, and the real train step compiled ahead of time
for TPU slices on this CPU (libtpu needed for those; skipped without it)."""

import copy
import importlib.util

import pytest

from nnx_zoo.common import cli, mesh, plan
from nnx_zoo.common.errors import UserError
from nnx_zoo.common.train import fit
from nnx_zoo.experiments import REGISTRY


def test_cloud_and_jax_names():
  cases = {
    "v5p-128": ("v5p", "4x4x4", 64),  # v5p counts TensorCores, two a chip
    "v4-8": ("v4", "2x2x1", 4),
    "v5e-256": ("v5e", "16x16", 256),  # v5e and v6e count chips
    "v5litepod-4": ("v5e", "2x2", 4),
    "v6e-16": ("v6e", "4x4", 16),
    "v5e-1": ("v5e", "1x1", 1),
    "v5p:2x2x2": ("v5p", "2x2x2", 8),
    "v6e:2x4": ("v6e", "2x4", 8),
  }
  for name, (gen, shape, chips) in cases.items():
    t = plan.parse_topology(name)
    assert (t.generation, t.shape, t.chips) == (gen, shape, chips), name
  assert plan.parse_topology("v5p:4x4x4").cloud_name == "v5p-128"
  assert plan.parse_topology("v5e-16").hardware == "tpu-v5-litex16"
  assert plan.parse_topology("v5p-128").hardware == "tpu-v5x64"


@pytest.mark.parametrize(
  "name", ["v7x-8", "h100-8", "v5p-7", "v5e-3", "v5p:2x2", "v5e:2x2x1", "tpu"]
)
def test_unknown_topology_is_one_clear_error(name):
  with pytest.raises(UserError, match="topolog") as e:
    plan.parse_topology(name)
  assert "\n" not in str(e.value)


def test_cli_unknown_topology_exits_2_with_one_line(capsys):
  assert cli.main(["plan", "lm/shakespeare-char:smoke", "--topology", "v9-8"]) == 2
  err = capsys.readouterr().err.strip()
  assert err.startswith("zoo: error: Unknown topology 'v9-8'")
  assert "Accepted: Cloud names" in err and "v5p:4x4x4" in err
  assert len(err.splitlines()) == 1


def test_missing_libtpu_is_one_clear_line(monkeypatch, capsys):
  find_spec = importlib.util.find_spec
  monkeypatch.setattr(
    importlib.util, "find_spec", lambda name, *a: None if name == "libtpu" else find_spec(name, *a)
  )
  assert cli.main(["plan", "lm/shakespeare-char:smoke", "--topology", "v5e-4"]) == 2
  err = capsys.readouterr().err.strip()
  assert 'pip install -e ".[tpu]"' in err and len(err.splitlines()) == 1


def test_show_names_the_mesh_rule_a_topology_picks(capsys):
  # Needs no libtpu: the hardware name comes from the topology's name.
  assert cli.main(["show", "lm/llama3-8b", "--topology", "v5p-128"]) == 0
  out = capsys.readouterr().out
  assert "# mesh rule: tpu-v5x64 matches 'tpu-v5x64'" in out
  assert cli.main(["show", "lm/llama3-8b", "--topology", "v5e-64"]) == 0
  assert "# mesh rule: tpu-v5-litex64 matches 'tpu-v5-litex64'" in capsys.readouterr().out
  assert cli.main(["show", "lm/llama3-8b", "--topology", "v5e-256"]) == 0
  assert "# mesh rule: tpu-v5-litex256 matches no mesh rule" in capsys.readouterr().out


def test_fixes_name_the_levers_not_yet_pulled():
  from nnx_zoo.common import experiments

  cfg = experiments.get_config("lm/llama3-8b", {"mesh.data": "4", "mesh.fsdp": "16"})
  fixes = " ".join(plan.fixes(cfg, mesh.resolve(cfg.mesh, 64)))
  assert "--config.mesh.fsdp=64 --config.mesh.data=1" in fixes
  assert "--config.model.remat=full" in fixes and "--config.train.micro_batches=2" in fixes
  assert f"--config.train.loss_chunk={fit.LOSS_CHUNK}" in fixes  # a 128k vocab, logits whole
  cfg = experiments.get_config(
    "lm/llama3-8b",
    {
      "mesh.fsdp": "-1",
      "model.remat": "full",
      "model.scan": "true",
      "train.micro_batches": "8",
      "train.loss_chunk": "2048",
    },
  )
  fixes = plan.fixes(cfg, mesh.resolve(cfg.mesh, 64))  # 8 rows a device, 8 slices
  # The last lever before more chips: each row's 8,192 tokens over 2 devices, half the fsdp.
  assert fixes[0].startswith(
    "--config.mesh.context=2 --config.mesh.fsdp=32 --config.train.micro_batches=16"
  )
  rest = " ".join(fixes[1:])
  assert "mesh.fsdp" not in rest and "remat" not in rest and "micro_batches" not in rest
  assert "loss_chunk" not in rest
  assert "larger topology" in rest
  # Rows too short to be worth splitting (the smoke form's 32 tokens): no context lever.
  cfg = experiments.get_config("lm/llama3-8b:smoke", {"mesh.fsdp": "-1"})
  assert "mesh.context" not in " ".join(plan.fixes(cfg, mesh.resolve(cfg.mesh, 4)))
  # Every chip already holds its own share (fsdp x tensor x expert): no fsdp lever to name.
  for split in ({"mesh.fsdp": "16", "mesh.tensor": "4"}, {"mesh.fsdp": "8", "mesh.expert": "8"}):
    cfg = experiments.get_config("lm/mixtral-8x7b", split)
    assert "--config.mesh.data=1" not in " ".join(plan.fixes(cfg, mesh.resolve(cfg.mesh, 64)))


def test_model_flops_is_6_params_tokens_plus_attention():
  from nnx_zoo.common import experiments, models

  cfg = experiments.get_config("lm/llama3-8b")
  m, tokens = cfg.model, cfg.train.batch_size * cfg.data.seq_len
  matmul_params = models.num_params(m) - m.vocab_size * m.dim  # the input table is a gather
  att = 12 * m.num_layers * m.attention.num_heads * m.attention.head_dim * cfg.data.seq_len
  assert plan.model_flops(cfg)[0] == pytest.approx(6 * matmul_params * tokens + att * tokens)


def test_a_preference_step_counts_both_replies():
  """A DPO pair is two rows the model reads: the step's FLOPs and tokens are twice those of a
  language model's batch of as many rows of the same length."""
  from nnx_zoo.common import experiments

  lm = experiments.get_config("chat/shakespeare-dialogue")
  dpo = experiments.get_config("chat/shakespeare-dialogue-dpo")
  assert dpo.train.batch_size == lm.train.batch_size and dpo.data.seq_len == lm.data.seq_len
  assert plan.tokens(dpo) == 2 * plan.tokens(lm) == 2 * lm.train.batch_size * lm.data.seq_len
  assert plan.model_flops(dpo)[0] == pytest.approx(2 * plan.model_flops(lm)[0])


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("window", [0, 1, 5, 40])
def test_score_pairs_count_what_the_attention_mask_lets_through(causal, window):
  import jax.numpy as jnp

  from nnx_zoo.common.nn import attention_ref

  T = 37
  idx, seg = jnp.arange(T), jnp.ones((1, T), jnp.int32)
  mask = attention_ref.make_mask(idx, idx, seg, seg, causal=causal, window=window)
  assert plan._score_pairs(T, causal=causal, window=window) == int(jnp.sum(mask))


def test_kernel_flops_count_splash_attention_only_where_it_runs():
  """XLA's cost analysis sees nothing inside a Mosaic kernel: the plan adds splash attention's
  matmuls by count, for flash layers only (Gemma 2's sliding layers fewer, rematerialised more)."""
  cfg = plan.config("lm/llama3-8b:smoke", "v5e-4", {"model.attention.impl": "xla"})
  assert plan.kernel_flops(cfg)[0] == 0.0  # impl=xla: XLA counts it
  cfg.model.attention.impl = "auto"  # splash on a TPU
  auto = plan.kernel_flops(cfg)[0]
  cfg.model.attention.impl = "flash"
  flops, how = plan.kernel_flops(cfg)
  assert auto == flops
  m, T, B = cfg.model, cfg.data.seq_len, cfg.train.batch_size
  pairs = T * (T + 1) // 2
  assert flops == 18 * m.attention.head_dim * m.attention.num_heads * pairs * B * m.num_layers
  assert "splash" in how
  cfg.model.remat = "full"
  assert plan.kernel_flops(cfg)[0] == flops * 22 / 18
  gemma = plan.config("lm/gemma2-2b:smoke", "v5e-4", {"model.attention.impl": "flash"})
  full = copy.deepcopy(gemma)
  full.model.layer_kinds.sliding.attention.window = 0
  assert 0 < plan.kernel_flops(gemma)[0] < plan.kernel_flops(full)[0]


def test_model_flops_of_a_mixture_of_experts_count_the_active_parameters():
  """Mixtral 8x7B computes with 12.9 B of its 46.7 B parameters a token (transformers' counts)."""
  from nnx_zoo.common import experiments

  cfg = experiments.get_config("lm/mixtral-8x7b")
  m, tokens = cfg.model, cfg.train.batch_size * cfg.data.seq_len
  active = 12_879_925_248 - m.vocab_size * m.dim
  att = 12 * m.num_layers * m.attention.num_heads * m.attention.head_dim * cfg.data.seq_len
  assert plan.model_flops(cfg)[0] == pytest.approx(6 * active * tokens + att * tokens)


def test_oom_message_is_read():
  text = (
    "RESOURCE_EXHAUSTED: ... required for HLO temporaries (147.03G) exceeds available HBM (95.74G)."
  )
  found = plan._OOM.search(text)
  assert plan._bytes(*found.groups()[:2]) == int(147.03 * 2**30)
  assert plan._bytes(*found.groups()[2:]) == int(95.74 * 2**30)


# Compiled for TPU slices (libtpu)

libtpu = pytest.mark.skipif(importlib.util.find_spec("libtpu") is None, reason="needs libtpu")


@libtpu
@pytest.mark.parametrize("topology", ["v5e-4", "v5p-8", "v4-8", "v6e-4"])
def test_hardware_name_is_what_the_devices_report(topology):
  t = plan.parse_topology(topology)
  devices = plan.devices(t)
  assert len(devices) == t.chips
  assert mesh.hardware_name(devices) == t.hardware


def smoke_plan(topology, **overrides):
  cfg = plan.config(
    "lm/llama3-8b:smoke", topology, {k.replace("__", "."): str(v) for k, v in overrides.items()}
  )
  return plan.plan(cfg, topology, estimate_time=False)


@libtpu
@pytest.mark.slow
@pytest.mark.parametrize("topology", ["v5e:2x2", "v5p:2x2x2"])
def test_memory_grows_with_the_model_and_shrinks_with_fsdp(topology):
  n = plan.parse_topology(topology).chips
  replicated = smoke_plan(topology, mesh__data=-1, mesh__fsdp=1, train__batch_size=8)
  deep = smoke_plan(topology, mesh__data=-1, mesh__fsdp=1, train__batch_size=8, model__num_layers=4)
  sharded = smoke_plan(topology, mesh__data=1, mesh__fsdp=-1, train__batch_size=8)
  assert replicated["fits"] and (replicated["mesh"]["data"], replicated["mesh"]["fsdp"]) == (n, 1)
  # Twice the layers: the layers' parameters double, the embedding and head stay.
  assert 1.6 < deep["param_bytes"] / replicated["param_bytes"] < 2.0
  assert deep["optimizer_bytes"] > 1.6 * replicated["optimizer_bytes"]
  # fsdp over n devices: each holds about 1/n of the matrices (norm scales stay replicated).
  assert sharded["param_bytes"] < 1.3 * replicated["param_bytes"] / n
  assert sharded["optimizer_bytes"] < 1.3 * replicated["optimizer_bytes"] / n
  # (Not the total: in a model this small the gathered weights and buffers outweigh the saving.)
  assert sharded["code_bytes"] > 0


@libtpu
def test_moe_auto_impl_is_chosen_for_the_slice_not_this_host():
  import jax
  import numpy as np

  from nnx_zoo.common.nn import moe

  assert moe.resolve_impl("auto") == "blocked"  # this CPU
  devices = plan.devices(plan.parse_topology("v5e:2x2"))
  with jax.set_mesh(jax.sharding.Mesh(np.asarray(devices), ("data",))):
    assert moe.resolve_impl("auto") == "gmm"


@libtpu
@pytest.mark.slow
def test_plan_cli_reports_memory_time_and_mfu(capsys):
  argv = ["plan", "lm/llama3-8b:smoke", "--topology", "v5e-4", "--config.mesh.fsdp=4"]
  assert cli.main(argv) == 0
  out = capsys.readouterr().out
  for text in ("on v5e-4 (v5e:2x2, 4 chips", "fsdp=4", "HBM: fits", "s/step", "MFU"):
    assert text in out, text


@libtpu
@pytest.mark.slow
def test_time_estimate_counts_every_layer_and_micro_batch():
  """XLA counts a loop body once; the estimate must not: a scanned model run in two
  micro-batches costs what the unrolled single-batch step costs."""
  topology = "v5e:2x2"

  def flops(**more):
    overrides = {"mesh.fsdp": "4", "train.batch_size": "8", **more}
    cfg = plan.config("lm/llama3-8b:smoke", topology, overrides)
    return plan.plan(cfg, topology)["compiler_flops_per_device"]

  unrolled = flops()
  looped = flops(**{"model.scan": "True", "train.micro_batches": "2"})
  assert looped == pytest.approx(unrolled, rel=0.05)


@libtpu
@pytest.mark.slow
def test_full_size_on_one_chip_exits_2_naming_the_fix(capsys):
  # Llama 3 8B's weights and AdamW state alone are ~90 GiB: refused before compiling.
  assert cli.main(["plan", "lm/llama3-8b", "--topology", "v5e-1"]) == 2
  captured = capsys.readouterr()
  assert "DOES NOT FIT" in captured.out
  err = captured.err
  assert "lm/llama3-8b does not fit on v5e-1" in err
  assert "--config.model.remat=full" in err and "--config.train.micro_batches=2" in err
  assert "larger topology" in err


# The recipes (published dimensions, meant for accelerators): their smoke forms, one compile
# each. The Shakespeare experiments share these families' code and run on the CPU instead.
RECIPES = [
  name
  for name in sorted(REGISTRY)
  if "shakespeare" not in name and "digits" not in name and not name.startswith(("bench/", "text/"))
]


@libtpu
@pytest.mark.slow
@pytest.mark.parametrize("name", RECIPES)
def test_every_recipe_smoke_form_compiles_for_a_tpu_slice(name):
  topology = "v5e:2x2"
  cfg = plan.config(
    f"{name}:smoke",
    topology,
    {"mesh.data": "-1", "mesh.fsdp": "1", "mesh.tensor": "1", "train.batch_size": "4"},
  )
  try:
    result = plan.plan(cfg, topology, estimate_time=False)
  except UserError as e:
    if "does not know the batches" not in str(e):
      raise
    pytest.skip(str(e))  # a data kind plan has no batch shapes for (abstract_batch)
  assert result["fits"] and result["total_bytes"] > result["param_bytes"] > 0


# Every attention configuration the recipes use (GQA, windows, QK-norm, Gemma's soft-caps and
# layer pattern, MQA), with attention.impl=flash, in the real train step for a TPU slice: jax's
# splash kernel, inside the trainer's check_vma shard_map (kernels/vma.py), forward and backward.
# The last: as the TPU mesh rules run it, scanned and rematerialised (the step's jaxpr re-traced).
FLASH_RECIPES = [
  ("lm/llama3-8b", {}),
  ("lm/mistral-7b", {}),
  ("lm/qwen3-0.6b", {}),
  ("lm/gemma2-2b", {}),
  ("lm/gemma3-1b", {}),
  (
    "lm/llama3-8b",
    {
      "model.scan": "True",
      "model.remat": "full",
      "train.micro_batches": "2",
      "train.batch_size": "8",
    },
  ),
]


@libtpu
@pytest.mark.slow
@pytest.mark.parametrize("name,overrides", FLASH_RECIPES)
def test_flash_attention_train_step_compiles_for_tpu(name, overrides, caplog):
  from nnx_zoo.common import attention_impl, parallel

  attention_impl._logged.clear()
  topology = plan.parse_topology("v5e:2x2")
  cfg = plan.config(
    f"{name}:smoke",
    topology,
    {"model.attention.impl": "flash", "mesh.data": "4", "data.seq_len": "128", **overrides},
  )
  layout = parallel.make_layout(mesh.resolve(cfg.mesh, 4), plan.devices(topology))
  with caplog.at_level("WARNING"):
    _, compiled = plan._compile(cfg, layout)
  assert not [r.getMessage() for r in caplog.records if "falls back" in r.getMessage()]
  hlo = compiled.as_text()
  assert hlo.count("tpu_custom_call") >= 3  # the forward, dK/dV and dQ kernels


@libtpu
@pytest.mark.slow
@pytest.mark.parametrize("sizes", [{"data": 4}, {"data": 2, "expert": 2}], ids=["data", "expert"])
def test_moe_train_step_runs_megablox_on_tpu(sizes):
  """The MoE recipes' step for a TPU slice runs megablox's grouped matmuls (kernels/tpu_gmm.py),
  forward and backward, inside the trainer's check_vma shard_map, with or without experts split
  over devices; never ragged-dot (whose weight gradient XLA:TPU runs densely over all experts)."""
  from nnx_zoo.common import parallel

  topology = plan.parse_topology("v5e:2x2")
  overrides = {f"mesh.{a}": str(sizes.get(a, 1)) for a in mesh.AXES}
  cfg = plan.config("lm/mixtral-8x7b:smoke", topology, {**overrides, "train.batch_size": "4"})
  layout = parallel.make_layout(mesh.resolve(cfg.mesh, 4), plan.devices(topology))
  hlo = plan._compile(cfg, layout)[1].as_text()
  assert hlo.count("tpu_custom_call") >= 3 and "ragged-dot" not in hlo


def test_plan_recipes_plans_the_slice_a_recipe_is_written_for():
  """bench/plan_recipes.py's table: each generation's 64-chip slice, or the larger one a
  recipe's TPU rule names where 64 chips do not hold its step (Mixtral on v5e)."""
  import importlib.util
  import pathlib

  path = pathlib.Path(__file__).resolve().parents[2] / "bench" / "plan_recipes.py"
  spec = importlib.util.spec_from_file_location("plan_recipes", path)
  bench = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(bench)
  assert [bench.recipe_topology("lm/llama3-8b", t) for t in bench.TOPOLOGIES] == list(
    bench.TOPOLOGIES
  )
  for exp in ("lm/mixtral-8x7b", "lm/qwen3-30b-a3b"):
    # Qwen3-30B's step fits 64 v5e chips since the scanned layers accumulate the micro-batches'
    # gradients in their backward loop (13.4 GiB a chip); Mixtral's does not (17.5).
    v5e = "v5e-64" if exp == "lm/qwen3-30b-a3b" else "v5e-128"
    assert bench.recipe_topology(exp, "v5e-64") == v5e
    assert bench.recipe_topology(exp, "v5p-128") == "v5p-128"
    rules = plan.config(exp, "v5e-128").mesh_rules
    assert mesh.pick_rule(rules, plan.parse_topology("v5e-128").hardware)[0] == "tpu-v5-litex128"


@libtpu
@pytest.mark.slow
def test_plan_compiles_a_pipelined_step_and_reports_its_schedule(capsys):
  """Pipeline 2 x fsdp 4 on a v5e-8: the plan's pipeline line (bubble (S - 1) / (M + S - 1) =
  1 / 5 with M = 2 x stages, the stage's weights, what it keeps and sends), and a time estimate
  whose layers are the stage's share stretched by the bubbles. "auto" attention runs the XLA
  path inside the stages, where splash fails to lower (common/attention_impl.py's RULES)."""
  argv = ["plan", "lm/llama3-8b:smoke", "--topology", "v5e-8", "--config.mesh.pipeline=2"]
  argv += ["--config.mesh.fsdp=4", "--config.model.scan=True", "--config.model.num_layers=4"]
  argv += ["--config.train.batch_size=16"]
  assert cli.main(argv) == 0
  out = capsys.readouterr().out
  for text in ("pipeline=2", "2 stages x 1 repeats, 4 micro-batches: bubble 20.0%", "MFU"):
    assert text in out, text
