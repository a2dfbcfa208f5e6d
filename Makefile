PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
NAME ?= pegaflow
POOL_SIZE ?= 4GiB
BACKEND ?= auto

.PHONY: install test test-gpu run-engine smoke stat bench-ipc clean

# One command installs everything, vLLM included, into $(VENV).
install:
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --upgrade pip
	$(PY) -m pip install -e '.[test]'

# The CI test command: GPU tests skip themselves where CUDA is absent.
test:
	$(PY) -m pytest -q

test-gpu:
	$(PY) -m pytest -q -m gpu

run-engine:
	$(PY) -m engine --name $(NAME) --pool-size $(POOL_SIZE) --backend $(BACKEND)

smoke:
	$(PY) tools/smoke.py --name $(NAME)

stat:
	$(VENV)/bin/pegaflow-stat --name $(NAME)

bench-ipc:
	$(PY) tools/bench_ipc.py

clean:
	rm -rf .pytest_cache .hypothesis build *.egg-info
