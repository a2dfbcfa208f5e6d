"""Every vLLM of these tests computes with the same number of threads, connector or not."""

from __future__ import annotations

import os

import pytest

RESERVED = "VLLM_CPU_NUM_OF_RESERVED_CPU"


@pytest.fixture(scope="session", autouse=True)
def same_threads_with_and_without_a_connector():
    """vLLM's CPU build keeps one more core off its worker's threads when a KV connector is
    configured: a run with pegaflow and one without then sum in other orders and round apart
    (seen on 2 cores: 2 threads against 1, a top-5 logprob 0.008 off with nothing loaded).
    One reserved core for every run makes them compare bit for bit."""
    old = os.environ.get(RESERVED)
    os.environ[RESERVED] = "1"
    yield
    if old is None:
        os.environ.pop(RESERVED, None)
    else:
        os.environ[RESERVED] = old
