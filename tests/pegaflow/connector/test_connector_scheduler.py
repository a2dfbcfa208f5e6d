"""PegaKVConnector driven by vLLM's real Scheduler against a real engine (host backend)."""

from __future__ import annotations

import os
import signal
import sys
import time

import numpy as np
import pytest

from pegaflow.client.connection import EngineClient
from pegaflow.client.host_memory import HostKVBuffer, layer_major_records
from pegaflow.stats.engine_stats import read_stats
from tests.pegaflow.connector.vllm_harness import (
    BLOCK,
    NUM_LAYERS,
    PAGE_ELEMS,
    VllmInstance,
    block_pattern,
    make_request,
)
from tools.engine_process import EngineProcess

pytestmark = pytest.mark.vllm

PROMPT = list(range(100, 100 + 5 * BLOCK + 7))  # 5 full blocks and 7 tokens


@pytest.fixture
def engine(vllm_engine):
    return vllm_engine


@pytest.fixture
def held_loads_engine(tmp_path):
    """(engine, hold file): an engine whose LOAD copies run only while the file is absent."""
    hold = tmp_path / "hold"
    engine = EngineProcess(f"conn{os.getpid()}_h{os.urandom(3).hex()}", "--lease-ttl", "30",
                           prefix=(sys.executable, "-m", "tests.pegaflow.connector.held_copies", "--loads", str(hold)))
    yield engine, hold
    engine.stop()


def _wait_lease_expired(engine_name: str, timeout_s: float = 30.0) -> None:
    """Until the engine has let a lease expire (its ttl past, at a housekeeping pass)."""
    deadline = time.monotonic() + timeout_s
    while not read_stats(engine_name)["lease_expiries"]:
        if time.monotonic() > deadline:
            pytest.fail(f"engine {engine_name}: no lease expired within {timeout_s}s")
        time.sleep(0.05)


def _leases_drain_to_zero(engine_name: str, timeout_s: float = 30.0) -> bool:
    """Releases are fire-and-forget: give the engine a moment to apply the last ones."""
    deadline = time.monotonic() + timeout_s
    while read_stats(engine_name)["leases_active"]:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def _warm(engine_name: str, prompt: list[int], req_id: str = "warm") -> None:
    """A first vLLM computes ``prompt`` and saves its full blocks."""
    first = VllmInstance(engine_name)
    try:
        first.add(make_request(req_id, prompt))
        first.run_until_done()
    finally:
        first.close()


def _assert_loaded_bytes(vllm: VllmInstance, load) -> None:
    for block_id, block_hash in zip(load.block_ids, load.hashes):
        for layer in range(NUM_LAYERS):
            assert np.array_equal(vllm.page(layer, block_id), block_pattern(block_hash, layer)), \
                f"block {block_id} layer {layer} differs from what was saved"


def _assert_served(engine_name: str, req_id: str, prompt: list[int], num_blocks: int) -> None:
    """A fresh vLLM (its KV memory poisoned) loads ``num_blocks`` blocks of ``prompt`` in one
    load, each byte what was saved."""
    vllm = VllmInstance(engine_name)
    try:
        vllm.poison()
        vllm.add(make_request(req_id, prompt))
        (load,) = vllm.step_until_admitted(req_id).loads
        assert len(load.block_ids) == num_blocks
        _assert_loaded_bytes(vllm, load)
        vllm.run_until_done()
    finally:
        vllm.close()


def _wait_matched(connector, request, timeout_s: float = 10.0):
    """Ask again until the lookup's answer is in (vLLM would ask again next step)."""
    deadline = time.monotonic() + timeout_s
    while (hit := connector.get_num_new_matched_tokens(request, 0))[0] is None:
        assert time.monotonic() < deadline, "the lookup's answer never came"
        time.sleep(0.001)
    return hit


def test_connector_first_request_saves_full_blocks(engine):
    # 1. One vLLM computes a 87-token prompt and two output tokens.
    _warm(engine.name, PROMPT)
    # 2. Its five full prompt blocks are stored, and only those (the 88th token makes no block).
    stats = read_stats(engine.name)
    assert stats["blocks_saved"] == 5
    assert stats["leases_active"] == 0


