"""Layering: lower packages never import upper ones (a static scan of every import).

evidence (records, logs, run directories) sits below scoring, which reads it; the model sits
below training, which trains it. An import in the wrong direction, even a lazy one inside a
function, fails here with the file and line.
"""

import ast
import pathlib

import pytest

LLA = pathlib.Path(__file__).resolve().parent.parent / "lla"
FORBIDDEN = {  # package -> packages it must not import
    "evidence": ("lla.scoring", "lla.attacks", "lla.study", "lla.train", "lla.model"),
    "model": ("lla.train", "lla.attacks", "lla.scoring", "lla.study"),
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
