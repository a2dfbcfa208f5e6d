import pytest

pytest.importorskip("vllm")


@pytest.fixture
def vllm_engine():
    """A host-backend engine of its own for one vLLM-harness test (leases live 30 s)."""
    import os

    from tools.engine_process import EngineProcess
    proc = EngineProcess(f"conn{os.getpid()}_{os.urandom(3).hex()}", "--lease-ttl", "30")
    try:
        yield proc
    finally:
        if proc.stop() != 0:  # killed by the test: a new engine of the name removes its leftovers
            EngineProcess(proc.name).stop()
