"""Real vLLM on a GPU: outputs served from pegaflow equal a run with no cache, exactly.

Process R computes every prompt with no connector (the reference).  Process A, with the
connector, computes the base prompts cold and saves them.  Process B, a fresh vLLM with
its own prefix cache off, runs the base prompts, prompts that extend them, prompts that
share only part of them, and a batch of them together (also from a new engine whose pool
is empty and whose disk tier holds them, and from an engine whose pool was filled past
them): its prefixes come from the engine (the engine's counters and vLLM's per-request
count of tokens it did not compute say so) and its greedy tokens and top-5 logprobs equal
R's bit for bit.  Corrupting one page in the pool makes the check fail; an engine gone
mid-run still yields exact outputs (vLLM recomputes).
"""

from __future__ import annotations

import os
import random
import time
from pathlib import Path

import numpy as np
import pytest

import tests.e2e.gpu_only  # noqa: F401  (skips this module without a GPU)
from pegaflow.platform import shm
from pegaflow.stats.engine_stats import read_stats
from tests.e2e.outputs import max_logprob_diff as _max_logprob_diff
from tests.e2e.runs import run_vllm
from tools.engine_process import EngineProcess

pytestmark = [pytest.mark.gpu, pytest.mark.vllm, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
MODEL = ROOT / "tools" / "models" / "llama-1b-shape"
BLOCK = 16


def _prompts() -> dict:
    rng = random.Random(7)
    base = [[rng.randrange(10, 31000) for _ in range(n)] for n in (1200, 700, 2500)]
    extended = [p + [rng.randrange(10, 31000) for _ in range(300)] for p in base]
    partial = [p[:len(p) // 2] + [rng.randrange(10, 31000) for _ in range(400)] for p in base]
    return {"base": base, "extended": extended, "partial": partial}


def _run(tmp: Path, name: str, batches: list, engine: str = "", *flags: str) -> dict:
    return run_vllm(tmp, name, MODEL, batches, engine, *flags)


def _b_batches(p: dict) -> list:
    one_by_one = [[x] for x in p["base"] + p["extended"] + p["partial"]]
    return one_by_one + [p["base"]]  # and the base prompts again, all at once


def _flatten(result: dict) -> list:
    return [r for batch in result["batches"] for r in batch]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ref")
    p = _prompts()
    return p, _flatten(_run(tmp, "R", _b_batches(p), "", "--no-prefix-caching"))


@pytest.fixture
def engine():
    with EngineProcess(f"e2e{os.getpid()}_{os.urandom(2).hex()}", backend="cuda",
                       pool_size="2GiB", start_timeout_s=120) as proc:
        yield proc


def test_e2e_outputs_from_cache_equal_no_cache_run(engine, reference, tmp_path):
    prompts, ref = reference
    # 1. A computes the base prompts cold and saves them.
    _run(tmp_path, "A", [[x] for x in prompts["base"]], engine.name)
    saved = read_stats(engine.name)["blocks_saved"]
    assert saved >= sum(len(x) // BLOCK for x in prompts["base"])
    # 2. B, a fresh vLLM without its own prefix cache, serves everything with the engine.
    result = _run(tmp_path, "B", _b_batches(prompts), engine.name, "--no-prefix-caching")
    stats = read_stats(engine.name)
    assert stats["blocks_loaded"] > 0 and result["cached_tokens"] > 0
    # 3. Tokens and top-5 logprobs equal the no-cache run exactly.
    assert _max_logprob_diff(_flatten(result), ref) == 0.0


def test_e2e_default_compilation_serves_decode_completed_blocks_exactly(engine, tmp_path):
    # vLLM's default compilation (full CUDA graphs for decode): the blocks A's decode
    # completed (its answers' KV, saved behind one event after each full-graph step) are
    # served to B's next-round prompts, whose outputs equal a no-cache run's exactly.
    prompts = _prompts()["base"]
    answer_tokens = 40  # decode completes two or three blocks of each prompt
    ref_first = _flatten(_run(tmp_path, "Rg1", [[x] for x in prompts], "", "--no-prefix-caching", "--graphs",
                              "--max-tokens", str(answer_tokens)))
    rng = random.Random(11)
    rounds = [p + r["tokens"] + [rng.randrange(10, 31000) for _ in range(200)] for p, r in zip(prompts, ref_first)]
    ref_next = _flatten(_run(tmp_path, "Rg2", [[x] for x in rounds], "", "--no-prefix-caching", "--graphs"))
    first = _run(tmp_path, "Ag", [[x] for x in prompts], engine.name, "--graphs", "--max-tokens", str(answer_tokens))
    assert _max_logprob_diff(_flatten(first), ref_first) == 0.0
    loaded_before = read_stats(engine.name)["blocks_loaded"]
    result = _run(tmp_path, "Bg", [[x] for x in rounds], engine.name, "--no-prefix-caching", "--graphs")
    assert _max_logprob_diff(_flatten(result), ref_next) == 0.0
    # Served: every full block of prompt and answer whose KV A computed (the answer's last
    # token never is), i.e. more than the prompts alone hold.
    held = sum(min(len(p) + answer_tokens - 1, len(r) - 1) // BLOCK * BLOCK for p, r in zip(prompts, rounds))
    prompt_only = sum((len(p) - 1) // BLOCK * BLOCK for p in prompts)
    loaded = (read_stats(engine.name)["blocks_loaded"] - loaded_before) * BLOCK
    assert result["cached_tokens"] >= held > prompt_only and loaded >= held, \
        (result["cached_tokens"], loaded, result["external_hit_tokens"], held)


def test_e2e_corrupted_pool_page_is_caught(engine, reference, tmp_path):
    prompts, ref = reference
    _run(tmp_path, "A", [[x] for x in prompts["base"]], engine.name)
    # 1. Flip the bytes of the first pages of the pool (where the first blocks live).
    pool = shm.attach_segment(shm.ipc_name(engine.name, "pool"))
    data = pool.array(np.uint8, 1 << 20)
    data[:] = ~data
    del data
    pool.close()
    # 2. The same comparison must now fail.
    result = _run(tmp_path, "B", _b_batches(prompts), engine.name, "--no-prefix-caching")
    with pytest.raises(AssertionError):
        assert _max_logprob_diff(_flatten(result), ref) == 0.0


def test_e2e_engine_gone_still_exact(reference, tmp_path):
    prompts, ref = reference
    # 1. An engine serves A, then dies (SIGKILL) before B runs: B must recompute everything.
    proc = EngineProcess(f"e2ek{os.getpid()}", backend="cuda", pool_size="4GiB", start_timeout_s=120)
    name = proc.name
    try:
        _run(tmp_path, "A", [[x] for x in prompts["base"]], name)
        proc.proc.kill()
        proc.proc.wait()
        result = _run(tmp_path, "B", _b_batches(prompts), name, "--no-prefix-caching")
    finally:
        if proc.proc.poll() is None:  # run A failed: the engine still runs
            proc.proc.kill()
            proc.proc.wait()
        # 2. A new engine of that name removes what the killed one left in /dev/shm.
        EngineProcess(name, backend="cuda", pool_size="64MiB", start_timeout_s=120).stop()
    assert result["cached_tokens"] == 0
    assert _max_logprob_diff(_flatten(result), ref) == 0.0


def _disk_engine(name: str, disk: str, *flags: str, admission: str = "all", pool_size: str = "2GiB") -> EngineProcess:
    """An engine with a disk tier (``all``: every block is written as it is stored)."""
    return EngineProcess(name, "--disk-path", disk, "--disk-admission", admission, *flags, backend="cuda",
                         pool_size=pool_size, start_timeout_s=120)


def test_e2e_prefixes_served_from_disk_equal_no_cache_run(reference, tmp_path):
    pytest.importorskip("xxhash")  # the disk tier's checksums
    prompts, ref = reference
    name, disk = f"e2ed{os.getpid()}", str(tmp_path / "disk")
    # 1. A computes the base prompts cold; every block it saves is written to disk; the
    #    engine stops.
    with _disk_engine(name, disk) as first:
        _run(tmp_path, "A", [[x] for x in prompts["base"]], first.name)
        deadline = time.monotonic() + 60
        while (stats := read_stats(first.name))["disk_blocks_written"] < stats["blocks_saved"]:
            assert time.monotonic() < deadline, stats
            time.sleep(0.1)
    assert stats["disk_blocks_written"] >= sum(len(x) // BLOCK for x in prompts["base"])
    # 2. A new engine on that disk, its pool empty, serves B: its prefixes come from disk.
    with _disk_engine(name, disk) as second:
        result = _run(tmp_path, "B", _b_batches(prompts), second.name, "--no-prefix-caching")
        stats = read_stats(second.name)
    assert stats["disk_blocks_read"] > 0 and stats["lookup_disk_blocks"] > 0
    assert stats["disk_checksum_failures"] == 0 and result["cached_tokens"] > 0
    # 3. Tokens and top-5 logprobs equal the no-cache run exactly.
    assert _max_logprob_diff(_flatten(result), ref) == 0.0


def test_e2e_prefixes_evicted_to_disk_are_served_exactly(reference, tmp_path):
    pytest.importorskip("xxhash")
    prompts, ref = reference
    # A pool of 192 blocks (three 32 MiB slabs of 512 KiB blocks for this shape) under the
    # base prompts' 274: saving them evicts the first ones, which the default admission
    # writes to disk.
    with _disk_engine(f"e2ev{os.getpid()}", str(tmp_path / "disk"), "--slab-size", "32MiB",
                      admission="evicted", pool_size="96MiB") as engine:
        _run(tmp_path, "A", [[x] for x in prompts["base"]], engine.name)
        assert read_stats(engine.name)["disk_blocks_written"] > 0
        # The same engine serves B: what left its pool comes back from disk, the rest from
        # the pool (what does not fit at once is recomputed).
        result = _run(tmp_path, "B", _b_batches(prompts), engine.name, "--no-prefix-caching")
        stats = read_stats(engine.name)
    assert stats["disk_blocks_read"] > 0 and stats["disk_checksum_failures"] == 0
    assert result["cached_tokens"] > 0
    assert _max_logprob_diff(_flatten(result), ref) == 0.0
