"""common/train/fit.py and common/device_memory.py: the train step's memory against a device's
before the first step (NNX_ZOO_MEMORY_BUDGET forces what a device has), the one-line refusal,
train.fit=auto's choice (equal to the same levers set by hand, resumed the same way), and the
same check on `zoo eval`'s step and the sampler's programs."""

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest

from nnx_zoo.common import cli, device_memory, experiments, programs
from nnx_zoo.common.errors import UserError
from nnx_zoo.common.nn import attention_blocked
from nnx_zoo.common.train import fit, optim, trainer

SMOKE = "lm/shakespeare-char:smoke"
# As tests/common/test_trainer.py: a constant schedule after a warm-up shorter than the first
# run, so a run extended from 4 to 6 steps equals a 6-step run.
BASE = {
  "train.steps": "6",
  "train.checkpoint_every": "2",
  "train.log_every": "1",
  "train.eval_every": "0",
  "optim.schedule": "constant",
  "optim.warmup_steps": "2",
}


def smoke(overrides=None):
  return experiments.get_config(SMOKE, {**BASE, **(overrides or {})})


def losses(workdir) -> dict[int, float]:
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    return {r["step"]: r["loss"] for r in map(json.loads, f) if "split" not in r}


def needs(cfg) -> int:
  tx = optim.optimizer(cfg.optim, cfg.train.steps)
  compiled = fit.compile_step(cfg, tx=tx, layout=None)[1]
  return device_memory.measure(compiled).needed


def expected_choice(cfg):
  """(budget, candidate) such that the step does not fit and `candidate` is the first of
  train.fit=auto's list that fits with 10% headroom, from the compiled figures (None, None if
  no candidate is below the step)."""
  base = needs(cfg)
  figures = [(c, needs(fit.with_overrides(cfg, c))) for c in fit.candidates(cfg, {"data": 1})]
  for i, (candidate, need) in enumerate(figures):
    budget = int(need / (1 - device_memory.HEADROOM)) + 1
    if budget < base and all(n > (1 - device_memory.HEADROOM) * budget for _, n in figures[:i]):
      return budget, candidate
  return None, None


def test_parse_bytes():
  assert device_memory.parse_bytes("1073741824") == 2**30
  assert device_memory.parse_bytes("1GiB") == 2**30
  assert device_memory.parse_bytes("512 MiB") == 2**29
  assert device_memory.parse_bytes("1.5KiB") == 1536
  with pytest.raises(UserError, match="NNX_ZOO_MEMORY_BUDGET"):
    device_memory.parse_bytes("lots")


def test_cpu_budget_is_the_hosts_available_memory(monkeypatch):
  monkeypatch.delenv(device_memory.BUDGET, raising=False)
  with open("/proc/meminfo") as f:
    available = next(int(x.split()[1]) * 1024 for x in f if x.startswith("MemAvailable:"))
  got = device_memory.budget()
  assert got.where.startswith("this host's available memory")
  assert abs(got.bytes - available) < 2**30  # read a moment apart
  monkeypatch.setenv(device_memory.BUDGET, "3GiB")
  assert device_memory.budget().bytes == 3 * 2**30