def test_connector_same_prefix_loads_exact_blocks_and_bytes(engine):
    # 1. A first vLLM computes and saves the prompt.
    _warm(engine.name, PROMPT)
    # 2. A second vLLM (fresh process state, poisoned KV memory) gets the same prompt.
    second = VllmInstance(engine.name)
    try:
        second.poison()
        second.add(make_request("r2", PROMPT))
        first_step = second.step_until_admitted("r2")
        # 3. The load plan names the request's first five blocks, in order, with their hashes.
        (load,) = first_step.loads
        request = second.requests["r2"]
        assert list(load.block_ids) == second.scheduler.kv_cache_manager.get_block_ids("r2")[0][:5]
        assert list(load.hashes) == list(request.block_hashes[:5])
        assert first_step.output.scheduled_new_reqs[0].num_computed_tokens == 5 * BLOCK
        # 4. After the worker ran, the blocks hold exactly what the first vLLM saved.
        _assert_loaded_bytes(second, load)
        assert not first_step.load_errors
        assert second.external_hits() == 5 * BLOCK
        second.run_until_done()
    finally:
        second.close()
    assert _leases_drain_to_zero(engine.name)


def test_connector_partial_prefix_hits_only_shared_blocks(engine):
    # 1. Save a prompt; 2. ask for one that shares its first 3 blocks, then diverges.
    _warm(engine.name, PROMPT)
    other = PROMPT[:3 * BLOCK] + [9] * (2 * BLOCK + 3)
    # 3. Exactly the 3 shared blocks are loaded, byte-exact.
    _assert_served(engine.name, "partial", other, num_blocks=3)


def test_connector_extended_prompt_loads_whole_cached_prefix(engine):
    # 1. Save a prompt; 2. extend it by 40 new tokens.
    _warm(engine.name, PROMPT)
    longer = PROMPT + list(range(3000, 3040))
    second = VllmInstance(engine.name)
    try:
        second.add(make_request("longer", longer))
        record = second.step_until_admitted("longer")
        # 3. All 5 cached blocks load; the rest is computed, and its new full blocks are saved:
        #    KV exists for the prompt and the first output token (decoded in the last step).
        assert len(record.loads[0].block_ids) == 5
        _assert_loaded_bytes(second, record.loads[0])
        second.run_until_done()
    finally:
        second.close()
    assert read_stats(engine.name)["blocks_saved"] == (len(longer) + 1) // BLOCK


def test_connector_async_load_completes_through_get_finished(engine):
    # 1. Save; 2. a vLLM in async load mode asks for the prompt.
    _warm(engine.name, PROMPT)
    second = VllmInstance(engine.name, extra={"load_mode": "async"})
    try:
        second.poison()
        second.add(make_request("async", PROMPT))
        first = second.step_until_admitted("async")
        # 3. The load is planned as async: vLLM schedules no tokens until it finishes.
        (load,) = first.loads
        assert load.is_async and first.output.total_num_scheduled_tokens == 0
        # 4. The next steps report it through get_finished and the request runs to the end
        #    (its tokens are scheduled only after the load was reported)...
        records = second.run_until_done()
        assert any(r.output.total_num_scheduled_tokens for r in records)
        assert second.external_hits() == 5 * BLOCK
        # 5. ...and the loaded blocks hold what the first vLLM saved.
        _assert_loaded_bytes(second, load)
    finally:
        second.close()
    assert _leases_drain_to_zero(engine.name)


def test_connector_auto_load_mode_loads_a_hit_between_steps_while_another_request_decodes(engine):
    # 1. Save two prompts; 2. a vLLM under load_mode auto decodes a new request (nothing cached).
    later = list(range(500, 500 + 4 * BLOCK + 3))
    _warm(engine.name, PROMPT, "wa")
    _warm(engine.name, later, "wb")
    second = VllmInstance(engine.name, extra={"load_mode": "auto"})
    try:
        second.poison()
        second.add(make_request("busy", list(range(3000, 3000 + 2 * BLOCK)), max_tokens=30))
        second.step_until_admitted("busy")
        second.step()
        # 3. A hit arriving meanwhile loads between steps: the busy request's steps go on
        #    without waiting for it...
        second.add(make_request("hit", PROMPT))
        admitted = second.step_until_admitted("hit")
        (load,) = admitted.loads
        assert load.is_async and second.external_hits() == 5 * BLOCK
        second.run_until_done()
        _assert_loaded_bytes(second, load)
        # 4. ...and once nothing runs, the next hit loads inside its step.
        second.add(make_request("alone", later))
        (alone,) = second.step_until_admitted("alone").loads
        assert not alone.is_async
        second.run_until_done()
        _assert_loaded_bytes(second, alone)
    finally:
        second.close()
    assert _leases_drain_to_zero(engine.name)


