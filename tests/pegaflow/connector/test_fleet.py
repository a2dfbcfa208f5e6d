"""Several vLLMs on one engine: what one instance saves is served to every other, at once,
whether the saver goes idle, exits or outlives an engine restart (--keep-pool).

Each instance is a real vLLM ``Scheduler`` plus a worker side over the host backend
(``vllm_harness``), all attached to one real engine process at the same time.
"""

from __future__ import annotations

import os
import random
import signal
import time

import pytest

from pegaflow.stats.engine_stats import read_stats
from tests.pegaflow.connector.vllm_harness import BLOCK, VllmInstance, make_request
from tools.engine_process import EngineProcess

pytestmark = pytest.mark.vllm

KEEP = ("--keep-pool",)


def _prompts(seed: int, count: int = 3) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(10, 30000) for _ in range(rng.randrange(3, 7) * BLOCK + 5)]
            for _ in range(count)]


def _num_full_tokens(prompt: list[int]) -> int:
    """Tokens a complete cache serves: every full block but the one holding the last token."""
    return (len(prompt) - 1) // BLOCK * BLOCK


def _compute(vllm: VllmInstance, prompts: list[list[int]], tag: str) -> None:
    """One request at a time, as a user sending prompts one after another."""
    for i, prompt in enumerate(prompts):
        vllm.add(make_request(f"{tag}{i}", prompt))
        vllm.run_until_done()


def _served(vllm: VllmInstance, prompts: list[list[int]], tag: str) -> list[int]:
    """Tokens of each prompt loaded from the engine without a load error, run one at a
    time (vLLM's external-hit counter also counts hits whose load then failed)."""
    served = []
    for i, prompt in enumerate(prompts):
        before = vllm.served_tokens
        vllm.add(make_request(f"{tag}{i}", prompt))
        vllm.run_until_done()
        served.append(vllm.served_tokens - before)
    return served


def _engine(name: str, *args: str) -> EngineProcess:
    return EngineProcess(name, "--lease-ttl", "30", *args)


@pytest.fixture
def name():
    name = f"fleet{os.getpid()}_{os.urandom(3).hex()}"
    yield name
    EngineProcess(name).stop()  # removes whatever a killed or kept engine left


def _instances(name: str, count: int, **kwargs) -> list[VllmInstance]:
    made = []
    try:
        for _ in range(count):
            made.append(VllmInstance(name, **kwargs))
    except BaseException:
        for vllm in made:
            vllm.close()
        raise
    return made


@pytest.mark.parametrize("engine_args", [(), KEEP], ids=["pool", "kept-pool"])
def test_fleet_blocks_of_an_idle_instance_are_served_to_another(name, engine_args):
    # 1. A and B are alive together; A computes three prompts one at a time, then does
    #    nothing at all (no step, no call into its connector).
    prompts = _prompts(1)
    with _engine(name, *engine_args):
        a, b = _instances(name, 2)
        try:
            _compute(a, prompts, "a")
            # 2. B is served every full block of each, the last one A computed included.
            assert _served(b, prompts, "b") == [_num_full_tokens(p) for p in prompts]
        finally:
            a.close()
            b.close()


def test_fleet_each_of_three_instances_serves_the_others(name):
    # 1. Three instances alive together, each computes its own prompt and goes idle.
    prompts = _prompts(2)
    with _engine(name):
        fleet = _instances(name, 3)
        try:
            for i, vllm in enumerate(fleet):
                _compute(vllm, [prompts[i]], f"own{i}")
            # 2. Each is served the other two instances' prompts in full.
            for i, vllm in enumerate(fleet):
                others = [p for j, p in enumerate(prompts) if j != i]
                assert _served(vllm, others, f"other{i}_") == [_num_full_tokens(p) for p in others]
        finally:
            for vllm in fleet:
                vllm.close()


def test_fleet_blocks_of_an_instance_that_exited_are_served(name):
    # 1. A computes two prompts and exits at once (its connector shuts down).
    prompts = _prompts(3, 2)
    with _engine(name):
        (a,) = _instances(name, 1)
        try:
            _compute(a, prompts, "a")
        finally:
            a.close()
        # 2. A fresh B is served them in full.
        (b,) = _instances(name, 1)
        try:
            assert _served(b, prompts, "b") == [_num_full_tokens(p) for p in prompts]
        finally:
            b.close()


