"""The import order of docs/DESIGN.md ("Layers"): every import of common/, zoo/, kernels/ and
experiments/, the ones inside functions included, points down the layers; and no module imports
itself round a cycle. Read from the source (ast), so an import that only runs on some path counts
as much as one that runs at start-up."""

import ast
import collections
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[2]

# Bottom to top, as docs/DESIGN.md lists them. A node is a module of common/ (`mesh`), a package
# of common/ (`nn`: all its modules), or one of the other trees (`zoo/`, `kernels/`,
# `experiments/`: the experiment files). A node imports only from the layers below its own.
LAYERS = (
  ("errors", "kernels/"),
  ("files", "config", "step_context", "distributed", "attention_impl", "device_memory"),
  ("mesh", "programs"),
  ("parallel",),
  ("nn",),
  ("keymap",),
  ("zoo/",),
  ("models", "modifiers"),
  ("engine",),
  ("hub",),
  ("data",),
  ("tasks",),
  ("train",),
  ("experiments/",),
  ("experiments", "report", "lm_eval", "supervisor"),
  ("plan", "serve"),
  ("cli",),
)
RANK = {node: rank for rank, layer in enumerate(LAYERS) for node in layer}
TREES = {"zoo": "zoo/", "kernels": "kernels/", "experiments": "experiments/"}


def node_of_module(dotted: str) -> str | None:
  """The node of a module or attribute under nnx_zoo (`nnx_zoo.common.nn.attention` -> nn)."""
  parts = dotted.split(".")
  if parts[0] != "nnx_zoo" or len(parts) < 2:
    return None
  if parts[1] in TREES:
    return TREES[parts[1]]
  if parts[1] == "common" and len(parts) > 2:
    return parts[2]
  return None


def node_of_file(path: pathlib.Path) -> str:
  rel = path.relative_to(ROOT)
  if rel.parts[0] in TREES:
    return TREES[rel.parts[0]]
  return rel.parts[1].removesuffix(".py")  # common/<module>.py or common/<package>/...


def imports(path: pathlib.Path, source: str | None = None) -> list[tuple[int, str]]:
  """(line, module or module.attribute) of every import in the file, at any depth."""
  rel = path.relative_to(ROOT).with_suffix("")
  package = ["nnx_zoo", *rel.parts[: -1 if path.name != "__init__.py" else -1]]
  out = []
  source = path.read_text() if source is None else source
  for node in ast.walk(ast.parse(source, str(path))):
    if isinstance(node, ast.Import):
      out += [(node.lineno, alias.name) for alias in node.names]
    elif isinstance(node, ast.ImportFrom):
      base = node.module or ""
      if node.level:  # relative: from the file's package, up level - 1
        up = package[: len(package) - (node.level - 1)]
        base = ".".join(up + ([node.module] if node.module else []))
      out += [(node.lineno, f"{base}.{alias.name}") for alias in node.names]
  return out


def sources() -> list[pathlib.Path]:
  return sorted(p for tree in ("common", *TREES) for p in (ROOT / tree).rglob("*.py"))


def test_every_import_points_down_the_layers():
  unknown, upward = set(), []
  for path in sources():
    src = node_of_file(path)
    if src not in RANK:
      unknown.add(f"{src} ({path.relative_to(ROOT)})")
      continue
    for line, name in imports(path):
      dst = node_of_module(name)
      if dst is None or dst == src:
        continue
      if dst not in RANK:
        unknown.add(f"{dst} (imported by {path.relative_to(ROOT)}:{line})")
      elif RANK[dst] >= RANK[src]:
        upward.append(
          f"{path.relative_to(ROOT)}:{line}: {src} -> {dst} ({name}); {dst} is in layer "
          f"{RANK[dst]}, {src} in layer {RANK[src]}"
        )
  assert not unknown, f"parts with no place in LAYERS (docs/DESIGN.md): {sorted(unknown)}"
  assert not upward, "imports that point up the layers of docs/DESIGN.md:\n  " + "\n  ".join(upward)


def test_no_module_imports_itself_round_a_cycle():
  modules = {}
  for path in sources():
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    modules[".".join(["nnx_zoo", *(parts[:-1] if parts[-1] == "__init__" else parts)])] = path

  def module_of(name: str) -> str | None:
    while name and name not in modules:
      name = name.rpartition(".")[0]
    return name or None

  graph = collections.defaultdict(set)
  for module, path in modules.items():
    for _, name in imports(path):
      target = module_of(name)
      if target and target != module:
        graph[module].add(target)

  # Tarjan's strongly connected components, iteratively: a component of two or more is a cycle.
  index, low, stack, on_stack, cycles = {}, {}, [], set(), []
  for root in modules:
    if root in index:
      continue
    work = [(root, iter(sorted(graph[root])))]
    index[root] = low[root] = len(index)
    stack.append(root)
    on_stack.add(root)
    while work:
      v, children = work[-1]
      w = next(children, None)
      if w is not None:
        if w not in index:
          index[w] = low[w] = len(index)
          stack.append(w)
          on_stack.add(w)
          work.append((w, iter(sorted(graph[w]))))
        elif w in on_stack:
          low[v] = min(low[v], index[w])
        continue
      work.pop()
      if work:
        low[work[-1][0]] = min(low[work[-1][0]], low[v])
      if low[v] == index[v]:
        component = []
        while True:
          w = stack.pop()
          on_stack.discard(w)
          component.append(w)
          if w == v:
            break
        if len(component) > 1:
          cycles.append(sorted(component))
  assert not cycles, f"modules that import each other round a cycle: {cycles}"


def test_the_checks_see_an_upward_import():
  """The reader finds imports inside functions and relative ones (what the tests above rely on)."""
  source = "def f():\n  from nnx_zoo.common.train import trainer\n  from ..hub import weights\n"
  found = imports(ROOT / "common" / "nn" / "probe.py", source)
  assert found == [(2, "nnx_zoo.common.train.trainer"), (3, "nnx_zoo.common.hub.weights")]
  assert [node_of_module(n) for _, n in found] == ["train", "hub"]
  assert RANK["train"] > RANK["nn"] and RANK["hub"] > RANK["nn"]