def test_connector_abort_after_lookup_releases_lease(engine):
    # 1. Save; 2. a request is looked up and allocated, then aborted before its load runs.
    _warm(engine.name, PROMPT)
    second = VllmInstance(engine.name, num_blocks=64)
    try:
        second.add(make_request("abort-me", PROMPT))
        request = second.requests["abort-me"]
        _wait_matched(second.scheduler.connector, request)
        assert read_stats(engine.name)["leases_active"] == 1
        from vllm.v1.request import RequestStatus
        second.scheduler.finish_requests(["abort-me"], RequestStatus.FINISHED_ABORTED)
        # 3. The abort released the lease.
        assert _leases_drain_to_zero(engine.name)
    finally:
        second.close()


def test_connector_preemption_releases_leases_and_recovers(engine):
    # 1. Save two prompts' blocks.
    prompt_b = list(range(500, 500 + 4 * BLOCK + 3))
    _warm(engine.name, PROMPT, "wa")
    _warm(engine.name, prompt_b, "wb")
    # 2. A vLLM with too few blocks for both runs them together with long outputs: one is
    #    preempted when decode needs blocks, and must later load again and finish.
    second = VllmInstance(engine.name, num_blocks=12)
    try:
        second.add(make_request("a", PROMPT, max_tokens=40))
        second.add(make_request("b", prompt_b, max_tokens=40))
        records = second.run_until_done(max_steps=400)
        assert any(r.output.preempted_req_ids for r in records), "no preemption happened"
        assert not any(r.load_errors for r in records)
    finally:
        second.close()
    assert _leases_drain_to_zero(engine.name)


def test_connector_engine_killed_gives_load_errors_and_misses(engine):
    # 1. Save; 2. a second vLLM is told of the hit, then the engine is killed before the load.
    _warm(engine.name, PROMPT)
    second = VllmInstance(engine.name)
    try:
        request = make_request("r", PROMPT)
        second.add(request)
        connector = second.scheduler.connector
        _wait_matched(connector, request)
        engine.proc.send_signal(signal.SIGKILL)
        engine.proc.wait(10)
        # 3. The planned blocks are reported as load errors (vLLM recomputes them)...
        record = second.step_until_admitted("r")
        assert set(record.loads[0].block_ids) <= record.load_errors
        # 4. ...the request still finishes, and a new request gets no hit and no exception.
        second.run_until_done()
        second.add(make_request("after", PROMPT))
        after = second.step_until_admitted("after")
        assert not after.loads
        second.run_until_done()
    finally:
        second.close()


def test_connector_other_model_same_prompt_no_hit(engine):
    # 1. Save with the bf16 model; 2. the same prompt under another dtype is another namespace.
    _warm(engine.name, PROMPT)
    second = VllmInstance(engine.name, dtype="float16")
    try:
        second.add(make_request("f16", PROMPT))
        assert not second.step_until_admitted("f16").loads
        second.run_until_done()
    finally:
        second.close()


