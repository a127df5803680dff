"""Print the path of the newest Python 3 interpreter on this machine, for `make test-latest`.

pip resolves the newest jax, jaxlib, flax, optax, chex and equinox releases for the newest
Python (jax 0.12 needs Python 3.12 or later, while Python 3.11 gets jax 0.10), so that is the
interpreter a new user's virtual environment most likely has. Looks on PATH (`python3.N`) and in
pyenv's versions directory; exits with an error if nothing newer than this interpreter is found.
"""

import os
import shutil
import subprocess
import sys
from pathlib import Path

NEWEST_MINOR = 20  # looks for python3.11 .. python3.20


def _runs(python: str) -> tuple[int, int] | None:
  try:
    out = subprocess.run([python, "-c", "import sys; print(*sys.version_info[:2])"],
                         capture_output=True, text=True, timeout=30, check=True).stdout
  except (OSError, subprocess.SubprocessError):
    return None  # e.g. a pyenv shim for a version that is not selected
  major, minor = map(int, out.split())
  return major, minor


def candidates() -> list[str]:
  found = []
  for minor in range(NEWEST_MINOR, 10, -1):
    path = shutil.which(f"python3.{minor}")
    if path:
      found.append(path)
  root = Path(os.environ.get("PYENV_ROOT", Path.home() / ".pyenv")) / "versions"
  if root.is_dir():
    found += sorted(str(p) for p in root.glob("3.*/bin/python3.*")
                    if p.name.count(".") == 1 and p.name[-1].isdigit())
  return found


def main() -> None:
  best: tuple[tuple[int, int], str] | None = None
  for python in candidates():
    version = _runs(python)
    if version is not None and (best is None or version > best[0]):
      best = (version, python)
  if best is None or best[0] <= sys.version_info[:2]:
    sys.exit(f"no Python newer than {sys.version.split()[0]} found on PATH or in pyenv: "
             "install one (e.g. Python 3.13) or pass LATEST_PYTHON=/path/to/python3.13.")
  print(best[1])


if __name__ == "__main__":
  main()