def _kill(engine: EngineProcess) -> None:
    engine.proc.send_signal(signal.SIGKILL)
    engine.proc.wait(10)


def test_fleet_blocks_outlive_an_engine_crash_for_a_fresh_instance(name):
    # 1. A and B, alive together, each compute prompts on a --keep-pool engine.
    a_prompts, b_prompts = _prompts(4, 2), _prompts(5, 2)
    engine = _engine(name, *KEEP)
    a, b = _instances(name, 2)
    try:
        _compute(a, a_prompts, "a")
        _compute(b, b_prompts, "b")
        # 2. The engine is SIGKILLed and restarted with --keep-pool; A and B exit.
        _kill(engine)
        engine = _engine(name, *KEEP)
    finally:
        a.close()
        b.close()
    try:
        # 3. A fresh C is served both instances' blocks in full.
        (c,) = _instances(name, 1)
        try:
            assert _served(c, a_prompts + b_prompts, "c") == \
                [_num_full_tokens(p) for p in a_prompts + b_prompts]
        finally:
            c.close()
    finally:
        engine.stop()


def test_fleet_instance_alive_across_a_restart_is_served_after_it(name):
    # 1. A computes prompts; B is attached (idle) on the same --keep-pool engine.
    prompts = _prompts(6, 2)
    engine = _engine(name, *KEEP)
    try:
        a, b = _instances(name, 2)
        try:
            _compute(a, prompts, "a")
            # 2. The engine dies and a new one takes in the kept pool; B notices nothing yet.
            _kill(engine)
            engine = _engine(name, *KEEP)
            # 3. B's first requests after the restart are served in full, without waiting
            #    for a reconnect interval (5 s by default) to pass.
            assert _served(b, prompts, "b") == [_num_full_tokens(p) for p in prompts]
            # 4. And A, alive across the restart, saves again: B is served a new prompt of A's.
            fresh = _prompts(7, 1)
            _compute(a, fresh, "a2")
            assert _served(b, fresh, "b2") == [_num_full_tokens(fresh[0])]
        finally:
            a.close()
            b.close()
    finally:
        engine.stop()


def test_fleet_same_prefix_saved_at_once_is_stored_once_and_served_to_both(name):
    # 1. A and B compute the same prompt at once: B's whole first step (lookup: a miss,
    #    forward, save) runs after A's lookup missed and before A's forward saves.  (Compute
    #    once off: with it, B's lookup would wait for A's claim instead of computing.)
    (prompt,) = _prompts(8, 1)
    num_blocks = len(prompt) // BLOCK
    with _engine(name) as engine:
        a, b = _instances(name, 2, extra={"compute_once": False})
        try:
            a.add(make_request("a", prompt))
            b.add(make_request("b", prompt))
            b_started = []

            def b_first_step(meta):
                # A is scheduled (its lookup may take a few steps); B goes once, before A saves.
                if a.requests["a"].num_computed_tokens and not b_started:
                    b_started.append(b.step_until_admitted("b"))

            a.step_until_admitted("a", before_forward=b_first_step)
            assert b_started
            a.run_until_done()
            b.run_until_done()
            assert a.served_tokens == b.served_tokens == 0
            # 2. The engine holds one copy of each block: the second save deduplicated all.
            stats = read_stats(engine.name)
            assert (stats["blocks_saved"], stats["save_dedup_blocks"]) == (num_blocks, num_blocks)
            # 3. Both are served it again in full (their own GPU prefix caches reset).
            for vllm, tag in ((a, "a2"), (b, "b2")):
                vllm.scheduler.reset_prefix_cache()
                assert _served(vllm, [prompt], tag) == [_num_full_tokens(prompt)]
        finally:
            a.close()
            b.close()


