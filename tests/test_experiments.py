"""The experiment catalogue: registration, docstrings, common keys, golden configs, smoke runs,
and the modularity rule of docs/DESIGN.md (one modifier reaches every experiment; no family has its
own attention, RoPE or norm)."""

import ast
import importlib
import inspect
import json
import math
import os
import pathlib
import re
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from nnx_zoo.common import config as config_lib
from nnx_zoo.common import experiments, models, modifiers
from nnx_zoo.common.tasks import losses
from nnx_zoo.common.train import trainer
from nnx_zoo.experiments import DEFAULT, REGISTRY

ROOT = pathlib.Path(__file__).resolve().parents[1]
GOLDEN = ROOT / "tests" / "golden"
NAMES = list(REGISTRY)
# Every experiment and its smoke form: what the golden files hold.
FORMS = [form for name in NAMES for form in (name, f"{name}:smoke")]


def walk(cfg, path=""):
  """(dotted path, sub-config) for the config and every sub-config under it."""
  yield path, cfg
  for key, value in cfg.items():
    if hasattr(value, "items"):
      yield from walk(value, f"{path}.{key}" if path else key)


# (a) Registration


def test_registry_names_and_default():
  assert DEFAULT in REGISTRY
  for name, module in REGISTRY.items():
    domain, _, short = name.partition("/")
    assert domain and short and "/" not in short and ":" not in name, name
    # The name says where the file is: lm/qwen3-0.6b -> experiments/lm/qwen3_0_6b.py.
    expected = f"nnx_zoo.experiments.{domain}.{re.sub(r'[-.]', '_', short)}"
    assert module == expected, f"{name} is registered as {module}, expected {expected}"


def test_every_experiment_file_is_registered():
  files = {
    ".".join(("nnx_zoo", *p.relative_to(ROOT).with_suffix("").parts))
    for p in (ROOT / "experiments").rglob("*.py")
    if p.name != "__init__.py"
  }
  orphans = sorted(files - set(REGISTRY.values()))
  missing = sorted(set(REGISTRY.values()) - files)
  assert not orphans, f"experiment files not in experiments.REGISTRY: {orphans}"
  assert not missing, f"registered experiments with no file: {missing}"


# (b) Docstrings


@pytest.mark.parametrize("name", NAMES)
def test_docstring(name):
  doc = importlib.import_module(REGISTRY[name]).__doc__
  assert doc and doc.strip(), f"{name} has no docstring"
  lines = doc.strip().splitlines()
  assert lines[0].strip(), f"{name}: the docstring's first line is `zoo list`'s description"
  fields = {}
  for line in lines:
    m = re.match(r"(\w+):\s+(.*)", line)
    if m:
      fields.setdefault(m.group(1), m.group(2))
  for field in ("Command", "Hardware", "Time", "Expected"):
    assert fields.get(field, "").strip(), f"{name}: the docstring has no `{field}:` line"
  command = fields["Command"]
  assert command.startswith("zoo "), f"{name}: Command: {command!r} is not a zoo command"
  assert re.search(rf"(^|\s){re.escape(name)}(?=[\s:]|$)", command), (
    f"{name}: Command: {command!r} does not name the experiment"
  )


# (c) Common keys


@pytest.mark.parametrize("form", FORMS)
def test_common_keys(form):
  name, arg = experiments.split_arg(form)
  module = importlib.import_module(REGISTRY[name])
  flat = config_lib.flatten(module.get_config(arg) if arg else module.get_config())
  missing = [k for k in experiments.COMMON_KEYS if k not in flat]
  assert not missing, f"{form} lacks the common keys {missing}"


@pytest.mark.parametrize("name", NAMES)
def test_smoke_form_is_small(name):
  """`EXP:smoke` runs on a CPU in seconds, even for an 8 B model (docs/DESIGN.md)."""
  cfg = experiments.get_config(f"{name}:smoke")
  assert cfg.train.steps <= 10
  assert cfg.train.batch_size * cfg.data.get("seq_len", 1) <= 1024  # image data: one an image
  assert models.num_params(cfg.model) < 5_000_000
  assert cfg.mesh.data * cfg.mesh.fsdp * cfg.mesh.tensor == 1


# (d) Golden configs


def golden_path(form: str) -> pathlib.Path:
  return GOLDEN / (form.replace("/", "_").replace(":", "_") + ".txt")


