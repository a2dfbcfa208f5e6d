"""Imported first by every e2e module: skips the module where vLLM or a CUDA GPU is missing."""

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("vllm")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
