PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# The engine's settings come from its PEGAFLOW_* variables (or its defaults); ENGINE_ARGS adds
# flags, e.g. `make run-engine ENGINE_ARGS="--pool-size 64GiB --keep-pool"`.
ENGINE_ARGS ?=
NAME ?= $(or $(PEGAFLOW_NAME),pegaflow)

.PHONY: install system-libs test lint test-gpu run-engine smoke stat bench-ipc clean

# The Debian libraries the remote tier's Mooncake client links against, and iproute2 for the
# tests' network namespaces.
REMOTE_DEBS := libibverbs1 librdmacm1 liburing2 libnl-3-200 libnl-route-3-200 libnuma1 libcurl4 iproute2

# One command installs everything, vLLM and the remote tier's client included, into $(VENV).
install: system-libs
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --upgrade pip
	$(PY) -m pip install -e '.[test,remote]'

# Installs (as root, with apt-get) those of REMOTE_DEBS that are missing; elsewhere it says
# what to install and goes on (the remote tier's tests then skip, saying why).  Then promtool,
# which a test runs on the Prometheus metrics: taken out of Debian's prometheus package into
# $(VENV)/bin (no root needed, and no Prometheus server installed as a service).
system-libs:
	@missing=""; for deb in $(REMOTE_DEBS); do \
	  dpkg-query -W -f='$${Status}' $$deb 2>/dev/null | grep -q "install ok installed" || missing="$$missing $$deb"; \
	done; \
	if [ -z "$$missing" ]; then echo "system libraries: all there"; \
	elif ! command -v apt-get >/dev/null 2>&1; then echo "not a Debian host: install$$missing for the remote tier"; \
	elif [ "$$(id -u)" != 0 ]; then echo "not root: run sudo apt-get install -y$$missing for the remote tier"; \
	else DEBIAN_FRONTEND=noninteractive apt-get update -qq && \
	  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $$missing || \
	  echo "apt-get failed: install$$missing for the remote tier"; fi
	@if command -v promtool >/dev/null 2>&1 || [ -x $(VENV)/bin/promtool ]; then echo "promtool: there"; \
	elif ! command -v apt-get >/dev/null 2>&1; then echo "not a Debian host: no promtool (its test skips)"; \
	else tmp=$$(mktemp -d) && (cd $$tmp && { apt-get download -qq prometheus >/dev/null 2>&1 || \
	  { [ "$$(id -u)" = 0 ] && apt-get update -qq && apt-get download -qq prometheus >/dev/null 2>&1; }; }) && \
	  dpkg-deb -x $$tmp/prometheus_*.deb $$tmp/x && mkdir -p $(VENV)/bin && \
	  cp $$tmp/x/usr/bin/promtool $(VENV)/bin/promtool && echo "promtool: in $(VENV)/bin" || \
	  echo "promtool: apt-get download prometheus failed (apt-get update first?); its test skips"; \
	  rm -rf $$tmp; fi

# The CI test command: the lint gate, then the tests (GPU tests skip themselves where CUDA
# is absent).
test: lint
	$(PY) -m pytest -q

lint:
	$(VENV)/bin/ruff check pegaflow engine tests tools

test-gpu:
	$(PY) -m pytest -q -m gpu

run-engine:
	$(PY) -m engine $(ENGINE_ARGS)

smoke:
	$(PY) -m pegaflow.smoke --name $(NAME)

stat:
	$(VENV)/bin/pegaflow-stat --name $(NAME)

bench-ipc:
	$(PY) -m tools.bench_ipc

clean:
	rm -rf .pytest_cache .hypothesis build *.egg-info
