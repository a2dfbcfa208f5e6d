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

.PHONY: install install-cpu test-env system-libs promtool test test-cpu lint test-gpu run-engine smoke stat bench-ipc clean

# The Debian libraries the remote tier's Mooncake client links against, and iproute2 for the
# tests' network namespaces.
REMOTE_DEBS := libibverbs1 librdmacm1 liburing2 libnl-3-200 libnl-route-3-200 libnuma1 libcurl4 iproute2
# The vLLM the tests run against on the CPU (the connector against vLLM's real Scheduler), put
# into $(VENV) by `make test` only where $(VENV) has no vLLM yet: a GPU host's pinned 0.26.0 stays.
VLLM_TEST ?= 0.33.0
# Stamps: what `make test` built on first use (rebuilt when pyproject.toml changes).
TEST_STAMP := $(VENV)/.test-env
CPU_STAMP := $(VENV_CPU)/.cpu-env

# What running pegaflow needs and nothing else: the package (editable) and its five
# dependencies. vLLM is yours to bring (on a GPU host: pip install -e '.[vllm]', the version
# verified on a GPU); the test environments are `make test`'s, built on first use.
install:
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --upgrade pip
	$(PY) -m pip install -e .

$(PY):
	$(MAKE) install

# The test tools, the remote tier's client, vLLM for the CPU tests (unless one is there),
# the remote tier's Debian libraries (only when missing, and only as root) and promtool.
$(TEST_STAMP): pyproject.toml | $(PY)
	$(PY) -m pip install -e '.[test,remote,proxy]'
	$(PY) -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('vllm') is None)" || \
	  $(PY) -m pip install 'vllm==$(VLLM_TEST)'
	$(MAKE) system-libs promtool
	touch $@

test-env: $(TEST_STAMP)

# vLLM's CPU build pulls CUDA builds of torchvision, torchaudio and torchcodec, which break
# `import vllm` beside a CPU torch: they go.
$(CPU_STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV_CPU)
	$(PY_CPU) -m pip install --upgrade pip
	$(PY_CPU) -m pip install $(if $(TORCH_CPU_INDEX),--extra-index-url $(TORCH_CPU_INDEX)) -e '.[cpu]'
	$(PY_CPU) -m pip uninstall -y torchvision torchaudio torchcodec
	touch $@

install-cpu: $(CPU_STAMP)

# Installs (as root, with apt-get) those of REMOTE_DEBS that are missing; elsewhere it says
# what to install and goes on (the remote tier's tests then skip, saying why).
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

# promtool, which tests run on the Prometheus metrics and the alert rules (deploy/): taken out of
# Debian's prometheus package into $(VENV)/bin (nothing installed, no root needed where apt's
# lists are there; no Prometheus server installed as a service).
promtool:
	@if command -v promtool >/dev/null 2>&1 || [ -x $(VENV)/bin/promtool ]; then echo "promtool: there"; \
	elif ! command -v apt-get >/dev/null 2>&1; then echo "not a Debian host: no promtool (its tests skip)"; \
	else tmp=$$(mktemp -d) && (cd $$tmp && { apt-get download -qq prometheus >/dev/null 2>&1 || \
	  { [ "$$(id -u)" = 0 ] && apt-get update -qq && apt-get download -qq prometheus >/dev/null 2>&1; }; }) && \
	  dpkg-deb -x $$tmp/prometheus_*.deb $$tmp/x && mkdir -p $(VENV)/bin && \
	  cp $$tmp/x/usr/bin/promtool $(VENV)/bin/promtool && echo "promtool: in $(VENV)/bin" || \
	  echo "promtool: apt-get download prometheus failed (apt-get update first?); its tests skip"; \
	  rm -rf $$tmp; fi

# The CI test command, whole after `make install`: the test environments on first use, the
# lint gate, then the tests (GPU tests skip themselves where CUDA is absent), then real vLLM
# on the CPU.
test: $(TEST_STAMP) lint
	$(PY) -m pytest -q
	$(MAKE) test-cpu

test-cpu: $(CPU_STAMP)
	$(PY_CPU) -m pytest -q tests/e2e_cpu

lint: $(TEST_STAMP)
	$(VENV)/bin/ruff check pegaflow engine tests tools

test-gpu: $(TEST_STAMP)
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
