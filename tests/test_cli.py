"""The `zoo` command line (docs/DESIGN.md's contract): list, show, run, eval, generate, and user
errors as one clean line on stderr with exit code 2."""

import json
import os
import pathlib
import re
import shutil
import subprocess
import sys

import pytest

from nnx_zoo.common import cli, experiments, models
from nnx_zoo.experiments import REGISTRY

ROOT = pathlib.Path(__file__).resolve().parents[1]
SMOKE = "lm/shakespeare-char:smoke"


def zoo(capsys, *argv) -> tuple[int, str, str]:
  """Runs `zoo ARGV` in this process: (exit code, stdout, stderr)."""
  capsys.readouterr()  # drop what came before
  code = cli.main([str(a) for a in argv])
  out, err = capsys.readouterr()
  return code, out, err


def zoo_script(*argv, cwd) -> subprocess.CompletedProcess:
  """Runs the installed `zoo` console script."""
  script = shutil.which("zoo", path=os.path.dirname(sys.executable)) or shutil.which("zoo")
  assert script, "the `zoo` console script is not installed"
  return subprocess.run(
    [script, *map(str, argv)], cwd=cwd, capture_output=True, text=True, timeout=120
  )


def assert_user_error(code: int, err: str, *culprits: str):
  assert code == 2, f"exit code {code}, stderr: {err}"
  assert err.startswith("zoo: error:"), err
  assert "Traceback" not in err, err
  for culprit in culprits:
    assert culprit in err, f"{culprit!r} not named in: {err}"


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
  """One smoke run of lm/shakespeare-char, shared by the tests that need a trained workdir."""
  path = tmp_path_factory.mktemp("smoke") / "run"
  assert cli.main(["run", SMOKE, "--workdir", str(path), "--quiet"]) == 0
  return path


# zoo list, zoo show


def test_list(capsys):
  code, out, err = zoo(capsys, "list")
  assert code == 0 and not err
  lines = out.splitlines()
  assert len(lines) == len(REGISTRY)
  for name, line in zip(REGISTRY, lines, strict=True):
    description = experiments.describe(name)
    assert description
    assert re.fullmatch(rf"{re.escape(name)}\s+{re.escape(description)}", line), line


def test_list_console_script(tmp_path):
  result = zoo_script("list", cwd=tmp_path)
  assert result.returncode == 0, result.stderr
  for name in REGISTRY:
    assert f"{name} " in result.stdout


def test_show(capsys):
  code, out, err = zoo(capsys, "show", "lm/shakespeare-char")
  assert code == 0 and not err
  cfg = experiments.get_config("lm/shakespeare-char")
  assert "experiment: lm/shakespeare-char" in out
  assert f"steps: {cfg.train.steps}" in out
  m = re.search(r"^# parameters: ([\d,]+)", out, re.M)
  assert m, out
  assert int(m.group(1).replace(",", "")) == models.num_params(cfg.model)


def test_show_resolves_attention_auto_for_the_hardware(capsys):
  """`zoo show` prints what attention.impl="auto" runs on the hardware of the mesh rule (the
  platform the step compiles for), as the layer resolves it
  (common/attention_impl.resolve_auto)."""
  shown = {}
  # The smoke form has no mesh rules (the TPU rules set impl=flash themselves) and fp32 compute.
  overrides = ("--config.model.dtype=bfloat16", "--config.data.seq_len=64")
  for hw in ("cpux1", "gpu-nvidia-h100-80gb-hbm3x8", "tpu-v5x64"):
    code, out, _ = zoo(capsys, "show", "lm/llama3-8b:smoke", "--mesh-rule", hw, *overrides)
    assert code == 0
    assert "impl: auto" in out
    shown[hw] = re.search(r"^# attention.impl: auto -> (\w+) ", out, re.M).group(1)
  assert shown == {"cpux1": "xla", "gpu-nvidia-h100-80gb-hbm3x8": "cudnn", "tpu-v5x64": "flash"}
  code, out, _ = zoo(capsys, "show", SMOKE, "--config.model.attention.impl=xla")
  assert code == 0 and "# attention.impl" not in out  # nothing to resolve


def test_show_with_overrides(capsys):
  code, out, _ = zoo(
    capsys, "show", SMOKE, "--config.train.steps=123", "--config.model.num_layers", "3"
  )
  assert code == 0
  assert "steps: 123" in out and "num_layers: 3" in out
  cfg = experiments.get_config(SMOKE, {"model.num_layers": "3"})
  m = re.search(r"^# parameters: ([\d,]+)", out, re.M)
  assert int(m.group(1).replace(",", "")) == models.num_params(cfg.model)