def test_eight_cpu_devices_share_the_host():
  code = (
    "from nnx_zoo.common import device_memory as d; b = d.budget();"
    "print(b.bytes, d._mem_available(), b.where)"
  )
  env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu")
  env.pop(device_memory.BUDGET, None)
  out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
  share, available, *_ = out.stdout.split()
  assert abs(int(share) - int(available) // 8) < 2**27 and "1/8" in out.stdout


def test_a_step_that_fits_is_unchanged(monkeypatch):
  monkeypatch.setenv(device_memory.BUDGET, "64GiB")
  cfg = smoke()
  tx = optim.optimizer(cfg.optim, cfg.train.steps)
  got, _ = fit.fitted_step(cfg, tx=tx, layout=None)
  assert got is cfg and cfg.train.fitted == ""


def test_refused_in_one_line_exit_2_nothing_written(monkeypatch, tmp_path, capsys):
  monkeypatch.setenv(device_memory.BUDGET, "1KiB")
  workdir = tmp_path / "run"
  # Every lever pulled already (one row, remat full in a scan): one compile, no candidate to try.
  pulled = ["--config.model.remat=full", "--config.model.scan=true", "--config.train.batch_size=1"]
  code = cli.main(["run", SMOKE, "--workdir", str(workdir), "--quiet", *pulled])
  err = capsys.readouterr().err.strip()
  assert code == 2 and len(err.splitlines()) == 1, err
  assert "train step does not fit: it needs" in err
  assert "has 0.00 MiB (NNX_ZOO_MEMORY_BUDGET)" in err and "No lever train.fit=auto" in err
  assert not workdir.exists()


def test_unknown_fit_mode():
  cfg = smoke({"train.fit": "sometimes"})
  with pytest.raises(UserError, match="train.fit='sometimes'"):
    fit.fitted_step(cfg, tx=optim.optimizer(cfg.optim, 4), layout=None)


def test_candidates_accumulate_in_their_order():
  cfg = experiments.get_config(SMOKE, {"train.batch_size": "8"})
  got = fit.candidates(cfg, {"data": 1})
  # The smoke model's blocks are not scanned: each remat candidate scans them too.
  scan = {"model.scan": True}
  assert got[:2] == [{"model.remat": "save_dots", **scan}, {"model.remat": "full", **scan}]
  assert [c["train.micro_batches"] for c in got[2:]] == [2, 4, 8]
  assert all(c["model.remat"] == "full" for c in got[2:])
  # A large vocabulary adds the chunked loss; blocked attention comes after it where a row is
  # longer than one of its blocks, before the micro-batches.
  cfg.model.vocab_size = 32768
  short = fit.candidates(cfg, {"data": 1})
  assert all("model.attention.impl" not in c for c in short)
  cfg.data.seq_len = 2 * attention_blocked.BLOCK
  got = fit.candidates(cfg, {"data": 1})
  assert got[2] == {"model.remat": "full", **scan, "train.loss_chunk": fit.LOSS_CHUNK}
  assert got[3] == {**got[2], "model.attention.impl": "blocked"}
  assert got[4] == {**got[3], "train.micro_batches": 2}


def test_remat_candidates_scan_the_blocks_and_lower_the_step():
  # XLA:CPU in jax 0.10 keeps a rematerialised stack of unrolled blocks' activations (it
  # schedules every recomputation early): remat alone lowers that step by 5%. jax 0.12's does
  # not; scanned, the step is lower on both, which is why the lever scans.
  cfg = experiments.get_config(
    "lm/shakespeare-char",
    {"model.num_layers": "6", "data.seq_len": "256", "train.batch_size": "4"},
  )
  assert not cfg.model.scan
  full = fit.candidates(cfg, {"data": 1})[1]
  assert full == {"model.remat": "full", "model.scan": True}
  base, scanned = needs(cfg), needs(fit.with_overrides(cfg, full))
  assert scanned < 0.5 * base, (base, scanned)
  # Blocks already scanned and rematerialised: no remat lever left.
  assert not [c for c in fit.levers(fit.with_overrides(cfg, full), {"data": 1, "fsdp": 1})
              if "model.scan" in c.overrides or "model.remat" in c.overrides]  # fmt: skip


def test_blocked_attention_candidate_compiles_and_lowers_the_step():
  cfg = smoke({"data.seq_len": "1024", "train.batch_size": "1"})
  blocked = fit.with_overrides(cfg, {"model.attention.impl": "blocked"})
  assert needs(blocked) < needs(cfg)


@pytest.mark.slow
def test_auto_equals_the_levers_set_by_hand_and_resumes_with_them(monkeypatch, tmp_path):
  budget, choice = expected_choice(smoke())
  assert choice is not None, "no candidate lowers the smoke step"
  monkeypatch.setenv(device_memory.BUDGET, str(budget))
  auto = tmp_path / "auto"
  trainer.train(smoke({"train.steps": "4"}), str(auto), progress=False)
  with open(auto / "config.json") as f:
    saved = json.load(f)
  assert saved["train"]["fitted"] == fit.format_fitted(choice)
  assert saved["train"]["fit"] == "auto"
  # Resumed on a machine with room for the step as configured: the recorded choice still holds.
  monkeypatch.delenv(device_memory.BUDGET)
  trainer.train(smoke(), str(auto), progress=False)
  with open(auto / "config.json") as f:
    assert json.load(f)["train"]["fitted"] == fit.format_fitted(choice)

  by_hand = tmp_path / "hand"
  trainer.train(smoke({**{k: str(v) for k, v in choice.items()}, "train.fit": "off"}), str(by_hand),
                progress=False)  # fmt: skip
  assert losses(auto) == losses(by_hand)  # bit for bit, all six steps


@pytest.mark.slow
def test_off_refuses_naming_what_fits(monkeypatch, tmp_path):
  budget, choice = expected_choice(smoke())
  monkeypatch.setenv(device_memory.BUDGET, str(budget))
  with pytest.raises(UserError) as e:
    trainer.train(smoke({"train.fit": "off"}), str(tmp_path / "off"), progress=False)
  message = str(e.value)
  assert "\n" not in message and "train step does not fit" in message
  assert " ".join(f"--config.{k}={v}" for k, v in choice.items()) + " (train.fit=auto" in message
  assert not (tmp_path / "off").exists()


@pytest.mark.slow
def test_eval_step_refused(monkeypatch, tmp_path, capsys):
  workdir = tmp_path / "run"
  trainer.train(smoke({"train.steps": "2"}), str(workdir), progress=False)
  monkeypatch.setenv(device_memory.BUDGET, "1KiB")
  code = cli.main(["eval", SMOKE, "--workdir", str(workdir), *[f"--config.{k}={v}" for k, v in
                   {**BASE, "train.steps": "2"}.items()]])  # fmt: skip
  err = capsys.readouterr().err.strip()
  assert code == 2 and len(err.splitlines()) == 1 and "eval step does not fit" in err, err


@pytest.mark.parametrize("cached", [True, False])
def test_sampler_program_refused(monkeypatch, tmp_path, cached):
  monkeypatch.setattr(programs, "_loaded", {})
  monkeypatch.setattr(programs, "directory", lambda: str(tmp_path) if cached else None)
  args = (jax.ShapeDtypeStruct((64, 64), jnp.float32),)
  program = programs.load("square", lambda x: x @ x, args, static="square")
  assert float(program(jnp.ones((64, 64)))[0, 0]) == 64.0  # fits: runs
  monkeypatch.setattr(programs, "_loaded", {})
  monkeypatch.setenv(device_memory.BUDGET, "1KiB")
  with pytest.raises(UserError, match=r"^The square program does not fit: it needs 0.03 MiB"):
    programs.load("square", lambda x: x @ x, args, static="square")


def test_show_memory(monkeypatch, capsys):
  monkeypatch.setenv(device_memory.BUDGET, "64GiB")
  assert cli.main(["show", SMOKE, "--memory"]) == 0
  out = capsys.readouterr().out
  assert "# memory: the train step needs" in out and "has 64.00 GiB (NNX_ZOO_MEMORY_BUDGET)" in out
  assert "# memory: fits; train.fit changes nothing" in out
  monkeypatch.setenv(device_memory.BUDGET, "1KiB")
  pulled = ["--config.model.remat=full", "--config.model.scan=true", "--config.train.batch_size=1"]
  assert cli.main(["show", SMOKE, "--memory", *pulled]) == 0
  assert "# memory: DOES NOT FIT" in capsys.readouterr().out
