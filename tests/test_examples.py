"""Every example of issue 7 runs in a tiny configuration and gives the right numbers; the
benchmark's methods agree with the full batch (its report, and those of ``bench_features``
and ``bench_per_example``, are read from their tiny runs in ``tests/test_benchmarks.py``).

The examples compare three or four training runs from one initialisation; a float32
gradient equal to the full batch's up to round-off keeps the runs within ~1e-6 relative
over a few steps, so 1e-5 separates "the same computation" from a different one (the
per-micro-batch-means bug and BatchNorm's ghost batches move the numbers by >= 1e-3).
"""

import importlib.util
import pathlib
import sys

import jax
import numpy as np
import optax
import pytest

from tests._util import assert_close

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _load(relpath: str):
  path = ROOT / relpath
  if str(path.parent) not in sys.path:
    sys.path.insert(0, str(path.parent))  # the benchmark imports its sibling _common
  name = f"_issue7_{path.stem}"
  if name not in sys.modules:
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
  return sys.modules[name]


def _is_png(path: pathlib.Path) -> bool:
  return path.exists() and path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_char_lm_accumulated_matches_full_batch_and_micro_means_do_not(tmp_path, capsys):
  char_lm = _load("examples/char_lm.py")
  cfg = char_lm.Config(steps=3, batch_size=8, num_micro_batches=4, seq_len=16, min_len=2,
                       d_model=16, heads=2, layers=1, learning_rate=1e-2, max_chars=50_000)
  out = char_lm.main(cfg, out_dir=tmp_path, progress=False)
  printed = capsys.readouterr().out
  for words in ("effective batch", "micro-batches: 4 of 2", "largest |gradient",
                "compiled memory", f"plot: {tmp_path}"):
    assert words in printed, printed
  assert _is_png(out["plot"])
  # The micro-batches really hold different numbers of tokens, so the bug shows.
  assert len(set(out["tokens_per_micro_batch"])) > 1, out["tokens_per_micro_batch"]
  full = np.asarray(out["curves"]["full batch"])
  acc = np.asarray(out["curves"]["accumulated"])
  bug = np.asarray(out["curves"]["per-micro-batch means"])
  assert full.shape == acc.shape == bug.shape == (3,) and np.all(np.isfinite(full))
  np.testing.assert_allclose(acc, full, rtol=1e-5)
  # Step 0 is evaluated before any update; afterwards the bug's trajectory departs.
  assert bug[0] == pytest.approx(full[0], rel=1e-5)
  assert np.max(np.abs(bug[1:] - full[1:]) / full[1:]) > 1e-4
  scale = out["grad_scale"]
  assert out["grad_diff"]["accumulated"] <= 1e-5 * scale
  assert out["grad_diff"]["per-micro-batch means"] > 1e-3 * scale
  mem = out["memory"]
  assert 0 < mem["accumulated"]["temp"] < mem["full batch"]["temp"]


def test_char_lm_corpus_is_the_stdlib_and_batches_are_padded():
  char_lm = _load("examples/char_lm.py")
  corpus = char_lm.load_corpus(20_000)
  assert corpus.shape == (20_000,) and corpus.min() >= 1 and corpus.max() < char_lm.VOCAB
  text = "".join(map(chr, corpus[:5000]))
  assert "def " in text or "import " in text
  cfg = char_lm.Config(batch_size=16, seq_len=12, min_len=3)
  batch = char_lm.sample_batch(np.random.default_rng(0), corpus, cfg)
  lengths = batch["mask"].sum(axis=1)
  assert lengths.min() >= 3 and lengths.max() <= 12 and len(set(lengths)) > 1
  # Targets are the inputs shifted by one; padding only after the real tokens.
  real = batch["mask"].astype(bool)
  np.testing.assert_array_equal(batch["inputs"][:, 1:][real[:, 1:]],
                                batch["targets"][:, :-1][real[:, 1:]])
  assert np.all(batch["targets"][~real] == char_lm.PAD)
  assert np.all(batch["targets"][real] != char_lm.PAD)


