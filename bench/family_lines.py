"""How many lines each family is, and how many it needs outside its own folder, from git.

python bench/family_lines.py

A family is zoo/<family>/ (presets, config, HF key map, README), its tests (tests/zoo/<family>/)
and the experiments that build it (with their golden configs and registry lines). "Outside" is
every line of common/ or kernels/ that names the family's module or compares a config's family
with it: the special cases the design forbids (the target is 0). Counts are of files tracked
by git at HEAD.
"""

import pathlib
import re
import subprocess

ROOT = pathlib.Path(__file__).resolve().parents[1]


def tracked(*patterns: str) -> list[str]:
  out = subprocess.run(["git", "ls-files", *patterns], cwd=ROOT, capture_output=True, text=True)
  return [line for line in out.stdout.splitlines() if line]


def lines(paths) -> int:
  return sum(len((ROOT / p).read_text().splitlines()) for p in paths)


def main():
  families = sorted(p.parent.name for p in (ROOT / "zoo").glob("*/model.py"))
  shared = [p for p in tracked("common", "kernels") if p.endswith(".py")]
  print("| family | zoo/<family> | tests | experiments (+ goldens) | outside (common/, kernels/) |")
  print("|---|---|---|---|---|")
  for family in families:
    own = tracked(f"zoo/{family}")
    tests = tracked(f"tests/zoo/{family}")
    exps = [
      p
      for p in tracked("experiments")
      if p.endswith(".py") and f"zoo.{family}" in (ROOT / p).read_text()
    ]
    goldens = [
      p for p in tracked("tests/golden") if f"model.family: '{family}'" in (ROOT / p).read_text()
    ]
    special = re.compile(rf"zoo[./]{family}\b|family\s*==\s*['\"]{family}['\"]")
    outside = sum(
      1 for p in shared for line in (ROOT / p).read_text().splitlines() if special.search(line)
    )
    print(
      f"| {family} | {lines(own)} | {lines(tests)} | {lines(exps)} in {len(exps)} files "
      f"(+ {lines(goldens)}) | {outside} |"
    )


if __name__ == "__main__":
  main()