def test_connector_slow_engine_lookup_asks_again_then_misses_and_frees_lease(engine):
    # 1. Save; 2. a second vLLM with a 300 ms lookup deadline; the engine is stopped (SIGSTOP).
    #    (Compute once off: a lookup that may wait for another vLLM's claim has
    #    compute_once_wait_ms more, test_lookups.py.)
    _warm(engine.name, PROMPT)
    second = VllmInstance(engine.name, extra={"lookup_timeout_ms": 300, "compute_once": False})
    connector = second.scheduler.connector
    try:
        request = make_request("slow", PROMPT)
        second.requests["slow"] = request
        client = connector._scheduler.link.client()
        assert client is not None
        engine.proc.send_signal(signal.SIGSTOP)
        try:
            # 3. No answer yet: vLLM is told to ask again (None), not blocked.
            assert connector.get_num_new_matched_tokens(request, 0) == (None, False)
            time.sleep(0.4)
            # 4. Past the deadline: a miss, and the connection is kept (the engine is only slow).
            assert connector.get_num_new_matched_tokens(request, 0) == (0, False)
            assert not connector._scheduler.link.is_down
        finally:
            engine.proc.send_signal(signal.SIGCONT)
        # 5. The late answer's lease is given back at the next lookup; a new request hits.
        other = make_request("after-slow", PROMPT)
        assert _wait_matched(connector, other, 5) == (5 * BLOCK, False)
        connector.request_finished(other, [])
        time.sleep(0.05)
        assert _leases_drain_to_zero(engine.name)
    finally:
        second.close()


def test_connector_failed_load_never_poisons_the_pool():
    # 1. A tiny pool (1 MiB) and 1 s leases; a first vLLM saves the prompt.
    with EngineProcess(f"conn{os.getpid()}_p{os.urandom(2).hex()}", "--lease-ttl", "1",
                       "--pool-size", "1MiB", "--slab-size", "1MiB") as tiny:
        _warm(tiny.name, PROMPT)
        second = VllmInstance(tiny.name)
        filler_client, filler = None, None
        try:
            # 2. A second vLLM (poisoned memory) is offered the hit; the request then waits
            #    longer than the lease while other traffic evicts the blocks.
            second.poison()
            request = make_request("x", PROMPT)
            second.add(request)
            connector = second.scheduler.connector
            _wait_matched(connector, request)
            _wait_lease_expired(tiny.name)
            filler_client = EngineClient.connect(tiny.name)
            filler = HostKVBuffer(NUM_LAYERS * 64 * PAGE_ELEMS * 2, "filler")
            page = PAGE_ELEMS * 2
            filler_client.register_region(0, filler.region_record(64, page, NUM_LAYERS),
                                          layer_major_records(NUM_LAYERS, 64, page))
            filler_client.wait(filler_client.submit_save(999, list(range(60)),
                                                         [os.urandom(32) for _ in range(60)]))
            # 3. The load fails (the blocks are gone): vLLM is told, and recomputes.
            record = second.step()
            assert record.load_errors
            second.run_until_done()
        finally:
            second.close()
            if filler_client is not None:
                filler_client.close()
                filler.close()
        # 4. Whatever the pool now holds for the prompt is what was computed, never garbage.
        third = VllmInstance(tiny.name)
        try:
            third.add(make_request("y", PROMPT))
            for load in third.step_until_admitted("y").loads:
                _assert_loaded_bytes(third, load)
            third.run_until_done()
        finally:
            third.close()


def test_connector_abort_during_async_load_after_preemption_keeps_vllm_consistent(engine):
    from vllm.v1.request import RequestStatus
    # 1. A request saves its blocks, then is preempted (as vLLM does under memory pressure).
    vllm = VllmInstance(engine.name, extra={"load_mode": "async"})
    scheduler = vllm.scheduler
    try:
        vllm.add(make_request("R", PROMPT, max_tokens=50))
        for _ in range(3):
            vllm.step()
        deadline = time.monotonic() + 10
        while read_stats(engine.name)["blocks_saved"] < 5:  # saves complete asynchronously
            assert time.monotonic() < deadline
            vllm.step()
        request = scheduler.requests["R"]
        scheduler.running.remove(request)
        scheduler._preempt_request(request, time.monotonic())
        scheduler.reset_prefix_cache()
        aborted = []

        def abort_while_loading(meta):
            # 2. It resumes through an async load from the engine, and is aborted meanwhile.
            if meta.loads and not aborted:
                scheduler.finish_requests(["R"], RequestStatus.FINISHED_ABORTED)
                aborted.append(True)
        # 3. vLLM frees the blocks only after the load is reported (no assertion, no leak).
        deadline = time.monotonic() + 10
        while not aborted or "R" in scheduler.requests:
            assert time.monotonic() < deadline, "the aborted request never left vLLM"
            vllm.step(before_forward=abort_while_loading)
    finally:
        vllm.close()
    assert _leases_drain_to_zero(engine.name)


