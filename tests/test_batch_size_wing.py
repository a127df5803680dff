"""The batch-size wing's shape (``jaxaccum/_batch_size/``), read from its source with ``ast``.

The wing sits below the API, its modules read no other module's private names (each reads
what another offers under a name without an underscore), the count ramp does not import the
controller, and no function is longer than 80 code lines.
"""

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "jaxaccum"
WING = sorted((PACKAGE / "_batch_size").glob("*.py"))
# Read by the wing under its private name until _sharding (the parallel wing's) offers it.
KNOWN_PRIVATE = {"jaxaccum._core._sharding.resolve_mesh"}
MAX_LINES = 80


def _is_module(dotted: str) -> bool:
  path = ROOT.joinpath(*dotted.split("."))
  return path.with_suffix(".py").exists() or (path / "__init__.py").exists()


def _name(path: pathlib.Path) -> str:
  return ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")


def _tree(path: pathlib.Path) -> ast.Module:
  return ast.parse(path.read_text())


def _imported_modules(tree: ast.Module) -> dict[str, str]:
  """``{local name: package module}`` of every jaxaccum module a file imports, and of the
  modules named by ``from m import x`` (as ``m``)."""
  out = {}
  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      out |= {a.asname or a.name: a.name for a in node.names if a.name.startswith("jaxaccum")}
    elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("jaxaccum"):
      assert node.module is not None
      out[f"<from {node.module}>"] = node.module
      for a in node.names:
        if _is_module(f"{node.module}.{a.name}"):
          out[a.asname or a.name] = f"{node.module}.{a.name}"
  return out


@pytest.mark.parametrize("path", WING, ids=lambda p: p.name)
def test_the_wing_sits_below_the_api(path):
  imported = set(_imported_modules(_tree(path)).values())
  above = {"jaxaccum._api", "jaxaccum.nnx", "jaxaccum.linen", "jaxaccum.eqx"}
  assert not imported & above, f"{path.name} imports {sorted(imported & above)}"


def test_the_count_ramp_does_not_import_the_controller():
  imported = set(_imported_modules(_tree(PACKAGE / "_batch_size" / "_ramp.py")).values())
  assert "jaxaccum._batch_size._adaptive" not in imported
  assert "jaxaccum._batch_size._counter" in imported  # it reads a state's counter there


@pytest.mark.parametrize("path", WING, ids=lambda p: p.name)
def test_no_module_of_the_wing_reads_another_modules_private_name(path):
  tree, me = _tree(path), _name(path)
  modules = _imported_modules(tree)
  found = set()
  for node in ast.walk(tree):
    if isinstance(node, ast.ImportFrom) and node.module in modules.values():
      found |= {f"{node.module}.{a.name}" for a in node.names
                if a.name.startswith("_") and not _is_module(f"{node.module}.{a.name}")
                and node.module != me}
    if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
        and node.value.id in modules and node.attr.startswith("_")
        and not node.attr.startswith("__")
        and not _is_module(f"{modules[node.value.id]}.{node.attr}")):
      found.add(f"{modules[node.value.id]}.{node.attr}")
  assert found <= KNOWN_PRIVATE, f"{me} reads {sorted(found - KNOWN_PRIVATE)}"


def _code_lines(fn: ast.FunctionDef | ast.AsyncFunctionDef, source: list[str]) -> int:
  """The body after the docstring, nested functions included, blank and comment lines not."""
  body = fn.body
  if (body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)
      and isinstance(body[0].value.value, str)):
    body = body[1:]
  lines = set()
  for stmt in body:
    for i in range(stmt.lineno, (stmt.end_lineno or stmt.lineno) + 1):
      text = source[i - 1].strip()
      if text and not text.startswith("#"):
        lines.add(i)
  return len(lines)


@pytest.mark.parametrize("path", WING, ids=lambda p: p.name)
def test_no_function_of_the_wing_is_over_80_lines(path):
  source = path.read_text().splitlines()
  long = {node.name: n for node in ast.walk(_tree(path))
          if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
          and (n := _code_lines(node, source)) > MAX_LINES}
  assert not long, f"{path.name}: {long} (code lines; at most {MAX_LINES})"
