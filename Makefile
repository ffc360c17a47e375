# The two commands of the README: `make demo` and `make test`. Each sets up first.
VENV   ?= .venv
PY      = $(VENV)/bin/python
STAMP   = $(VENV)/.overlapc-setup
PYTEST_ARGS ?=

.PHONY: setup demo test test-all lint bench clean

setup: $(STAMP)

$(STAMP): pyproject.toml scripts/setup.sh
	./scripts/setup.sh $(VENV)
	touch $(STAMP)

demo: setup
	$(PY) -m overlapc.demo

test: setup
	$(PY) -m pytest -q -m "not extended" --durations=15 $(PYTEST_ARGS)

# ruff's rules and format, configured in pyproject.toml.
lint: setup
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

# Also the tests marked `extended` (a few minutes more: the full region chunk-count sweep,
# dropless chunk counts, the world-4 dynamic-shape test, more MoE variants).
test-all: setup
	$(PY) -m pytest -q $(PYTEST_ARGS)

# Needs root (network namespaces, tc). Writes benchmarks/results/ and BENCHMARKS.md.
bench: setup
	$(PY) -m benchmarks.bench_tp --default-cmd --variant rows microbatches=1 strategy=decompose --variant microbatches microbatches=2 strategy=none $(BENCH_ARGS)

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
