"""The documentation site covers the public API and every page is in the navigation."""

import re
from pathlib import Path

import pytest

import jaxaccum

ROOT = Path(__file__).resolve().parent.parent
ADAPTERS = ("nnx", "linen", "eqx")


def _documented() -> set[str]:
  text = (ROOT / "docs" / "api.md").read_text()
  return set(re.findall(r"^::: jaxaccum\.([\w.]+)\s*$", text, flags=re.MULTILINE))


def test_api_reference_lists_every_public_name():
  missing = sorted(set(jaxaccum.__all__) - _documented())
  assert not missing, f"docs/api.md has no '::: jaxaccum.NAME' entry for {missing}"


@pytest.mark.parametrize("tier", ["dp", "planning", "contrib"])
def test_api_reference_lists_every_name_of_each_tier(tier):
  module = getattr(jaxaccum, tier)
  top = set(jaxaccum.__all__)  # plan and friends: documented once, under the core
  missing = sorted(n for n in module.__all__
                   if f"{tier}.{n}" not in _documented() and n not in top)
  assert not missing, f"docs/api.md has no '::: jaxaccum.{tier}.NAME' entry for {missing}"


def test_api_reference_lists_every_adapter():
  present = [name for name in ADAPTERS if (ROOT / "jaxaccum" / f"{name}.py").exists()]
  assert {"nnx", "linen"} <= set(present)
  missing = sorted(set(present) - _documented())
  assert not missing, f"docs/api.md has no '::: jaxaccum.NAME' entry for the adapters {missing}"


def test_every_page_is_in_the_navigation():
  nav = (ROOT / "mkdocs.yml").read_text()
  pages = sorted(p.name for p in (ROOT / "docs").glob("*.md"))
  missing = [page for page in pages if not re.search(rf":\s*{re.escape(page)}\s*$", nav, re.M)]
  assert not missing, f"mkdocs.yml's nav does not list {missing}"


def test_readme_links_resolve():
  readme = (ROOT / "README.md").read_text()
  targets = re.findall(r"\]\((docs/[^)#]*)", readme)
  assert targets, "the README links into docs/"
  broken = [t for t in targets if not (ROOT / t).exists()]
  assert not broken, f"README.md links to missing files: {broken}"


def test_guides_table_links_are_defined_in_the_readme_and_the_site_index():
  """docs/index.md includes the README's guides table, whose links are reference links: each
  needs its definition in both files, to a page that exists (the strict docs build fails on
  a missing one)."""
  readme = (ROOT / "README.md").read_text()
  table = re.search(r"\[start:guides\] -->(.*?)<!-- --8<-- \[end:guides\]", readme, re.S)
  assert table, "README.md marks its guides table with --8<-- [start:guides] / [end:guides]"
  labels = sorted(set(re.findall(r"\]\[([\w-]+)\]", table.group(1))))
  assert labels, "the guides table links with reference links"
  for path in (ROOT / "README.md", ROOT / "docs" / "index.md"):
    defined = dict(re.findall(r"^\[([\w-]+)\]: (\S+)$", path.read_text(), re.M))
    missing = [label for label in labels if label not in defined]
    assert not missing, f"{path.name} does not define the guides table's links {missing}"
    broken = [defined[label] for label in labels if not (path.parent / defined[label]).exists()]
    assert not broken, f"{path.name} defines the guides table's links to missing pages {broken}"
