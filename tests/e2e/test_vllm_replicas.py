"""Two ``vllm serve`` replicas on one engine, behind the replicas bench's router, on a GPU:
every answer equals a single server's without the connector, and each replica is served from
the engine what the other computed (its external-hit counter says so)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

import tests.e2e.gpu_only  # noqa: F401  (skips this module without a GPU)
from tools.bench_replicas import Chat, Fleet, parse_args
from tools.engine_process import EngineProcess
from tools.replica_router import Router

pytestmark = [pytest.mark.gpu, pytest.mark.vllm, pytest.mark.slow]

MODEL = Path(__file__).resolve().parents[2] / "tools" / "models" / "llama-1b-shape"
ROUNDS = 3


def _args(replicas: int):
    """The bench's own options (its defaults for the rest), sized for a quick test."""
    return parse_args(["--model", str(MODEL), "--port", str(8100 + os.getpid() % 500), "--replicas", str(replicas),
                       "--max-model-len", "8192", "--gpu-memory-utilization", "0.25", "--gpu-blocks", "800",
                       "--host-gib", "4", "--users", "5", "--context-tokens", "3000", "--question-tokens", "32",
                       "--answer-tokens", "12", "--seed", "0"])


def _chat(config: str, replicas: int, engine_name: str, tmp_path: Path):
    """Every round's answers by request key, and each replica's external-hit tokens."""
    args = _args(replicas)
    fleet = Fleet(config, args, engine_name, tmp_path, f"{config}{replicas}")
    try:
        chat = Chat(args, Router("round-robin", replicas, seed=3))
        routed = [x for r in range(ROUNDS) for x in chat.round(fleet, r)]
        hits = {r: c["host_hit_tokens"] for r, c in fleet.counters().items()}
    finally:
        fleet.close()
    assert not [x.result.error for x in routed if x.result.error]
    return {x.result.key: x.result.tokens for x in routed}, routed, hits


def test_two_replicas_on_one_engine_equal_one_server_and_serve_each_other(tmp_path):
    reference, _, _ = _chat("none", 1, "", tmp_path)
    name = f"replicas{os.getpid()}"
    with EngineProcess(name, backend="cuda", pool_size="4GiB", start_timeout_s=120):
        answers, routed, hits = _chat("pegaflow", 2, name, tmp_path)
    assert answers == reference
    # Each replica got turns whose previous turn the other computed, and was served from
    # the engine: at least a full context's worth of tokens each.
    for replica in (0, 1):
        assert any(x.moved and x.replica == replica for x in routed), replica
        assert hits[replica] >= 3000 // 16 * 16, hits