def test_digits_cnn_groupnorm_matches_full_batch_and_batchnorm_does_not(tmp_path):
  digits = _load("examples/digits_cnn.py")
  # A batch of 16 = 8 micro-batches of 2 (the default is 32 = 16 x 2): a CNN step costs
  # ~25x more at the suite's O0 than at the default level, in proportion to the batch.
  out = digits.main(epochs=1, max_steps=3, batch_size=16, out_dir=tmp_path, progress=False,
                    verbose=False)
  assert _is_png(out["plot"])
  g = out["curves"]["GroupNorm"]
  np.testing.assert_allclose(g["accumulated"], g["full batch"], rtol=1e-5)
  assert out["grad_diff"]["GroupNorm"] <= 1e-5 * out["grad_scale"]["GroupNorm"]
  # BatchNorm over micro-batches of 2 uses ghost-batch statistics: a different gradient.
  assert out["grad_diff"]["BatchNorm"] > 1e-3 * out["grad_scale"]["BatchNorm"]
  b = out["curves"]["BatchNorm"]
  assert abs(b["accumulated"][0] - b["full batch"][0]) > 1e-3 * b["full batch"][0]
  for norm in digits.NORMS:
    for mode in digits.MODES:
      assert 0.0 <= out["accuracy"][norm][mode] <= 1.0


def test_digits_cnn_rejects_a_batch_not_divisible_by_the_micro_batch(tmp_path):
  digits = _load("examples/digits_cnn.py")
  with pytest.raises(ValueError, match="batch_size=30 must be a multiple of micro_batch_size=4"):
    digits.main(batch_size=30, micro_batch_size=4, out_dir=tmp_path, progress=False)


def test_clip_contrastive_cached_matches_the_full_batch_and_plain_does_not(tmp_path):
  clip = _load("examples/clip_contrastive.py")
  out = clip.main(steps=3, batch_size=16, num_micro_batches=4, out_dir=tmp_path, verbose=False)
  assert _is_png(out["plot"])
  curves = out["curves"]
  np.testing.assert_allclose(curves["cached"], curves["full batch"], rtol=1e-5)
  assert out["grad_gap"]["cached"] <= 1e-5
  # Each micro-batch's InfoNCE sees 4 negatives instead of 16: another gradient.
  assert out["grad_gap"]["plain"] > 1e-2, out["grad_gap"]
  assert abs(curves["plain"][-1] - curves["full batch"][-1]) > 1e-4 * curves["full batch"][-1]


def test_streaming_multisteps_weighted_matches_reference_and_optax_does_not(tmp_path):
  stream = _load("examples/streaming_multisteps.py")
  out = stream.main(windows=3, k=4, rows=2, width=24, out_dir=tmp_path, progress=False,
                    verbose=False)
  assert _is_png(out["plot"])
  assert out["steps"] == 3
  assert len(out["tokens"]) == 12 and len(set(out["tokens"])) > 1
  ours, theirs = out["gap"]["jaxaccum.MultiSteps"], out["gap"]["optax.MultiSteps"]
  assert len(ours) == len(theirs) == 3
  # Parameters are O(0.1-1); Adam's first steps move them by ~1e-2.
  assert max(ours) < 1e-5, ours
  assert min(theirs) > 1e-4, theirs


# ------------------------------------------------------------------------- benchmark


def _tiny_problems(bench):
  return {
      "mlp": bench.mlp_problem(bench.MLPConfig(batch=16, d_in=8, hidden=16, depth=2)),
      "transformer": bench.lm_problem(bench.LMConfig(batch=8, seq=8, vocab=16, d_model=16,
                                                     heads=2, layers=1)),
  }


