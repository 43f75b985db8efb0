# Developer entry points. `make test` is what CI runs after `bash install.sh`; it is exactly
# `python3 -m pytest -q` (pyproject.toml's addopts spread the suite over one xdist worker per core).
# Extra pytest arguments: make test ARGS="-k router -x".

PYTHON ?= python3
PYTEST = $(PYTHON) -m pytest -q
ARGS ?=

.PHONY: lint format test-fast test bench

# What CI runs before the tests: lint (ruff), formatting (ruff format), import contracts (import-linter: the
# request path's layers, no cycles, tools never import the engine), types (mypy on the engine side).
lint:
	$(PYTHON) -m ruff check pagoda tests benchmarks
	$(PYTHON) -m ruff format --check pagoda tests benchmarks
	lint-imports
	$(PYTHON) -m mypy

format:
	$(PYTHON) -m ruff check --fix pagoda tests benchmarks
	$(PYTHON) -m ruff format pagoda tests benchmarks

# The fast tier (tests/unit: pure CPU, no subprocess, no model beyond a tiny one): under 3 minutes on 2 cores.
test-fast:
	$(PYTEST) -m fast $(ARGS)

# Every tier: fast, interp (Triton kernels, interpreted on a CPU), golden (whole engines), e2e (servers).
test:
	$(PYTEST) $(ARGS)

# The product benchmark: on a CUDA machine the H200 table (benchmarks/h200.py), elsewhere the offline CPU
# comparison against transformers (benchmarks/offline_throughput.py).
bench:
	@if $(PYTHON) -c "import sys, torch; sys.exit(not torch.cuda.is_available())"; then \
		$(PYTHON) benchmarks/h200.py $(ARGS); else $(PYTHON) benchmarks/offline_throughput.py $(ARGS); fi
