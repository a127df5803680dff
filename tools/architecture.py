"""The package's shape, read from its source: what ``tests/test_architecture.py`` holds to.

Run ``python tools/architecture.py`` for the report: the keyword options of the main
entry points, the longest functions and modules, the uses of another module's private names,
the import floors (each module imports only modules on lower floors) and who imports the
ghost analysis. Everything is read with :mod:`ast`; nothing is imported.
"""

from __future__ import annotations

import ast
import dataclasses
import pathlib
import re
import sys
from collections.abc import Iterator

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "jaxaccum"


@dataclasses.dataclass(frozen=True)
class Module:
  name: str  # dotted, e.g. "jaxaccum._core._transform"
  path: pathlib.Path
  tree: ast.Module

  @property
  def is_package(self) -> bool:
    return self.path.name == "__init__.py"


def modules(package: pathlib.Path = PACKAGE) -> dict[str, Module]:
  """Every module of the package, by dotted name."""
  found = {}
  for path in sorted(package.rglob("*.py")):
    parts = list(path.relative_to(package.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
      parts = parts[:-1]
    found[".".join(parts)] = Module(".".join(parts), path, ast.parse(path.read_text()))
  return found


def _absolute(mod: Module, node: ast.ImportFrom) -> str:
  if not node.level:
    return node.module or ""
  base = mod.name.split(".")
  if not mod.is_package:
    base = base[:-1]
  base = base[:len(base) - node.level + 1]
  return ".".join(base + ([node.module] if node.module else []))


def _runtime_nodes(tree: ast.AST) -> Iterator[ast.AST]:
  """Every node of ``tree`` but those under ``if TYPE_CHECKING:`` (imports for annotations
  only, which never run)."""
  for node in ast.iter_child_nodes(tree):
    if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
      for other in node.orelse:
        yield other
        yield from _runtime_nodes(other)
      continue
    yield node
    yield from _runtime_nodes(node)


def imports(mod: Module, names: dict[str, Module]) -> set[str]:
  """The package modules that ``mod`` imports when it runs (``from x import y`` counts
  ``x.y`` when that is a module, else ``x``); imports for annotations only do not count."""
  out = set()
  for node in _runtime_nodes(mod.tree):
    if isinstance(node, ast.Import):
      out |= {a.name for a in node.names if a.name in names}
    elif isinstance(node, ast.ImportFrom):
      source = _absolute(mod, node)
      for a in node.names:
        full = f"{source}.{a.name}"
        if full in names:
          out.add(full)
        elif source in names:
          out.add(source)
  out.discard(mod.name)
  return out


def hidden_imports(mods: dict[str, Module]) -> list[str]:
  """``module:line`` of each import of the package that is not at a module's top level: one
  inside a function, or under ``if TYPE_CHECKING:`` (an edge the import graph does not
  show, which can close a circle)."""
  found = []

  def visit(mod: Module, node: ast.AST, hidden: bool) -> None:
    for child in ast.iter_child_nodes(node):
      inner = hidden or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)) or (
          isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test))
      if inner and isinstance(child, ast.Import) and any(
          a.name.split(".")[0] == "jaxaccum" for a in child.names):
        found.append(f"{mod.name}:{child.lineno}")
      elif inner and isinstance(child, ast.ImportFrom) and (
          child.level or _absolute(mod, child).split(".")[0] == "jaxaccum"):
        found.append(f"{mod.name}:{child.lineno}")
      visit(mod, child, inner)

  for mod in mods.values():
    visit(mod, mod.tree, False)
  return found


