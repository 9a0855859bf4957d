"""README, CONTRIBUTING and CI stay true to each other and to the tree."""

import pathlib
import re
import subprocess
import sys

import pytest

from nnx_zoo.common import cli
from nnx_zoo.experiments import REGISTRY

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def readme_commands() -> list[str]:
  return re.findall(r"```bash\n(python3 -m venv .*)\n```", README)


def test_readme_gives_the_two_commands():
  run, test = readme_commands()
  assert "zoo run lm/shakespeare-char" in run
  assert "pytest" in test


def test_ci_runs_readmes_test_command():
  _, test = readme_commands()
  after_activate = test.split("bin/activate && ", 1)[1]
  assert after_activate in (ROOT / ".ci" / "run").read_text()


def test_readme_names_every_experiment():
  for name in REGISTRY:
    assert f"`{name}`" in README or f"`{name}:" in README or name in README, name


def test_contributing_names_real_paths():
  text = (ROOT / "CONTRIBUTING.md").read_text()
  for path in re.findall(r"`((?:common|zoo|experiments|tests)/[\w./]+\.py)`", text):
    if "<" not in path:
      assert (ROOT / path).exists(), path
  assert "UPDATE_GOLDEN=1" in text and (ROOT / "tests" / "golden").is_dir()


@pytest.mark.slow
def test_readmes_python_example_runs_as_written(tmp_path):
  """README's Python block, run from a directory where the first command's run exists (a smoke
  run of the same experiment stands in for it), in a fresh interpreter without the working
  directory on sys.path: the imports are the installed nnx_zoo's."""
  (block,) = re.findall(r"```python\n(.*?)```", README, re.S)
  workdir = tmp_path / "runs" / "shakespeare"
  cli.main(["run", "lm/shakespeare-char:smoke", "--workdir", str(workdir), "--quiet"])
  check = "\nassert logits.shape == (1, 16, 256), logits.shape\nprint(type(model).__name__)\n"
  proc = subprocess.run(
    [sys.executable, "-P", "-c", block + check], cwd=tmp_path, capture_output=True, text=True
  )
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert proc.stdout.split() == ["Decoder"]
