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

.PHONY: setup run test test-fast params clean-runs serve stop

setup: $(STAMP)

# torch (CPU build) first, then DeepSpeed without ops, then the project; a second run is a no-op
$(STAMP): pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q -U pip setuptools wheel
	$(BIN)/python -m pip install -q torch==2.13.0
	DS_BUILD_OPS=0 $(BIN)/python -m pip install -q --no-build-isolation deepspeed==0.19.8
	$(BIN)/python -m pip install -q -e '.[test]'
	@touch $(STAMP)

params: setup
	$(BIN)/hacrl config $(OVERRIDES)

run: params
	$(BIN)/dvc repro
	@echo "Report: $(CURDIR)/reports/README.md (summary: reports/summary.json, plots: reports/*.png)"

# Prefect server + work pools + deployments + worker, MLflow UI (127.0.0.1); writes .services.env
PREFECT_PORT ?= 4200
MLFLOW_PORT ?= 5000
serve: setup
	@test -f params.yaml || $(BIN)/hacrl config
	$(BIN)/hacrl serve --prefect-port $(PREFECT_PORT) --mlflow-port $(MLFLOW_PORT)

stop:
	@if [ -x $(BIN)/hacrl ]; then $(BIN)/hacrl stop; fi

test: setup
	$(BIN)/python -m pytest $(PYTEST_ARGS)

test-fast: setup
	$(BIN)/python -m pytest -m "not slow" $(PYTEST_ARGS)

clean-runs:
	rm -rf runs data reports/*.png reports/*.json reports/*.csv reports/README.md
