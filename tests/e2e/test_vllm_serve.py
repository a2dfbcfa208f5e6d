"""``vllm serve`` with pegaflow on a GPU: concurrent HTTP requests over shared prefixes get
the tokens a server without the connector gives, and a second server is served the
prefixes from the engine (vLLM's external-hit counter says so)."""

from __future__ import annotations

import os
from pathlib import Path
from types import SimpleNamespace

import pytest

import tests.e2e.gpu_only  # noqa: F401  (skips this module without a GPU)
from tools.bench_serving import Server, external_hit_tokens, run_all, server_command
from tools.engine_process import EngineProcess
from tools.serving_workload import shared_prefix_prompts

pytestmark = [pytest.mark.gpu, pytest.mark.vllm, pytest.mark.slow]

MODEL = Path(__file__).resolve().parents[2] / "tools" / "models" / "llama-1b-shape"


def _args(port: int) -> SimpleNamespace:
    return SimpleNamespace(model=str(MODEL), port=port, max_model_len=4096, gpu_memory_utilization=0.3,
                           gpu_blocks=2000, host_gib=2, eager=False)


def _serve(config: str, engine_name: str, tmp_path: Path, prompts):
    args = _args(8000 + os.getpid() % 1000)
    server = Server(server_command(config, args, engine_name), args.port, tmp_path / f"{config}.log")
    try:
        results = run_all(args.port, [(f"p{i}", p, 0.0) for i, p in enumerate(prompts)], 12, concurrency=8)
        return results, external_hit_tokens(args.port)
    finally:
        server.stop()


def test_serve_shared_prefixes_equal_a_server_without_the_connector(tmp_path):
    prompts = shared_prefix_prompts(num_prefixes=3, prefix_tokens=1500, num_requests=12, suffix_tokens=40)
    reference, _ = _serve("none", "", tmp_path, prompts)
    assert all(not r.error and len(r.tokens) == 12 for r in reference)
    name = f"serve{os.getpid()}"
    with EngineProcess(name, backend="cuda", pool_size="2GiB", start_timeout_s=120):
        first, _ = _serve("pegaflow", name, tmp_path, prompts)     # computes and saves
        second, hits = _serve("pegaflow", name, tmp_path, prompts)  # a fresh server: from the engine
    assert [r.tokens for r in first] == [r.tokens for r in reference]
    assert [r.tokens for r in second] == [r.tokens for r in reference]
    # Each of the 3 prefixes is served from the engine (at least once: a request that shares
    # one with a request scheduled before it hits vLLM's own prefix cache, where a layer-wise
    # load's blocks are cached at allocation).
    assert hits >= 3 * (1500 // 16) * 16, hits
