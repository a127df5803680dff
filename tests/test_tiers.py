"""The public surface in tiers: the accumulation core at the top level, ``jaxaccum.dp``,
``jaxaccum.planning`` and ``jaxaccum.contrib`` loaded on first use, and every name that left
the top level still reachable there for one release, with one ``DeprecationWarning``."""

import importlib
import io
import json
import os
import pathlib
import re
import subprocess
import sys
import tokenize
import warnings

import pytest

import jaxaccum

ROOT = pathlib.Path(__file__).resolve().parents[1]
MAX_TOP_LEVEL_NAMES = 22
MAX_MODULES_ON_IMPORT = 18
TIERS = ("dp", "planning", "contrib")
# What `import jaxaccum` must not load: the DP wing, the planner, the research add-ons.
FORBIDDEN = ("jaxaccum._per_example._dp", "jaxaccum._per_example._ghost", "jaxaccum._planning",
             "jaxaccum._batch_size._adaptive", "jaxaccum._batch_size._seesaw",
             "jaxaccum._parallel._pipeline", "jaxaccum._batch_size._rows",
             "jaxaccum.dp", "jaxaccum.planning", "jaxaccum.contrib")


def _run(code: str) -> str:
  """``code``'s output in a fresh interpreter, importing this checkout's jaxaccum."""
  env = {**os.environ, "PYTHONPATH": os.pathsep.join(
      [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}
  return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                        check=True, cwd=ROOT, env=env).stdout


def _loaded_by(code: str) -> list[str]:
  out = _run(f"{code}\nimport json, sys\n"
             "print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] == 'jaxaccum')))")
  return json.loads(out.splitlines()[-1])


def test_import_jaxaccum_loads_the_core_only():
  loaded = _loaded_by("import jaxaccum")
  assert "jaxaccum._api" in loaded  # the measure reads the package, not an empty list
  assert len(loaded) <= MAX_MODULES_ON_IMPORT, loaded
  bad = [m for m in loaded if m.startswith(FORBIDDEN)]
  assert not bad, bad


def test_a_tier_is_loaded_on_first_use():
  loaded = _loaded_by("import jaxaccum\njaxaccum.dp.dp_noise")
  assert "jaxaccum.dp" in loaded and "jaxaccum._per_example._dp" in loaded
  assert "jaxaccum.contrib" not in loaded and "jaxaccum._planning._plan" not in loaded


def test_the_top_level_is_short_and_every_name_resolves():
  assert len(jaxaccum.__all__) <= MAX_TOP_LEVEL_NAMES, jaxaccum.__all__
  assert len(set(jaxaccum.__all__)) == len(jaxaccum.__all__)
  with warnings.catch_warnings():
    warnings.simplefilter("error")  # no core name is a deprecated one
    for name in jaxaccum.__all__:
      assert getattr(jaxaccum, name) is not None, name
  assert not set(jaxaccum.__all__) & set(jaxaccum._MOVED)


def test_dir_lists_the_tiers_and_the_lazy_core_names():
  names = dir(jaxaccum)
  for name in (*TIERS, "nnx", "linen", "eqx", *jaxaccum.__all__):
    assert name in names, name
  assert not set(names) & set(jaxaccum._MOVED)  # the old names are not advertised


@pytest.mark.parametrize("tier", TIERS)
def test_each_tier_is_a_module_whose_names_resolve(tier):
  module = getattr(jaxaccum, tier)
  assert module is importlib.import_module(f"jaxaccum.{tier}")
  assert module.__all__
  for name in module.__all__:
    assert getattr(module, name).__doc__, f"jaxaccum.{tier}.{name}"


def test_the_moved_table_covers_every_tier_name_but_the_top_levels():
  in_tiers = {n for t in TIERS for n in getattr(jaxaccum, t).__all__}
  assert set(jaxaccum._MOVED) == in_tiers - set(jaxaccum.__all__)
  for name, home in jaxaccum._MOVED.items():
    assert name in importlib.import_module(home).__all__, (name, home)


def test_each_old_name_is_the_same_object_and_warns_once():
  """In a fresh process (the once-ness is per process): the first read of each old name
  warns, naming the new place; the second read returns the same object, silently."""
  code = """
import importlib, json, warnings
import jaxaccum
report = {}
for name, home in jaxaccum._MOVED.items():
  with warnings.catch_warnings(record=True) as first:
    warnings.simplefilter("always")
    obj = getattr(jaxaccum, name)
  with warnings.catch_warnings(record=True) as second:
    warnings.simplefilter("always")
    again = getattr(jaxaccum, name)
  report[name] = dict(
      same=obj is getattr(importlib.import_module(home), name) and again is obj,
      first=[(w.category.__name__, str(w.message)) for w in first],
      second=len(second))
print(json.dumps(report))
"""
  report = json.loads(_run(code).splitlines()[-1])
  assert set(report) == set(jaxaccum._MOVED)
  for name, r in report.items():
    home = jaxaccum._MOVED[name]
    assert r["same"], name
    assert len(r["first"]) == 1, (name, r["first"])
    category, message = r["first"][0]
    assert category == "DeprecationWarning"
    assert message.startswith(f"jaxaccum.{name} moved to {home}.{name}; "), message
    assert r["second"] == 0, name


def test_from_import_of_an_old_name_warns_and_works():
  code = ("import warnings\nwarnings.simplefilter('error')\n"
          "try:\n  from jaxaccum import seesaw\nexcept DeprecationWarning as e:\n  print(e)")
  assert "jaxaccum.seesaw moved to jaxaccum.contrib.seesaw" in _run(code)


def test_an_unknown_name_is_an_attribute_error():
  with pytest.raises(AttributeError, match="has no attribute 'no_such_name'"):
    jaxaccum.no_such_name  # noqa: B018


# The project's own files that run jaxaccum, outside the suite the tier tests sit in too.
_OWN_CODE = ("tests", "tests_gpu_target", "benchmarks", "examples", "tools")


def _code_only(source: str) -> str:
  """``source`` with its strings and comments blanked, lines kept."""
  tokens = tokenize.generate_tokens(io.StringIO(source).readline)
  lines = source.splitlines(keepends=True)
  for tok in tokens:
    if tok.type in (tokenize.STRING, tokenize.COMMENT) and tok.start[0] == tok.end[0]:
      row = tok.start[0] - 1
      lines[row] = lines[row][:tok.start[1]] + " " * (tok.end[1] - tok.start[1]) + lines[row][
          tok.end[1]:]
    elif tok.type == tokenize.STRING:  # a multi-line string: blank its lines
      for row in range(tok.start[0] - 1, tok.end[0]):
        lines[row] = "\n"
  return "".join(lines)


def _old_spellings(source: str) -> list[str]:
  """Reads of a moved name from the top level, and of a private module as an attribute
  chain (``jaxaccum._planning._gpu_target``: it resolves only once something imported it),
  in ``source``'s code (its strings and comments are not read)."""
  text = _code_only(source)
  moved = "|".join(sorted(jaxaccum._MOVED, key=len, reverse=True))
  found = re.findall(rf"\bjaxaccum\.(?:{moved})\b(?!\.)", text)
  found += re.findall(rf"(?m)^\s*from jaxaccum import [^\n]*\b(?:{moved})\b", text)
  found += re.findall(r"(?m)^(?!\s*(?:from|import) ).*?\b(jaxaccum\._\w+\.\w+)", text)
  return found


def test_the_project_spells_every_name_at_its_new_home():
  hits = {}
  for folder in _OWN_CODE:
    for path in sorted((ROOT / folder).rglob("*.py")):
      if path == pathlib.Path(__file__):
        continue  # this file spells the old names on purpose
      if found := _old_spellings(path.read_text()):
        hits[str(path.relative_to(ROOT))] = found
  assert not hits, f"old top-level names or private attribute chains: {hits}"


def test_the_old_spelling_finder_finds_each_kind():
  text = ("m = jaxaccum.target_mesh('h100')\nfrom jaxaccum import dp, seesaw\n"
          "jaxaccum._planning._gpu_target.GPU_TARGETS\njaxaccum.dp.clip_per_example\n"
          "jaxaccum.planning.target_mesh\nfrom jaxaccum.contrib import seesaw\n")
  text += ("from jaxaccum._core._split import split\nsetattr('jaxaccum._core._split.x', 1)\n"
           '"""Calls jaxaccum.seesaw and\njaxaccum._core._split.split."""  # jaxaccum.seesaw\n')
  assert _old_spellings(text) == ["jaxaccum.target_mesh", "from jaxaccum import dp, seesaw",
                                  "jaxaccum._planning._gpu_target"]