def test_connector_reconnects_when_the_engine_comes_back():
    name = f"conn{os.getpid()}_r{os.urandom(2).hex()}"
    first_engine = EngineProcess(name)  # its leftovers are removed by the second one
    try:
        vllm = VllmInstance(name, extra={"reconnect_interval_s": 0.2})
    except BaseException:
        first_engine.stop()
        raise
    try:
        # 1. The engine dies: the running vLLM misses and keeps serving.
        first_engine.proc.kill()
        first_engine.proc.wait(10)
        vllm.add(make_request("during", PROMPT))
        vllm.run_until_done()
        # 2. A new engine of that name starts; after the retry interval the same vLLM
        #    uses it again: it saves, and a second request with the prefix hits.
        with EngineProcess(name) as second_engine:
            links = [vllm.scheduler.connector._scheduler.link] + [w._worker.link for w in vllm.workers]
            deadline = time.monotonic() + 30.0
            while not all(link.client() is not None for link in links):  # each tries every 0.2 s
                assert time.monotonic() < deadline, "the vLLM never reconnected"
                time.sleep(0.05)
            vllm.add(make_request("warm-again", PROMPT))
            vllm.run_until_done()
            assert read_stats(second_engine.name)["blocks_saved"] == 5
            vllm.scheduler.reset_prefix_cache()
            vllm.add(make_request("hit", PROMPT))
            assert len(vllm.step_until_admitted("hit").loads) == 1
            vllm.run_until_done()
    finally:
        vllm.close()


def test_connector_many_requests_in_one_step_hits_misses_and_a_hit_that_waits_for_blocks(engine):
    # 1. Three prompts are computed and saved by a first vLLM (5 full blocks each).
    cached = {name: [base + i for i in range(5 * BLOCK + 7)]
              for name, base in (("a", 1000), ("b", 2000), ("c", 3000))}
    for name, prompt in cached.items():
        _warm(engine.name, prompt, f"warm-{name}")
    saved_before = read_stats(engine.name)["blocks_saved"]
    misses = {name: [base + i for i in range(5 * BLOCK + 7)] for name, base in (("d", 4000), ("e", 5000))}
    # 2. A second vLLM gets all five at once, in the order d a b e c, with a GPU cache of 23
    #    usable blocks: d, a and b (6 blocks each) fit in the first step, e and c must wait
    #    for blocks, c's lookup answered (and its lease held) all the while.
    second = VllmInstance(engine.name, num_blocks=24)
    checked = []
    try:
        second.poison()
        for name in ("d", "a", "b", "e", "c"):
            second.add(make_request(name, (cached | misses)[name]))
        # Every lookup is answered before the first step: one answered only after vLLM
        # asked (a busy engine) would leave its request for a later step.
        for name in ("d", "a", "b", "e", "c"):
            _wait_matched(second.scheduler.connector, second.requests[name])
        records = []
        while second.scheduler.requests:
            assert len(records) < 200, list(second.scheduler.requests)
            records.append(second.step())
            for load in records[-1].landed:  # before a later step may reuse the blocks
                _assert_loaded_bytes(second, load)
                checked.append(load.req_id)
    finally:
        second.close()
    loads = {load.req_id: (i, load) for i, r in enumerate(records) for load in r.loads}
    first_step = next(i for i, r in enumerate(records) if r.output.scheduled_new_reqs)
    admitted = {new.req_id for new in records[first_step].output.scheduled_new_reqs}
    # 3. One step took a miss and two hits; the last hit was loaded in a later step.
    assert admitted == {"d", "a", "b"}, admitted
    assert sorted(loads) == ["a", "b", "c"] and sum(len(r.loads) for r in records) == 3
    assert loads["a"][0] == loads["b"][0] == first_step < loads["c"][0]
    # 4. Every hit got its five blocks' bytes exactly (checked in the step each load
    #    landed: the blocks are reused later), no load failed, and the misses were saved.
    assert all(len(load.block_ids) == 5 for _, load in loads.values())
    assert sorted(checked) == ["a", "b", "c"] and not any(r.load_errors for r in records)
    assert second.served_tokens == second.external_hits() == 3 * 5 * BLOCK
    assert read_stats(engine.name)["blocks_saved"] - saved_before == 2 * 5
    assert _leases_drain_to_zero(engine.name)


