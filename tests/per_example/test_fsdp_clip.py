"""DP-SGD with FSDP parameters: every placement x method clips each example's WHOLE gradient.

Parameters sharded over the data axis (FSDP) on 8 CPU devices, ``clip_per_example`` under
``data_axis=DataParallel(...)``: each example's norm must be that of its gradient with
respect to the gathered (full) parameters, and its clip factor apply to the whole of it,
whatever ``param_gather``, ``grad_scatter`` and ``overlap_grad_reduce`` say; clipping each
shard's slice of the gradient on its own lets one example add up to ``sqrt(8) C``.

The reference never goes through the library: ``jax.vmap`` of ``jax.grad`` on each example
alone, on the unsharded parameters, its norm taken, ``min(1, C / |g_e|)`` applied by hand
(per group under per-layer clip norms), summed (a mean divides by the batch). A seeded
NumPy fuzz draws one structure per placement x method (the widths, which leaves are sharded
and along which dimension, the loss's kind, B, N, one global clip norm or per-layer ones),
compiles it once and runs several drawn cases through it: C a drawn multiple of the true
norms' median, and sensitivity cases where one real example (drawn, scaled so that every
shard's slice of its gradient exceeds C) sits among rows of zero gradient; its contribution
must be at most C (1 + 1e-5), and the clipped sum match the reference (float32, 1e-5
relative to each leaf's largest entry). ``Auto`` mesh axes (the parameters placed sharded,
their type replicated) are checked the same way at the default placement.
"""

import itertools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import jaxaccum

D = 8
METHODS = ("materialize", "ghost", "auto")
PLACEMENTS = [(g, s, o) for g, s in itertools.product(("step", "micro_batch"), repeat=2)
              for o in (False, True)]
CASES = 4  # drawn cases per compiled step: 2 with C against the true norms, 2 sensitivity
RTOL = 1e-5


def loss_fn(kind):
  def loss(params, batch):
    x, y, s = batch
    h = jnp.tanh(x @ params["w1"] + params["b1"])
    per_row = s * jnp.sum((h @ params["w2"] - y) ** 2, axis=-1)
    return jnp.mean(per_row) if kind == "mean" else jnp.sum(per_row)
  return loss


def _draw_structure(rng, explicit):
  d_in, hid, d_out = (int(rng.choice(c)) for c in ((8, 16), (8, 16), (1, 2, 8)))
  shapes = {"w1": (d_in, hid), "b1": (hid,), "w2": (hid, d_out)}
  specs = {}
  for name, shape in shapes.items():
    options = [None] + [dim for dim, size in enumerate(shape) if size % D == 0]
    specs[name] = options[int(rng.integers(len(options)))]
  if explicit and all(v is None for v in specs.values()):
    specs["w1"] = 0  # at least one FSDP leaf
  n = int(rng.choice((1, 2, 4)))
  b = D * n * int(rng.choice((1, 2)))
  return dict(shapes=shapes, specs=specs, n=n, b=b, kind=str(rng.choice(("mean", "sum"))))


def _spec(dim, ndim):
  if dim is None:
    return P()
  return P(*[("data" if k == dim else None) for k in range(ndim)])


def _reference(loss, params, batch, c):
  """The clipped sum by hand: per-example jax.grad on the full parameters."""
  x, y, s = batch

  def one(xe, ye, se):
    return jax.grad(loss)(params, (xe[None], ye[None], se[None]))

  g = jax.vmap(one)(x, y, s)  # each leaf (B, ...)
  sq = {k: jnp.sum(v.reshape(v.shape[0], -1) ** 2, axis=1) for k, v in g.items()}
  if isinstance(c, dict):  # per-layer: each leaf its own group
    norms = {k: jnp.sqrt(sq[k]) for k in g}
    f = {k: jnp.minimum(1.0, c[k] / norms[k]) for k in g}
  else:
    whole = jnp.sqrt(sum(sq.values()))
    f = {k: jnp.minimum(1.0, c / whole) for k in g}
    norms = whole
  clipped = {k: jnp.einsum("e,e...->...", f[k], v) for k, v in g.items()}
  return clipped, norms


def _norm(tree):
  return float(jnp.sqrt(sum(jnp.sum(jnp.asarray(v, jnp.float32) ** 2)
                            for v in jax.tree.leaves(tree))))


