import pytest

pytest.importorskip("vllm")
