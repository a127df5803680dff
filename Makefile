# Quickstart: `make demo` runs the main demo, `make test` runs the tests.
# Both create (or reuse) a local virtual environment in .venv and install what they need.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
# A separate environment with the CUDA compile-only plugin (the gpu-plan extra), so that it
# never sits next to the main test suite.
GPU_VENV  := .venv-gpu
GPU_STAMP := $(GPU_VENV)/.installed

.PHONY: demo test test-gpu-target lint bench bench-quick bench-tiny clean docs typecheck test-min test-latest dist dist-check fuzz-dp

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[test,dev,docs]'
	touch $(STAMP)

$(GPU_STAMP): pyproject.toml
	test -x $(GPU_VENV)/bin/python || $(PYTHON) -m venv $(GPU_VENV)
	$(GPU_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(GPU_VENV)/bin/python -m pip install --quiet -e '.[test,gpu-plan]'
	touch $(GPU_STAMP)

demo: $(STAMP)
	$(BIN)/python examples/char_lm.py

bench: $(STAMP) $(GPU_STAMP)
	$(BIN)/python benchmarks/bench_accumulation.py
	$(BIN)/python benchmarks/bench_sharding.py
	$(BIN)/python benchmarks/bench_features.py
	$(BIN)/python benchmarks/bench_per_example.py
	$(BIN)/python benchmarks/bench_evaluate.py
	$(BIN)/python benchmarks/bench_pipeline.py
	JAX_PLATFORMS=cpu $(GPU_VENV)/bin/python benchmarks/bench_gpu_target.py
	JAX_PLATFORMS=cpu $(GPU_VENV)/bin/python benchmarks/bench_pipeline.py --target-only
	JAX_PLATFORMS=cpu $(GPU_VENV)/bin/python benchmarks/bench_overlap.py

# Every benchmark's tiny mode (the smallest problems, results in a temporary folder): checks
# that each script runs, in a few minutes; the suite runs the same (tests/test_benchmarks.py,
# tests_gpu_target/test_benchmarks.py).
BENCH_SCRIPTS := accumulation adaptive adaptive_grid adaptive_lm coupled dp_padding evaluate features \
  gpu_lm per_example pipeline seesaw sharding
bench-tiny: $(STAMP) $(GPU_STAMP)
	for b in $(BENCH_SCRIPTS); do BENCH_TINY=1 $(BIN)/python benchmarks/bench_$$b.py || exit 1; done
	JAX_PLATFORMS=cpu BENCH_TINY=1 $(GPU_VENV)/bin/python benchmarks/bench_gpu_target.py
	JAX_PLATFORMS=cpu BENCH_TINY=1 $(GPU_VENV)/bin/python benchmarks/bench_pipeline.py --target-only
	JAX_PLATFORMS=cpu BENCH_TINY=1 $(GPU_VENV)/bin/python benchmarks/bench_overlap.py

bench-quick: $(STAMP)
	BENCH_QUICK=1 $(BIN)/python benchmarks/bench_accumulation.py
	BENCH_QUICK=1 $(BIN)/python benchmarks/bench_sharding.py
	BENCH_QUICK=1 $(BIN)/python benchmarks/bench_features.py
	BENCH_QUICK=1 $(BIN)/python benchmarks/bench_per_example.py
	BENCH_QUICK=1 $(BIN)/python benchmarks/bench_evaluate.py
	BENCH_QUICK=1 $(BIN)/python benchmarks/bench_pipeline.py

test: $(STAMP)
	$(BIN)/python -m pytest -n 2 --dist worksteal -q --durations=25
	$(BIN)/pyright --pythonpath $(BIN)/python

# The long differential fuzz of clip_per_example (tests/_dp_fuzz.py): 1000 generated models, each
# method against per-example jax.grad on the norms, the clipped sum and the sensitivity bound;
# every 4th model also under an FSDP placement (param_gather x grad_scatter x overlap_grad_reduce
# in turn, on 8 virtual CPU devices), counted per placement x method in the summary.
# Prints what it found; the JSON report goes to FUZZ_DP_REPORT. Exit status 1 if a case failed.
FUZZ_DP_REPORT ?= fuzz-dp-report.json
fuzz-dp: $(STAMP)
	nice -n 10 $(BIN)/python tools/dp_fuzz.py --cases 1000 --seed 0 --out $(FUZZ_DP_REPORT)

# Compiles for described H100/H200/A100/B200 GPUs on this machine (no GPU needed).
test-gpu-target: $(GPU_STAMP)
	JAX_PLATFORMS=cpu $(GPU_VENV)/bin/python -m pytest -p no:xdist -q tests_gpu_target

lint: $(STAMP)
	$(BIN)/ruff check jaxaccum tests tests_gpu_target benchmarks examples tools

# Pyright (basic mode, configured in pyproject.toml) on the package.
typecheck: $(STAMP)
	$(BIN)/pyright --pythonpath $(BIN)/python

# The documentation site (docs/, mkdocs.yml) into site/; any warning is an error.
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict

# The suite against the lowest versions pyproject.toml allows for the core dependencies, in its
# own environment (.venv-min). MIN_JOBS sets pytest's worker count.
MIN_VENV := .venv-min
MIN_JOBS ?= 2
test-min:
	test -x $(MIN_VENV)/bin/python || $(PYTHON) -m venv $(MIN_VENV)
	$(MIN_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(PYTHON) tools/min_constraints.py > $(MIN_VENV)/constraints.txt
	cat $(MIN_VENV)/constraints.txt
	$(MIN_VENV)/bin/python -m pip install --quiet -c $(MIN_VENV)/constraints.txt -e '.[test]'
	$(MIN_VENV)/bin/python -m pip list 2>/dev/null | grep -E -i '^(jax|jaxlib|optax|flax|chex|numpy|equinox) '
	$(MIN_VENV)/bin/python -m pytest -n $(MIN_JOBS) -q

# The suite on the newest Python this machine has, with the newest releases pip resolves there
# (jax 0.12 and later need Python >= 3.12), in its own environment (.venv-latest): what a new
# user's virtual environment gets. LATEST_PYTHON picks the interpreter; LATEST_JOBS the workers.
LATEST_VENV := .venv-latest
LATEST_JOBS ?= 2
LATEST_PYTHON ?= $(shell $(PYTHON) tools/latest_python.py)
test-latest:
	@test -n "$(LATEST_PYTHON)" || { echo "no newer Python found: set LATEST_PYTHON"; exit 1; }
	test -x $(LATEST_VENV)/bin/python || $(LATEST_PYTHON) -m venv $(LATEST_VENV)
	$(LATEST_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(LATEST_VENV)/bin/python -m pip install --quiet --upgrade --upgrade-strategy eager -e '.[test]'
	$(LATEST_VENV)/bin/python --version
	$(LATEST_VENV)/bin/python -m pip list 2>/dev/null | grep -E -i '^(jax|jaxlib|optax|flax|chex|numpy|equinox) '
	$(LATEST_VENV)/bin/python -m pytest -n $(LATEST_JOBS) --dist worksteal -q --durations=25

# A wheel and an sdist in dist/, checked by twine.
dist: $(STAMP)
	rm -rf dist
	$(BIN)/python -m build
	$(BIN)/twine check --strict dist/*

# Installs the wheel, then the sdist, in a fresh environment (no flax, no equinox) and imports
# jaxaccum from each.
DIST_IMPORT := import importlib.util as u, jaxaccum; \
  assert u.find_spec("flax") is None and u.find_spec("equinox") is None; \
  print("imported jaxaccum", jaxaccum.__version__, "from", jaxaccum.__file__)
dist-check: dist
	rm -rf .venv-dist
	$(PYTHON) -m venv .venv-dist
	.venv-dist/bin/python -m pip install --quiet dist/*.whl
	cd /tmp && $(CURDIR)/.venv-dist/bin/python -c '$(DIST_IMPORT)'
	.venv-dist/bin/python -m pip install --quiet --force-reinstall --no-deps dist/*.tar.gz
	cd /tmp && $(CURDIR)/.venv-dist/bin/python -c '$(DIST_IMPORT)'

clean:
	rm -rf $(VENV) $(GPU_VENV) $(MIN_VENV) $(LATEST_VENV) .venv-dist .pytest_cache .ruff_cache .hypothesis site dist
