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
.PHONY: help install proto proto-check lint test test-vllm smoke bench bench-peers engines-peers bench-engines bench-rl chaos docs-provenance docs-map run demo clean clean-cache ci-local

help: ## list the targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  %-16s %s\n", $$1, $$2}'

EXTRAS := .[worker,text,gateway,bridge,dev,plot,accel]
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
	# torch pinned to the CPU wheel: an unpinned torch pulls a multi-GB CUDA build. pip installs
	# it: its configuration says where a machine keeps the CPU wheel.
	$(PIP) install --quiet "torch==2.13.0"
	# The rest through uv, which links files from its cache (~/.cache/uv) instead of unpacking
	# every wheel again: 18-20 s here against pip's 100-140 s (measured, #49). pip where uv
	# cannot serve.
	$(PIP) install --quiet uv && $(VENV)/bin/uv pip install --quiet --python $(PY) -e "$(EXTRAS)" \
	  || $(PIP) install --quiet -e "$(EXTRAS)"
	touch $(STAMP)

# The index's optional compiled core (Cython + the C compiler; coordinator/core/index/holdings.py).
# Where it cannot build, the pure-Python holdings serve; either way this says which.
ACCEL := $(VENV)/.accel
$(ACCEL): $(STAMP) setup.py coordinator/core/_holdings_accel.pyx coordinator/core/_chain_accel.pyx \
  coordinator/core/_slot_positions_accel.pyx coordinator/core/_slot_positions_accel.pxd \
  coordinator/core/_holdings_entry.pxd
	@$(PY) setup.py -q build_ext --inplace > $(VENV)/accel-build.log 2>&1 || \
	  echo "install: the compiled index core did not build (see $(VENV)/accel-build.log)"
	@$(PY) -c "from coordinator.core import accel; print('install: index core:', accel.status())"
	@touch $(ACCEL)

install: $(STAMP) $(ACCEL) ## create .venv and install everything (runtime, worker, dev), build the index core

proto: $(STAMP) ## regenerate the gRPC stubs from proto/
	$(PY) -m grpc_tools.protoc -Iproto --python_out=. --pyi_out=. --grpc_python_out=. $(PROTOS)

proto-check: $(STAMP) ## fail when the committed stubs are stale
	@tmp=$$(mktemp -d); \
	$(PY) -m grpc_tools.protoc -Iproto --python_out=$$tmp --pyi_out=$$tmp --grpc_python_out=$$tmp $(PROTOS); \
	status=0; for f in $$(cd $$tmp && find . -name '*.py' -o -name '*.pyi'); do \
	  cmp -s $$tmp/$$f $$f || { echo "stale generated stub: $$f (run 'make proto')"; status=1; }; \
	done; rm -rf $$tmp; exit $$status

lint: $(STAMP) ## ruff, mypy (strict) and the import contracts of the layers (lint-imports)
	$(VENV)/bin/ruff check coordinator worker kvcoord tests tests_vllm bench .ci
	$(VENV)/bin/mypy coordinator worker kvcoord
	$(VENV)/bin/lint-imports --no-cache

# Every process a suite starts carries its owner mark (kvcoord.child_process); after the suite,
# kvcoord.leftovers lists (and kills) any still running, and fails the target when there is one.
OWNED = owner=$@-$$$$-$$(date +%s%N); export KVCOORD_PROCESS_OWNER=$$owner; status=0;
LEFTOVERS = $(PY) -m kvcoord.leftovers $$owner || status=1; exit $$status

test: $(STAMP) $(ACCEL) proto-check lint ## lint, the whole test suite (starts its own redis-server), smoke; fails on a process left running
	@$(OWNED) \
	$(VENV)/bin/pytest tests --durations=15 || status=$$?; \
	if [ $$status = 0 ]; then $(MAKE) --no-print-directory smoke || status=$$?; fi; \
	$(LEFTOVERS)

# A real vLLM engine (its CPU build) behind `kvcoord bridge` and `kvcoord gateway`: tests_vllm/,
# which `make test` does not run. vLLM (~3.5 GB) and SGLang's model gateway `smg` (~0.15 GB) get
# environments of their own (their pins are not ours). They hold no project code, so each is
# built once per machine in $(KVCOORD_CACHE), named by what it pins, and every clone uses it
# (kvcoord/engine_envs.py: built aside, renamed into place once checked).
KVCOORD_CACHE ?= $(HOME)/.cache/kvcoord
export KVCOORD_CACHE
ENGINE_ENVS := $(PYTHON) kvcoord/engine_envs.py
VLLM_VENV := $(shell $(ENGINE_ENVS) path vllm)
SMG_VENV := $(shell $(ENGINE_ENVS) path smg)
VLLM_STAMP := $(VLLM_VENV)/.complete
SMG_STAMP := $(SMG_VENV)/.complete

$(VLLM_STAMP):
	@$(ENGINE_ENVS) build vllm

$(SMG_STAMP):
	@$(ENGINE_ENVS) build smg

