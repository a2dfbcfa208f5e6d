"""Real vLLM on a GPU through the remote tier: a vLLM on engine B is served, exactly, the
prefixes a vLLM on engine A computed, fetched from the Mooncake Store A published them to.

Process R computes the prompts with no connector (the reference).  Engines A and B (two
names, two pools, one ``mooncake_master`` on loopback) both run ``--remote mooncake``.  A
vLLM on A computes the prompts cold and saves them; once A has published them, a fresh vLLM
on B (its own prefix cache off; B's pool never held them) runs them: its prefixes come
from the store (B's fetch counters and vLLM's count of tokens it did not compute say so),
and its greedy tokens and top-5 logprobs equal R's bit for bit.  Needs the ``remote``
extra (the Mooncake client and its ``mooncake_master``); skipped where it is absent.
"""

from __future__ import annotations

import os
import random
import time
from pathlib import Path

import pytest

import tests.e2e.gpu_only  # noqa: F401  (skips this module without a GPU)
from pegaflow.stats.engine_stats import read_stats
from tests.e2e.outputs import max_logprob_diff
from tests.e2e.runs import run_vllm
from tools.engine_process import EngineProcess
from tools.remote_hosts import Host, MasterProcess, TwoHosts, mooncake_master_binary

pytestmark = [pytest.mark.gpu, pytest.mark.vllm, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
MODEL = ROOT / "tools" / "models" / "llama-1b-shape"
BLOCK = 16
PUBLISH_WAIT_S = 60.0
ONE_HOST = TwoHosts(Host("127.0.0.1", ()), Host("127.0.0.1", ()), False, "one host, loopback")


def _prompts() -> list[list[int]]:
    rng = random.Random(17)
    return [[rng.randrange(10, 31000) for _ in range(n)] for n in (1200, 700, 2500)]


def _flatten(result: dict) -> list:
    return [r for batch in result["batches"] for r in batch]


def _wait_published(name: str, num_blocks: int) -> dict:
    deadline = time.monotonic() + PUBLISH_WAIT_S
    while (stats := read_stats(name))["remote_blocks_put"] < num_blocks:
        assert time.monotonic() < deadline, f"engine {name} published {stats['remote_blocks_put']} of {num_blocks}"
        time.sleep(0.1)
    return stats


def test_remote_vllm_on_engine_b_is_served_what_engine_a_published_exactly(tmp_path):
    pytest.importorskip("mooncake.store", reason="the remote extra (Mooncake's client) is not installed")
    if mooncake_master_binary() is None:
        pytest.skip("no mooncake_master beside this Python or on PATH")
    prompts = [[p] for p in _prompts()]
    full_blocks = sum(len(p[0]) // BLOCK for p in prompts)
    reference = _flatten(run_vllm(tmp_path, "R", MODEL, prompts, "", "--no-prefix-caching"))
    master = MasterProcess(ONE_HOST, tmp_path)
    master.start()
    try:
        tag = f"{os.getpid()}_{os.urandom(2).hex()}"
        flags = master.engine_flags(ONE_HOST.first, "2GiB")
        with EngineProcess(f"rma{tag}", *flags, backend="cuda", pool_size="2GiB", start_timeout_s=120) as a, \
                EngineProcess(f"rmb{tag}", *flags, backend="cuda", pool_size="2GiB", start_timeout_s=120) as b:
            # 1. A's vLLM computes the prompts cold; A publishes every block it saved.
            run_vllm(tmp_path, "A", MODEL, prompts, a.name)
            _wait_published(a.name, read_stats(a.name)["blocks_saved"])
            # 2. B's vLLM (no prefix cache of its own; B's pool is empty) is served them from
            #    the store: B fetched them, vLLM computed only the tails.
            served = run_vllm(tmp_path, "B", MODEL, prompts, b.name, "--no-prefix-caching")
            stats_b = read_stats(b.name)
    finally:
        master.kill()
    assert stats_b["remote_blocks_fetched"] >= full_blocks * 0.95, stats_b
    assert stats_b["remote_checksum_failures"] == 0
    assert served["cached_tokens"] >= full_blocks * BLOCK * 0.95, served["cached_tokens"]
    # 3. Tokens and top-5 logprobs equal the no-cache run exactly.
    assert max_logprob_diff(_flatten(served), reference) == 0.0
