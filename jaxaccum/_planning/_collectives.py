"""``jaxaccum.planning.collectives``: what a compiled program communicates, read before it runs.

XLA's compiled program (``jax.jit(f).lower(*args).compile().as_text()``) is the program that
runs, after every pass: the collectives the partitioner inserted, the ones XLA hoisted out of
loops or combined, and the ones ``shard_map`` asked for. This module reads that text: one
:class:`Collective` per op (an asynchronous ``-start``/``-done`` pair is one op; an op over a
tuple of operands is one op whose bytes are their sum), with the attributes listed there.

It is the one parser of compiled HLO text in the project: :func:`jaxaccum.plan` reports the
collectives of the chosen program with it, and the tests read compiled programs with it.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import math
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, NamedTuple, overload

import jax
import numpy as np

KINDS = ("all-reduce", "reduce-scatter", "all-gather", "all-to-all", "collective-permute")

_HEADER = re.compile(r"^(ENTRY )?%?([\w.\-]+) .*\{\s*$")
_KIND = "|".join(KINDS)
# `%name = <result type> kind(` or `kind-start(`; the result type may be a tuple with spaces.
_OP = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.+?)\s(" + _KIND + r")(-start)?\(")
_DONE = re.compile(r"^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*(.+?)\s(?:" + _KIND
                   + r")-done\(((?:[^()]|\([^()]*\))*)\)")
_CALLS = re.compile(r"\b(calls|to_apply|body|condition)=%?([\w.\-]+)")
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
_TRUE_FALSE = re.compile(r"\b(?:true|false)_computation=%?([\w.\-]+)")
_WHILE = re.compile(r"\swhile\(")
_TRIP = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')
_ARRAY = re.compile(r"\b([a-z][a-z0-9]*)\[([\d,]*)\]")
# An attribute's raw value runs up to the next `, name=` (group lists and mesh axes hold no
# such sequence).
_GROUPS = re.compile(r"\breplica_groups=(.*?)(?:, [a-z_]+=|$)")
_PAIRS = re.compile(r"\bsource_target_pairs=(\{.*?\})(?:, [a-z_]+=|$)")
_IOTA = re.compile(r"^\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?$")
_MESH = re.compile(r"^mesh\[([^\]]*)\]\s*(?:<=\[([\d,]+)\](?:T\(([\d,]+)\))?)?\s*\{([^}]*)\}$")

# HLO element types: (numpy name, bits). Others keep their HLO name, with the bits in it.
_DTYPES = {
    "pred": ("bool", 8), "s4": ("int4", 4), "u4": ("uint4", 4), "s8": ("int8", 8),
    "u8": ("uint8", 8), "s16": ("int16", 16), "u16": ("uint16", 16), "s32": ("int32", 32),
    "u32": ("uint32", 32), "s64": ("int64", 64), "u64": ("uint64", 64),
    "f16": ("float16", 16), "bf16": ("bfloat16", 16), "f32": ("float32", 32),
    "f64": ("float64", 64), "c64": ("complex64", 64), "c128": ("complex128", 128),
    "f8e4m3fn": ("float8_e4m3fn", 8), "f8e5m2": ("float8_e5m2", 8),
    "f8e4m3fnuz": ("float8_e4m3fnuz", 8), "f8e5m2fnuz": ("float8_e5m2fnuz", 8),
    "f8e4m3b11fnuz": ("float8_e4m3b11fnuz", 8), "f8e4m3": ("float8_e4m3", 8),
    "f8e3m4": ("float8_e3m4", 8), "f8e8m0fnu": ("float8_e8m0fnu", 8),
    "f4e2m1fn": ("float4_e2m1fn", 4),
}


def format_bytes(n: int) -> str:
  """``n`` bytes in the largest binary unit that keeps the number at least 1."""
  for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
    if abs(n) >= size:
      return f"{n / size:.2f} {unit}"
  return f"{n} B"


class Operand(NamedTuple):
  """One array a collective produces: element type (numpy's name), shape and bytes."""

  dtype: str
  shape: tuple[int, ...]
  bytes: int


@dataclasses.dataclass(frozen=True)
class Collective:
  """One collective op of a compiled program.

  Attributes:
    kind: ``"all-reduce"``, ``"reduce-scatter"``, ``"all-gather"``, ``"all-to-all"`` or
      ``"collective-permute"`` (an asynchronous ``-start``/``-done`` pair is one op).
    operands: the arrays the op produces, one :class:`Operand` each: one for most ops,
      several for an op over a tuple (XLA combines reductions into one such op).
    loop_depth: how many ``while`` loops enclose the op (0: it runs once per call).
    executions: how many times the op runs per call of the program when it runs whenever
      its computation is reached: the product of the enclosing loops' trip counts (plus one
      for a loop's condition, evaluated once more to stop), summed over the places that
      call its computation; ``None`` where a loop's trip count is not in the text. For a
      ``conditional`` op it is an upper bound: the count if its branch were taken every
      time.
    conditional: whether the op sits in a branch of a ``conditional`` (:func:`jax.lax.cond`,
      :func:`jax.lax.switch`, a micro-batch loop under a traced ``active_micro_batches``),
      on some path from the program's entry: it runs only when its branch is taken, so
      ``executions`` is at most what runs, and ops in sibling branches never both run.
    replica_groups: the device groups that communicate, as logical device ids (positions in
      the program's device assignment: for a program on one mesh, ``mesh.devices.flat``
      order); ``()`` where the text says every device (``replica_groups={}``) and no mesh
      is known; ``None`` where the text does not give them (collective permutes).
    source_target_pairs: a collective permute's ``(source, target)`` pairs, else ``None``.
    mesh_axes: the mesh axes the op communicates over, in mesh order, where they can be told
      (from the text's ``mesh[...] {...}`` form, or by matching the device groups against the
      program's mesh), else ``None``.
    groups: the text's own spelling of the groups (``replica_groups=`` or
      ``source_target_pairs=``), kept whether or not it could be read.
    name: the op's name in the HLO text.
    computation: the HLO computation that holds it.
    line: the op's full line of HLO text.
  """

  kind: str
  operands: tuple[Operand, ...]
  loop_depth: int
  executions: int | None
  conditional: bool
  replica_groups: tuple[tuple[int, ...], ...] | None
  source_target_pairs: tuple[tuple[int, int], ...] | None
  mesh_axes: tuple[str, ...] | None
  groups: str
  name: str
  computation: str
  line: str = dataclasses.field(repr=False, compare=False)

  @property
  def in_loop(self) -> bool:
    """Whether the op sits inside a ``while`` loop (runs once per iteration)."""
    return self.loop_depth > 0

  @property
  def bytes(self) -> int:
    """Bytes of the op's result(s), per device: the sum over its operands."""
    return sum(o.bytes for o in self.operands)

  @property
  def dtype(self) -> str | tuple[str, ...]:
    """The result's element type, or one per operand for an op over a tuple."""
    dtypes = tuple(o.dtype for o in self.operands)
    return dtypes[0] if len(dtypes) == 1 else dtypes

  @property
  def shape(self) -> tuple[int, ...] | tuple[tuple[int, ...], ...]:
    """The result's shape, or one per operand for an op over a tuple."""
    return self.shapes[0] if len(self.operands) == 1 else self.shapes

  @property
  def shapes(self) -> tuple[tuple[int, ...], ...]:
    """One shape per operand, for a single-operand op too."""
    return tuple(o.shape for o in self.operands)

  @property
  def is_tuple(self) -> bool:
    return len(self.operands) != 1

  def __repr__(self) -> str:
    arrays = ", ".join(f"{o.dtype}[{','.join(map(str, o.shape))}]" for o in self.operands)
    arrays = arrays if len(self.operands) == 1 else f"({arrays})"
    where = f", loop depth {self.loop_depth}" if self.loop_depth else ""
    where += ", in a conditional branch" if self.conditional else ""
    over = f", over {self.mesh_axes}" if self.mesh_axes is not None else ""
    return f"<{self.kind} {arrays} {format_bytes(self.bytes)}{where}{over}>"


def _check_kind(kind: Any) -> tuple[str, ...] | None:
  if kind is None:
    return None
  kinds = (kind,) if isinstance(kind, str) else tuple(kind)
  unknown = [k for k in kinds if k not in KINDS]
  if unknown or not kinds:
    raise ValueError(
        f"kind={kind!r} is not a collective kind; the kinds are {', '.join(KINDS)} (a "
        "string, or a tuple of them), or None for every kind.")
  return kinds


@dataclasses.dataclass(frozen=True)
class Collectives:
  """The collectives of one compiled program, as :func:`jaxaccum.planning.collectives` returns them.

  Iterate over it (or index it) for the :class:`Collective` ops. ``str(result)`` (or
  :meth:`summary`) is a table per kind: ops, their bytes, how many sit inside a loop, the
  deepest, and how many times they run per call where the loops' trip counts are known
  (:meth:`max_executions`: marked ``≤``, an upper bound, where some sit in conditional
  branches).

  Attributes:
    ops: the ops, in the order of the HLO text's computations.
    num_loops: how many ``while`` loops the program runs (nested ones included).
    mesh_shape: the mesh the device groups were matched against, as ``(axis, size)`` pairs,
      or ``None`` when no mesh was known.
  """

  ops: tuple[Collective, ...]
  num_loops: int = 0
  mesh_shape: tuple[tuple[str, int], ...] | None = None
  # The program's call graph (computation -> its calls), read by max_executions.
  _calls: Mapping[str, tuple[_Call, ...]] = dataclasses.field(
      default_factory=dict, repr=False, compare=False)
  _entry: str | None = dataclasses.field(default=None, repr=False, compare=False)
  # Every computation the entry reaches: its instruction lines and its loop depth.
  _lines: Mapping[str, tuple[str, ...]] = dataclasses.field(
      default_factory=dict, repr=False, compare=False)
  _depths: Mapping[str, int] = dataclasses.field(
      default_factory=dict, repr=False, compare=False)

  @classmethod
  def from_text(cls, text: str, mesh: Any = None) -> Collectives:
    """Reads compiled HLO text (``compiled.as_text()``).

    Args:
      text: the text of a compiled program.
      mesh: optionally the program's mesh (a :class:`jax.sharding.Mesh`, an abstract mesh,
        or a mapping from axis names to sizes), to name the axes explicit device groups
        communicate over.
    """
    return _parse(text, _mesh_shape(mesh))

  def __iter__(self) -> Iterator[Collective]:
    return iter(self.ops)

  def __len__(self) -> int:
    return len(self.ops)

  @overload
  def __getitem__(self, i: int) -> Collective: ...
  @overload
  def __getitem__(self, i: slice) -> tuple[Collective, ...]: ...
  def __getitem__(self, i: int | slice) -> Collective | tuple[Collective, ...]:
    return self.ops[i]

  def __repr__(self) -> str:
    return f"Collectives({list(self.ops)!r})"

  def select(self, kind: str | Sequence[str] | None = None,
             in_loop: bool | None = None) -> Collectives:
    """The ops of ``kind`` (one or several; ``None``: all) and, with ``in_loop``, only those
    inside (``True``) or outside (``False``) a loop."""
    kinds = _check_kind(kind)
    ops = tuple(c for c in self.ops if (kinds is None or c.kind in kinds)
                and (in_loop is None or c.in_loop == bool(in_loop)))
    return dataclasses.replace(self, ops=ops)

  @property
  def in_loop(self) -> Collectives:
    """The ops inside a loop: each runs once per iteration, not once per call."""
    return self.select(in_loop=True)

  def count(self, kind: str | Sequence[str] | None = None, in_loop: bool | None = None) -> int:
    """How many ops (of ``kind``, inside or outside loops: as :meth:`select`)."""
    return len(self.select(kind, in_loop))

  def bytes(self, kind: str | Sequence[str] | None = None, in_loop: bool | None = None) -> int:
    """Their results' bytes per device, each op counted once (as :meth:`select`)."""
    return sum(c.bytes for c in self.select(kind, in_loop))

  def max_executions(self, kind: str | Sequence[str] | None = None,
                     in_loop: bool | None = None) -> int | None:
    """At most how many times the ops (as :meth:`select`) run per call, together.

    Each op counts its runs over every place that calls its computation and every iteration
    of the loops around it; of the branches of one conditional only the one whose ops run
    most is counted, since one branch runs per execution. Exact when no op is
    ``conditional``; ``None`` where a loop's trip count is not in the text.
    """
    ops = self.select(kind, in_loop).ops
    if self._entry is None:  # built without a program: each op on its own
      runs = [c.executions for c in ops]
      return None if None in runs else sum(r for r in runs if r is not None)
    return _max_runs(self._calls, self._entry, collections.Counter(c.computation for c in ops))

  def computations(self, in_loop: bool | None = None) -> dict[str, tuple[str, ...]]:
    """The program's HLO computations that its entry reaches, by name, each as its
    instruction lines; with ``in_loop``, only those that run inside (``True``: in a
    ``while`` loop's body or condition, or called from there) or outside (``False``) a
    loop. Empty for a :class:`Collectives` built without a program.

    To read other ops than collectives where the loops put them, e.g. the GEMMs that run
    once per micro-batch:

    >>> import jax, jax.numpy as jnp
    >>> import jaxaccum
    >>> def f(w, xs):
    ...   return jax.lax.scan(lambda w, x: (jnp.tanh(x @ w), None), w, xs)[0]
    >>> found = jaxaccum.planning.collectives(f, jax.ShapeDtypeStruct((4, 4), jnp.float32),
    ...                              jax.ShapeDtypeStruct((3, 4, 4), jnp.float32))
    >>> any(" dot(" in line for lines in found.computations(in_loop=True).values()
    ...     for line in lines)
    True
    """
    return {c: lines for c, lines in self._lines.items()
            if in_loop is None or (self._depths[c] > 0) == bool(in_loop)}

  def summary(self) -> str:
    """A table per kind: ops, bytes, in a loop, deepest loop, executions per call (at most,
    marked ``≤``, where some ops sit in conditional branches)."""
    header = ("kind", "ops", "bytes", "in a loop", "loop depth", "runs per call")
    rows: list[tuple[str, ...]] = [header]
    for kind in KINDS:
      ops = [c for c in self.ops if c.kind == kind]
      if not ops:
        continue
      runs = self.max_executions(kind)
      bound = "≤" if any(c.conditional for c in ops) else ""
      rows.append((kind, str(len(ops)), format_bytes(sum(c.bytes for c in ops)),
                   str(sum(c.in_loop for c in ops)), str(max(c.loop_depth for c in ops)),
                   "?" if runs is None else f"{bound}{runs}"))
    loops = f" in a program with {self.num_loops} loop{'s' * (self.num_loops != 1)}"
    title = (f"{len(self.ops)} collective{'s' * (len(self.ops) != 1)}{loops} "
             f"({format_bytes(self.bytes())} of results per device, each op counted once)")
    if len(rows) == 1:
      return title
    widths = [max(len(r[k]) for r in rows) for k in range(len(header))]
    lines = [title] + ["  ".join([r[0].ljust(widths[0])] +
                                 [r[k].rjust(widths[k]) for k in range(1, len(header))])
                       for r in rows]
    if any(c.conditional for c in self.ops):
      lines.append("≤: at most; some ops sit in conditional branches and run only when "
                   "their branch is taken")
    return "\n".join(lines)

  __str__ = summary


# --------------------------------------------------------------------------- parsing


def _computations(text: str) -> tuple[dict[str, list[str]], str | None]:
  comps: dict[str, list[str]] = {}
  entry = current = None
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


class _Call(NamedTuple):
  """One HLO line's calls: a loop's body, run ``trip`` times (``how="while"``; ``None`` if
  unknown), and its condition, one more (evaluated before every iteration and once to
  stop), a conditional's branches (``"branches"``: one of them runs), or other callees
  (``"call"``: fusions, calls, reductions, each run once)."""

  how: str
  callees: tuple[str, ...]
  trip: int | None = 1


def _line_calls(line: str) -> Iterator[_Call]:
  """The calls of one HLO line."""
  found = [(how, c) for how, c in _CALLS.findall(line)
           if not (how == "to_apply" and _OP.search(line))]  # a collective's reduction
  if _WHILE.search(line):
    match = _TRIP.search(line)
    trip = int(match.group(1)) if match else None
    yield _Call("while", tuple(c for how, c in found if how == "body"), trip)
    yield _Call("while", tuple(c for how, c in found if how == "condition"),
                None if trip is None else trip + 1)
    found = [(how, c) for how, c in found if how not in ("body", "condition")]
  branches = [n.strip().lstrip("%") for group in _BRANCHES.findall(line)
              for n in group.split(",") if n.strip()] + _TRUE_FALSE.findall(line)
  if branches:
    yield _Call("branches", tuple(branches))
  if found:
    yield _Call("call", tuple(c for _, c in found))


def _contexts(comps: dict[str, list[str]], entry: str):
  """Per computation reachable from ``entry``: deepest loop nesting, executions per call (a
  sum over call sites, each branch counted as taken; None when a trip count is unknown),
  whether a conditional branch leads to it; the call graph, and the number of while loops."""
  calls = {c: tuple(call for line in lines for call in _line_calls(line))
           for c, lines in comps.items()}
  depth: dict[str, int] = {}
  runs: dict[str, int | None] = collections.defaultdict(int)
  branched: dict[str, bool] = {}
  stack: list[tuple[str, int, int | None, bool]] = [(entry, 0, 1, False)]
  while stack:
    comp, d, times, in_branch = stack.pop()
    if comp not in comps:
      continue
    depth[comp] = max(depth.get(comp, 0), d)
    branched[comp] = branched.get(comp, False) or in_branch
    before = runs[comp]
    runs[comp] = None if before is None or times is None else before + times
    for call in calls[comp]:
      if call.how == "while":
        inner = None if times is None or call.trip is None else times * call.trip
        stack.extend((c, d + 1, inner, in_branch) for c in call.callees)
      else:
        stack.extend((c, d, times, in_branch or call.how == "branches")
                     for c in call.callees)
  loops = sum(bool(_WHILE.search(line)) for c in depth for line in comps[c])
  return depth, dict(runs), branched, {c: calls[c] for c in depth}, loops


def _max_runs(calls: Mapping[str, tuple[_Call, ...]], entry: str,
              counted: Mapping[str, int]) -> int | None:
  """At most how many runs per call of the ops ``counted`` (per computation) the program
  makes: a sum over call sites and loop iterations, the max over a conditional's branches;
  None where a trip count that matters is unknown."""
  memo: dict[str, int | None] = {}

  def runs(comp: str) -> int | None:
    if comp not in memo:
      total: int | None = counted.get(comp, 0)
      for call in calls.get(comp, ()):
        inner = [runs(c) for c in call.callees]
        if None in inner:
          n = None
        else:
          known = [i for i in inner if i is not None]
          n = max(known, default=0) if call.how == "branches" else sum(known)
          if call.how == "while" and n:
            n = None if call.trip is None else n * call.trip
        total = None if total is None or n is None else total + n
      memo[comp] = total
    return memo[comp]

  return runs(entry)


def _top_level(type_str: str) -> list[str]:
  """The elements of a tuple type ``(a, (b, c), d)``; a non-tuple type is one element."""
  s = type_str.strip()
  if not s.startswith("("):
    return [s]
  parts, level, start = [], 0, 1
  for i, ch in enumerate(s):
    if ch in "({[":
      level += 1
    elif ch in ")}]":
      level -= 1
    elif ch == "," and level == 1:
      parts.append(s[start:i])
      start = i + 1
  parts.append(s[start:s.rfind(")")])
  return [p.strip() for p in parts if p.strip()]


def _operands(type_str: str) -> tuple[Operand, ...]:
  out = []
  for hlo_type, dims in _ARRAY.findall(type_str):
    if hlo_type in ("token", "opaque"):
      continue
    name, bits = _DTYPES.get(hlo_type, (hlo_type, None))
    if bits is None:
      digits = re.search(r"\d+", hlo_type)
      if digits is None:
        continue
      bits = int(digits.group())
    shape = tuple(int(d) for d in dims.split(",") if d)
    out.append(Operand(name, shape, math.ceil(math.prod(shape) * bits / 8)))
  return tuple(out)


def _start_result(kind: str, type_str: str) -> str:
  """The results in an async ``-start`` op's type when no ``-done`` names them."""
  if kind == "all-reduce":
    return type_str  # all-reduce-start's type is its result
  # all-gather-start: (operands, results); reduce-scatter-start: ((operands), results);
  # collective-permute-start: (operand, result, u32[], u32[]) with context scalars.
  parts = [p for p in _top_level(type_str) if not re.fullmatch(r"u32\[\](\{[^}]*\})?", p)]
  return parts[-1] if parts else type_str


def _iota(dims: str, reshape: str, perm: str | None) -> np.ndarray:
  shape = [int(d) for d in reshape.split(",")]
  ids = np.arange(math.prod(shape)).reshape(shape)
  if perm:
    ids = ids.transpose([int(p) for p in perm.split(",")])
  return ids.reshape([int(d) for d in dims.split(",")])


def _mesh_groups(ids: np.ndarray, names: Sequence[str], over: Sequence[str]) -> np.ndarray:
  """Device groups over the mesh axes ``over`` of a mesh whose device ids are ``ids``."""
  keep = [names.index(a) for a in names if a not in over]
  ids = ids.transpose(keep + [names.index(a) for a in over])
  size = math.prod(ids.shape[len(keep):])
  return ids.reshape(-1, size)


def _read_groups(raw: str, mesh: tuple[tuple[str, int], ...] | None):
  """(groups, axes named by the text) from a ``replica_groups=`` value; None where unread."""
  if raw.startswith("{"):
    groups = tuple(tuple(int(d) for d in g.split(",") if d.strip())
                   for g in re.findall(r"\{([^{}]*)\}", raw[1:-1]))
    if not groups and mesh is not None:  # {}: every device in one group
      groups = (tuple(range(math.prod(s for _, s in mesh))),)
    return groups, None
  m = _IOTA.match(raw)
  if m:
    return tuple(tuple(int(i) for i in g) for g in _iota(*m.groups())), None
  m = _MESH.match(raw)
  if m:
    sizes = re.findall(r"'([^']+)'=(\d+)", m.group(1))
    names = [n for n, _ in sizes]
    shape = ",".join(s for _, s in sizes)
    ids = _iota(shape, m.group(2) or shape, m.group(3))
    over = re.findall(r"'([^']+)'", m.group(4))
    if names and set(over) <= set(names):
      groups = _mesh_groups(ids, names, over)
      return tuple(tuple(int(i) for i in g) for g in groups), tuple(a for a in names if a in over)
  return None, None


def _axes_of_groups(groups, mesh: tuple[tuple[str, int], ...]) -> tuple[str, ...] | None:
  """The mesh axes whose device groups (in mesh order) are ``groups``, if any are."""
  names = [n for n, _ in mesh]
  ids = np.arange(math.prod(s for _, s in mesh)).reshape([s for _, s in mesh])
  want = {frozenset(g) for g in groups}
  for r in range(len(names) + 1):
    for over in itertools.combinations(names, r):
      if {frozenset(int(i) for i in g) for g in _mesh_groups(ids, names, over)} == want:
        return over
  return None


def _axes_of_pairs(pairs, mesh: tuple[tuple[str, int], ...]) -> tuple[str, ...] | None:
  """The mesh axes along which a permute's pairs move data."""
  sizes = [s for _, s in mesh]
  n = math.prod(sizes)
  if not pairs or any(not 0 <= i < n for p in pairs for i in p):
    return None
  sources = np.unravel_index([src for src, _ in pairs], sizes)
  targets = np.unravel_index([dst for _, dst in pairs], sizes)
  return tuple(axis for (axis, _), src, dst in zip(mesh, sources, targets, strict=True)
               if np.any(src != dst))


def _parse(text: str, mesh: tuple[tuple[str, int], ...] | None) -> Collectives:
  comps, entry = _computations(text)
  if entry is None:
    raise ValueError(
        "no ENTRY computation in this text: pass the text of a compiled program, "
        "jax.jit(f).lower(*args).compile().as_text().")
  depth, runs, branched, calls, loops = _contexts(comps, entry)
  done: dict[str, str] = {}
  for c in depth:
    for line in comps[c]:
      m = _DONE.search(line)
      if m:
        names = re.findall(r"%?([\w.\-]+)\s*$", m.group(2).strip())
        if names:
          done[names[-1]] = m.group(1)
  ops = []
  for c in depth:
    for line in comps[c]:
      m = _OP.search(line)
      if not m:
        continue
      name, result, kind, start = m.groups()
      if start:
        result = done.get(name) or _start_result(kind, result)
      pairs = None
      gm = _GROUPS.search(line)
      pm = _PAIRS.search(line)
      raw = gm.group(1).strip() if gm else (pm.group(1).strip() if pm else "")
      groups, axes = _read_groups(raw, mesh) if gm else (None, None)
      if pm:
        pairs = tuple((int(s), int(t)) for s, t in re.findall(r"\{(\d+),\s*(\d+)\}", raw))
      if mesh is not None:
        if groups:
          axes = _axes_of_groups(groups, mesh) or axes
        elif pairs is not None:
          axes = _axes_of_pairs(pairs, mesh)
      ops.append(Collective(kind=kind, operands=_operands(result), loop_depth=depth[c],
                            executions=runs[c], conditional=branched[c],
                            replica_groups=groups,
                            source_target_pairs=pairs, mesh_axes=axes, groups=raw,
                            name=name, computation=c, line=line.strip()))
  return Collectives(ops=tuple(ops), num_loops=loops, mesh_shape=mesh, _calls=calls,
                     _entry=entry, _lines={c: tuple(comps[c]) for c in depth},
                     _depths=dict(depth))


# ------------------------------------------------------------------------ compiling


def _mesh_shape(mesh: Any) -> tuple[tuple[str, int], ...] | None:
  if mesh is None:
    return None
  shape = mesh if isinstance(mesh, Mapping) else getattr(mesh, "shape", None)
  if not isinstance(shape, Mapping):
    raise TypeError(
        f"mesh must be a jax.sharding.Mesh, an abstract mesh or a mapping from axis names to "
        f"sizes, got {mesh!r} of type {type(mesh).__name__}.")
  return tuple((str(k), int(v)) for k, v in shape.items())


def _program_mesh(compiled: Any) -> tuple[tuple[str, int], ...] | None:
  """The one mesh the compiled program's inputs and outputs are placed on, if there is one."""
  shardings = []
  for which in ("input_shardings", "output_shardings"):
    try:
      shardings += jax.tree.leaves(getattr(compiled, which))
    except Exception:  # a backend that does not say
      continue
  meshes = {_mesh_shape(s.mesh) for s in shardings
            if isinstance(s, jax.sharding.NamedSharding)}
  if len(meshes) != 1:
    abstract = jax.sharding.get_abstract_mesh()
    return None if abstract.empty else _mesh_shape(abstract)
  return meshes.pop()


def _is_array_like(leaf: Any) -> bool:
  return isinstance(leaf, (jax.Array, np.ndarray, np.generic, jax.ShapeDtypeStruct, bool, int,
                           float, complex)) or (hasattr(leaf, "shape") and hasattr(leaf, "dtype"))


def _not_lowerable(args: tuple, kwargs: dict) -> list[str]:
  return [f"{prefix}{jax.tree_util.keystr(path)} = {leaf!r:.60} "
          f"(of type {type(leaf).__name__})"
          for prefix, tree in (("args", args), ("kwargs", kwargs))
          for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]
          if not _is_array_like(leaf)]


