# kfp-pytorch: everything installs from nothing; `make demo` and `make test` are the entry points.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp
# The exact releases CI ran with (pip constraints); pyproject.toml keeps the ranges users install from.
CONSTRAINTS := .ci/constraints.txt
# State (embedded MLflow store, kfp.local outputs, local servers) lives in $$KFP_PYTORCH_HOME, default ~/.kfp-pytorch.

.PHONY: setup system-deps demo test bench simulate clean lock
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)

# torch==2.13.0 first (the CPU wheel on disk): an unpinned torch would pull a multi-GB CUDA build.
$(STAMP): pyproject.toml $(CONSTRAINTS)
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -c $(CONSTRAINTS) -e '.[dev]'
	@touch $(STAMP)

## Re-resolve $(CONSTRAINTS): the newest releases within pyproject.toml's ranges, in a throwaway
## venv; then run `make test` on them before committing the new file.
LOCK_VENV ?= /tmp/kfp-pytorch-lock
lock:
	rm -rf $(LOCK_VENV) && $(PYTHON) -m venv $(LOCK_VENV)
	$(LOCK_VENV)/bin/python -m pip install -q --upgrade pip
	$(LOCK_VENV)/bin/python -m pip install -q torch==2.13.0
	$(LOCK_VENV)/bin/python -m pip install -q -e '.[dev]'
	{ sed -n '/^#/p' $(CONSTRAINTS); $(LOCK_VENV)/bin/python -m pip freeze --exclude-editable | grep -iv '^torch=='; } > $(CONSTRAINTS).new
	mv $(CONSTRAINTS).new $(CONSTRAINTS)
	rm -rf $(LOCK_VENV)

## Debian packages the tests run for real: PostgreSQL (the usage ledger's HA backend).
system-deps:
	@ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 || { $(SUDO) apt-get update -q && \
	  $(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends postgresql; }

setup: system-deps $(STAMP)

## The main job: train_and_serve end-to-end on this machine (kfp.local, 2 DDP workers, local server).
demo: setup
	$(VENV)/bin/kfp-pytorch run train_and_serve --local

## The test suite (starts SeaweedFS, MLflow and PostgreSQL itself, on 127.0.0.1).
test: setup
	$(PY) -m pytest

## The fair-share benchmark: six scheduling policies side by side on one trace (TRACE=FILE).
TRACE ?= ../shared/traces/itp-2021/cluster07.csv
simulate: setup
	$(VENV)/bin/kfp-pytorch simulate --trace $(TRACE)

## Benchmarks: ratios against the named baselines, measured side by side in one run.
bench: setup
	$(PY) tests/bench.py

clean:
	rm -rf $(VENV) .kfp-pytorch .pytest_cache bench_results
