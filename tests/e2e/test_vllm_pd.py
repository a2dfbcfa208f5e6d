"""Prefill/decode disaggregation under ``vllm serve`` on one GPU: a ``kv_producer`` and a
``kv_consumer`` server on one pegaflow engine, ``pegaflow-proxy`` in front.  Every answer
equals a single server's without the connector, and the decode server was served every
full block of each prompt from the engine (vLLM's external-hit counter says so)."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

import tests.e2e.gpu_only  # noqa: F401  (skips this module without a GPU)
from tools.bench_pd import BLOCK, pd_command, prompts, server_args
from tools.bench_serving import Server, external_hit_tokens, run_all, server_command
from tools.engine_process import EngineProcess

pytestmark = [pytest.mark.gpu, pytest.mark.vllm, pytest.mark.slow]

MODEL = Path(__file__).resolve().parents[2] / "tools" / "models" / "llama-1b-shape"
ANSWER_TOKENS = 16


# tools/bench_pd.py's options, as this test sets them (two servers share the GPU)
OPTIONS = SimpleNamespace(model=str(MODEL), gpu_share=0.3, gpu_blocks=2000, max_model_len=4096, eager=False)


def _reference(port: int, jobs: list[list[int]], tmp_path: Path) -> list:
    server = Server(server_command("none", server_args(OPTIONS, port, OPTIONS.gpu_share), ""), port,
                    tmp_path / "reference.log")
    try:
        return run_all(port, [(f"p{i}", p, 0.0) for i, p in enumerate(jobs)], ANSWER_TOKENS, concurrency=1)
    finally:
        server.stop()


def test_pd_decode_server_is_served_every_full_block_and_answers_equal(tmp_path):
    base = 8000 + os.getpid() % 1000
    # distinct prompts (no shared prefix: the decode server can only be served what the
    # prefill server saved), of lengths that end mid-block and on a block's end
    jobs = [p[:n] for p, n in zip(prompts(8, 2000, seed=3), (2000, 1999, 1500, 1024, 1025, 700, 333, 1760))]
    reference = _reference(base, jobs, tmp_path)
    assert all(not r.error and len(r.tokens) == ANSWER_TOKENS for r in reference)
    name, opts = f"pd{os.getpid()}", OPTIONS
    servers = []
    with EngineProcess(name, backend="cuda", pool_size="4GiB", start_timeout_s=120):
        try:
            servers.append(Server(pd_command("kv_producer", opts, base, name), base, tmp_path / "prefill.log"))
            servers.append(Server(pd_command("kv_consumer", opts, base + 1, name), base + 1, tmp_path / "decode.log"))
            servers.append(Server([sys.executable, "-m", "pegaflow.proxy", "--port", str(base + 2),
                                   "--prefill", f"http://127.0.0.1:{base}", "--decode",
                                   f"http://127.0.0.1:{base + 1}"], base + 2, tmp_path / "proxy.log"))
            # several in flight at once: a decode lookup may come while the prefill's saves land
            results = run_all(base + 2, [(f"p{i}", p, 0.0) for i, p in enumerate(jobs)], ANSWER_TOKENS,
                              concurrency=4)
            hits = external_hit_tokens(base + 1)
        finally:
            for server in reversed(servers):
                server.stop()
    assert [r.error for r in results] == [""] * len(jobs)
    assert [r.tokens for r in results] == [r.tokens for r in reference]
    full_tokens = sum((len(p) - 1) // BLOCK * BLOCK for p in jobs)
    assert hits >= full_tokens, (hits, full_tokens)