def private_uses(mod: Module, names: dict[str, Module]) -> list[str]:
  """Where ``mod`` reads another module's private name: ``from x import _y`` (``_y`` not a
  module) or ``x._y`` with ``x`` an imported package module."""
  aliases, found = {}, []
  for node in ast.walk(mod.tree):
    if isinstance(node, ast.ImportFrom):
      source = _absolute(mod, node)
      for a in node.names:
        full = f"{source}.{a.name}"
        if full in names:
          aliases[a.asname or a.name] = full
        elif source in names and a.name.startswith("_") and source != mod.name:
          found.append(f"{mod.name}:{node.lineno} {source}.{a.name}")
    elif isinstance(node, ast.Import):
      for a in node.names:
        if a.name in names and a.asname:
          aliases[a.asname] = a.name
  for node in ast.walk(mod.tree):
    if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
        and node.value.id in aliases and node.attr.startswith("_")
        and not node.attr.startswith("__") and f"{aliases[node.value.id]}.{node.attr}"
        not in names):
      found.append(f"{mod.name}:{node.lineno} {aliases[node.value.id]}.{node.attr}")
  return found


def _body_lines(fn: ast.FunctionDef | ast.AsyncFunctionDef, source: list[str]) -> int:
  """The code lines of ``fn``'s body, counted plainly: every line from the end of its
  docstring (or from its first statement, decorators included) to its last line, except
  blank and comment lines."""
  body = fn.body
  first = body[0]
  if (isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant)
      and isinstance(first.value.value, str)):
    start = (first.end_lineno or first.lineno) + 1
  else:
    start = min([first.lineno] + [d.lineno for d in getattr(first, "decorator_list", [])])
  texts = (source[i - 1].strip() for i in range(start, (fn.end_lineno or fn.lineno) + 1))
  return sum(1 for text in texts if text and not text.startswith("#"))


def function_lengths(mods: dict[str, Module]) -> list[tuple[int, str]]:
  """``(code lines, "module.function")`` for every function, longest first: the body after
  the docstring, nested functions included, blank and comment lines not."""
  out = []
  for mod in mods.values():
    source = mod.path.read_text().splitlines()
    for node in ast.walk(mod.tree):
      if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        out.append((_body_lines(node, source), f"{mod.name}.{node.name}"))
  return sorted(out, reverse=True)


def floors(mods: dict[str, Module]) -> dict[str, int]:
  """Each module's import floor: 0 imports no package module, else one more than the
  highest module it imports. Raises ``ValueError`` on an import circle."""
  graph = {name: imports(mod, mods) for name, mod in mods.items()}
  done: dict[str, int] = {}

  def floor(name: str, path: tuple[str, ...]) -> int:
    if name in path:
      raise ValueError(f"import circle: {' -> '.join(path[path.index(name):] + (name,))}")
    if name not in done:
      below = [floor(d, path + (name,)) for d in graph[name] if not _is_parent(d, name)]
      done[name] = 1 + max(below, default=-1)
    return done[name]

  for name in graph:
    floor(name, ())
  return done


def _is_parent(package: str, name: str) -> bool:
  """A package's ``__init__`` re-exports its modules: its children import it only for
  those names, which are below them."""
  return name.startswith(package + ".")


def module_lengths(mods: dict[str, Module]) -> list[tuple[int, str]]:
  """``(lines, module)`` for every module, longest first: every line of its file, as
  ``wc -l`` counts them."""
  return sorted(((len(m.path.read_text().splitlines()), name) for name, m in mods.items()),
                reverse=True)


def keyword_options(mods: dict[str, Module], module: str, function: str) -> list[str]:
  """The keyword-only parameters of ``module.function``."""
  for node in ast.walk(mods[module].tree):
    if isinstance(node, ast.FunctionDef) and node.name == function:
      return [a.arg for a in node.args.kwonlyargs]
  raise LookupError(f"{module}.{function}")


def importers(mods: dict[str, Module], target: str) -> set[str]:
  """The modules that import ``target`` (or one of its sub-modules)."""
  return {name for name, mod in mods.items()
          if any(i == target or i.startswith(target + ".") for i in imports(mod, mods))
          and not (name == target or name.startswith(target + "."))}


def _class(mods: dict[str, Module], module: str, name: str) -> ast.ClassDef:
  for node in mods[module].tree.body:
    if isinstance(node, ast.ClassDef) and node.name == name:
      return node
  raise LookupError(f"{module}.{name}")


