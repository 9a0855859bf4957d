"""Mesh sizes from config: -1 takes the rest; sizes that do not fit the devices are refused."""

import ml_collections
import pytest

from nnx_zoo.common import mesh
from nnx_zoo.common.errors import UserError


def cfg(data, fsdp, tensor):
  return ml_collections.ConfigDict({"data": data, "fsdp": fsdp, "tensor": tensor})


@pytest.mark.parametrize(
  "sizes, devices, want",
  [
    ((1, 1, 1), 1, (1, 1, 1)),
    ((1, -1, 1), 1, (1, 1, 1)),
    ((2, -1, 2), 8, (2, 2, 2)),
    ((-1, 1, 1), 8, (8, 1, 1)),
    ((1, 4, 2), 8, (1, 4, 2)),
  ],
)
def test_resolve(sizes, devices, want):
  got = mesh.resolve(cfg(*sizes), devices)  # a config without mesh.expert: expert is 1
  assert (got["data"], got["fsdp"], got["tensor"]) == want and got["expert"] == 1


@pytest.mark.parametrize(
  "sizes, devices, want",
  [
    ((1, 1, 4, 2), 8, (1, 1, 4, 2)),
    ((2, 1, -1, 1), 8, (2, 1, 4, 1)),
    ((-1, 2, 2, 1), 8, (2, 2, 2, 1)),
  ],
)
def test_resolve_with_an_expert_axis(sizes, devices, want):
  axes = ("data", "fsdp", "expert", "tensor")
  got = mesh.resolve(mesh.config(**dict(zip(axes, sizes, strict=True))), devices)
  assert tuple(got[a] for a in axes) == want and got["context"] == 1


def test_mesh_config_has_every_axis_and_refuses_others():
  assert dict(mesh.config(fsdp=-1)) == {
    "pipeline": 1,
    "data": 1,
    "fsdp": -1,
    "expert": 1,
    "context": 1,
    "tensor": 1,
  }
  with pytest.raises(UserError, match="no axis 'stage'"):
    mesh.config(stage=2)


@pytest.mark.parametrize(
  "sizes, devices, words",
  [
    ((2, 2, 1), 8, "needs 4 devices but 8"),
    ((3, -1, 1), 8, "does not divide the 8 devices"),
    ((-1, -1, 1), 8, "at most one may be -1"),
    ((0, 1, 1), 1, "positive size"),
  ],
)
def test_resolve_errors_name_the_problem(sizes, devices, words):
  with pytest.raises(UserError, match=words):
    mesh.resolve(cfg(*sizes), devices)


def test_hardware_name_is_kind_and_count():
  import jax

  assert mesh.hardware_name() == f"cpux{jax.device_count()}"


def test_first_matching_rule_wins():
  rules = [("cpux1", {"a": 1}), ("cpu*", {"a": 2}), ("*", {"a": 3})]
  assert mesh.pick_rule(rules, "cpux1") == ("cpux1", {"a": 1})
  assert mesh.pick_rule(rules, "cpux8") == ("cpu*", {"a": 2})
  assert mesh.pick_rule(rules, "gpu-nvidia-h100x8") == ("*", {"a": 3})
  assert mesh.pick_rule(rules[:1], "tpu-v5px64") is None


def test_experiment_mesh_rule_applies_before_command_line_overrides():
  from nnx_zoo.common import experiments

  h100 = "gpu-nvidia-h100-80gb-hbm3x8"
  cfg = experiments.get_config("lm/llama3-8b", hardware=h100)
  assert (cfg.mesh.fsdp, cfg.model.remat) == (8, "full")
  assert "gpu-*h100*x8" in cfg.mesh_rule
  cfg = experiments.get_config("lm/llama3-8b", {"model.remat": "save_dots"}, hardware=h100)
  assert cfg.model.remat == "save_dots"  # the user's override wins
  cfg = experiments.get_config("lm/llama3-8b", hardware="tpu-v4x8")
  assert "matches no mesh rule" in cfg.mesh_rule and cfg.mesh.fsdp == -1


def test_zoo_show_says_which_rule_applies_and_why(capsys):
  from nnx_zoo.common import cli

  assert cli.main(["show", "lm/llama3-8b", "--mesh-rule", "tpu-v5x64"]) == 0
  out = capsys.readouterr().out
  assert "# mesh rule: tpu-v5x64 matches 'tpu-v5x64'" in out


def test_tpu_rules_name_the_hardware_of_each_64_chip_slice():
  """Each rule's pattern is the hardware name `zoo plan` (and jax's devices) give that slice,
  so a recipe's TPU rule is the one a real or planned slice picks."""
  from nnx_zoo.common import plan

  rules = dict(mesh.tpu_rules(v5p=2, v4=8, v6e=8, v5e=16))
  for cloud in ("v5p-128", "v4-128", "v6e-64", "v5e-64"):
    topology = plan.parse_topology(cloud)
    name, overrides = mesh.pick_rule(list(rules.items()), topology.hardware)
    assert name == topology.hardware and topology.chips == 64
    assert mesh.resolve(
      ml_collections.ConfigDict({a: overrides.get(f"mesh.{a}", 1) for a in mesh.AXES}), 64
    )
    assert overrides["model.attention.impl"] == "flash"
  assert [n for n, _ in mesh.tpu_rules(v5e=4)] == ["tpu-v5-litex64"]
  with pytest.raises(UserError, match="v7"):
    mesh.tpu_rules(v7=1)