@pytest.mark.parametrize("form", FORMS)
def test_golden_config(form):
  # As the file declares it: a model taken from init_from is the checkpoint's, on this machine.
  text = config_lib.golden_text(experiments.get_config(form, resolve=False))
  path = golden_path(form)
  if os.environ.get("UPDATE_GOLDEN") == "1":
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return
  assert path.exists(), f"{path} is missing: run `UPDATE_GOLDEN=1 pytest {__file__}`"
  assert text == path.read_text(), (
    f"{form}'s resolved config differs from {path.relative_to(ROOT)}. If the change is meant, "
    f"rerun with UPDATE_GOLDEN=1 and commit the diff."
  )


def test_no_stale_golden_files():
  domains = {name.split("/")[0] for name in NAMES}
  wanted = {golden_path(form).name for form in FORMS}
  stale = [
    p
    for p in sorted(GOLDEN.glob("*.txt"))
    if p.name.split("_")[0] in domains and p.name not in wanted
  ]
  if os.environ.get("UPDATE_GOLDEN") == "1":
    for p in stale:
      p.unlink()
    return
  assert not stale, f"golden files of no registered experiment: {[p.name for p in stale]}"


# (e) Every smoke form trains end to end


# Experiments that cannot start without another's run (DPO needs its reference model).
STARTS_FROM = {"chat/shakespeare-dialogue-dpo": "chat/shakespeare-dialogue"}


@pytest.mark.slow
@pytest.mark.parametrize("name", NAMES)
def test_smoke_trains(name, tmp_path):
  cfg = experiments.get_config(f"{name}:smoke")
  if cfg.data.get("kind") == "spoken_digits" and shutil.which("espeak-ng") is None:
    pytest.skip("its audio is synthesised by espeak-ng, not installed here (.ci/run installs it)")
  if name in STARTS_FROM:  # its init_from is another experiment's run: one step of its smoke
    start = experiments.get_config(f"{STARTS_FROM[name]}:smoke", {"train.steps": "1"})
    trainer.train(start, str(tmp_path / "start"), progress=False)
    cfg.init_from = str(tmp_path / "start")
  workdir = str(tmp_path / "run")
  last = trainer.train(cfg, workdir, progress=False)
  assert math.isfinite(last["loss"])

  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    records = [json.loads(line) for line in f]
  train_lines = [r for r in records if "split" not in r]
  eval_lines = [r for r in records if r.get("split") == "eval"]
  assert train_lines, "no training lines in metrics.jsonl"
  for r in train_lines:
    assert {"step", "loss", "tokens_per_s"} <= set(r), r
    assert math.isfinite(r["loss"]) and r["tokens_per_s"] > 0, r
  assert train_lines[-1]["step"] == cfg.train.steps
  assert eval_lines, "no eval line in metrics.jsonl"
  assert {"step", "loss"} <= set(eval_lines[-1]) and math.isfinite(eval_lines[-1]["loss"])

  with open(os.path.join(workdir, "config.json")) as f:
    saved = json.load(f)
  assert saved["model"] == json.loads(json.dumps(cfg.model.to_dict()))  # tuples read as lists
  steps = [p for p in os.listdir(os.path.join(workdir, "checkpoints")) if p.isdigit()]
  assert str(cfg.train.steps) in steps, f"checkpoints/ holds {steps}"


# (f) Modularity: one modifier changes the position encoding of every experiment

MODIFIERS = {
  "rope_to_alibi": "alibi",
  "rope_to_none": "none",
  "rope_to_yarn": "rope",
}


def test_modifier_list_is_complete():
  found = {n for n, f in vars(modifiers).items() if n.startswith("rope_to_") and callable(f)}
  assert found == set(MODIFIERS)


@pytest.mark.parametrize("name", sorted(MODIFIERS))
def test_modifier_is_short(name):
  """docs/DESIGN.md: switching the position encoding of every experiment is at most 10 lines."""
  fn = getattr(modifiers, name)
  tree = ast.parse(inspect.cleandoc("\n" + inspect.getsource(fn)))
  (func,) = tree.body
  body = func.body
  if isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
    body = body[1:]  # the docstring does not count
  lines = inspect.getsource(fn).splitlines()[body[0].lineno - 1 : body[-1].end_lineno]
  code = [line for line in lines if line.strip() and not line.strip().startswith("#")]
  assert len(code) <= 10, f"{name} has {len(code)} lines of body:\n" + "\n".join(code)


def has_rope(cfg) -> bool:
  return any(sub.get("kind") == "rope" for _, sub in walk(cfg))


def loss_and_grads(params, batch, *, graphdef):
  def loss_fn(p):
    total, count = losses.loss_sums(nnx.merge(graphdef, p), batch)
    return total / count

  return jax.value_and_grad(loss_fn)(params)


# Jitted once: the smoke forms that share a model (and so a graphdef) share the compilation.
loss_and_grads_jit = jax.jit(loss_and_grads, static_argnames="graphdef")