def dataclass_fields(mods: dict[str, Module], module: str, cls: str) -> list[str]:
  """The fields a dataclass ``cls`` declares (its annotated names, ``ClassVar`` aside)."""
  return [n.target.id for n in _class(mods, module, cls).body
          if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)
          and "ClassVar" not in ast.unparse(n.annotation)]


def lambdas(mods: dict[str, Module], module: str, cls: str) -> int:
  """How many lambdas the body of class ``cls`` holds, in its methods included."""
  return sum(isinstance(n, ast.Lambda) for n in ast.walk(_class(mods, module, cls)))


PLACEMENT_FIELDS = frozenset({"param_gather", "grad_scatter"})
PLACEMENT_VALUES = frozenset({"step", "micro_batch"})


def _is_placement(node: ast.AST | None) -> bool:
  """Whether ``node`` is (or holds) a placement written as a string constant."""
  return node is not None and any(isinstance(c, ast.Constant) and c.value in PLACEMENT_VALUES
                                  for c in ast.walk(node))


def placement_defaults(mods: dict[str, Module]) -> list[str]:
  """Where the FSDP placement's default is written as constants (``module:line``): a field
  or a parameter ``param_gather``/``grad_scatter`` with a constant default, a dict entry
  under one of those keys holding a constant, or a comparison with a tuple of constants
  (``(param_gather, grad_scatter) != ("step", "micro_batch")``). A comparison of one field
  with one constant (``grad_scatter == "step"``) chooses a behaviour and is not counted."""
  return sorted({f"{name}:{line}" for name, mod in mods.items()
                 for node in ast.walk(mod.tree) for line in _placement_lines(node)})


def _placement_lines(node: ast.AST) -> list[int]:
  """The lines at which ``node`` writes a placement default (:func:`placement_defaults`)."""
  if isinstance(node, ast.AnnAssign | ast.Assign):
    targets = [node.target] if isinstance(node, ast.AnnAssign) else node.targets
    named = any(isinstance(t, ast.Name) and t.id in PLACEMENT_FIELDS for t in targets)
    return [node.lineno] if named and isinstance(node.value, ast.Constant) and _is_placement(
        node.value) else []
  if isinstance(node, ast.arguments):
    named = [*node.posonlyargs, *node.args]
    pairs = [*zip(named[len(named) - len(node.defaults):], node.defaults, strict=True),
             *zip(node.kwonlyargs, node.kw_defaults, strict=True)]
    return [d.lineno for a, d in pairs
            if a.arg in PLACEMENT_FIELDS and isinstance(d, ast.Constant) and _is_placement(d)]
  if isinstance(node, ast.Dict):
    hit = any(isinstance(k, ast.Constant) and k.value in PLACEMENT_FIELDS and _is_placement(v)
              for k, v in zip(node.keys, node.values, strict=True))
    return [node.lineno] if hit else []
  if isinstance(node, ast.Compare):
    hit = any(isinstance(o, ast.Tuple | ast.List) and _is_placement(o)
              for o in (node.left, *node.comparators))
    return [node.lineno] if hit else []
  return []


# The words of the wings that the core's code must not speak (``wing_words``).
WING_WORDS = re.compile(r"clip|norms|example_mask|param_gather|grad_scatter", re.IGNORECASE)


def _docstrings(tree: ast.AST) -> set[int]:
  """The ids of the docstring constants of ``tree``'s module, classes and functions."""
  out = set()
  for node in ast.walk(tree):
    if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
      first = node.body[0] if node.body else None
      if (isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant)
          and isinstance(first.value.value, str)):
        out.add(id(first.value))
  return out