VLLM_TEST_ENV = KVCOORD_VLLM_PYTHON=$(VLLM_VENV)/bin/python KVCOORD_SMG=$(SMG_VENV)/bin/smg

test-vllm: $(STAMP) $(ACCEL) $(VLLM_STAMP) $(SMG_STAMP) ## a real vLLM (CPU) behind the bridge and gateway, the engines bench's quick form, the RL test on two engines and the rl bench's quick form (~8 min on 2 cores; the first run on a machine builds the vLLM and smg environments, 3.7 GB, in KVCOORD_CACHE)
	@$(OWNED) \
	$(VLLM_TEST_ENV) $(VENV)/bin/pytest tests_vllm --durations=5 || status=$$?; \
	$(LEFTOVERS)

engines-peers: $(VLLM_STAMP) $(SMG_STAMP) ## build what `kvcoord bench engines` runs, once per machine: vLLM's CPU build and smg, in KVCOORD_CACHE

bench-engines: $(STAMP) $(ACCEL) $(VLLM_STAMP) $(SMG_STAMP) ## two vLLM engines behind kvcoord gateway, Envoy + kvcoord epp and smg, 6 routers x 3 repeats per rig and regime (a quota case took 6.5-12.6 min on 2 cores); bench/results/engines.json
	$(VLLM_TEST_ENV) $(VENV)/bin/kvcoord bench engines

bench-rl: $(STAMP) $(ACCEL) $(VLLM_STAMP) ## RL updates on two vLLM engines under GRPO load: kvcoord's sync update against reload + reset with no barrier (~9 min, 2 cores); bench/results/rl.json
	KVCOORD_VLLM_PYTHON=$(VLLM_VENV)/bin/python $(VENV)/bin/kvcoord bench rl

# Every `kvcoord bench` suite at its quick sizes, then one chaos round of each fault, all writing
# under a temporary directory (bench/results/ is for full runs). Fails when a suite crashes or an
# invariant it measures breaks. Chaos needs root and `ip netns`: without them `--quick` skips
# with its reason, except under CI=true, where it fails. --allow-busy: the smoke run checks that
# the suites work and their invariants hold, it measures nothing anyone reads (its JSON still
# records what else was running).
smoke: $(STAMP) $(ACCEL) ## quick bench suites + one chaos round, into a temp dir; fails on a broken invariant
	@tmp=$$(mktemp -d -t kvcoord-smoke-XXXXXX); status=0; began=$$SECONDS; \
	$(VENV)/bin/kvcoord bench all --quick --allow-busy --out $$tmp || status=1; \
	bench_s=$$((SECONDS - began)); began=$$SECONDS; \
	$(PY) -m bench.chaos --quick --allow-busy --out $$tmp || status=1; \
	echo "smoke: bench suites $${bench_s}s, chaos $$((SECONDS - began))s"; \
	if [ $$status = 0 ]; then rm -rf $$tmp; else echo "smoke: FAILED (results in $$tmp)"; fi; \
	exit $$status

bench: $(STAMP) $(ACCEL) ## run the benchmarks; tables printed, JSON in bench/results/
	$(VENV)/bin/kvcoord bench

# NVIDIA Dynamo's Rust radix tree (ai-dynamo-runtime, ~220 MB installed: not in `make install`)
# beside our index on the same prompts; `kvcoord bench coordinator` prints null without it.
bench-peers: $(STAMP) $(ACCEL) ## install the bench-peer extra (Dynamo) and run the coordinator benchmark beside it
	$(PIP) install --quiet "ai-dynamo-runtime==1.6.1"
	$(VENV)/bin/kvcoord bench coordinator

chaos: $(STAMP) $(ACCEL) ## faults on a namespace cluster, 2 replicas (root; ~5 min); bench/results/chaos.json
	$(PY) -m bench.chaos

# After a bench run rewrites a result file: the docs' "Measured at" lines quoting it follow
# (tests/test_doc_provenance.py fails until they do).
docs-provenance: $(STAMP) ## rewrite the docs' generated 'Measured at' lines from bench/results/*.json
	$(PY) -m bench.doc_provenance

docs-map: $(STAMP) ## regenerate docs/ARCHITECTURE.md's module map from the code (every module, its docstring, its lines)
	$(PY) -m bench.module_map

run: $(STAMP) $(ACCEL) ## run a coordinator on LISTEN (embedded store)
	$(VENV)/bin/kvcoord coordinator --listen $(LISTEN)

demo: $(STAMP) $(ACCEL) ## the main job: `kvcoord up` (local fleet, demo workload, report)
	$(VENV)/bin/kvcoord up

clean: ## remove caches (keeps .venv and the engine environments)
	rm -rf .pytest_cache .mypy_cache .ruff_cache .hypothesis

clean-cache: ## remove the engine environments every clone shares (KVCOORD_CACHE, default ~/.cache/kvcoord)
	@$(ENGINE_ENVS) clean

ci-local: ## check HEAD as CI will: a fresh clone in a temp dir runs .ci/run (CI=true, no stdin); each stage's time and disk; the clone removed
	@$(PYTHON) .ci/local.py
