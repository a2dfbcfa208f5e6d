PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# The engine's settings come from its PEGAFLOW_* variables (or its defaults); ENGINE_ARGS adds
# flags, e.g. `make run-engine ENGINE_ARGS="--pool-size 64GiB --keep-pool"`.
ENGINE_ARGS ?=
NAME ?= $(or $(PEGAFLOW_NAME),pegaflow)

.PHONY: install test lint test-gpu run-engine smoke stat bench-ipc clean

# One command installs everything, vLLM included, into $(VENV).
install:
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --upgrade pip
	$(PY) -m pip install -e '.[test]'

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
	$(PY) -m tools.smoke --name $(NAME)

stat:
	$(VENV)/bin/pegaflow-stat --name $(NAME)

bench-ipc:
	$(PY) -m tools.bench_ipc

clean:
	rm -rf .pytest_cache .hypothesis build *.egg-info
