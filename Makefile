# Trainyard developer targets. Everything runs from the virtual environment $(VENV), which
# `make venv` creates and keeps in sync with pyproject.toml and constraints.txt.

SHELL := bash
.SHELLFLAGS := -eu -o pipefail -c
.DEFAULT_GOAL := help

VENV ?= .venv
# python3.11 where there is one (the version the project is developed with), else python3.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
PY := $(VENV)/bin/python
STAMP := $(VENV)/.trainyard-installed
PACKAGES := control_plane node_agent worker_runtime trainyard bench
# pytest-xdist workers for `make test`, each with its own PostgreSQL and S3. The suite waits on real
# processes much of the time: one session kept 0.9 of 2 cores busy, two about 1.5. A third was
# slower on the 2-core development machine, and its saturated cores delayed agents' heartbeats until
# nodes were declared lost (docs/benchmarks.md, "make test"). Beside them, the tests that start no
# process run in a second session at idle priority (scripts/test-lanes.sh); TEST_WORKERS=0 runs
# the whole suite in one process.
TEST_WORKERS ?= 2

.PHONY: help venv test lint demo clean distclean

help:
	@echo "make venv       create $(VENV) and install trainyard[dev] (pinned by constraints.txt)"
	@echo "make test       system packages where it can (scripts/system-deps.sh), ruff, then the whole pytest suite (real PostgreSQL and S3, no GPU needed) with mypy and the import contracts beside it"
	@echo "make lint       ruff, mypy, the import contracts (lint-imports) and scripts/check_imports.py (no cycles)"
	@echo "make demo       a 2-node dev cluster on this machine, running one tiny-gpt job end to end"
	@echo "make clean      remove caches and .trainyard/ (demo data); distclean also removes $(VENV)"

venv: $(STAMP)

# The stamp is newer than both inputs once the install has succeeded: a re-run costs nothing.
# constraints.txt pins torch to the CPU build; without it pip would pull a multi-GB CUDA build.
$(STAMP): pyproject.toml constraints.txt
	@test -x $(PY) || { echo "creating $(VENV) with $(PYTHON)"; $(PYTHON) -m venv $(VENV); }
	$(PY) -m pip install --quiet -c constraints.txt -e '.[dev]'
	@touch $@

# The system packages some fault tests need (libfaketime, chromium): installed where it can be
# (root and apt-get; nothing to do once present), else the script says what is missing and those
# tests skip, each saying the one command that installs its tool.
test: venv
	-scripts/system-deps.sh
	$(VENV)/bin/ruff check .
	TEST_LANES_CHECKS="$(VENV)/bin/mypy $(PACKAGES) && $(VENV)/bin/lint-imports && $(PY) scripts/check_imports.py" \
	    scripts/test-lanes.sh $(PY) $(TEST_WORKERS)

lint: venv
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy $(PACKAGES)
	$(VENV)/bin/lint-imports
	$(PY) scripts/check_imports.py

demo: venv
	PATH="$(abspath $(VENV))/bin:$$PATH" bash scripts/demo.sh

clean:
	rm -rf .pytest_cache .mypy_cache .ruff_cache build dist *.egg-info .trainyard
	find . -name __pycache__ -type d -not -path './$(VENV)/*' -prune -exec rm -rf {} +

distclean: clean
	rm -rf $(VENV)
