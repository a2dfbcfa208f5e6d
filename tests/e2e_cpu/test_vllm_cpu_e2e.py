"""Real vLLM on the CPU (its CPU build) with a tiny Llama of random weights: outputs served
from pegaflow equal a run with no cache, exactly, in every CI run.

Two references with no connector: R_cold computes every prompt cold (its prefix cache
off); R_warm, its prefix cache on, computes the base prompts and then B's prompts, whose
prefixes its own cache serves: the same uncached tails after the same cached prefixes as B
(vLLM's CPU attention over a cached context rounds apart from a cold prefill's, so a served
prompt is compared with a served one).  Process A, with the connector, computes the base
prompts cold and saves them; B, a fresh vLLM with its own prefix cache off, runs the base
prompts, prompts that extend them, prompts that share only half of them, and the base
prompts together: its prefixes come from the engine (all of the full blocks A saved) and
its greedy tokens and top-5 logprobs equal R_warm's bit for bit.  The engine then restarts
with ``--keep-pool`` and a third fresh vLLM is served the same from the kept pool.  An
engine killed while a vLLM runs leaves that vLLM computing every prompt, exactly as R_cold.
"""

from __future__ import annotations

import os
import random

import pytest

import tests.e2e_cpu.cpu_only  # noqa: F401  (skips this module without vLLM's CPU build)
from pegaflow.platform import shm
from pegaflow.stats.engine_stats import read_stats
from tests.e2e.outputs import max_logprob_diff
from tests.e2e_cpu.cpu_runs import BLOCK, Session, cached_tokens, flatten, run, start_engine
from tests.e2e_cpu.random_weights import write_model

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
NO_PREFIX_CACHING = "--no-prefix-caching"


