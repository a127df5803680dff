"""The package's shape, held: a narrow main entry, short functions, modules of a readable
length, modules that talk through each other's public names, an import graph without circles
in few floors, the ghost analysis (a sub-package of short modules) reached only through the
per-example wing, and the core importing nothing from its wings.

The measures are ``tools/architecture.py``'s (read with :mod:`ast`); each is checked here on
the package and, so that a broken measure cannot pass, on a small planted package.
"""

import pathlib
import sys
import textwrap

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))

import architecture  # noqa: E402

MODS = architecture.modules()
MAX_KEYWORD_OPTIONS = 20
MAX_FUNCTION_LINES = 80
MAX_PRIVATE_USES = 5
# 10 with the ghost analysis in one module; its sub-package adds the floors of its own
# pipeline (norms -> rules -> analysis -> the entry point -> the package), 2 of them above
# the core's transform, which the per-example rule sat on before.
MAX_FLOORS = 12
MAX_MODULE_LINES = 1000
MAX_GHOST_MODULE_LINES = 600
MAX_OPTIONS_FIELDS = 12
OPTIONS = "jaxaccum._core._options"
CORE = "jaxaccum._core"
PER_EXAMPLE = "jaxaccum._per_example"
API = "jaxaccum._api"


def test_value_and_grad_has_at_most_twenty_keyword_options():
  options = architecture.keyword_options(MODS, "jaxaccum._api", "value_and_grad")
  assert len(options) <= MAX_KEYWORD_OPTIONS, options


def test_no_function_is_longer_than_eighty_code_lines():
  long = [(n, name) for n, name in architecture.function_lengths(MODS)
          if n > MAX_FUNCTION_LINES]
  assert not long, long


def test_no_module_is_longer_than_a_thousand_lines():
  long = [(n, name) for n, name in architecture.module_lengths(MODS) if n > MAX_MODULE_LINES]
  assert not long, long


def test_the_ghost_analysis_is_a_package_of_modules_of_at_most_six_hundred_lines():
  ghost = f"{PER_EXAMPLE}._ghost"
  assert MODS[ghost].is_package
  parts = [(n, name) for n, name in architecture.module_lengths(MODS)
           if name.startswith(ghost + ".")]
  assert len(parts) >= 5, parts  # walk, analysis, rules, norms, the rewritten program
  long = [(n, name) for n, name in parts if n > MAX_GHOST_MODULE_LINES]
  assert not long, long


def test_modules_use_few_of_each_others_private_names():
  uses = [u for mod in MODS.values() for u in architecture.private_uses(mod, MODS)]
  assert len(uses) <= MAX_PRIVATE_USES, uses


def test_the_import_graph_has_no_circle_and_few_floors():
  floors = architecture.floors(MODS)
  assert max(floors.values()) + 1 <= MAX_FLOORS, sorted(floors.items(), key=lambda x: x[1])


# The package imports one way, at the top of each module; two exceptions, each for a reason:
# the top level's `if TYPE_CHECKING:` names what its `__getattr__` loads on first use, and
# the per-example wing is loaded when a `per_example=` is first given, so that `import
# jaxaccum` loads no DP module (tests/test_tiers.py).
HIDDEN_IMPORTS_ALLOWED = {"jaxaccum": "TYPE_CHECKING",
                          "jaxaccum._transforms": "the per-example wing"}


def test_the_package_imports_at_the_top_of_its_modules():
  hidden = {where.split(":")[0] for where in architecture.hidden_imports(MODS)}
  assert hidden <= set(HIDDEN_IMPORTS_ALLOWED), architecture.hidden_imports(MODS)
  lazy = [w for w in architecture.hidden_imports(MODS) if w.startswith("jaxaccum._transforms")]
  assert len(lazy) == 1, lazy


def test_the_hidden_import_measure_on_a_planted_module(tmp_path):
  pkg = tmp_path / "jaxaccum"
  (pkg / "_a").mkdir(parents=True)
  (pkg / "__init__.py").write_text("")
  (pkg / "_a" / "__init__.py").write_text("")
  (pkg / "_a" / "_b.py").write_text(textwrap.dedent("""\
      from typing import TYPE_CHECKING
      import numpy as np
      from jaxaccum._a import _c
      if TYPE_CHECKING:
        from jaxaccum._a import _d
      def f():
        import json
        from . import _e
        return _e
      class K:
        def g(self):
          import jaxaccum._a._f
  """))
  found = architecture.hidden_imports(architecture.modules(pkg))
  assert found == ["jaxaccum._a._b:5", "jaxaccum._a._b:8", "jaxaccum._a._b:12"], found


def test_only_the_per_example_wing_imports_the_ghost_analysis():
  ghosts = [n for n in MODS if n.rsplit(".", 1)[-1] == "_ghost"]
  assert ghosts
  for ghost in ghosts:
    outside = {m for m in architecture.importers(MODS, ghost)
               if not m.startswith(PER_EXAMPLE)}
    assert not outside, (ghost, outside)