def smoke_step(model_cfg, seq_len: int, batch_size: int = 2) -> tuple[float, float]:
  """Loss and gradient norm of one forward and backward pass on random tokens."""
  graphdef, params = nnx.split(models.build(model_cfg), nnx.Param)
  tokens = jax.random.randint(
    jax.random.key(0), (batch_size, seq_len + 1), 0, model_cfg.vocab_size, jnp.int32
  )
  batch = {"tokens": tokens, "segment_ids": jnp.ones_like(tokens)}
  loss, grads = loss_and_grads_jit(params, batch, graphdef=graphdef)
  return float(loss), float(jnp.sqrt(sum(jnp.sum(g**2) for g in jax.tree.leaves(grads))))


@pytest.mark.parametrize("exp", NAMES)
@pytest.mark.parametrize("modifier", sorted(MODIFIERS))
@pytest.mark.slow
def test_modifier_reaches_every_experiment(modifier, exp):
  cfg = experiments.get_config(f"{exp}:smoke")
  before = config_lib.golden_text(cfg)
  new = getattr(modifiers, modifier)(cfg)
  assert config_lib.golden_text(cfg) == before, f"{modifier} changed its input config"
  if not has_rope(cfg):  # an encoder with learned positions: nothing to replace
    assert config_lib.golden_text(new) == before
    return

  kinds = {path: sub.get("kind") for path, sub in walk(new) if path.endswith("position")}
  assert kinds, f"{exp} has no position sub-config"
  assert set(kinds.values()) == {MODIFIERS[modifier]}, kinds
  ropes = [sub for _, sub in walk(new) if sub.get("kind") == "rope"]
  if modifier == "rope_to_yarn":
    assert ropes and all(sub.scaling.kind == "yarn" for sub in ropes)
  else:
    assert not ropes, f"{modifier} left RoPE sub-configs: {ropes}"
  # Everything but the position encoding is as it was.
  old_flat, new_flat = config_lib.flatten(cfg), config_lib.flatten(new)
  changed = {k for k in set(old_flat) | set(new_flat) if old_flat.get(k) != new_flat.get(k)}
  assert all(".position." in f".{k}" for k in changed), sorted(changed)

  loss, grad_norm = smoke_step(new.model, new.data.seq_len)
  assert np.isfinite(loss) and np.isfinite(grad_norm) and grad_norm > 0, (loss, grad_norm)


@pytest.mark.parametrize("exp", NAMES)
@pytest.mark.parametrize("modifier", sorted(MODIFIERS))
def test_modifier_fits_full_model(modifier, exp):
  """The smoke forms share one tiny model; the full ones have GQA, windows, QK-norm, tied
  embeddings. One layer of each, traced abstractly (nothing allocated), still gives a loss."""
  if experiments.get_config(exp, resolve=False).get("model_from"):
    pytest.skip(f"{exp}'s model is its init_from checkpoint's: its smoke form is checked above")
  cfg = getattr(modifiers, modifier)(experiments.get_config(exp))
  if not has_rope(experiments.get_config(exp)):
    pytest.skip(f"{exp} has no RoPE to replace (checked unchanged above)")
  cfg.model.num_layers = 1

  def abstract_step():
    model = models.build(cfg.model)
    graphdef, params = nnx.split(model, nnx.Param)
    batch = {"tokens": jnp.zeros((1, 17), jnp.int32), "segment_ids": jnp.ones((1, 17), jnp.int32)}
    return loss_and_grads(params, batch, graphdef=graphdef)

  loss, grads = jax.eval_shape(abstract_step)
  assert loss.shape == () and jax.tree.leaves(grads)


# (g) No family defines its own attention, positions, norm, MLP, MoE, patch embedding, block or
# front-end (a convolutional stem)

DEFINITIONS = [
  re.compile(
    r"class \w*(Attention|Norm|Rotary|RoPE|MLP|FeedForward|MoE|Expert|Router|Block|Layer"
    r"|PatchEmbed|Stem|Conv|Position|Embedding|Decoder|Encoder)"
  ),
  re.compile(r"def \w*(apply_rope|rotary|rope_|relative_position|attend|patchify)"),
  # Conditioning (DiT): timestep and class embeddings, adaLN modulation.
  re.compile(r"class \w*(Modulation|Conditioning|Timestep|AdaLN|LabelEmbed|ClassEmbed)"),
  re.compile(r"def \w*(modulate|timestep_(features|embedding)|sincos)"),
]
# In a model file these mean attention (or a piece of it) written by hand.
MODEL_FILE_USES = [
  re.compile(r"\bjax\.nn\.softmax\b"),
  re.compile(r"\bjnp\.einsum\b"),
  re.compile(r"\bdot_product_attention\b"),
]