def test_show_experiment_file(capsys, tmp_path):
  """Copy-edit an experiment file, then show it by path (docs/DESIGN.md, use 3)."""
  src = (ROOT / "experiments" / "lm" / "shakespeare_char.py").read_text()
  default_steps = experiments.get_config("lm/shakespeare-char").train.steps
  assert f"steps={default_steps}," in src
  path = tmp_path / "mine.py"
  path.write_text(src.replace(f"steps={default_steps},", "steps=1234,"))
  code, out, _ = zoo(capsys, "show", path)
  assert code == 0
  assert "steps: 1234" in out and f"experiment: {path}" in out
  code, out, _ = zoo(capsys, "show", f"{path}:smoke")
  assert code == 0
  assert "steps: 4" in out


# User errors: exit code 2, one clean message naming the culprit, no traceback


def test_unknown_experiment(capsys):
  code, _, err = zoo(capsys, "show", "lm/shakespeare-chr")
  assert_user_error(code, err, "lm/shakespeare-chr", "Did you mean: lm/shakespeare-char")


def test_unknown_experiment_console_script(tmp_path):
  result = zoo_script("show", "lm/shakespeare-chr", cwd=tmp_path)
  assert_user_error(result.returncode, result.stderr, "Did you mean: lm/shakespeare-char")
  assert not result.stdout


def test_unknown_config_key(capsys):
  code, _, err = zoo(capsys, "show", SMOKE, "--config.train.step=3")
  assert_user_error(code, err, "'train.step'", "Did you mean: train.steps")


def test_wrong_type(capsys):
  code, _, err = zoo(capsys, "show", SMOKE, "--config.train.steps=many")
  assert_user_error(code, err, "train.steps", "int", "'many'")


def test_group_key(capsys):
  code, _, err = zoo(capsys, "show", SMOKE, "--config.train=3")
  assert_user_error(code, err, "--config.train ", "group")


def test_override_without_value(capsys):
  code, _, err = zoo(capsys, "show", SMOKE, "--config.seed")
  assert_user_error(code, err, "--config.seed")


def test_list_takes_no_overrides(capsys):
  code, _, err = zoo(capsys, "list", "--config.seed=1")
  assert_user_error(code, err, "zoo list")


def test_missing_experiment_file(capsys, tmp_path):
  path = tmp_path / "nothere.py"
  code, _, err = zoo(capsys, "show", f"{path}:smoke")
  assert_user_error(code, err, str(path), "does not exist")


def test_experiment_file_without_get_config(capsys, tmp_path):
  path = tmp_path / "empty.py"
  path.write_text('"""Nothing here."""\n')
  code, _, err = zoo(capsys, "show", path)
  assert_user_error(code, err, str(path), "get_config")


def test_init_from_missing(capsys, tmp_path):
  run = ["run", SMOKE, "--workdir", tmp_path / "run", "--quiet"]
  code, _, err = zoo(capsys, *run, "--config.init_from=/does/not/exist")
  assert_user_error(code, err, "/does/not/exist")


def test_eval_without_checkpoints(capsys, tmp_path):
  code, _, err = zoo(capsys, "eval", SMOKE, "--workdir", tmp_path)
  assert_user_error(code, err, str(tmp_path), "checkpoints")


def test_generate_without_run(capsys, tmp_path):
  code, _, err = zoo(capsys, "generate", "--workdir", tmp_path, "--prompt", "ROMEO:")
  assert_user_error(code, err, str(tmp_path), "config.json")


# Commands on a trained workdir


@pytest.mark.slow
def test_run_writes_the_workdir(workdir):
  assert (workdir / "config.json").exists()
  with open(workdir / "metrics.jsonl") as f:
    records = [json.loads(line) for line in f]
  assert any("tokens_per_s" in r for r in records)
  assert any(r.get("split") == "eval" for r in records)
  assert any(p.isdigit() for p in os.listdir(workdir / "checkpoints"))


@pytest.mark.slow
def test_workdir_of_a_different_model(capsys, workdir):
  before = (workdir / "config.json").read_text()
  code, _, err = zoo(capsys, "run", SMOKE, "--workdir", workdir, "--quiet", "--config.model.dim=32")
  assert_user_error(code, err, str(workdir), "model.dim", "64 -> 32")
  assert (workdir / "config.json").read_text() == before


@pytest.mark.slow
def test_eval_of_a_different_model(capsys, workdir):
  """`zoo eval` of the full experiment on a smoke run's workdir (a `:smoke` forgotten)."""
  code, _, err = zoo(capsys, "eval", "lm/shakespeare-char", "--workdir", workdir)
  assert_user_error(code, err, str(workdir), "model.dim: 64 -> 256")


@pytest.mark.slow
def test_generate(capsys, workdir):
  argv = ["generate", "--workdir", workdir, "--prompt", "ROMEO:", "--max-new-tokens", 16]
  code, out, err = zoo(capsys, *argv)
  assert code == 0, err
  assert out.startswith("ROMEO:")
  assert len(out) > len("ROMEO:\n")


