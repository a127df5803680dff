"""Compiling for a described NVIDIA GPU that is not there (deviceless ahead-of-time compilation).

XLA's GPU compiler needs the device's properties (compute capability, streaming
multiprocessors, shared memory, memory size, ...), not the device. JAX builds a *topology*
of described GPUs from a text ``GpuTargetConfigProto``
(:func:`jax.experimental.topologies.get_topology_desc`); arrays placed on a mesh of its
devices lower and compile as they would on the real machine, and
:meth:`~jax.stages.Compiled.memory_analysis` gives each device's memory. Nothing runs.

What it needs:

* the CUDA compiler plugin and ``ptxas``, compile-only: ``pip install 'jaxaccum[gpu-plan]'``
  (``jax-cuda12-plugin`` and ``jax-cuda12-pjrt`` of the installed jax's version, and
  ``nvidia-cuda-nvcc-cu12``);
* ``JAX_PLATFORMS=cpu`` in the environment before JAX initialises its backends (otherwise
  JAX tries to start the CUDA plugin on a machine without a GPU and the topology is refused).

jaxaccum ships descriptions of four devices, written from their published properties
(``jaxaccum/gpu_targets/*.txtpb``): ``"h100"`` (H100 SXM5 80 GB), ``"h200"`` (H200 SXM
141 GB), ``"a100-80gb"`` (A100 SXM4 80 GB) and ``"b200"``. On a machine with the real GPU,
:func:`capture_gpu_target` returns that device's exact description, to plan elsewhere later.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.metadata
import importlib.resources
import importlib.util
import math
import os
import re
import shutil
import sys
import tempfile
from collections.abc import Iterator, Sequence
from typing import Any, cast

import jax
import numpy as np

GPU_TARGETS = ("h100", "h200", "a100-80gb", "b200")
"""The names of the GPU descriptions shipped with jaxaccum."""

_ALIASES = {"h100-sxm": "h100", "h100-80gb": "h100", "a100": "a100-80gb", "h200-141gb": "h200"}

# Fields that newer XLA versions write into a captured description and that the supported
# jaxlib's parser rejects; they describe collective buffers, not code generation.
_UNKNOWN_TO_THIS_JAXLIB = ("collective_memory_granularity",)

# Hosts of this many GPUs each when ``num_devices`` is larger (a DGX/HGX node).
DEVICES_PER_HOST = 8

_INSTALL = (
    "Compiling for a described GPU needs the CUDA compiler plugin and ptxas: install them with "
    "`pip install 'jaxaccum[gpu-plan]'` (or `pip install jax-cuda12-plugin=={v} "
    "jax-cuda12-pjrt=={v} nvidia-cuda-nvcc-cu12` for jax {v})."
)


class GpuTarget:
  """A resolved GPU description: its name, text, and the properties the planner reports."""

  def __init__(self, name: str, text: str):
    self.name = name
    self.text = text
    self.device_name = _field(text, "device_description_str") or _field(text, "name") or name
    memory = _field(text, "device_memory_size")
    self.memory_bytes = int(memory) if memory else None

  def __repr__(self) -> str:
    return f"GpuTarget({self.name!r}, device={self.device_name!r})"


def _field(text: str, name: str) -> str | None:
  m = re.search(rf"^\s*{name}\s*:\s*\"?([^\"\n]*)\"?\s*$", text, re.M)
  return m.group(1).strip() if m else None


def resolve(target: Any) -> GpuTarget:
  """A shipped name, the text of a ``GpuTargetConfigProto``, or a path to a file with it."""
  if isinstance(target, GpuTarget):
    return target
  if isinstance(target, os.PathLike):
    return GpuTarget(os.fspath(target), pathlib_read(target))
  if not isinstance(target, str):
    raise TypeError(
        f"target must be the name of a shipped GPU description ({', '.join(GPU_TARGETS)}), "
        f"the text of a GpuTargetConfigProto or a path to a .txtpb file, got {target!r} of "
        f"type {type(target).__name__}."
    )
  if "gpu_device_info" in target:
    return GpuTarget("custom", _clean(target))
  key = _ALIASES.get(target.strip().lower(), target.strip().lower())
  if key in GPU_TARGETS:
    text = importlib.resources.files("jaxaccum").joinpath(f"gpu_targets/{key}.txtpb").read_text()
    return GpuTarget(key, text)
  if target.endswith((".txtpb", ".textproto", ".pbtxt")) and os.path.exists(target):
    return GpuTarget(target, pathlib_read(target))
  raise ValueError(
      f"target={target!r} is not a GPU description jaxaccum ships; those are "
      f"{', '.join(map(repr, GPU_TARGETS))}. For another GPU pass the text of its "
      "GpuTargetConfigProto (jaxaccum.planning.capture_gpu_target() returns it on a machine "
      "with that GPU) or the path of a .txtpb file holding it."
  )


def pathlib_read(path: Any) -> str:
  with open(path, encoding="utf-8") as f:
    return _clean(f.read())


def _clean(text: str) -> str:
  lines = [ln for ln in text.splitlines()
           if not any(re.match(rf"\s*{f}\s*:", ln) for f in _UNKNOWN_TO_THIS_JAXLIB)]
  return "\n".join(lines) + "\n"


def check_installed() -> None:
  """Raises a clear ImportError when the CUDA compile-only packages are missing."""
  install = _INSTALL.format(v=jax.__version__)
  missing = []
  for dist in ("jax-cuda12-plugin", "jax-cuda12-pjrt"):
    try:
      version = importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
      missing.append(dist)
      continue
    if version != jax.__version__:
      raise ImportError(
          f"{dist} {version} does not match jax {jax.__version__}: the CUDA plugin must be "
          f"the same version as jax. " + install)
  if missing:
    raise ImportError(f"{' and '.join(missing)} not installed. " + install)
  if importlib.util.find_spec("nvidia.cuda_nvcc") is None and shutil.which("ptxas") is None:
    raise ImportError("ptxas (from nvidia-cuda-nvcc-cu12) was not found. " + install)


# What XLA's C++ code writes on stderr that tells a planner nothing: the CUDA runtime stub
# finding no driver (there is no GPU here, by design), absl's note printed before its first
# line, and the rematerialisation pass's report that a program does not fit XLA's own
# limit (the described device's memory, not the planner's budget; the plan's table gives
# each candidate's peak against the budget).
_COMPILER_NOISE = re.compile(
    r"cudart_stub\.cc.*Could not find cuda drivers"
    r"|All log messages before absl::InitializeLog\(\) is called are written to STDERR"
    r"|hlo_rematerialization.*(Can't reduce memory use below|rematerializ)")


@contextlib.contextmanager
def quiet_compiler_stderr() -> Iterator[None]:
  """Holds back what is written on the process's stderr (file descriptor 2, where XLA's
  C++ code logs) inside the block, then passes on every line but the noise above.

  Python's own ``sys.stderr`` writes inside the block are passed on too, in order.
  """
  try:
    sys.stderr.flush()
    saved = os.dup(2)
  except (OSError, ValueError):  # no file descriptor 2 to capture: leave it be
    yield
    return
  with tempfile.TemporaryFile() as held:
    os.dup2(held.fileno(), 2)
    try:
      yield
    finally:
      try:
        sys.stderr.flush()
      finally:
        os.dup2(saved, 2)
        os.close(saved)
      held.seek(0)
      text = held.read().decode("utf-8", errors="replace")
  kept = [line for line in text.splitlines(keepends=True)
          if line.strip() and not _COMPILER_NOISE.search(line)]
  if kept:
    sys.stderr.write("".join(kept))
    sys.stderr.flush()


@functools.lru_cache(maxsize=32)
def _topology(text: str, num_devices: int) -> Any:
  from jax.experimental import topologies

  per_host = min(num_devices, DEVICES_PER_HOST)  # gpu_devices checks that it divides
  shape = f"1x{num_devices // per_host}x{per_host}"
  try:
    with quiet_compiler_stderr():
      return topologies.get_topology_desc(platform="cuda", target_config=text,
                                          topology=shape)
  except NotImplementedError:
    raise RuntimeError(
        "JAX refused to build a CUDA topology because it was initialised without "
        f"JAX_PLATFORMS=cpu (jax_platforms is {jax.config.values['jax_platforms']!r}). Set it "
        "before JAX initialises: run `JAX_PLATFORMS=cpu python your_script.py`, or put "
        "`os.environ['JAX_PLATFORMS'] = 'cpu'` at the top of the script, before the first "
        "`jax.devices()`, `jax.jit` call or array is created (in a notebook: restart the "
        "kernel first)."
    ) from None
  except jax.errors.JaxRuntimeError as e:
    if "Failed to parse GpuTargetConfigProto" in str(e):
      raise ValueError(
          "the GPU description could not be parsed as a GpuTargetConfigProto by jaxlib "
          f"{jax.__version__} (XLA logged the line and the field it rejects on stderr). "
          "A description captured with a newer jaxlib may hold fields this one does not "
          "know: delete those lines."
      ) from None
    raise


def gpu_devices(target: Any, num_devices: int = 1) -> list[Any]:
  """``num_devices`` described GPUs of ``target`` (the same device objects on each call)."""
  if (isinstance(num_devices, bool) or not isinstance(num_devices, (int, np.integer))
      or num_devices < 1):
    raise ValueError(f"num_devices must be a positive int, got num_devices={num_devices!r}.")
  num_devices = int(num_devices)
  if num_devices > DEVICES_PER_HOST and num_devices % DEVICES_PER_HOST:
    raise ValueError(
        f"num_devices={num_devices}: more than {DEVICES_PER_HOST} GPUs are described as hosts "
        f"of {DEVICES_PER_HOST}, so pass a multiple of {DEVICES_PER_HOST}.")
  gpu = resolve(target)
  check_installed()
  return list(_topology(gpu.text, num_devices).devices)


def target_mesh(target: Any, shape: int | Sequence[int] = (1,),
                axis_names: Sequence[str] = ("data",)) -> jax.sharding.Mesh:
  """A :class:`jax.sharding.Mesh` of described GPUs, to compile for them without them.

  Arrays (or :class:`jax.ShapeDtypeStruct` s) placed on this mesh with
  :class:`~jax.sharding.NamedSharding` lower and compile for the described GPU; nothing can
  run on it. Needs ``pip install 'jaxaccum[gpu-plan]'`` and ``JAX_PLATFORMS=cpu`` set before
  JAX initialises. Meshes of more than 8 GPUs are described as hosts of 8.

  Args:
    target: a shipped description (``"h100"``, ``"h200"``, ``"a100-80gb"``, ``"b200"``), the
      text of a ``GpuTargetConfigProto`` (see :func:`capture_gpu_target`) or a path to it.
    shape: the mesh's shape; its product is the number of GPUs.
    axis_names: one name per axis of ``shape``.

  Returns:
    The mesh. Calls with the same target and device count share the same device objects.

  Raises:
    ImportError: the CUDA compile-only packages are missing (install ``jaxaccum[gpu-plan]``).
    RuntimeError: JAX was initialised without ``JAX_PLATFORMS=cpu``.
    ValueError: an unknown target name, a description jaxlib cannot parse, a bad shape.

  Example (needs the ``gpu-plan`` extra)::

    import os
    os.environ["JAX_PLATFORMS"] = "cpu"
    import jax, jax.numpy as jnp, jaxaccum
    from jax.sharding import NamedSharding, PartitionSpec as P
    mesh = jaxaccum.planning.target_mesh("h100", (8,), ("data",))
    x = jax.ShapeDtypeStruct((64, 1024), jnp.bfloat16, sharding=NamedSharding(mesh, P("data")))
    compiled = jax.jit(lambda x: (x @ x.T).sum()).lower(x).compile()
  """
  # A lone entry is checked with the others just below.
  shape = tuple(shape) if isinstance(shape, (tuple, list)) else (cast(int, shape),)
  axis_names = (axis_names,) if isinstance(axis_names, str) else tuple(axis_names)
  if not shape or any(isinstance(s, bool) or not isinstance(s, (int, np.integer)) or s < 1
                      for s in shape):
    raise ValueError(f"shape must be a tuple of positive ints, got shape={shape!r}.")
  if len(axis_names) != len(shape):
    raise ValueError(
        f"axis_names={axis_names!r} names {len(axis_names)} axes but shape={shape!r} has "
        f"{len(shape)}; give one name per axis.")
  devices = gpu_devices(target, math.prod(shape))
  return jax.sharding.Mesh(np.array(devices, dtype=object).reshape(shape), axis_names)


def capture_gpu_target(device: Any = None) -> str:
  """The text ``GpuTargetConfigProto`` of a real GPU, to plan for it on another machine.

  Run this once on a machine with the GPU, save the text, and pass it (or the file's path)
  as ``target=`` to :func:`jaxaccum.plan` anywhere. The description is exactly what XLA's
  compiler sees on that device (including the CUDA and cuDNN versions there).

  Args:
    device: a GPU device (default: the first of ``jax.devices()``).

  Returns:
    The text of the device's ``GpuTargetConfigProto``.

  Raises:
    ValueError: the device is not a CUDA GPU, or this jaxlib does not expose its description.

  Example (on a machine with a GPU)::

    import pathlib, jaxaccum
    pathlib.Path("my_gpu.txtpb").write_text(jaxaccum.planning.capture_gpu_target())
    # later, on a laptop: jaxaccum.plan(loss, params, batch, target="my_gpu.txtpb")
  """
  device = jax.devices()[0] if device is None else device
  if device.platform not in ("gpu", "cuda"):
    raise ValueError(
        f"capture_gpu_target needs a CUDA GPU, got device {device} (platform "
        f"{device.platform!r}). Run it on the machine with the GPU you want to describe.")
  # jaxlib's compiled extension (no stubs), which has get_topology_for_devices.
  xla_ext = importlib.import_module("jaxlib._jax")
  getter = getattr(xla_ext, "get_topology_for_devices", None)
  if getter is None:
    from jaxlib import xla_client
    getter = getattr(xla_client, "get_topology_for_devices", None)
  if getter is None:
    raise ValueError(f"jaxlib {jax.__version__} does not expose get_topology_for_devices.")
  topology = getter([device])
  text = getattr(topology, "target_config", None)
  if not text:
    raise ValueError(f"jaxlib {jax.__version__} gives no target_config for {device}.")
  return text
