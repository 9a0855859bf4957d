"""The zoo installs and imports under one root, `nnx_zoo` (docs/DESIGN.md, "Import root").

setup.py maps the repository's folders (common/, zoo/, experiments/, kernels/) to
`nnx_zoo.common`, ...; no plain folder name is the zoo's to import. So Hugging Face's `kernels`
distribution (imported by transformers >= 5.25) and a user's own `common` module meet nothing of
ours, installed or run from the repository root: kernels/, common/ and zoo/ have no
`__init__.py`, and a regular package anywhere on sys.path wins over a folder without one.
"""

import importlib.metadata
import importlib.util
import json
import os
import pathlib
import subprocess
import sys
import zipfile

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
FOLDERS = ("common", "zoo", "experiments", "kernels")

# Where each plain name is found by a fresh interpreter (None: nowhere).
FIND = """
import importlib.util, json
specs = {n: importlib.util.find_spec(n) for n in ("common", "zoo", "experiments", "kernels")}
print(json.dumps({n: s and [s.origin, list(s.submodule_search_locations or [])]
                  for n, s in specs.items()}))
"""


def python(*args, cwd) -> subprocess.CompletedProcess:
  return subprocess.run(
    [sys.executable, *args], cwd=cwd, capture_output=True, text=True, check=True, timeout=300
  )


def in_repository(path: str) -> bool:
  """Is `path` a file or folder of this repository's tree? A virtual environment made inside
  the checkout (README's `python3 -m venv .venv`) is not: what it installs is not ours."""
  path = pathlib.Path(path).resolve()
  return path.is_relative_to(ROOT) and not path.is_relative_to(pathlib.Path(sys.prefix).resolve())


def ours(found) -> bool:
  """Is a find_spec result (origin, search locations) a file or folder of this repository?"""
  origin, locations = found
  return any(in_repository(p) for p in [origin or "/", *locations])


def test_the_wheel_holds_every_module_under_nnx_zoo_and_nothing_else(tmp_path):
  """`pip install .` installs what the tree has, each file under its nnx_zoo.* name: a
  subpackage that setup.py's discovery missed would import in an editable install and be absent
  from the wheel."""
  python("-m", "pip", "wheel", "--no-deps", "-q", "-w", str(tmp_path), str(ROOT), cwd=tmp_path)
  (wheel,) = tmp_path.glob("nnx_zoo-*.whl")
  names = zipfile.ZipFile(wheel).namelist()
  assert {n.split("/")[0] for n in names} == {"nnx_zoo", wheel.name.split("-py")[0] + ".dist-info"}
  expected = {
    "nnx_zoo/" + p.relative_to(ROOT).as_posix()
    for folder in FOLDERS
    for p in (ROOT / folder).rglob("*")
    if p.suffix == ".py" or p.name == "README.md"
    if "__pycache__" not in p.parts
  }
  assert {n for n in names if n.startswith("nnx_zoo/")} == expected


def test_the_installed_distribution_names_only_nnx_zoo():
  try:
    importlib.metadata.distribution("nnx-zoo")
  except importlib.metadata.PackageNotFoundError:
    pytest.skip("nnx-zoo is not installed (pip install -e .)")
  owned = {
    n for n, dists in importlib.metadata.packages_distributions().items() if "nnx-zoo" in dists
  }
  assert owned == {"nnx_zoo"}
  for folder in FOLDERS:
    spec = importlib.util.find_spec(f"nnx_zoo.{folder}")
    assert [pathlib.Path(p).resolve() for p in spec.submodule_search_locations][0] == ROOT / folder


def test_the_plain_folder_names_are_not_the_zoos(tmp_path):
  """Outside the repository (`-P`: no working directory on sys.path), `import common`, `zoo`,
  `experiments` and `kernels` find nothing of ours; from its root (the working directory first
  on sys.path, as `python -c` and `python -m` put it), `kernels` is Hugging Face's where that is
  installed, never our folder."""
  outside = json.loads(python("-P", "-c", FIND, cwd=tmp_path).stdout)
  assert not any(found and ours(found) for found in outside.values()), outside
  assert outside["common"] is None and outside["zoo"] is None and outside["experiments"] is None
  at_root = json.loads(python("-c", FIND, cwd=ROOT).stdout)
  if outside["kernels"] is not None:  # another distribution ships `kernels`: it wins
    assert at_root["kernels"] == outside["kernels"]
  else:  # our folder is a namespace portion at most, never a regular package
    assert at_root["kernels"] is None or at_root["kernels"][0] is None


def test_the_tests_import_the_zoo_as_installed():
  """pytest puts neither the repository root nor a test folder on sys.path (importlib import
  mode): a test that passed only because the working tree shadowed an installed name would hide
  exactly the clash this file guards against."""
  for entry in sys.path:
    path = pathlib.Path(entry or os.getcwd()).resolve()
    assert path != ROOT and not path.is_relative_to(ROOT / "tests"), entry
  assert importlib.util.find_spec("common") is None
  assert importlib.util.find_spec("zoo") is None


def test_transformers_imports_beside_the_zoo_from_its_root():
  """transformers >= 5.25 imports Hugging Face's `kernels` (`from kernels import
  CUDAProperties`), which failed beside the zoo when ours was a top-level `kernels`."""
  if importlib.util.find_spec("transformers") is None or importlib.util.find_spec("torch") is None:
    pytest.skip("needs transformers and torch (the test extra)")
  code = (
    "import importlib.util, transformers\n"
    "from transformers import LlamaForCausalLM\n"
    "spec = importlib.util.find_spec('kernels')\n"
    "print(transformers.__version__, spec and spec.origin)"
  )
  version, origin = python("-c", code, cwd=ROOT).stdout.split()
  if tuple(int(v) for v in version.split(".")[:2]) >= (5, 25):
    assert importlib.metadata.distribution("kernels")  # the dependency that clashed
    assert not in_repository(origin), origin