def violations(relpath: str, text: str) -> list[str]:
  patterns = DEFINITIONS + (MODEL_FILE_USES if relpath.endswith("model.py") else [])
  out = []
  for lineno, line in enumerate(text.splitlines(), 1):
    for pattern in patterns:
      if pattern.search(line):
        out.append(f"{relpath}:{lineno}: {line.strip()}")
  return out


def test_violation_check_catches_private_copies():
  text = "class MyRMSNorm(nnx.Module):\n  pass\ndef apply_rope(x):\n  return jnp.einsum('x', x)\n"
  found = violations("zoo/fake/model.py", text)
  assert [v.split(":")[1] for v in found] == ["1", "3", "4"], found
  for own in (
    "SwiGLUMLP", "SparseMoE", "GemmaDecoderLayer", "Block", "T5RelativePosition",
    "AdaLNZeroModulation", "TimestepEmbedder", "DiTConditioning",
  ):  # fmt: skip
    assert violations("zoo/fake/model.py", f"class {own}(nnx.Module):\n"), own
  assert violations("zoo/fake/params.py", "y = jnp.einsum('x', x)\n") == []
  assert violations("zoo/fake/model.py", "def modulate(x, shift, scale):\n")


def test_zoo_defines_no_attention_rope_or_norm():
  files = sorted((ROOT / "zoo").rglob("*.py"))
  assert any(p.name == "model.py" for p in files)
  found = [v for p in files for v in violations(str(p.relative_to(ROOT)), p.read_text())]
  assert not found, (
    "a family must compose the shared layers of common/nn/ (attention, positions, norms, MLPs, "
    "the transformer stacks), not define its own (docs/DESIGN.md, the one rule):\n  "
    + "\n  ".join(found)
  )


# (h) The layout: what a family may import, and how deep common/ goes

# A family composes the layers and names its config and HF weights: nothing else of common/.
ZOO_MAY_IMPORT = tuple(f"nnx_zoo.common.{m}" for m in ("nn", "config", "errors", "keymap"))


def imports_of(path: pathlib.Path) -> list[str]:
  out = []
  for node in ast.walk(ast.parse(path.read_text())):
    if isinstance(node, ast.Import):
      out += [alias.name for alias in node.names]
    elif isinstance(node, ast.ImportFrom) and node.module:
      out += [f"{node.module}.{alias.name}" for alias in node.names]
  return out


def may_import(name: str) -> bool:
  """May a family's file import `name` (a module, or a module's attribute)?"""
  if name.startswith("nnx_zoo.experiments") or name == "nnx_zoo.common":
    return False
  if not name.startswith("nnx_zoo.common."):
    return True  # jax, flax, ml_collections, the family's own zoo/ modules
  return any(name == m or name.startswith(m + ".") for m in ZOO_MAY_IMPORT)


def test_zoo_imports_only_the_layers_and_config_helpers():
  bad = []
  for path in sorted((ROOT / "zoo").rglob("*.py")):
    for name in imports_of(path):
      if not may_import(name):
        bad.append(f"{path.relative_to(ROOT)}: {name}")
  assert not bad, f"zoo/ may import only {ZOO_MAY_IMPORT}:\n  " + "\n  ".join(bad)


def test_import_rule_catches_a_trainer_import(tmp_path):
  path = tmp_path / "model.py"
  path.write_text(
    "from nnx_zoo.common.train import trainer\nfrom nnx_zoo.common.nn import attention\n"
  )
  names = imports_of(path)
  assert names == ["nnx_zoo.common.train.trainer", "nnx_zoo.common.nn.attention"]
  assert [may_import(n) for n in names] == [False, True]
  assert not may_import("nnx_zoo.common.hub.weights")
  assert may_import("nnx_zoo.common.keymap.copy")


def test_common_is_at_most_two_levels_deep():
  deep = [
    str(p.relative_to(ROOT))
    for p in (ROOT / "common").rglob("*.py")
    if len(p.relative_to(ROOT / "common").parts) > 2
  ]
  assert not deep, f"common/ packages nest at most one level: {deep}"


def test_every_family_folder_is_registered_by_itself():
  """A folder zoo/<family>/ with model.py is a family: nothing outside it lists it."""
  folders = {p.parent.name for p in (ROOT / "zoo").glob("*/model.py")}
  assert set(models.families()) == folders
  for family in folders:
    module = models.family_module(family)
    assert callable(module.config) and isinstance(module.Model, type), family