def _compile(fn: Any, args: tuple, kwargs: dict) -> Any:
  if isinstance(fn, jax.stages.Compiled | jax.stages.Lowered):
    if args or kwargs:
      raise TypeError(
          f"fn is already a {type(fn).__name__} program, so it takes no arguments here; got "
          f"{len(args)} positional and {len(kwargs)} keyword argument(s). Pass the jitted "
          "function instead, or drop the arguments.")
    return fn.compile() if isinstance(fn, jax.stages.Lowered) else fn
  if not callable(fn):
    raise TypeError(
        f"fn must be a function (jitted or not), a jax.stages.Lowered or a "
        f"jax.stages.Compiled, got {fn!r:.80} of type {type(fn).__name__}.")
  jitted: Any = fn if hasattr(fn, "lower") else jax.jit(fn)
  try:
    lowered = jitted.lower(*args, **kwargs)
  except TypeError as e:
    bad = _not_lowerable(args, kwargs)
    if not bad:
      raise
    raise TypeError(
        "collectives could not lower fn for these arguments, which are not arrays: "
        f"{'; '.join(bad)}. Pass arrays or jax.ShapeDtypeStruct(shape, dtype, sharding=...) "
        "for them (or jit fn with static_argnums / static_argnames for arguments that are "
        "not arrays)."
    ) from e
  return lowered.compile()


