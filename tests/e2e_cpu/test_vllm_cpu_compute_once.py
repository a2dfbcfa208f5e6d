"""Compute once with real vLLM on the CPU (its CPU build): two vLLM processes on one engine are
sent one new document at the same moment, each with a question of its own.  With compute once
(the engine's default) the document is prefilled once: one vLLM computes it, the other waits
for its saves and loads them, computing only its question.  With the engine's
``--no-compute-once`` both compute it.  The prompt tokens each vLLM computed are its prompt less
the ``cached_tokens`` of its answer; the engine's counters say who waited.

The same two vLLM processes serve both halves: the engine is restarted between them (their
connectors attach to the new one at their next request), each half with a document of its own.
"""

from __future__ import annotations

import os
import random

import pytest

import tests.e2e_cpu.cpu_only  # noqa: F401  (skips this module without vLLM's CPU build)
from pegaflow.stats.engine_stats import read_stats
from tests.e2e_cpu.cpu_runs import BLOCK, Session, start_engine
from tests.e2e_cpu.random_weights import write_model

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
DOC_BLOCKS, QUESTION_TOKENS = 64, 40


@pytest.fixture
def connector_env(monkeypatch):
    """A CPU's prefill rate (the claim lasts its longest, 10 s) and the longest wait for a
    claim: a loaded CI machine's prefill of the document must not outlast either."""
    monkeypatch.setenv("PEGAFLOW_PREFILL_TOKENS_PER_S", "200")
    monkeypatch.setenv("PEGAFLOW_COMPUTE_ONCE_WAIT_MS", "10000")


def _burst(sessions: list[Session], seed: int) -> tuple[list[int], int]:
    """One new document to every session at once, each with its own question: the prompt
    tokens each computed, and the unique prompt tokens (the document once, every question)."""
    rng = random.Random(seed)
    document = [rng.randrange(10, 31000) for _ in range(DOC_BLOCKS * BLOCK)]
    prompts = [document + [rng.randrange(10, 31000) for _ in range(QUESTION_TOKENS)] for _ in sessions]
    for session, prompt in zip(sessions, prompts):
        session.send({"op": "generate", "prompts": [prompt], "max_tokens": 4})
    answers = [session.answer() for session in sessions]
    computed = [len(p) - a["results"][0]["cached_tokens"] for p, a in zip(prompts, answers)]
    return computed, len(document) + len(sessions) * QUESTION_TOKENS


def test_cpu_compute_once_burst_prefills_a_new_document_once_and_twice_without(tmp_path, connector_env):
    model = write_model("llama-tiny", tmp_path / "llama-tiny")
    name = f"cpuonce{os.getpid()}"
    engine = start_engine(name)
    sessions: list[Session] = []
    try:
        sessions = [Session(model, name), Session(model, name)]
        # 1. Compute once: one vLLM computed the document and its question, the other only its
        #    question (it waited for the first one's claim and loaded the document's 64 blocks).
        computed, unique = _burst(sessions, seed=3)
        stats = read_stats(name)
        claims = {k: v for k, v in stats.items() if k.startswith("claim")}
        assert sorted(computed) == [QUESTION_TOKENS, DOC_BLOCKS * BLOCK + QUESTION_TOKENS], claims
        assert sum(computed) == unique
        assert stats["claim_waits"] == 1 and stats["claim_wait_blocks"] == DOC_BLOCKS, claims
        assert stats["claim_timeouts"] == stats["claims_dropped"] == 0, claims
        # 2. The engine restarted with --no-compute-once, a new document: each vLLM computes
        #    (most of) it; the engine served them (their saves reached it) and claimed nothing.
        engine.stop()
        engine = start_engine(name, "--no-compute-once")
        computed, unique = _burst(sessions, seed=4)
        stats = read_stats(name)
        assert sum(computed) > unique and stats["claims"] == stats["claim_waits"] == 0
        # (the document's blocks, stored once, and each prompt's block of 32 question tokens)
        assert stats["blocks_saved"] == DOC_BLOCKS + 2 and stats["commands_by_opcode"]["lookup"] >= 2
    finally:
        for session in sessions:
            session.close()
        engine.stop()
