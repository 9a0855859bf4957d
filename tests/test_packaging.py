"""The installed nnx-zoo owns its top-level import names alone.

transformers 5.25 began to depend on Hugging Face's `kernels` distribution, whose top-level
`kernels` package clashes with the zoo's kernels/ (transformers' `from kernels import
CUDAProperties` found ours); pyproject.toml keeps transformers below 5.25 for that. This test
fails as soon as any installed distribution ships a top-level name the zoo also ships.
"""

import importlib.metadata
import importlib.util
import pathlib
import tomllib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


def zoo_top_level_names() -> set[str]:
  """The packages at the top of this tree that pyproject.toml installs."""
  pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
  included = {p.rstrip("*") for p in pyproject["tool"]["setuptools"]["packages"]["find"]["include"]}
  return {p.name for p in ROOT.iterdir() if p.name in included and (p / "__init__.py").exists()}


def test_no_other_distribution_ships_our_top_level_packages():
  try:
    importlib.metadata.distribution("nnx-zoo")
  except importlib.metadata.PackageNotFoundError:
    pytest.skip("nnx-zoo is not installed (pip install -e .)")
  names = zoo_top_level_names()
  assert names == {"common", "zoo", "experiments", "kernels"}
  owners = importlib.metadata.packages_distributions()
  clashes = {n: sorted(set(owners.get(n, [])) - {"nnx-zoo"}) for n in names}
  assert not any(clashes.values()), (
    f"installed distributions also ship these top-level packages: {clashes}; rename ours"
  )
  for name in names:  # and the import system finds ours, wherever the tests run from
    origin = pathlib.Path(importlib.util.find_spec(name).origin).resolve()
    assert origin.is_relative_to(ROOT), (name, origin)
