# Every target sets itself up on a fresh machine: the venv is created (torch first, the CPU wheel)
# and reused while pyproject.toml is unchanged.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
TORCH_SPEC ?= torch==2.13.0
PYTEST_ARGS ?=

.PHONY: help install native system-deps client-venvs lint format generate test demo bench up down status clean

help:
	@echo "make demo   - bring up the embedded stack and run a dataset through the pipeline"
	@echo "make test   - lint, then the whole test suite against real services"
	@echo "make bench  - benchmarks (event latency, serving vs Triton/KServe, training, demo): same-run ratios"
	@echo "make lint   - ruff, mypy, codespell"
	@echo "make generate - regenerate serving/proto/ gRPC code from its .proto files"

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	# torch first, pinned: any other spec pulls a multi-GB CUDA build on a CPU machine.
	$(BIN)/pip install --quiet "$(TORCH_SPEC)"
	$(BIN)/pip install --quiet -e '.[dev]'
	touch $(STAMP)

install: $(STAMP) native

# The native gRPC front end (serving/native, C++ grpc++): rebuilt only when its sources change; where the
# build tools are missing it says what to install and the server runs on grpcio alone.
native: $(STAMP)
	@$(BIN)/python -m serving.native.build --optional

system-deps:
	@bash scripts/system-deps.sh

# KServe's own client, to test the server against it; its pins clash with ours, so it lives apart.
client-venvs:
	@bash scripts/kserve-client-venv.sh > /dev/null

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy
	$(BIN)/codespell sluicegate flows tasks serving tests benchmarks docker README.md

format: $(STAMP)
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

# The generated code is checked in; tests/serving/test_proto.py fails when it drifts from the .proto.
generate: $(STAMP)
	PYTHON=$(BIN)/python bash scripts/generate_proto.sh

test: lint system-deps client-venvs
	$(BIN)/python -m serving.native.build
	$(BIN)/pytest $(PYTEST_ARGS)

demo: $(STAMP)
	$(BIN)/sluicegate demo

# system-deps: the event benchmark runs the Prefect server on a throwaway PostgreSQL cluster too.
bench: $(STAMP) system-deps native
	$(BIN)/python -m benchmarks

up: $(STAMP)
	$(BIN)/sluicegate up

down: $(STAMP)
	$(BIN)/sluicegate down

status: $(STAMP)
	$(BIN)/sluicegate status

clean:
	-$(BIN)/sluicegate down
	rm -rf .sluicegate