def test_connector_async_load_lands_after_the_step_that_plans_it_and_is_checked_when_received(
        held_loads_engine):
    engine, hold = held_loads_engine
    # 1. A first vLLM saves the prompt; a second one (async loads, poisoned KV memory) gets
    #    it while the engine holds every LOAD's copies back, as a GPU's copies queued
    #    behind other work.
    _warm(engine.name, PROMPT)
    second = VllmInstance(engine.name, extra={"load_mode": "async"})
    try:
        second.poison()
        hold.touch()
        second.add(make_request("r", PROMPT))
        planned = second.step_until_admitted("r")
        (load,) = planned.loads
        # 2. The step that plans the load ends before its copies ran: its blocks still hold
        #    the poison (reading them now is reading too early), and it has not landed...
        assert load.is_async and not planned.landed and not planned.finished_recving
        assert all((second.page(layer, block_id) == 0xEE).all()
                   for block_id in load.block_ids for layer in range(NUM_LAYERS))
        # 3. ...nor in any step while the copies are held.
        for _ in range(3):
            assert not second.step().landed
        # 4. Once they run, the step whose workers report the load received has it landed,
        #    every byte what the first vLLM saved.
        hold.unlink()
        deadline = time.monotonic() + 60
        while not (record := second.step()).landed:
            assert time.monotonic() < deadline, "the load was never reported"
            time.sleep(1e-3)
        assert record.landed == [load] and record.finished_recving == {"r"}
        _assert_loaded_bytes(second, load)
        assert not record.load_errors
        second.run_until_done()
    finally:
        second.close()


def test_connector_finished_request_is_freed_at_once_and_its_saved_bytes_stay_exact(engine):
    # 1. A vLLM with 7 usable blocks computes PROMPT (6 blocks); its SAVE is over by the
    #    time it finishes, so vLLM frees its blocks at once: it is never held.
    first = VllmInstance(engine.name, num_blocks=8)
    try:
        first.add(make_request("a", PROMPT, max_tokens=6))
        records = [first.step()]  # its prefill, and the SAVE of its 5 full blocks
        deadline = time.monotonic() + 10
        while read_stats(engine.name)["blocks_saved"] < 5:
            assert time.monotonic() < deadline, "the SAVE never ended"
            time.sleep(0.005)
        records += first.run_until_done()
        assert not any("a" in r.output.kv_connector_metadata.held_req_ids for r in records)
        assert first.scheduler.kv_cache_manager.block_pool.get_num_free_blocks() == 7
        # 2. Another prompt takes those blocks over and writes its own bytes into them.
        first.add(make_request("b", [9] * len(PROMPT)))
        first.run_until_done()
    finally:
        first.close()
    # 3. A fresh vLLM is served PROMPT's blocks with the bytes "a" computed.
    _assert_served(engine.name, "r2", PROMPT, num_blocks=5)


def test_connector_step_without_layerwise_loads_or_saves_skips_the_layer_hooks(engine):
    # vLLM calls wait_for_layer_load and save_kv_layer of a layer only where the connector
    # has metadata that needs them: a step that completes a block (a save) or loads one in
    # its forward does; a decode step that completes none does not.
    _warm(engine.name, PROMPT)
    vllm = VllmInstance(engine.name)
    try:
        needs = []
        vllm.add(make_request("r", PROMPT + list(range(900, 900 + 2 * BLOCK)), max_tokens=4))
        records = vllm.run_until_done(before_forward=lambda meta: needs.append(
            (bool(meta.loads), bool(meta.saves), vllm.worker.has_connector_metadata())))
        assert any(load and hooks for load, _, hooks in needs)  # the step that loads the prefix
        assert any(save and hooks for _, save, hooks in needs)
        assert any(not load and not save and not hooks for load, save, hooks in needs)  # decode
        assert all(hooks == (load or save) for load, save, hooks in needs) and len(records) == len(needs)
    finally:
        vllm.close()


