# kvcoord developer entry points. `make help` lists them.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
STAMP := $(VENV)/.installed
PROTOS := $(wildcard proto/coordinator/v1/*.proto proto/worker/v1/*.proto)
LISTEN ?= 127.0.0.1:50051
GEN_DIRS := coordinator/v1 $(wildcard worker/v1)

.DEFAULT_GOAL := help
.PHONY: help install proto proto-check lint test bench chaos run demo clean

help: ## list the targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  %-12s %s\n", $$1, $$2}'

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
	# torch pinned to the CPU wheel: an unpinned torch pulls a multi-GB CUDA build.
	$(PIP) install --quiet "torch==2.13.0"
	$(PIP) install --quiet -e ".[worker,bridge,dev,plot]"
	touch $(STAMP)

install: $(STAMP) ## create .venv and install everything (runtime, worker, dev)

proto: $(STAMP) ## regenerate the gRPC stubs from proto/
	$(PY) -m grpc_tools.protoc -Iproto --python_out=. --pyi_out=. --grpc_python_out=. $(PROTOS)

proto-check: $(STAMP) ## fail when the committed stubs are stale
	@tmp=$$(mktemp -d); \
	$(PY) -m grpc_tools.protoc -Iproto --python_out=$$tmp --pyi_out=$$tmp --grpc_python_out=$$tmp $(PROTOS); \
	status=0; for f in $$(cd $$tmp && find . -name '*.py' -o -name '*.pyi'); do \
	  cmp -s $$tmp/$$f $$f || { echo "stale generated stub: $$f (run 'make proto')"; status=1; }; \
	done; rm -rf $$tmp; exit $$status

lint: $(STAMP) ## ruff and mypy (strict)
	$(VENV)/bin/ruff check coordinator worker kvcoord tests bench
	$(VENV)/bin/mypy coordinator worker kvcoord

test: $(STAMP) proto-check ## run the whole test suite (starts its own redis-server)
	$(VENV)/bin/pytest tests

bench: $(STAMP) ## run the benchmarks; tables printed, JSON in bench/results/
	$(VENV)/bin/kvcoord bench

chaos: $(STAMP) ## faults on a namespace cluster, 2 replicas (root; ~2 min); bench/results/chaos.json
	$(PY) -m bench.chaos

run: $(STAMP) ## run a coordinator on LISTEN (embedded store)
	$(VENV)/bin/kvcoord coordinator --listen $(LISTEN)

demo: $(STAMP) ## the main job: `kvcoord up` (local fleet, demo workload, report)
	$(VENV)/bin/kvcoord up

clean: ## remove caches (keeps .venv)
	rm -rf .pytest_cache .mypy_cache .ruff_cache .hypothesis
