"""The quickstart example runs and the public API is documented."""

import importlib.util
import pathlib

import jaxaccum

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_every_public_name_has_a_docstring():
  for module in (jaxaccum, jaxaccum.nnx, jaxaccum.linen):
    for name in module.__all__:
      obj = getattr(module, name)
      assert obj.__doc__ and obj.__doc__.strip(), f"{module.__name__}.{name} has no docstring"


def test_quickstart_example_runs(capsys):
  spec = importlib.util.spec_from_file_location("quickstart", ROOT / "examples/quickstart.py")
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  mod.main(steps=2, batch_size=32, num_micro_batches=4)
  out = capsys.readouterr().out
  diffs = [float(line.rsplit("=", 1)[1]) for line in out.splitlines() if "grad -" in line]
  assert len(diffs) == 2 and max(diffs) < 1e-5, out