def test_benchmark_methods_agree_with_the_full_batch():
  bench = _load("benchmarks/bench_accumulation.py")
  n = 4  # N = 1 and 2 run in tests/test_benchmarks.py (the script's tiny mode)
  for model, (loss_fn, params, batch) in _tiny_problems(bench).items():
    # sgd(1): the parameter change is minus the (accumulated) gradient.
    methods = bench.build_methods(loss_fn, optax.sgd(1.0), jax.tree.leaves(batch)[0].shape[0],
                                  n, reference=False)
    assert tuple(methods) == bench.METHODS
    ref_loss, ref_grads = jax.jit(jax.value_and_grad(loss_fn))(params, batch)
    for name, method in methods.items():
      state = method.init(params)
      prepared = method.prepare(batch)
      stats = method.compile(state, prepared)
      assert stats["compile_s"] > 0 and stats["total"] > 0, (name, stats)
      for _ in range(2):  # the second step checks that state round-trips (donation)
        new_state, loss = method.step(state, prepared)
        if _ == 0:
          # (in NumPy on the host: the same float32 differences, no per-leaf programs)
          step_grads = jax.tree.map(lambda a, b: np.asarray(a) - np.asarray(b), params,
                                    method.params(new_state))
          # |change| error is float32 round-off of parameters of magnitude <= ~4.
          assert_close(step_grads, ref_grads, rtol=1e-5, atol=2e-6,
                       err_msg=f"{model} {name} N={n}")
          np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-5,
                                     err_msg=f"{model} {name} N={n}")
        state = new_state
      assert all(np.isfinite(p).all() for p in jax.tree.leaves(method.params(state)))


# ------------------------------------------------- noise scale and MoE examples (13, 14)