def test_connector_with_saving_off_sends_the_scheduler_no_save_reports(engine):
    vllm = VllmInstance(engine.name, extra={"enable_save": False})
    try:
        vllm.add(make_request("r", PROMPT))
        vllm.step()
        assert vllm.worker.build_connector_worker_meta() is None
    finally:
        vllm.close()
    saving = VllmInstance(engine.name)
    try:
        saving.add(make_request("s", PROMPT))
        saving.step()
        assert saving.worker.build_connector_worker_meta() is not None
    finally:
        saving.close()


def test_connector_with_loads_and_saves_off_holds_no_engine_slot(engine):
    # Nothing to look up or save: vLLM runs with neither side attached to the engine (a
    # client slot held for nothing could turn away an instance that caches).
    vllm = VllmInstance(engine.name, extra={"enable_save": False, "enable_load": False})
    try:
        vllm.add(make_request("r", PROMPT))
        vllm.run_until_done()
        assert read_stats(engine.name)["clients"] == []
        assert vllm.external_hits() == 0
        # (nor does it tell vLLM's metrics the engine is down: it reports nothing)
        assert vllm.worker.get_kv_connector_stats() is None
    finally:
        vllm.close()


# -- reset_cache: vLLM's reset_prefix_cache(reset_connector=True) -----------------------------


def test_connector_reset_cache_empties_the_engine_and_the_same_prompt_misses(engine):
    # 1. A first vLLM saves the prompt's five blocks.
    _warm(engine.name, PROMPT)
    second = VllmInstance(engine.name)
    try:
        # 2. A second vLLM resets its prefix cache and the connector's: vLLM says it worked.
        assert second.scheduler.reset_prefix_cache(reset_connector=True) is True
        stats = read_stats(engine.name)
        assert (stats["resets"], stats["reset_blocks_dropped"], stats["pool_blocks_used"]) == (1, 5, 0)
        # 3. The same prompt is computed again: no load planned.
        second.add(make_request("after-reset", PROMPT))
        assert not second.step_until_admitted("after-reset").loads
        second.run_until_done()
    finally:
        second.close()


def test_connector_reset_cache_is_false_when_the_engine_is_gone(engine):
    # 1. A vLLM attached to an engine that is then killed.
    second = VllmInstance(engine.name)
    try:
        engine.proc.send_signal(signal.SIGKILL)
        engine.proc.wait(10)
        # 2. The reset fails (False, no exception): vLLM reports it failed.
        assert second.scheduler.connector.reset_cache() is False
        assert second.scheduler.reset_prefix_cache(reset_connector=True) is False
    finally:
        second.close()


def test_connector_reset_cache_is_false_when_the_engine_does_not_answer_in_time(engine):
    # 1. A vLLM whose commands wait 300 ms at most; the engine is stopped (SIGSTOP).
    second = VllmInstance(engine.name, extra={"command_timeout_ms": 300})
    try:
        assert second.scheduler.connector._scheduler.link.client() is not None
        engine.proc.send_signal(signal.SIGSTOP)
        try:
            # 2. False once the deadline passes, not a hang (the bound is generous: a loaded machine).
            started = time.monotonic()
            assert second.scheduler.connector.reset_cache() is False
            assert time.monotonic() - started < 5.0
        finally:
            engine.proc.send_signal(signal.SIGCONT)
        # 3. The engine answers again: the next reset works (the late answer was dropped).
        assert second.scheduler.connector.reset_cache() is True
    finally:
        second.close()


def test_connector_reset_cache_is_false_when_the_engine_refuses(engine):
    # 1. TP=2: the scheduler resets both ranks' namespaces; rank 1's worker has gone, so no
    #    client of this vLLM is attached under its namespace.
    second = VllmInstance(engine.name, tp_size=2)
    try:
        attached = read_stats(engine.name)["clients_attached"]
        second.workers[1].shutdown()
        deadline = time.monotonic() + 30  # the engine takes its DETACH in its own time
        while read_stats(engine.name)["clients_attached"] >= attached:
            assert time.monotonic() < deadline, "rank 1's worker never detached"
            time.sleep(0.01)
        # 2. The engine refuses that RESET: False, and vLLM reports the reset failed.
        assert second.scheduler.connector.reset_cache() is False
        assert read_stats(engine.name)["errors_by_status"]["bad_argument"] == 1
    finally:
        second.close()
