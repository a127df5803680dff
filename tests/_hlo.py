"""Reading compiled HLO text: which collectives a program runs, and which run in a loop."""

import re

COLLECTIVES = ("all-reduce", "all-gather", "all-to-all", "collective-permute", "reduce-scatter")
_HEADER = re.compile(r"^(ENTRY )?%?([\w.\-]+) .*\{\s*$")
_OP = re.compile(r"=\s*(.+?)\s(" + "|".join(COLLECTIVES) + r")(?:-start)?\(")
_CALLS = re.compile(r"\b(?:calls|to_apply|body|condition)=%?([\w.\-]+)")
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
_BODY = re.compile(r"\bwhile\(.*\bbody=%?([\w.\-]+)")


class Collective:
  def __init__(self, kind: str, shape: str, in_loop: bool, line: str):
    self.kind, self.shape, self.in_loop, self.line = kind, shape, in_loop, line

  def __repr__(self):
    return f"{'LOOP ' if self.in_loop else ''}{self.kind} {self.shape}"


def _computations(text: str):
  comps, entry, current = {}, None, None
  for line in text.splitlines():
    if not line.startswith((" ", "}")):
      m = _HEADER.match(line)
      if m:
        current = m.group(2)
        comps[current] = []
        entry = current if m.group(1) else entry
        continue
    if line.startswith("}"):
      current = None
    elif current is not None:
      comps[current].append(line)
  return comps, entry


def _reachable(comps, roots):
  seen, stack = set(), list(roots)
  while stack:
    c = stack.pop()
    if c in seen or c not in comps:
      continue
    seen.add(c)
    for line in comps[c]:
      stack.extend(_CALLS.findall(line))
      for group in _BRANCHES.findall(line):
        stack.extend(n.strip().lstrip("%") for n in group.split(","))
  return seen


def collectives(text: str) -> list[Collective]:
  """Every collective reachable from the entry computation, marked if inside a while body."""
  comps, entry = _computations(text)
  assert entry is not None, "no ENTRY computation in the HLO text"
  live = _reachable(comps, [entry])
  bodies = [b for c in live for line in comps[c] for b in _BODY.findall(line)]
  assert bodies, "no while loop in the HLO text: the accumulation scan is missing"
  in_loop = _reachable(comps, bodies)
  out = []
  for c in live:
    for line in comps[c]:
      m = _OP.search(line)
      if m:
        out.append(Collective(m.group(2), m.group(1), c in in_loop, line.strip()))
  return out


def shapes(shape: str) -> list[tuple[int, ...]]:
  """The array shapes in an HLO result type, e.g. ``(f32[8,4]{1,0}, f32[])``."""
  return [tuple(int(d) for d in dims.split(",") if d)
          for dims in re.findall(r"\w+\[([\d,]*)\]", shape)]