@pytest.mark.slow
def test_eval(capsys, workdir):
  metrics = workdir / "metrics.jsonl"
  lines_before = metrics.read_text().splitlines()
  code, out, err = zoo(capsys, "eval", SMOKE, "--workdir", workdir)
  assert code == 0, err
  result = json.loads(out.strip().splitlines()[-1])
  cfg = experiments.get_config(SMOKE)
  assert result["split"] == "eval" and result["step"] == cfg.train.steps
  assert result["loss"] > 0
  lines_after = metrics.read_text().splitlines()
  assert lines_after[: len(lines_before)] == lines_before
  (added,) = lines_after[len(lines_before) :]
  assert json.loads(added) == result


# zoo generate --audio (a speech model's transcript)

SPEECH = "speech/spoken-digits:smoke"


def write_config(path, exp: str):
  path.mkdir(parents=True, exist_ok=True)
  (path / "config.json").write_text(experiments.get_config(exp).to_json())


def test_generate_audio_refusals(capsys, tmp_path):
  """--audio on a language model, --prompt on a speech model, both at once, and --language
  where no prompt has one (a language model, a speech experiment's own run)."""
  write_config(tmp_path / "lm", SMOKE)
  write_config(tmp_path / "speech", SPEECH)
  code, _, err = zoo(capsys, "generate", "--workdir", tmp_path / "lm", "--audio", "a.wav")
  assert_user_error(code, err, "--audio needs a speech model", "--prompt")
  code, _, err = zoo(capsys, "generate", "--workdir", tmp_path / "speech", "--prompt", "hi")
  assert_user_error(code, err, "speech model", "--audio FILE.wav")
  code, _, err = zoo(capsys, "generate", "--workdir", tmp_path, "--prompt", "a", "--audio", "a")
  assert code == 2 and "not allowed with argument" in err
  code, _, err = zoo(
    capsys, "generate", "--workdir", tmp_path / "lm", "--prompt", "a", "--task", "x"
  )
  assert_user_error(code, err, "--language and --task", "--audio")
  code, _, err = zoo(
    capsys, "generate", "--workdir", tmp_path / "speech", "--audio", "a.wav", "--language", "de"
  )
  assert_user_error(code, err, "speech experiment's run", "no --language")


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("espeak-ng") is None, reason="espeak-ng is not installed")
def test_generate_audio_transcribes(capsys, tmp_path):
  """A smoke run's transcript of a WAV file: digit words (what this tiny model writes), at
  16 kHz or resampled from 22.05 kHz, and of a file longer than the model's window (heard
  window by window)."""
  import numpy as np

  from nnx_zoo.common.data import audio

  run = tmp_path / "run"
  assert cli.main(["run", SPEECH, "--workdir", str(run), "--quiet"]) == 0
  clip = 0.1 * np.sin(2 * np.pi * 300 * np.arange(8000) / 16_000)
  audio.write_wav(str(tmp_path / "a.wav"), clip)
  audio.write_wav(str(tmp_path / "b.wav"), clip[::2], sample_rate=8_000)
  for name in ("a.wav", "b.wav"):
    code, out, err = zoo(capsys, "generate", "--workdir", run, "--audio", tmp_path / name)
    assert code == 0, err
    assert set(out.split()) <= set(speech_words())
  audio.write_wav(str(tmp_path / "long.wav"), np.tile(clip, 5))  # 2.5 s, the window 1 s
  code, out, err = zoo(capsys, "generate", "--workdir", run, "--audio", tmp_path / "long.wav")
  assert code == 0, err
  assert set(out.split()) <= set(speech_words())


def speech_words():
  from nnx_zoo.common.data import speech

  return speech.WORDS


def test_compiled_programs_are_kept_under_the_zoos_cache(monkeypatch, tmp_path):
  """JAX's persistent compilation cache is on by default (a second `zoo chat` loads its programs),
  under the zoo's cache, unless $JAX_COMPILATION_CACHE_DIR names one; "off" keeps none."""
  import jax

  from nnx_zoo.common import cli

  before = jax.config.jax_compilation_cache_dir
  try:
    monkeypatch.setenv("NNX_ZOO_CACHE", str(tmp_path))
    monkeypatch.delenv("JAX_COMPILATION_CACHE_DIR", raising=False)
    monkeypatch.delenv(cli.COMPILATION_CACHE, raising=False)
    cli.start_jax("run")
    assert jax.config.jax_compilation_cache_dir == str(tmp_path / "jax")
    monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", str(tmp_path / "mine"))
    cli.start_jax("run")
    assert jax.config.jax_compilation_cache_dir == str(tmp_path / "mine")
    jax.config.update("jax_compilation_cache_dir", before)
    monkeypatch.setenv(cli.COMPILATION_CACHE, "off")
    cli.start_jax("run")
    assert jax.config.jax_compilation_cache_dir == before
  finally:
    jax.config.update("jax_compilation_cache_dir", before)