def test_the_core_imports_nothing_outside_it():
  core = {n: m for n, m in MODS.items() if n.startswith(CORE)}
  assert core
  for name, mod in core.items():
    outside = {i for i in architecture.imports(mod, MODS) if not i.startswith(CORE)}
    assert not outside, (name, outside)


def test_the_core_and_the_batch_size_wing_sit_below_the_api():
  """``AdaptiveBatch.check`` reads a transform's options without importing the API; the
  count ramp reads a state's counter without importing the controller."""
  above = {"jaxaccum._api", "jaxaccum.nnx", "jaxaccum.linen", "jaxaccum.eqx"}
  for name, mod in MODS.items():
    if name.startswith((CORE, "jaxaccum._batch_size")):
      assert not architecture.imports(mod, MODS) & above, name
  ramp = architecture.imports(MODS["jaxaccum._batch_size._ramp"], MODS)
  assert "jaxaccum._batch_size._adaptive" not in ramp
  assert "jaxaccum._batch_size._counter" in ramp


def test_no_wing_imports_the_api():
  """Every wing sits below the public functions: the adapters, the tiers' faces, the planner,
  the coupled-loss transform and the wings build through ``_transforms`` and ``_core``, and
  only the top level imports ``_api`` (to re-export it)."""
  importers = architecture.importers(MODS, API)
  assert importers, "the top level re-exports the API"  # the measure sees imports at all
  assert importers <= {"jaxaccum"}, sorted(importers - {"jaxaccum"})


def test_options_is_a_record_of_at_most_twelve_fields_without_lambdas():
  fields = architecture.dataclass_fields(MODS, OPTIONS, "Options")
  assert "split" in fields and len(fields) <= MAX_OPTIONS_FIELDS, fields
  assert architecture.lambdas(MODS, OPTIONS, "Options") == 0


def test_the_fsdp_default_placement_is_written_in_one_place():
  places = architecture.placement_defaults(MODS)  # _axes.PLACEMENTS, default first
  assert len(places) == 1 and places[0].startswith("jaxaccum._parallel._axes:"), places


# What the core may write of a wing's words: AccumInfo's public field that the per-example
# wing fills, and the deprecated keywords of the table that folds them into their records.
CORE_ALLOWED_WORDS = {f"{CORE}._info": {"example_grad_norms"}, OPTIONS: {"DEPRECATED"}}


def test_the_core_speaks_only_accumulation():
  """No name or string in the core's code speaks of the clip, its norms and masks, or the
  FSDP placement: those are the per-example and the data-parallel wings' words."""
  found = architecture.wing_words(MODS, CORE, CORE_ALLOWED_WORDS)
  assert not found, found


# --- the measures themselves, on a planted package ------------------------------------------


@pytest.fixture
def planted(tmp_path):
  pkg = tmp_path / "pkg"
  (pkg / "_sub").mkdir(parents=True)
  files = {
      "__init__.py": "from pkg import _a\n",
      "_a.py": """
          from pkg import _b
          from pkg._sub import _c

          def f(*, x, y=1):
            z = _b._hidden
            return _c.public(z) + _b.shown
          """,
      "_b.py": "from pkg._sub._c import _private\n_hidden = shown = _private\n",
      "_sub/__init__.py": "",
      "_sub/_c.py": """
          from typing import TYPE_CHECKING

          if TYPE_CHECKING:  # for annotations only: not an import circle
            from pkg import _a

          _private = 1

          def public(z):
            # a comment

            a = z
            b = a
            return b

          def outer(wrap):
            '''A docstring, not counted.

            # nor this line of it
            '''
            @wrap  # a nested function's decorator is a code line
            def inner():
              return 1

            return inner
          """,
  }
  for name, text in files.items():
    (pkg / name).write_text(textwrap.dedent(text))
  return pkg


# Modules whose tests live elsewhere: (why, the files that test them; () for none needed).
TESTED_ELSEWHERE = {
    "_core/_types.py": ("type aliases and a Protocol only: nothing runs", ()),
    "_core/_sharding.py": ("the FSDP tie and the layout helpers, run by the placements",
                           ("tests/parallel/test_fsdp_gather.py",
                            "tests/parallel/test_sharding_recipe.py")),
    "_planning/_gpu_target.py": ("needs the gpu-plan extra, so its own suite",
                                 ("tests_gpu_target/test_gpu_target.py",)),
}


def test_every_wing_module_has_its_test_file():
  """``jaxaccum/_<wing>/_<x>.py`` is tested by ``tests/<wing>/test_<x>.py``."""
  missing = architecture.untested_modules()
  assert sorted(missing) == sorted(TESTED_ELSEWHERE), missing
  for _, paths in TESTED_ELSEWHERE.values():
    assert all((ROOT / path).exists() for path in paths), paths


