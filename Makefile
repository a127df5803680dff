# Quickstart: `make demo` runs the main demo, `make test` runs the tests.
# Both create (or reuse) a local virtual environment in .venv and install what they need.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: demo test lint bench bench-quick clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[test,dev]'
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/python examples/char_lm.py

bench: $(STAMP)
	$(BIN)/python benchmarks/bench_accumulation.py
	$(BIN)/python benchmarks/bench_sharding.py
	$(BIN)/python benchmarks/bench_pipeline.py

bench-quick: $(STAMP)
	BENCH_QUICK=1 $(BIN)/python benchmarks/bench_accumulation.py
	BENCH_QUICK=1 $(BIN)/python benchmarks/bench_sharding.py
	BENCH_QUICK=1 $(BIN)/python benchmarks/bench_pipeline.py

test: $(STAMP)
	$(BIN)/python -m pytest -n 2 -q

lint: $(STAMP)
	$(BIN)/ruff check jaxaccum tests benchmarks examples

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .hypothesis