def _words_of(node: ast.AST) -> list[str]:
  """The names and string constants ``node`` writes itself (not its children's)."""
  if isinstance(node, ast.Name):
    return [node.id]
  if isinstance(node, ast.Attribute | ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
    return [node.attr if isinstance(node, ast.Attribute) else node.name]
  if isinstance(node, ast.arg):
    return [node.arg]
  if isinstance(node, ast.keyword):
    return [node.arg] if node.arg else []
  if isinstance(node, ast.alias):
    return [node.asname or node.name]
  if isinstance(node, ast.Constant) and isinstance(node.value, str):
    return [node.value]
  return []


def wing_words(mods: dict[str, Module], prefix: str, allowed: dict[str, set[str]]
               ) -> list[str]:
  """Where the code of the modules under ``prefix`` speaks a wing's word (:data:`WING_WORDS`):
  ``module:line word`` for each name and string constant that holds one (docstrings and
  comments are prose, not code). ``allowed`` maps a module to the names it may write (a
  public field a wing fills, the deprecated keywords a table folds), with every string
  constant of the assignment to such a name."""
  found = []
  for name, mod in mods.items():
    if not (name == prefix or name.startswith(prefix + ".")):
      continue
    docs, ok = _docstrings(mod.tree), allowed.get(name, set())
    skip = set()
    for node in ast.walk(mod.tree):
      targets = ([node.target] if isinstance(node, ast.AnnAssign)
                 else node.targets if isinstance(node, ast.Assign) else [])
      if any(isinstance(t, ast.Name) and t.id in ok for t in targets):
        skip |= {id(n) for n in ast.walk(node)}
    for node in ast.walk(mod.tree):
      if id(node) in docs or id(node) in skip:
        continue
      for word in _words_of(node):
        if WING_WORDS.search(word):
          found.append(f"{name}:{getattr(node, 'lineno', 0)} {word}")
  return sorted(found)


def untested_modules(package: pathlib.Path = PACKAGE,
                     tests: pathlib.Path = ROOT / "tests") -> list[str]:
  """The modules of each wing (``jaxaccum/_<wing>/_<x>.py``, or a sub-package
  ``_<x>/``) without their test file ``tests/<wing>/test_<x>.py``."""
  missing = []
  for wing in sorted(p for p in package.iterdir() if p.is_dir() and p.name.startswith("_")
                     and (p / "__init__.py").exists()):
    for part in sorted(wing.iterdir()):
      name = part.stem if part.suffix == ".py" else part.name
      if not name.startswith("_") or name == "__init__" or name.startswith("__"):
        continue
      if part.suffix != ".py" and not (part / "__init__.py").exists():
        continue
      if not (tests / wing.name.lstrip("_") / f"test_{name.lstrip('_')}.py").exists():
        missing.append(f"{wing.name}/{part.name}")
  return missing


def report() -> str:
  mods = modules()
  api = next(n for n in mods if n.endswith("._api") or n == "jaxaccum._api")
  lines = [f"value_and_grad keyword options: {len(keyword_options(mods, api, 'value_and_grad'))}"]
  lengths = function_lengths(mods)
  lines.append("longest functions: " + ", ".join(f"{n} {c}" for c, n in lengths[:6]))
  lines.append("longest modules: " + ", ".join(f"{n} {c}" for c, n in module_lengths(mods)[:4]))
  uses = [u for mod in mods.values() for u in private_uses(mod, mods)]
  lines.append(f"uses of another module's private names: {len(uses)}")
  lines += [f"  {u}" for u in uses]
  fl = floors(mods)
  lines.append(f"modules: {len(mods)}; import floors: {max(fl.values()) + 1}")
  lines.append(f"places of the FSDP default placement: {placement_defaults(mods)}")
  lines.append(f"wing words in the core's code: {wing_words(mods, 'jaxaccum._core', {})}")
  ghost = [n for n in mods if n.rsplit(".", 1)[-1] == "_ghost"]
  for g in ghost:
    lines.append(f"importers of {g}: {sorted(importers(mods, g))}")
  return "\n".join(lines)


if __name__ == "__main__":
  sys.stdout.write(report() + "\n")
