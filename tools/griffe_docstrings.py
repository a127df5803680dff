"""A griffe extension for the API reference: reST habits in docstrings rendered as Markdown.

The docstrings are Google style, read by ``pytest --doctest-modules`` and by ``help()``; they
use reST habits (``double backticks``, :func:`roles`, bare ``>>>`` examples). mkdocstrings
renders docstrings as Markdown, so before parsing this extension

* turns ``:func:`x```, ``:class:`x``` and the other Python roles into code spans (``~a.b``
  gives ``b``, as in Sphinx);
* drops reST escaped spaces (``Variable``\\ s);
* fences each bare run of ``>>>`` lines and their output as a ``pycon`` block, so that it is
  shown as code rather than read as Markdown.

mkdocs.yml loads it with ``extensions: [tools/griffe_docstrings.py]``.
"""

import re
from typing import Any

import griffe

_ROLE = re.compile(r":(?:py:)?(?:func|class|mod|meth|attr|data|obj|exc|const):`~?([^`]+)`")


def _role(match: re.Match) -> str:
  target = match.group(1)
  if match.group(0).split("`")[1].startswith("~"):
    target = target.rsplit(".", 1)[-1]
  return f"`{target}`"


def _fence_doctests(text: str) -> str:
  out: list[str] = []
  in_block = False
  indent = ""
  for line in text.splitlines():
    stripped = line.lstrip()
    if not in_block and stripped.startswith(">>>"):
      indent = line[: len(line) - len(stripped)]
      out.append(f"{indent}```pycon")
      in_block = True
    elif in_block and not stripped:
      out.append(f"{indent}```")
      in_block = False
    out.append(line)
  if in_block:
    out.append(f"{indent}```")
  return "\n".join(out)


def convert(text: str) -> str:
  """Returns the docstring ``text`` with reST roles, escapes and doctests made Markdown."""
  text = _ROLE.sub(_role, text)
  text = text.replace("\\ ", "")
  return _fence_doctests(text)


class ReSTToMarkdown(griffe.Extension):
  """Rewrites each docstring with :func:`convert` when griffe creates its object."""

  def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
    if obj.docstring is not None:
      obj.docstring.value = convert(obj.docstring.value)
