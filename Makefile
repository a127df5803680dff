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

.PHONY: demo test test-gpu-target lint bench bench-quick clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[test,dev]'
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
	$(BIN)/python benchmarks/bench_pipeline.py
	JAX_PLATFORMS=cpu $(GPU_VENV)/bin/python benchmarks/bench_gpu_target.py

bench-quick: $(STAMP)
	BENCH_QUICK=1 $(BIN)/python benchmarks/bench_accumulation.py
	BENCH_QUICK=1 $(BIN)/python benchmarks/bench_sharding.py
	BENCH_QUICK=1 $(BIN)/python benchmarks/bench_features.py
	BENCH_QUICK=1 $(BIN)/python benchmarks/bench_pipeline.py

test: $(STAMP)
	$(BIN)/python -m pytest -n 2 -q

# Compiles for described H100/H200/A100/B200 GPUs on this machine (no GPU needed).
test-gpu-target: $(GPU_STAMP)
	JAX_PLATFORMS=cpu $(GPU_VENV)/bin/python -m pytest -p no:xdist -q tests_gpu_target

lint: $(STAMP)
	$(BIN)/ruff check jaxaccum tests tests_gpu_target benchmarks examples

clean:
	rm -rf $(VENV) $(GPU_VENV) .pytest_cache .ruff_cache .hypothesis
