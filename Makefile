# The README's two commands: `make serve` and `make test`. Both create .venv on first use and
# install the pinned dependencies (constraints.txt) into it; later runs reuse it.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV ?= .venv
PIP := $(VENV)/bin/python -m pip
CONSTRAINTS := constraints.txt
PYTEST_ARGS ?=

.PHONY: serve test install install-dev lint typecheck bench clean

$(VENV)/bin/python:
	$(PYTHON) -m venv $(VENV)

$(VENV)/.installed: $(VENV)/bin/python pyproject.toml $(CONSTRAINTS)
	$(PIP) install -q -c $(CONSTRAINTS) -e '.[demo]'
	touch $@

$(VENV)/.installed-dev: $(VENV)/.installed
	$(PIP) install -q -c $(CONSTRAINTS) -e '.[demo,dev]'
	touch $@

install: $(VENV)/.installed
install-dev: $(VENV)/.installed-dev

## Start the hub on its embedded default (SQLite, embedded MLflow, demo models) at :8000.
serve: $(VENV)/.installed
	$(VENV)/bin/hub serve --config configs/demo.yaml

## Install the dev extras and run the whole test suite.
test: $(VENV)/.installed-dev
	$(VENV)/bin/python -m pytest $(PYTEST_ARGS)

lint: $(VENV)/.installed-dev
	$(VENV)/bin/ruff check hub backends registry migrations tests benchmarks
	$(VENV)/bin/ruff format --check hub backends registry migrations tests benchmarks

typecheck: $(VENV)/.installed-dev
	$(VENV)/bin/mypy

clean:
	rm -rf $(VENV) .hub .mypy_cache .ruff_cache .pytest_cache
