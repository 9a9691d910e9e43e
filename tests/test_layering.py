"""Layering: lower packages never import upper ones, and no module imports itself back
(a static scan of every import).

evidence (records, logs, run directories) sits below scoring, which reads it and nothing of
the attacks, the replay or the study (a verdict is re-derived from a study's files); the model sits
below training, which trains it; attacks sit below the replay driver and the study that run
them. An import in the wrong direction, even a lazy one inside a function, fails here with
the file and line; so does a circle of imports between lla's modules.
"""

import ast
import pathlib

import pytest

LLA = pathlib.Path(__file__).resolve().parent.parent / "lla"
FORBIDDEN = {  # package -> packages it must not import
    "evidence": ("lla.scoring", "lla.attacks", "lla.study", "lla.train", "lla.model"),
    "model": ("lla.train", "lla.attacks", "lla.scoring", "lla.study"),
    "attacks": ("lla.replay", "lla.study", "lla.sweep"),
    # Scoring is re-derived from a study's files alone: the attack modules it reads are the
    # study's recorded threat space (lla.scoring.threat_space), never the live registry.
    "scoring": ("lla.attacks", "lla.replay", "lla.study"),
}


def imports(path: pathlib.Path) -> list[tuple[int, str]]:
  """(line, module) of every import statement in a file, at any depth."""
  out = []
  for node in ast.walk(ast.parse(path.read_text(), str(path))):
    if isinstance(node, ast.Import):
      out += [(node.lineno, alias.name) for alias in node.names]
    elif isinstance(node, ast.ImportFrom) and node.module:
      if node.level:  # relative: resolve against the file's package
        base = path.relative_to(LLA.parent).with_suffix("").parts[:-node.level]
        out.append((node.lineno, ".".join(base + (node.module,))))
      else:
        out += [(node.lineno, node.module)] + [(node.lineno, f"{node.module}.{a.name}")
                                                for a in node.names]
  return out


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_lower_layers_import_nothing_above_them(package):
  files = sorted((LLA / package).rglob("*.py"))
  assert files, f"no sources under lla/{package}"
  bad = [f"{path.relative_to(LLA.parent)}:{line} imports {module}"
         for path in files for line, module in imports(path)
         if any(module == f or module.startswith(f + ".") for f in FORBIDDEN[package])]
  assert not bad, bad


def test_the_scan_sees_lazy_and_from_imports(tmp_path):
  source = tmp_path / "m.py"
  source.write_text("def f():\n  from lla.scoring import records\n  import lla.train.loop\n")
  assert [m for _, m in imports(source)] == ["lla.scoring", "lla.scoring.records",
                                            "lla.train.loop"]


def module_name(path: pathlib.Path) -> str:
  parts = path.relative_to(LLA.parent).with_suffix("").parts
  return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(root: pathlib.Path = LLA) -> dict[str, set[str]]:
  """lla module -> the lla modules it imports. `from package import name` imports the
  submodule when `name` is one, else the package; parent packages are not edges (every
  import of a submodule runs them), so re-exports in an __init__ make no circle."""
  paths = {module_name(p): p for p in sorted(root.rglob("*.py"))}
  graph = {}
  for name, path in paths.items():
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    edges = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
      if isinstance(node, ast.Import):
        edges |= {a.name for a in node.names if a.name in paths}
      elif isinstance(node, ast.ImportFrom):
        base = node.module or ""
        if node.level:
          parts = package.split(".")[:len(package.split(".")) - node.level + 1]
          base = ".".join(parts + ([base] if base else []))
        for alias in node.names:
          target = f"{base}.{alias.name}"
          edges.add(target if target in paths else base)
    graph[name] = {e for e in edges if e in paths and e != name}
  return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
  """The strongly connected components of more than one module (Tarjan), each sorted."""
  index, low, stack, on_stack, found = {}, {}, [], set(), []

  def visit(v):
    index[v] = low[v] = len(index)
    stack.append(v)
    on_stack.add(v)
    for w in sorted(graph[v]):
      if w not in index:
        visit(w)
        low[v] = min(low[v], low[w])
      elif w in on_stack:
        low[v] = min(low[v], index[w])
    if low[v] == index[v]:
      component = []
      while True:
        w = stack.pop()
        on_stack.discard(w)
        component.append(w)
        if w == v:
          break
      if len(component) > 1:
        found.append(sorted(component))

  for v in sorted(graph):
    if v not in index:
      visit(v)
  return sorted(found)


def test_no_import_cycles_in_lla():
  assert cycles(import_graph()) == []


def test_the_cycle_scan_finds_lazy_circles(tmp_path):
  pkg = tmp_path / "lla"
  (pkg / "sub").mkdir(parents=True)
  (pkg / "__init__.py").write_text("")
  (pkg / "sub" / "__init__.py").write_text("")
  (pkg / "sub" / "a.py").write_text("from lla.sub import b\n")
  (pkg / "sub" / "b.py").write_text("def f():\n  from lla.sub import c\n")
  (pkg / "sub" / "c.py").write_text("import lla.sub.a\n")
  (pkg / "d.py").write_text("from lla.sub import a\n")
  global LLA
  saved, LLA = LLA, pkg
  try:
    graph = import_graph(pkg)
  finally:
    LLA = saved
  assert graph["lla.d"] == {"lla.sub.a"}
  assert cycles(graph) == [["lla.sub.a", "lla.sub.b", "lla.sub.c"]]


def reachable(graph: dict[str, set[str]], start: str) -> dict[str, list[str]]:
  """Module -> the import chain from `start` to it, for every lla module importing `start`
  runs: what it imports, transitively, and the packages above each (an import of a.b.c
  runs a/__init__ and a/b/__init__ first)."""
  chains, todo = {start: [start]}, [start]
  while todo:
    module = todo.pop()
    parts = module.split(".")
    for target in sorted(graph.get(module, set()) |
                         {".".join(parts[:i]) for i in range(1, len(parts))}):
      if target in graph and target not in chains:
        chains[target] = chains[module] + [target]
        todo.append(target)
  return chains


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_lower_layers_reach_nothing_above_them_transitively(package):
  """Through any chain of imports (a lower module importing a middle one that imports an
  upper one), never only directly."""
  graph = import_graph()
  bad = []
  for name in sorted(m for m in graph if m == f"lla.{package}" or
                     m.startswith(f"lla.{package}.")):
    for target, chain in sorted(reachable(graph, name).items()):
      if any(target == f or target.startswith(f + ".") for f in FORBIDDEN[package]):
        bad.append(" -> ".join(chain))
  assert not bad, bad[:20]


def test_the_transitive_scan_finds_an_indirect_import(tmp_path):
  graph = {"lla": set(), "lla.scoring": set(), "lla.scoring.a": {"lla.evidence.b"},
           "lla.evidence": set(), "lla.evidence.b": {"lla.attacks.c"}, "lla.attacks": set(),
           "lla.attacks.c": set()}
  chains = reachable(graph, "lla.scoring.a")
  assert chains["lla.attacks.c"] == ["lla.scoring.a", "lla.evidence.b", "lla.attacks.c"]
  assert set(chains) == set(graph)  # the packages above each module run too