def test_noise_scale_ramp_is_one_program_and_tracks_b_simple(tmp_path):
  ns = _load("examples/noise_scale.py")
  cfg = ns.TINY
  n = cfg.num_micro_batches
  out = ns.main(cfg, out_dir=tmp_path, progress=False, verbose=False)
  assert _is_png(out["plot"])
  # Both runs, every k, through one compiled train step.
  assert out["compiled_programs"] == 1
  ks = out["ks"]
  assert ks["constant"] == [n] * cfg.steps
  assert ks["ramp"][0] == cfg.ramp_from and ks["ramp"][-1] == n
  assert ks["ramp"] == sorted(ks["ramp"]) and len(set(ks["ramp"])) > 2, ks["ramp"]
  for run in ns.RUNS:
    np.testing.assert_array_equal(out["logs"][run]["k"], ks[run])
  # Step 0 (shared initialisation): the loss is the token mean over the rows of
  # micro-batches 0..k-1 (rows i::N), and the batch size in info is their token count.
  loss_fn, params = ns.init_model(cfg)
  loss_fn = jax.jit(loss_fn)
  batch0 = ns.make_batches(cfg)[0]
  for run in ns.RUNS:
    k = ks[run][0]
    rows = np.concatenate([np.arange(i, cfg.batch_size, n) for i in range(k)])
    total, count = loss_fn(params, jax.tree.map(lambda a, rows=rows: a[rows], batch0))
    assert out["logs"][run]["tokens"][0] == float(count)
    np.testing.assert_allclose(out["logs"][run]["loss"][0], total / count, rtol=1e-5)
  # B_simple: finite (k >= 2: at least two samples), positive after warm-up, and the
  # ratio of the EMAs of the per-step estimates (the bias corrections cancel).
  for run in ns.RUNS:
    lg = out["logs"][run]
    assert np.all(np.isfinite(lg["grad_sq_norm"])) and np.all(np.isfinite(lg["trace_cov"]))
    assert np.all(np.isfinite(lg["b_simple"])), lg["b_simple"]
    assert np.all(lg["b_simple"][cfg.steps // 2:] > 0), lg["b_simple"]
    g = t = 0.0
    for s in range(cfg.steps):
      g = cfg.decay * g + (1 - cfg.decay) * lg["grad_sq_norm"][s]
      t = cfg.decay * t + (1 - cfg.decay) * lg["trace_cov"][s]
      np.testing.assert_allclose(lg["b_simple"][s], t / g, rtol=1e-4, err_msg=f"{run} {s}")


def test_moe_lm_terms_match_a_hand_reference_and_bad_micro_batches_are_skipped(tmp_path):
  from functools import partial

  moe = _load("examples/moe_lm.py")
  cfg = moe.TINY
  n = cfg.num_micro_batches
  out = moe.main(cfg, out_dir=tmp_path, progress=False, verbose=False)
  assert _is_png(out["plot"])
  assert out["compiled_programs"] == 1
  clean, bad = out["logs"]["clean"], out["logs"]["poisoned"]
  # Every injected micro-batch, and only those, is skipped; both runs stay finite.
  assert out["injected"] >= 3 and any(len(m) == 2 for m in out["bad"]), out["bad"]
  np.testing.assert_array_equal(bad["skipped"], [len(m) for m in out["bad"]])
  assert int(bad["skipped"].sum()) == out["injected"]
  np.testing.assert_array_equal(clean["skipped"], np.zeros(cfg.steps))
  for lg in (clean, bad):
    for key in ("loss", *moe.TERMS):
      assert np.all(np.isfinite(lg[key])), (key, lg[key])
  assert bad["loss"][-1] < bad["loss"][0]  # it trains through the bad micro-batches
  # Step 0 by hand from the shared initialisation: ce the token mean and z the sum over
  # the whole batch, lb the mean over micro-batches (rows i::N) of each one's statistic.
  params = moe.init_params(cfg)
  batch0 = moe.make_batches(cfg)[0]
  terms = jax.jit(partial(moe.loss_terms, heads=cfg.heads))
  parts = [terms(params, jax.tree.map(lambda a, i=i: a[i::n], batch0)) for i in range(n)]
  whole = terms(params, batch0)
  ref = {"ce": whole["ce"][0] / whole["ce"][1], "lb": np.mean([p["lb"] for p in parts]),
         "z": whole["z"]}
  total = ref["ce"] + cfg.lb_weight * ref["lb"] + cfg.z_weight * ref["z"]
  np.testing.assert_allclose(clean["loss"][0], total, rtol=1e-5)
  for key in moe.TERMS:
    np.testing.assert_allclose(clean[key][0], ref[key], rtol=1e-5, err_msg=key)
  # "mean" is per micro-batch: the whole batch's load-balancing loss is another number.
  np.testing.assert_allclose(out["lb_full_batch"], whole["lb"], rtol=1e-5)
  # (relative, and 10x the equality tolerance above: the corpus, the running Python's own
  # standard library, differs between Python versions, and so does the gap: 4.5e-4 on 3.13)
  assert abs(out["lb_full_batch"] - clean["lb"][0]) > 1e-4 * abs(whole["lb"])
  # The poisoned step 0 drops micro-batch 0: every term over the others only (the
  # skipped tokens leave the denominator).
  assert out["bad"][0] == [0]
  kept = parts[1:]
  ref_bad = {"ce": sum(p["ce"][0] for p in kept) / sum(p["ce"][1] for p in kept),
             "lb": np.mean([p["lb"] for p in kept]), "z": sum(p["z"] for p in kept)}
  for key in moe.TERMS:
    np.testing.assert_allclose(bad[key][0], ref_bad[key], rtol=1e-5, err_msg=key)
  np.testing.assert_allclose(
      bad["loss"][0], ref_bad["ce"] + cfg.lb_weight * ref_bad["lb"] + cfg.z_weight * ref_bad["z"],
      rtol=1e-5)


def test_dp_sgd_clipped_mean_matches_the_loop_and_trains(capsys):
  dp = _load("examples/dp_sgd.py")
  cfg = dp.Config(steps=3, batch_size=32, num_micro_batches=4, hidden=16)
  out = dp.main(cfg)
  printed = capsys.readouterr().out
  for words in ("per-example loop", "noise multiplier 1.1", "test accuracy", "dp_accounting"):
    assert words in printed, printed
  assert out["check_diff"] <= 1e-5 * out["check_scale"] + 1e-7 and out["check_scale"] > 0
  assert 0.0 <= out["accuracy"] <= 1.0 and np.all(np.isfinite(out["losses"]))
  # The noise: std * N(0, 1) per leaf from one key per step, added once to the mean.
  # (Both sides jitted, as in the example's step: one compile each, not op by op.)
  grads = {"a": np.zeros(3, np.float32), "b": np.zeros((2, 2), np.float32)}
  key = jax.random.key(3)
  noisy = jax.jit(dp.add_noise)(grads, key, 0.5)

  @jax.jit
  def by_hand(key):
    k_a, k_b = jax.random.split(key, 2)
    return {"a": 0.5 * jax.random.normal(k_a, (3,)), "b": 0.5 * jax.random.normal(k_b, (2, 2))}

  assert_close(noisy, by_hand(key))


def test_dp_sgd_transformer_case_prints_its_table_and_both_methods_agree(capsys):
  dp = _load("examples/dp_sgd.py")
  cfg = dp.LMConfig(batch_size=4, micro_batch_size=2, seq=6, vocab=11, d_model=8, layers=1,
                    repeats=1)
  out = dp.transformer_costs(cfg)
  printed = capsys.readouterr().out
  assert "| ghost |" in printed and "| materialize |" in printed, printed
  assert out["diff"] < 1e-6 and set(out["table"]) == {"plain", "ghost", "materialize"}


def test_adaptive_batch_runs_four_ways_with_the_ramp_by_tokens_and_counts_tokens(tmp_path,
                                                                                  capsys):
  ex = _load("examples/adaptive_batch.py")
  cfg = ex.TINY
  out = ex.main(cfg, out_dir=tmp_path)
  printed = capsys.readouterr().out
  assert "target validation loss" in printed and f"plot: {tmp_path}" in printed
  assert _is_png(out["plot"]) and set(out["summary"]) == set(ex.RUNS)
  per_micro = cfg.micro_batch_size * cfg.seq_len  # 16 tokens
  for lg in out["logs"].values():
    k, tokens = lg["k"], lg["tokens"]
    # Tokens seen after each step: the running sum of k micro-batches of 16 tokens, to the
    # first step at or past the budget.
    np.testing.assert_array_equal(tokens, np.cumsum(k) * per_micro)
    assert tokens[-1] >= cfg.tokens > tokens[-2]
    assert 1 <= k.min() and k.max() <= cfg.max_micro_batches
    # Evaluations at step 0 and each time another eval_every_tokens were seen.
    ev = lg["evals"]
    assert ev[0, 0] == 0 and np.all(np.diff(ev[1:, 1] // cfg.eval_every_tokens) >= 1)
    assert len(ev) == 1 + len(set(tokens // cfg.eval_every_tokens) - {0})
  assert set(out["logs"]["small"]["k"]) == {cfg.small}
  assert set(out["logs"]["large"]["k"]) == {cfg.large}
  # The ramp "0:2 400:4 800:8" in sequences of micro-batches of 2: k = 1, 2, 4 from 0, 400
  # and 800 tokens seen (read before each step), by hand.
  ramp = out["logs"]["ramp"]
  before = np.concatenate([[0], ramp["tokens"][:-1]])
  np.testing.assert_array_equal(ramp["k"], np.where(before >= 800, 4,
                                                    np.where(before >= 400, 2, 1)))
  adaptive = out["logs"]["adaptive"]["k"]
  assert adaptive[0] == 2 and np.all(np.diff(adaptive) >= 0)  # monotone from init k = 2
  # Step 0's validation loss is the initial model's, the same for every run.
  first = {run: lg["evals"][0, 2] for run, lg in out["logs"].items()}
  assert len(set(np.round(list(first.values()), 5))) == 1
  loss_fn, params = ex.init_params(cfg, [cfg.seed])
  _, val = ex.load_data(cfg)
  p0 = jax.tree.map(lambda x: x[0], params)
  np.testing.assert_allclose(first["small"], float(jax.jit(loss_fn)(p0, val)), rtol=1e-5)
  # Steps and tokens to the target: linear interpolation between evaluations, by hand.
  evals = np.array([[0, 0, 3.0], [10, 100, 2.0], [20, 200, 1.0]])
  assert ex.to_target(evals, 1.5) == (15.0, 150.0)
  assert ex.to_target(evals, 3.5) == (0.0, 0.0)
  assert all(np.isnan(ex.to_target(evals, 0.5)))
  assert ex.loss_at_tokens(evals, 50) == 2.5
