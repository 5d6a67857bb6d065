# The README's two commands: `make serve` and `make test`. Both create .venv on first use and
# install the pinned dependencies (constraints.txt) into it; later runs reuse it.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV ?= .venv
PIP := $(VENV)/bin/python -m pip
CONSTRAINTS := constraints.txt
PYTEST_ARGS ?=

# pip does not byte-compile what it installs (a large share of a fresh install's time):
# Python compiles the modules a run imports, once, into __pycache__, which these targets let it
# write even where the environment sets PYTHONDONTWRITEBYTECODE.
PIP_INSTALL := $(PIP) install -q --no-compile
unexport PYTHONDONTWRITEBYTECODE

.PHONY: serve test test-pure install install-dev lint typecheck bench clean

$(VENV)/bin/python:
	$(PYTHON) -m venv $(VENV)

# Installing the package also compiles its native CPU kernels (setup.py's build_kernels).
$(VENV)/.installed: $(VENV)/bin/python pyproject.toml setup.py $(CONSTRAINTS)
	$(PIP_INSTALL) -c $(CONSTRAINTS) -e '.[demo]'
	touch $@

# One resolution for both extras (a fresh clone's `make test` installs once, not twice).
$(VENV)/.installed-dev: $(VENV)/bin/python pyproject.toml setup.py $(CONSTRAINTS)
	$(PIP_INSTALL) -c $(CONSTRAINTS) -e '.[demo,dev]'
	touch $(VENV)/.installed $@

# The kernels again when a C source changed since the install built them (only what is out of
# date is compiled); without a compiler the hub warns and runs its slower torch path.
KERNELS := backends/llm/_native/.built
$(KERNELS): $(VENV)/bin/python $(wildcard backends/llm/csrc/*) backends/llm/native_build.py
	mkdir -p $(@D)
	$(VENV)/bin/python -m backends.llm.native_build build || true
	touch $@

install: $(VENV)/.installed
install-dev: $(VENV)/.installed-dev

## Start the hub on its embedded default (SQLite, embedded MLflow, demo models) at :8000.
serve: $(VENV)/.installed $(KERNELS)
	$(VENV)/bin/hub serve --config configs/demo.yaml

# OpenMP's threads sleep while they wait (OMP_WAIT_POLICY=PASSIVE): two test workers, each with
# an engine's threads, share the cores, and spinning waits would take them from each other.
test: export OMP_WAIT_POLICY ?= PASSIVE

## Install the dev extras and run the whole test suite in two passes: first everything but
## the `serial` and `apart` tests on TEST_WORKERS processes (pytest-xdist, one module per worker
## at a time); then two pytest processes side by side, one running the `serial` tests (a
## cluster of PostgreSQL, MLflow and three hubs, timing-sensitive) and one the `apart` tests
## (long tests of their own processes), whose output make prints whole as each ends. A pass
## that PYTEST_ARGS leaves empty (exit status 5) is not a failure. A worker that dies (a test
## past its timeout) ends the first pass with that test named rather than being replaced:
## xdist's replacement worker can wait forever for work.
TEST_WORKERS ?= 2
test: $(VENV)/.installed-dev $(KERNELS)
	$(VENV)/bin/python -m pytest -n $(TEST_WORKERS) --dist loadscope --max-worker-restart 0 \
		-m "not serial and not apart" $(PYTEST_ARGS) || [ $$? -eq 5 ]
	$(MAKE) --no-print-directory -j2 --output-sync=target test-serial test-apart

.PHONY: test-serial test-apart
test-serial test-apart: test-%:
	$(VENV)/bin/python -m pytest -m $* $(PYTEST_ARGS) || [ $$? -eq 5 ]

## The pure layers (planner, scheduler, block pool, statistics) in a bare environment: no torch,
## FastAPI, SQLAlchemy or Prometheus installed, so an import of one of them fails the run.
PURE_VENV ?= .venv-pure
PURE_PACKAGES := pytest pytest-asyncio pytest-timeout numpy scipy

$(PURE_VENV)/.installed: $(CONSTRAINTS)
	$(PYTHON) -m venv $(PURE_VENV)
	$(PURE_VENV)/bin/python -m pip install -q --no-compile -c $(CONSTRAINTS) $(PURE_PACKAGES)
	touch $@

test-pure: $(PURE_VENV)/.installed
	HUB_PURE_TESTS=1 $(PURE_VENV)/bin/python -m pytest -m pure -p no:cacheprovider $(PYTEST_ARGS)

lint: $(VENV)/.installed-dev
	$(VENV)/bin/ruff check hub backends registry migrations tests benchmarks
	$(VENV)/bin/ruff format --check hub backends registry migrations tests benchmarks

typecheck: $(VENV)/.installed-dev
	$(VENV)/bin/mypy

clean:
	rm -rf $(VENV) $(PURE_VENV) .hub .mypy_cache .ruff_cache .pytest_cache