def collectives(fn: Callable[..., Any] | Any, /, *args: Any, **kwargs: Any) -> Collectives:
  """Compiles ``fn`` for ``args`` (never runs it) and returns the collectives of the program.

  The compiled program is what runs, after XLA's passes: the all-reduces the partitioner
  inserted for a sharded batch, the ones it hoisted out of loops or combined into one op over
  a tuple, and those ``shard_map`` code asked for. Each op says how many loops deep it sits
  (``in_loop``, ``loop_depth``; one ``lax.scan`` or ``fori_loop`` is one loop) and, where the
  loops' trip counts are known, how many times it runs per call (``executions``): an
  all-reduce at depth 2 of a 4-micro-batch scan around a 3-layer scan runs 12 times per step.

  Args:
    fn: a jitted function (``jax.jit(f, ...)``), anything :func:`jax.jit` accepts (it is
      jitted here), or an already lowered or compiled program (``jax.stages.Lowered`` /
      ``Compiled``, then with no arguments).
    *args: the arguments to compile for: arrays, or :class:`jax.ShapeDtypeStruct` s (with a
      ``sharding`` for sharded inputs) to compile without allocating anything.
    **kwargs: keyword arguments of ``fn``, likewise.

  Returns:
    A :class:`Collectives`: iterate over it for each :class:`Collective` (``kind``,
    ``dtype``, ``shape``, ``bytes``, ``in_loop``, ``loop_depth``, ``executions``,
    ``replica_groups``, ``mesh_axes``); ``print`` it for a table per kind; ``.in_loop``,
    ``.count(kind=None, in_loop=None)`` and ``.bytes(...)`` select and add up. Bytes are the
    sizes of the ops' results per device (an all-gather's gathered array, a reduce-scatter's
    shard). The mesh axes are read from the text where it names them, else by matching the
    device groups against the mesh the program's inputs are placed on (or the mesh set with
    :func:`jax.set_mesh`).

  Raises:
    TypeError: ``fn`` is not callable; arguments that are not arrays (named, with their
      paths); arguments given with an already compiled program.

  >>> import jax, jax.numpy as jnp
  >>> import jaxaccum
  >>> def f(x):
  ...   return jnp.sin(x) * 2
  >>> jaxaccum.planning.collectives(f, jax.ShapeDtypeStruct((8, 4), jnp.float32)).count()
  0
  """
  return from_compiled(_compile(fn, args, kwargs))


def from_compiled(compiled: Any) -> Collectives:
  """The collectives of a :class:`jax.stages.Compiled` program."""
  return _parse(compiled.as_text(), _program_mesh(compiled))
