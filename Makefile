# Two entry points, each doing all set-up on a fresh machine and reusing it afterwards:
#   make demo   the whole cluster on one machine, serving a request, then a clean stop
#   make test   the test suite (what .ci/run calls)
#   make check  the inner loop: lint, format check, unit and contract tests (2-3 minutes)
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.kvfabric-installed

.PHONY: demo up test faults compose check lint bench-bus setup clean models vllm prometheus

setup: $(STAMP)

# torch goes in first, pinned to the CPU build that lies on this machine's disk; the
# project's own range (torch>=2.4) is then already satisfied and pip pulls no CUDA build.
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev]'
	touch $(STAMP)

# The models live outside the repository (shared/models.py); fetching is a no-op once cached.
# The C kernels (shared/kernels/cpu) are built for this machine beside them: a no-op once built; a
# machine without a C compiler says so here and decodes from float32 weights.
models: $(STAMP)
	$(VENV)/bin/kvfabric models fetch
	$(PY) -m shared.kernels.cpu || true

# vLLM's CPU build in a venv of its own (its pins differ from ours), with what kvfabric's KV
# connector needs inside it: ~/.cache/kvfabric/peers/vllm, minutes and ~1 GB the first time,
# a no-op after. Only the vllm-worker service (`kvfabric up --engine vllm`), the tests marked
# vllm and `kvfabric bench peers` use it; `make demo` never builds it.
vllm: $(STAMP)
	$(PY) -m services.vllm_worker.vllm_env

# Prometheus's server and promtool (Debian's `prometheus` package): the dashboard and metrics
# tests run them and skip, naming the package, where they are missing. Installed here when
# this runs as root on a Debian machine (as CI does); elsewhere a line says what to install.
prometheus:
	@if ! command -v prometheus >/dev/null || ! command -v promtool >/dev/null; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	    echo "installing Debian's prometheus (the dashboard and metrics tests run it)"; \
	    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq prometheus \
	      >/dev/null) || echo "WARNING: apt-get install prometheus failed: those tests will skip"; \
	  else \
	    echo "WARNING: no prometheus/promtool: the dashboard tests will skip (apt-get install prometheus)"; \
	  fi; \
	fi

demo: models
	$(VENV)/bin/kvfabric demo

up: models
	$(VENV)/bin/kvfabric up

# Two test processes, a test file each at a time (module-scoped clusters stay whole); then
# the tests marked serial, alone.
test: models vllm prometheus
	$(PY) -m pytest -q -n 2 --dist loadfile -m "not serial and not faults and not compose"
	$(PY) -m pytest -q -m "serial and not faults and not compose"

# The fault suite (tests/faults): real faults under agent load on a cluster split over
# network-namespace hosts (root), the engine's failover continuation on both models, and the
# only vLLM worker of a model killed (vLLM's venv); with it the faults of the e2e modules
# (workers killed and restarted on test_serving's cluster, a killed launcher), which
# make test leaves out. .ci/run runs it after make test, in its own budget.
FAULT_MODULES := tests/faults tests/e2e/test_serving.py tests/e2e/test_up.py
faults: models vllm
	$(PY) -m pytest -q -m faults $(FAULT_MODULES)

# compose/ for real (tests/deploy/test_compose_up.py): podman, runc and mmdebstrap from Debian
# where missing (root), the images built (deploy/images/build.sh: the base once, then a few
# minutes), the whole cluster up on podman-compose, checked, and down again.
compose: $(STAMP)
	deploy/images/install-podman.sh
	deploy/images/build.sh
	$(PY) -m pytest -q -m compose tests/deploy/test_compose_up.py

lint: $(STAMP)
	$(VENV)/bin/ruff check . && $(VENV)/bin/ruff format --check .

# No NATS, no cluster, no vLLM: what a change must pass before the whole suite.
check: lint models
	$(PY) -m pytest -q -n 2 tests/unit tests/contract

bench-bus: $(STAMP)
	$(PY) -m loadtest.bench_bus

clean:
	rm -rf $(VENV) .kvfabric
