"""The repository's top-level folders, installed under one import root: `nnx_zoo.common`,
`nnx_zoo.zoo`, `nnx_zoo.experiments`, `nnx_zoo.kernels` (docs/DESIGN.md, "Import root").

The folders stay where the layout puts them; setuptools maps each to its name under the root.
Every subpackage is found by discovery (a hand-written list silently drops a new one from the
wheel while an editable install still imports it), and there is no `nnx_zoo/__init__.py`.
Everything else about the project is in pyproject.toml.
"""

from setuptools import find_namespace_packages, setup

ROOT = "nnx_zoo"
FOLDERS = ("common", "zoo", "experiments", "kernels")

packages, package_dir = [], {}
for folder in FOLDERS:
  package_dir[f"{ROOT}.{folder}"] = folder
  subpackages = find_namespace_packages(where=folder, exclude=["*__pycache__*"])
  packages += [f"{ROOT}.{folder}"] + [f"{ROOT}.{folder}.{p}" for p in subpackages]

setup(
  packages=packages,
  package_dir=package_dir,
  # Package data: each family's README.md travels with its code.
  package_data={f"{ROOT}.zoo": ["*/README.md"]},
)
