"""Print pip constraints pinning the core dependencies to the floors pyproject.toml gives them.

`make test-min` installs the project with these constraints, so the suite runs against the
lowest versions of jax, optax, flax, chex, numpy and equinox that pyproject.toml claims to
support. A dependency is pinned to the highest `>=` floor found for it in the dependencies and
the extras.
"""

import re
import sys
import tomllib
from pathlib import Path

_FLOOR = re.compile(r"\s*([A-Za-z0-9_.-]+)(?:\[[^\]]*\])?\s*>=\s*([0-9][0-9A-Za-z.]*)")
PINNED = ("jax", "jaxlib", "optax", "flax", "chex", "numpy", "equinox")


def floors(pyproject: dict) -> dict[str, str]:
  project = pyproject["project"]
  requirements = list(project.get("dependencies", []))
  for extra in project.get("optional-dependencies", {}).values():
    requirements.extend(extra)
  found: dict[str, str] = {}
  for requirement in requirements:
    match = _FLOOR.match(requirement)
    if match is None:
      continue
    name, version = match.group(1).lower(), match.group(2)
    if name in PINNED:
      key = tuple(int(p) if p.isdigit() else 0 for p in version.split("."))
      old = found.get(name)
      if old is None or key > tuple(int(p) if p.isdigit() else 0 for p in old.split(".")):
        found[name] = version
  return found


def main() -> None:
  path = Path(__file__).resolve().parent.parent / "pyproject.toml"
  pins = floors(tomllib.loads(path.read_text()))
  if not pins:
    sys.exit(f"no floors found in {path}")
  for name in PINNED:
    if name in pins:
      print(f"{name}=={pins[name]}")


if __name__ == "__main__":
  main()