def test_tpu_rules_max_tensor_moves_chips_to_fsdp():
  """A model whose heads allow less tensor parallelism than a slice's mesh (one kv head) keeps
  every chip: the rest go to fsdp."""
  full = dict(mesh.tpu_rules(v5p=2, v4=8, v6e=8, v5e=16))
  capped = dict(mesh.tpu_rules(v5p=2, v4=8, v6e=8, v5e=16, max_tensor=1))
  for name, sizes in full.items():
    t = sizes.get("mesh.tensor", 1)
    assert capped[name].get("mesh.tensor", 1) == 1
    assert capped[name]["mesh.fsdp"] == sizes["mesh.fsdp"] * t == 64
  two = dict(mesh.tpu_rules(v5e=16, max_tensor=2))["tpu-v5-litex64"]
  assert (two["mesh.fsdp"], two["mesh.tensor"]) == (32, 2)


def test_tpu_rules_for_larger_slices_and_experts():
  """chips: a larger slice's extra chips go to fsdp, under that slice's own hardware name;
  expert: chips taken from fsdp, every chip still used; a size with no room is refused."""
  from nnx_zoo.common import plan

  ((name, big),) = mesh.tpu_rules(v5e=8, chips=256)
  assert name == plan.parse_topology("v5e-256").hardware
  assert (big["mesh.fsdp"], big["mesh.tensor"]) == (64, 4)
  for name, sizes in mesh.tpu_rules(v5p=2, v4=8, v6e=8, v5e=32, expert=8):
    used = sizes["mesh.fsdp"] * sizes.get("mesh.tensor", 1) * sizes["mesh.expert"]
    assert sizes["mesh.expert"] == 8 and used == 64, name
  with pytest.raises(UserError, match="expert=32"):
    mesh.tpu_rules(v5e=8, expert=32)
  with pytest.raises(UserError, match="multiple of 64"):
    mesh.tpu_rules(v5e=8, chips=96)


# ---------------------------------------------------------------------------------------------
# GPU rules: sized by arithmetic (no GPU measured them), for 1 and 8 GPUs of 80 and 141 GB.

BIG = [
  "lm/llama2-7b",
  "lm/llama3-8b",
  "lm/mistral-7b",
  "lm/mixtral-8x7b",
  "lm/qwen3-30b-a3b",
  "lm/gemma2-2b",
  "lm/gemma3-1b",
  "lm/qwen3-0.6b",
]


@pytest.mark.slow  # builds each recipe's model abstractly: 3-13 s each on 2 cores
@pytest.mark.parametrize("exp", BIG)
def test_gpu_rules_state_is_the_models_and_every_rule_fits_its_budget(exp):
  """The parameter count the rules size the state by is the abstractly built model's; each rule
  fits state + a micro-batch's activations in XLA's 75% of the memory, and no fewer micro-batches
  would (the fewest that fit)."""
  from nnx_zoo.common import experiments, models

  c = experiments.get_config(exp)
  # Norms (and Qwen's q/k norms) are left out of the arithmetic: within 0.1% of the real count.
  assert mesh._param_count(c.model) == pytest.approx(models.num_params(c.model), rel=1e-3)
  per_row = mesh._activation_bytes_per_row(c.model, c.data.seq_len)
  state = 16 * models.num_params(c.model)
  rules = mesh.gpu_rules(c.model, batch_size=c.train.batch_size, seq_len=c.data.seq_len)
  assert rules == [r for r in c.mesh_rules if r[0].startswith("gpu-")]  # the recipe uses them
  for pattern, o in rules:
    gpus = int(pattern.rsplit("x", 1)[1])
    memory = 141 if "h200" in pattern else 80
    budget = memory * 1e9 * mesh.XLA_MEMORY_FRACTION - mesh.GPU_RESERVE
    rows = c.train.batch_size // gpus // o["train.micro_batches"]
    assert state / gpus + rows * per_row <= budget, pattern
    total = c.train.batch_size // gpus
    fewer = [d for d in range(1, o["train.micro_batches"]) if total % d == 0]
    assert all(state / gpus + total // d * per_row > budget for d in fewer), pattern
    assert o.get("mesh.fsdp", 1) == gpus and o["model.remat"] == "full"


def test_gpu_rules_match_jax_hardware_names_and_skip_what_cannot_fit():
  """The patterns match the names jax's devices give (mesh.hardware_name); a 7-8 B model's 128 GB
  of state gets no one-GPU rule, and Mixtral none on 8 GPUs of 80 GB (93 GB a GPU)."""
  from nnx_zoo.common import experiments

  small = experiments.get_config("lm/qwen3-0.6b")
  rules = small.mesh_rules
  for name, want in [
    ("gpu-nvidia-h100-80gb-hbm3x8", "gpu-*h100*x8"),
    ("gpu-nvidia-h100-pciex1", "gpu-*h100*x1"),
    ("gpu-nvidia-a100-sxm4-80gbx8", "gpu-*80gb*x8"),
    ("gpu-nvidia-h200x1", "gpu-*h200*x1"),
    ("gpu-nvidia-h200x8", "gpu-*h200*x8"),
  ]:
    assert mesh.pick_rule(rules, name)[0] == want, name
  assert mesh.pick_rule(rules, "gpu-nvidia-h200x16") is None
  big = experiments.get_config("lm/llama3-8b").mesh_rules
  assert not [p for p, _ in big if p.endswith("x1")]
  mixtral = [p for p, _ in experiments.get_config("lm/mixtral-8x7b").mesh_rules]
  assert "gpu-*h200*x8" in mixtral and "gpu-*h100*x8" not in mixtral