def test_fleet_stat_shows_which_instance_feeds_which(name):
    # 1. A computes a prompt, B is served it; both stay attached.
    import json
    import subprocess
    import sys
    (prompt,) = _prompts(9, 1)
    num_blocks = len(prompt) // BLOCK
    def stat_clients() -> list[dict]:
        out = subprocess.run([sys.executable, "-m", "pegaflow.stats.cli", "--name", name, "--once",
                              "--json"], capture_output=True, text=True, timeout=30, check=True).stdout
        return json.loads(out)["clients"]

    with _engine(name):
        a, b = _instances(name, 2)
        try:
            _compute(a, [prompt], "a")
            assert _served(b, [prompt], "b") == [_num_full_tokens(prompt)]
            # 2. pegaflow-stat lists the four clients (a scheduler and a worker of each), with
            #    their pid and role, and who saved, looked up and loaded what.
            clients = stat_clients()
            # 3. A exits: its two slots leave the list once the engine has freed them.
            a.close()
            deadline = time.monotonic() + 5
            while len(remaining := stat_clients()) != 2 and time.monotonic() < deadline:
                time.sleep(0.05)
            assert {c["slot"] for c in remaining} == {c["slot"] for c in clients
                                                      if c["lookup_hit_blocks"] or c["blocks_loaded"]}
        finally:
            a.close()
            b.close()
    assert sorted(c["role"] for c in clients) == ["scheduler", "scheduler", "worker", "worker"]
    assert {c["pid"] for c in clients} == {os.getpid()}  # both instances live in this process
    workers = sorted((c for c in clients if c["role"] == "worker"), key=lambda c: c["slot"])
    schedulers = sorted((c for c in clients if c["role"] == "scheduler"), key=lambda c: c["slot"])
    # A's worker attached first (at registration), then B's; schedulers attach at their first lookup.
    assert [(w["blocks_saved"], w["blocks_loaded"]) for w in workers] == \
        [(num_blocks, 0), (0, _num_full_tokens(prompt) // BLOCK)]
    assert [s["lookup_hit_blocks"] for s in schedulers] == [0, _num_full_tokens(prompt) // BLOCK]
    assert all(c["inflight_copies"] == 0 for c in clients)
    assert workers[0]["namespace"] == workers[1]["namespace"] == schedulers[0]["namespace"]


def _run_together(fleet: list[VllmInstance], timeout_s: float = 60.0) -> int:
    """Step each instance in turn until none has a request left; every block loaded is
    checked, byte for byte, in the step it landed.  Returns how many blocks were loaded."""
    num_loaded, deadline = 0, time.monotonic() + timeout_s
    while any(vllm.scheduler.requests for vllm in fleet):
        assert time.monotonic() < deadline, "requests still running"
        for vllm in fleet:
            if vllm.scheduler.requests:
                for load in vllm.step().landed:
                    num_loaded += len(load.block_ids)
                    _assert_pattern(vllm, load)
        time.sleep(1e-3)
    return num_loaded


def _assert_pattern(vllm: VllmInstance, load) -> None:
    for block_id, block_hash in zip(load.block_ids, load.hashes):
        for layer in range(3):
            assert (vllm.page(layer, block_id) == vllm.pattern(block_hash, layer)).all(), "a loaded byte differs"


@pytest.mark.parametrize("compute_once", [True, False], ids=["compute-once", "off"])
def test_fleet_burst_of_one_new_document_is_prefilled_once(name, compute_once):
    # 1. Two instances, chunked prefill (two blocks a step), are sent one new 8-block document
    #    at the same moment, each with its own question (one more block and a few tokens).
    rng = random.Random(7)
    document = [rng.randrange(10, 30000) for _ in range(8 * BLOCK)]
    prompts = [document + [rng.randrange(10, 30000) for _ in range(BLOCK + 4)] for _ in range(2)]
    extra = {"compute_once": compute_once, "prefill_tokens_per_s": 20}  # (a CPU's rate: claims last)
    with _engine(name):
        fleet = _instances(name, 2, extra=extra, max_batched_tokens=2 * BLOCK)
        try:
            for i, vllm in enumerate(fleet):
                vllm.add(make_request(f"q{i}", prompts[i]))
            num_loaded = _run_together(fleet)  # (each loaded byte checked as it lands)
            # prefill tokens computed: prompt tokens less those loaded (each vLLM is new: no local hit)
            computed = [len(p) - vllm.served_tokens for vllm, p in zip(fleet, prompts)]
        finally:
            for vllm in fleet:
                vllm.close()
        stats = read_stats(name)
    unique = len(document) + 2 * (BLOCK + 4)
    if not compute_once:  # 2. Off: the second instance computes part of the document again
        assert sum(computed) > unique and stats["claims"] == 0  # (how much: how the steps fell)
        return
    # 2. On: the first instance's miss claimed the document; the second waited for its saves
    #    and loaded them, computing only its question: the document was prefilled once.
    claims = {k: v for k, v in stats.items() if k.startswith("claim")}
    assert sorted(computed) == [BLOCK + 4, len(prompts[0])] and sum(computed) == unique, claims
    assert num_loaded == 8 and stats["claim_waits"] == 1
    assert stats["claim_timeouts"] == stats["claims_dropped"] == 0


NUM_CHUNK_BLOCKS = 4  # of the 8-block document, what the killed claimer computed and saved


def _claimer_child(conn, name: str, prompt: list[int], extra: dict) -> None:
    """A vLLM instance that is sent ``prompt``, computes its first NUM_CHUNK_BLOCKS blocks (two
    a step), says so once their saves are READY, then stops stepping until it is killed."""
    vllm = VllmInstance(name, extra=extra, max_batched_tokens=2 * BLOCK)
    vllm.add(make_request("claimer", prompt))
    deadline = time.monotonic() + 60.0
    while vllm.requests["claimer"].num_computed_tokens < NUM_CHUNK_BLOCKS * BLOCK:
        assert time.monotonic() < deadline, "the claimer's prefill never started"
        vllm.step()
    while read_stats(name)["blocks_saved"] < NUM_CHUNK_BLOCKS:
        assert time.monotonic() < deadline, "the claimer's first chunks were never saved"
        time.sleep(1e-3)
    conn.send(vllm.requests["claimer"].num_computed_tokens)
    time.sleep(3600)


def _remove_buffers_of(pid: int) -> None:
    """The KV buffers in /dev/shm of a killed process (it could not remove them itself)."""
    from pegaflow.platform import shm
    for entry in os.listdir("/dev/shm"):
        if shm.is_private_buffer_of(f"/{entry}", pid):
            shm.unlink_segment(f"/{entry}")


def test_fleet_claimer_killed_mid_prefill_leaves_the_waiter_its_saved_chunks_and_the_rest_to_compute(name):
    from tests.spawn import start_child
    rng = random.Random(11)
    document = [rng.randrange(10, 30000) for _ in range(8 * BLOCK)]
    prompt = document + [rng.randrange(10, 30000) for _ in range(BLOCK + 4)]
    extra = {"prefill_tokens_per_s": 20}  # (a CPU's rate: the claim lives MAX_CLAIM_S, 10 s)
    with _engine(name):
        (waiter,) = _instances(name, 1, extra=extra, max_batched_tokens=2 * BLOCK)
        conn, proc = start_child(_claimer_child, name, document + [1] * (BLOCK + 4), extra)
        try:
            # 1. Another vLLM (a process) claimed the document and computed its first four
            #    blocks, saved; it is killed mid-prefill, its last four blocks still claimed.
            assert conn.poll(120.0), "the claimer never reached the middle of its prefill"
            assert conn.recv() >= NUM_CHUNK_BLOCKS * BLOCK
            # 2. The waiter is sent the document with its own question: its lookup reaches the
            #    claim and is parked (vLLM keeps it waiting).
            waiter.add(make_request("w", prompt))
            for _ in range(5):
                assert not waiter.step().output.scheduled_new_reqs, "the waiter did not wait for the claim"
                time.sleep(0.01)
            os.kill(proc.pid, signal.SIGKILL)
            # 3. The engine reclaims the dead claimer: its claim ends; the waiter loads the four
            #    saved blocks (each byte checked as it lands) and computes the rest: no hang.
            num_loaded = _run_together([waiter])
            served = waiter.served_tokens
        finally:
            proc.kill()
            proc.join(30.0)
            _remove_buffers_of(proc.pid)
            waiter.close()
        stats = read_stats(name)
    assert num_loaded == NUM_CHUNK_BLOCKS and served == NUM_CHUNK_BLOCKS * BLOCK
    # 4. The claim ended with its claimer (dropped, unsaved blocks), not at its deadline.
    assert stats["claims_dropped"] == 1 and stats["claim_timeouts"] == 0, stats
    # (the four blocks were READY before it waited: the wait itself gained none)
    assert stats["claim_waits"] == 1 and stats["claim_wait_blocks"] == 0