def _check(structure, method, placement, seed, explicit=True):
  rng = np.random.default_rng(seed)
  mesh = jax.make_mesh((D,), ("data",), axis_types=(
      AxisType.Explicit if explicit else AxisType.Auto,))
  st = structure
  loss = loss_fn(st["kind"])
  per_layer = st["per_layer"]
  gather, scatter, overlap = placement
  dp = jaxaccum.DataParallel("data", mesh=mesh, param_gather=gather, grad_scatter=scatter,
                             overlap_grad_reduce=overlap)

  def step(params, batch, c):
    clip = jaxaccum.dp.clip_per_example(c, method)
    return jaxaccum.dp.per_example_value_and_grad(loss, clip, num_micro_batches=st["n"],
                                               reduce=st["kind"], data_axis=dp)(params, batch)

  step = jax.jit(step)
  reference = jax.jit(lambda p, b, c: _reference(loss, p, b, c))
  scale = 1.0 / st["b"] if st["kind"] == "mean" else 1.0
  for case in range(CASES):
    # w1 scaled by 1 / sqrt(d_in): pre-activations of order 1, so that no tanh saturates (a
    # saturated unit's derivative, ~1e-7, rounds to 0 or not depending on how XLA fuses tanh,
    # which moves a gradient entry by the tolerance between two programs).
    params = {k: jnp.asarray(rng.normal(size=v) / (np.sqrt(v[0]) if k == "w1" else 1.0),
                             jnp.float32) for k, v in st["shapes"].items()}
    b, d_in, d_out = st["b"], st["shapes"]["w1"][0], st["shapes"]["w2"][1]
    x = rng.normal(size=(b, d_in))
    y = rng.normal(size=(b, d_out))
    s = np.ones(b)
    sensitivity = case >= CASES // 2
    if sensitivity:  # one real example among rows of zero gradient
      s = np.zeros(b)
      s[int(rng.integers(b))] = 1.0
      y = y * 100.0  # a large residual, not a saturated tanh: a large gradient everywhere
    batch = tuple(jnp.asarray(v, jnp.float32) for v in (x, y, s))
    unit = {k: 1.0 for k in params} if per_layer else 1.0
    _, norms = reference(params, batch, unit)  # unclipped norms (C = 1 clips the large)
    real = s > 0
    norms = jax.tree.map(lambda v, real=real: np.asarray(v)[real], norms)
    if sensitivity:  # C well below the example's norm: every shard's slice exceeds it too
      c = jax.tree.map(lambda v: float(np.min(v)) * rng.uniform(0.01, 0.1), norms)
    else:
      c = jax.tree.map(lambda v: float(np.median(v)) * rng.uniform(0.3, 3.0), norms)
    c = jax.tree.map(jnp.float32, c)
    want, _ = reference(params, batch, c)
    want = jax.tree.map(lambda v: v * scale, want)
    placed = {k: jax.device_put(v, NamedSharding(mesh, _spec(st["specs"][k], v.ndim)))
              for k, v in params.items()}
    placed_batch = jax.device_put(batch, NamedSharding(mesh, P("data")))
    _, got = step(placed, placed_batch, c)
    got = jax.tree.map(np.asarray, got)
    what = f"{method} {placement} {st} case {case}"
    for k in want:
      atol = RTOL * float(np.max(np.abs(want[k])))
      chex.assert_trees_all_close(got[k], want[k], rtol=RTOL, atol=atol, custom_message=what)
    if sensitivity:
      contribution = _norm(got) / scale
      bound = (float(np.sqrt(sum(v ** 2 for v in jax.tree.leaves(c)))) if per_layer
               else float(c))
      assert contribution <= bound * (1 + 1e-5), (contribution / bound, what)
      if per_layer:
        for k in got:
          assert _norm(got[k]) / scale <= float(c[k]) * (1 + 1e-5), (k, what)


def _structures(explicit, count, seed):
  rng = np.random.default_rng(seed)
  out = []
  for k in range(count):
    st = _draw_structure(rng, explicit)
    # Alternating over the placements, shifted by one per method: every method meets
    # per-layer clip norms under half the placements, every placement under some method.
    st["per_layer"] = (k + k // len(PLACEMENTS)) % 2 == 1
    out.append(st)
  return out


# One structure per placement x method.
EXPLICIT = list(itertools.product(METHODS, PLACEMENTS))
_STRUCTURES = _structures(True, len(EXPLICIT), seed=49)


@pytest.mark.parametrize(("k", "method", "placement"),
                         [(k, m, p) for k, (m, p) in enumerate(EXPLICIT)],
                         ids=[f"{m}-{g}-{s}-{'overlap' if o else 'loop'}"
                              for m, (g, s, o) in EXPLICIT])
def test_fsdp_clip_every_placement(k, method, placement):
  _check(_STRUCTURES[k], method, placement, seed=1000 + k)


_AUTO = _structures(False, len(METHODS), seed=50)


@pytest.mark.parametrize("k", range(len(METHODS)), ids=METHODS)
def test_fsdp_clip_auto_mesh(k):
  # Auto axes: the parameters are placed sharded, but their type is replicated, so the
  # default placement is the only one (the others refuse: no FSDP parameter in the types).
  _check(_AUTO[k], METHODS[k], ("step", "micro_batch", False), seed=2000 + k, explicit=False)