def _prompts() -> dict:
    rng = random.Random(7)
    base = [[rng.randrange(10, 31000) for _ in range(n)] for n in (700, 450, 1000)]
    extended = [p + [rng.randrange(10, 31000) for _ in range(150)] for p in base]
    partial = [p[:len(p) // 2] + [rng.randrange(10, 31000) for _ in range(200)] for p in base]
    return {"base": base, "extended": extended, "partial": partial}


def _one_by_one(p: dict) -> list:
    return [[x] for x in p["base"] + p["extended"] + p["partial"]]


def _b_batches(p: dict) -> list:
    return _one_by_one(p) + [p["base"]]  # and the base prompts again, all at once


def _servable(p: dict) -> int:
    """Prompt tokens of B's prompts in the full blocks A saved (vLLM computes a prompt's
    last token itself): what a complete cache serves."""
    full = [len(x) // BLOCK * BLOCK for x in p["base"]]
    capped = [min(f, (len(x) - 1) // BLOCK * BLOCK) for f, x in zip(full, p["base"])]
    halves = [len(x) // 2 // BLOCK * BLOCK for x in p["base"]]
    return 2 * sum(capped) + sum(full) + sum(halves)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return write_model("llama-tiny", tmp_path_factory.mktemp("llama-tiny"))


@pytest.fixture(scope="module")
def reference(model, tmp_path_factory):
    """(prompts, R_warm's outputs of B's batches, R_cold's outputs of every prompt one by one)."""
    tmp = tmp_path_factory.mktemp("ref")
    p = _prompts()
    warm = flatten(run(tmp, "Rwarm", model, [[x] for x in p["base"]] + _b_batches(p)))[len(p["base"]):]
    cold = flatten(run(tmp, "Rcold", model, _one_by_one(p), "", NO_PREFIX_CACHING))
    return p, warm, cold


def _remove_kept_pool(name: str) -> None:
    """An engine of the same name without --keep-pool removes what the kept one left."""
    start_engine(name).stop()


def test_cpu_e2e_served_exactly_then_again_after_a_keep_pool_restart(model, reference, tmp_path):
    prompts, ref, _ = reference
    name = f"cpu{os.getpid()}_{os.urandom(2).hex()}"
    try:
        with start_engine(name, "--keep-pool") as engine:
            # 1. A computes the base prompts cold and saves every full block of them.
            run(tmp_path, "A", model, [[x] for x in prompts["base"]], engine.name)
            saved = read_stats(engine.name)["blocks_saved"]
            assert saved >= sum(len(x) // BLOCK for x in prompts["base"])
            # 2. B, a fresh vLLM without its own prefix cache, is served by the engine...
            result = run(tmp_path, "B", model, _b_batches(prompts), engine.name, NO_PREFIX_CACHING)
            loaded = read_stats(engine.name)["blocks_loaded"]
        # 3. ...its tokens and top-5 logprobs equal R_warm's exactly, and it was served what a
        #    complete cache holds of its prompts.
        print("served", cached_tokens(result), "of", _servable(prompts), "loaded blocks", loaded)  # (pytest -s)
        alone = len(_one_by_one(prompts))  # B's prompts one at a time: bit for bit
        assert max_logprob_diff(flatten(result)[:alone], ref[:alone]) == 0.0
        # The base prompts again, all at once: vLLM's CPU build alone, no connector, does not
        # reproduce such a batch bit for bit (three runs of R_warm: 2.9e-6 apart in one, 0 in the
        # other); tokens equal, logprobs to rounding.
        assert max_logprob_diff(flatten(result)[alone:], ref[alone:]) < 1e-4
        assert loaded * BLOCK >= cached_tokens(result) >= 0.95 * _servable(prompts), \
            (loaded, cached_tokens(result), _servable(prompts))
        # 4. The engine stopped with --keep-pool; a new one takes in the kept pool, and C, a
        #    fresh vLLM, is served from it, exactly.
        with start_engine(name, "--keep-pool") as engine:
            assert read_stats(engine.name)["blocks_loaded"] == 0
            kept = run(tmp_path, "C", model, [[x] for x in prompts["base"]], engine.name, NO_PREFIX_CACHING)
            loaded = read_stats(engine.name)["blocks_loaded"]
        assert loaded > 0 and cached_tokens(kept) >= 0.95 * sum((len(x) - 1) // BLOCK * BLOCK
                                                                for x in prompts["base"])
        assert max_logprob_diff(flatten(kept), ref[:len(prompts["base"])]) == 0.0
    finally:
        _remove_kept_pool(name)


def test_cpu_e2e_engine_killed_mid_run_still_exact(model, reference, tmp_path):
    prompts, warm_ref, cold_ref = reference
    engine = start_engine(f"cpuk{os.getpid()}_{os.urandom(2).hex()}")
    session = None
    try:
        # 1. One vLLM computes the base prompts cold (saved), then is served them (loaded).
        session = Session(model, engine.name, enable_prefix_caching=False)
        cold = session.generate(prompts["base"])
        warm = session.generate(prompts["base"])
        assert read_stats(engine.name)["blocks_loaded"] > 0
        # 2. The engine is killed under the running vLLM, which then runs every prompt: its
        #    lookups miss, nothing is loaded or saved, it computes them all.
        engine.proc.kill()
        engine.proc.wait()
        killed = session.generate([x[0] for x in _one_by_one(prompts)])
    finally:
        if session is not None:
            session.close()
        if engine.proc.poll() is None:
            engine.proc.kill()
            engine.proc.wait()
        start_engine(engine.name).stop()  # a new engine of that name removes what the killed one left
    # 3. Every output equals the reference of the same work exactly: cold as R_cold, served as
    #    R_warm (served in full), and after the kill, all cold.
    base = len(prompts["base"])
    assert max_logprob_diff(cold["results"], cold_ref[:base]) == 0.0
    assert [r["cached_tokens"] for r in warm["results"]] == [r["cached_tokens"] for r in warm_ref[:base]]
    assert max_logprob_diff(warm["results"], warm_ref[:base]) == 0.0
    assert sum(r["cached_tokens"] for r in killed["results"]) == 0
    assert max_logprob_diff(killed["results"], cold_ref) == 0.0
    assert not [s for s in os.listdir("/dev/shm") if s.startswith(shm.ipc_name(engine.name, "").lstrip("/"))]