def test_the_untested_module_measure_on_a_planted_package(tmp_path):
  pkg, tests = tmp_path / "pkg", tmp_path / "tests"
  for path in ("_core/__init__.py", "_core/_a.py", "_core/_b.py", "_core/_sub/__init__.py",
               "_wing/__init__.py", "_wing/_c.py", "top.py"):
    (pkg / path).parent.mkdir(parents=True, exist_ok=True)
    (pkg / path).write_text("")
  for path in ("core/test_a.py", "wing/test_c.py"):
    (tests / path).parent.mkdir(parents=True, exist_ok=True)
    (tests / path).write_text("")
  assert architecture.untested_modules(pkg, tests) == ["_core/_b.py", "_core/_sub"]


def test_the_measures_on_a_planted_package(planted):
  mods = architecture.modules(planted)
  assert set(mods) == {"pkg", "pkg._a", "pkg._b", "pkg._sub", "pkg._sub._c"}
  assert architecture.keyword_options(mods, "pkg._a", "f") == ["x", "y"]
  lengths = dict((n, c) for c, n in architecture.module_lengths(mods))
  assert lengths["pkg._b"] == 2 and lengths["pkg._sub"] == 0 and lengths["pkg._sub._c"] == 25
  assert dict((n, c) for c, n in architecture.function_lengths(mods)) == {
      "pkg._a.f": 2, "pkg._sub._c.public": 3, "pkg._sub._c.outer": 4,
      "pkg._sub._c.inner": 1}
  uses = sorted(u.split(" ")[1] for m in mods.values()
                for u in architecture.private_uses(m, mods))
  assert uses == ["pkg._b._hidden", "pkg._sub._c._private"]
  floors = architecture.floors(mods)
  assert floors["pkg._sub._c"] == 0 and floors["pkg._b"] == 1 and floors["pkg._a"] == 2
  assert architecture.importers(mods, "pkg._sub") == {"pkg._a", "pkg._b"}


def test_an_import_circle_is_found(planted):
  (planted / "_sub" / "_c.py").write_text("from pkg import _a\n")
  with pytest.raises(ValueError, match="import circle"):
    architecture.floors(architecture.modules(planted))


def test_the_record_measures_on_a_planted_module(tmp_path):
  pkg = tmp_path / "pkg"
  pkg.mkdir()
  (pkg / "__init__.py").write_text("")
  (pkg / "_o.py").write_text(textwrap.dedent("""
      import dataclasses
      from typing import ClassVar

      PLACEMENTS = {"param_gather": ("step", "micro_batch")}

      @dataclasses.dataclass(frozen=True)
      class Options:
        a: int
        b: int = dataclasses.field(metadata={"check": lambda raw: raw})
        c: ClassVar[int] = 0
        param_gather: str = "step"

        def f(self, param_gather="micro_batch"):
          return sorted([1], key=lambda x: x)

      def g(dp):
        ok = dp.grad_scatter == "step"  # a behaviour, not the default
        return ok or (dp.param_gather, dp.grad_scatter) != ("step", "micro_batch")
      """))
  mods = architecture.modules(pkg)
  assert architecture.dataclass_fields(mods, "pkg._o", "Options") == ["a", "b", "param_gather"]
  assert architecture.lambdas(mods, "pkg._o", "Options") == 2
  assert architecture.placement_defaults(mods) == [
      "pkg._o:12", "pkg._o:14", "pkg._o:19", "pkg._o:5"]


def test_the_wing_words_measure_on_a_planted_module(tmp_path):
  pkg = tmp_path / "pkg"
  (pkg / "_core").mkdir(parents=True)
  (pkg / "__init__.py").write_text("")
  (pkg / "_core" / "__init__.py").write_text('"""The core; its docstring speaks of clip."""\n')
  (pkg / "_core" / "_k.py").write_text(textwrap.dedent('''
      """A docstring may speak of the norms; so may a comment."""
      import jax.numpy as jnp  # clip
      from pkg import Clip as Clip

      TABLE = {"param_gather": "grad_scatter=..."}  # allowed below
      OTHER = {"grad_scatter": 1}

      def f(x, norms):
        """Nor the norms here."""
        y = jnp.clip(x, 0, 1)
        return g(y, example_mask=norms)

      class Info:
        example_grad_norms: int = 0
      '''))
  (pkg / "_wing.py").write_text("norms = 1\n")  # outside the core: not read
  mods = architecture.modules(pkg)
  assert architecture.wing_words(mods, "pkg._core", {"pkg._core._k": {"TABLE"}}) == [
      "pkg._core._k:11 clip", "pkg._core._k:12 example_mask", "pkg._core._k:12 norms",
      "pkg._core._k:15 example_grad_norms", "pkg._core._k:4 Clip", "pkg._core._k:7 grad_scatter",
      "pkg._core._k:9 norms"]
