"""SchedulerSide paths that need no engine: how long a lookup may hold vLLM's scheduler."""

from __future__ import annotations

import time
from types import SimpleNamespace

from pegaflow.connector.config import ConnectorConfig
from pegaflow.connector.prefix_lookups import FIRST_WAIT_S
from pegaflow.connector.scheduler import SchedulerSide
from pegaflow.platform.errors import EngineGoneError, EngineTimeoutError
from pegaflow.platform.protocol import Completion
from pegaflow.platform.wire import Opcode, Status


class SlowClient:
    """An engine that answers each rank's LOOKUP 1.5 ms after it is waited for; counts
    the time spent waiting."""

    ANSWER_S = 1.5e-3

    def __init__(self):
        self.waited_s, self.num_answered, self._ids = 0.0, 0, iter(range(1, 1000))

    def is_engine_up(self):
        return True

    def take_orphans(self):
        return []

    def submit_lookup(self, namespace, records, wait_ms=None, prefill=None):
        return next(self._ids)

    def wait(self, request_id, timeout_s):
        self.waited_s += min(timeout_s, self.ANSWER_S)
        time.sleep(min(timeout_s, self.ANSWER_S))
        if timeout_s < self.ANSWER_S:
            raise EngineTimeoutError("no answer yet")
        self.num_answered += 1
        return Completion(request_id, Opcode.LOOKUP, Status.OK, 4, 4, 0, 0)


def test_scheduler_lookup_of_many_ranks_waits_once_not_once_per_rank():
    # 1. TP=8: one LOOKUP per rank, each answered 1.5 ms after it is waited for.
    scheduler = SchedulerSide(ConnectorConfig(lookup_timeout_ms=1000), namespaces=list(range(1, 9)),
                              block_size=16)
    client = SlowClient()
    scheduler.link.use(client)
    request = SimpleNamespace(request_id="r", num_tokens=64, block_hashes=[b"h" * 32] * 4)
    # 2. vLLM is told to ask again (None) once one FIRST_WAIT_S is spent, not 8 of them.
    assert scheduler.get_num_new_matched_tokens(request, 0) == (None, False)
    assert client.num_answered < 8 and client.waited_s <= FIRST_WAIT_S + 1e-9


def test_scheduler_failed_async_load_rewinds_the_saves_of_its_blocks():
    # 1. A request with 4 cached blocks is allocated blocks 10-13 and loads them
    #    asynchronously (it is not scheduled until the load ends).
    from pegaflow.connector.scheduler import RequestState
    scheduler = SchedulerSide(ConnectorConfig(load_mode="async"), namespaces=[1], block_size=16)
    request = SimpleNamespace(request_id="r", num_tokens=80, block_hashes=[b"h" * 32] * 5)
    state = scheduler.requests["r"] = RequestState(request, lookup_at_tokens=0, lease_ids=(0,))
    blocks = SimpleNamespace(get_block_ids=lambda: ([10, 11, 12, 13, 14],))
    scheduler.update_state_after_alloc(request, blocks, num_external_tokens=64)
    assert state.num_saved_blocks == 4  # loaded blocks are stored already
    # 2. Block 12 fails to load: vLLM recomputes from it, so it and what follows must be
    #    saved again once recomputed.
    scheduler.update_connector_output(SimpleNamespace(finished_sending=None, finished_recving={"r"},
                                                      invalid_block_ids={12}))
    assert state.num_saved_blocks == 2


class AnsweringClient:
    """Answers every LOOKUP at once with all blocks hit and a new lease."""

    def __init__(self):
        self.lookups, self.released, self._ids = 0, [], iter(range(1, 1000))
        self.prefills, self.claims_released = [], []

    def is_engine_up(self):
        return True

    def take_orphans(self):
        return []

    def submit_lookup(self, namespace, records, wait_ms=None, prefill=None):
        self.lookups += 1
        self.prefills.append(prefill)
        return next(self._ids)

    def wait(self, request_id, timeout_s):
        return Completion(request_id, Opcode.LOOKUP, Status.OK, 4, 4, 100 + request_id, 0)

    def release_nowait(self, lease_id):
        self.released.append(lease_id)

    def release_claim_nowait(self, hashes):
        self.claims_released.append(list(hashes))


def test_scheduler_lookup_answer_kept_too_long_is_asked_again():
    # 1. A lookup hits 4 blocks under lease 101; vLLM asks again soon: the answer is reused.
    from pegaflow.connector.scheduler import LOOKUP_MAX_AGE_S
    scheduler = SchedulerSide(ConnectorConfig(), namespaces=[1], block_size=16)
    client = AnsweringClient()
    scheduler.link.use(client)
    request = SimpleNamespace(request_id="r", num_tokens=80, block_hashes=[b"h" * 32] * 5)
    assert scheduler.get_num_new_matched_tokens(request, 0) == (64, False)
    assert scheduler.get_num_new_matched_tokens(request, 0) == (64, False) and client.lookups == 1
    # 2. vLLM could not allocate the request for a long while: past LOOKUP_MAX_AGE_S the
    #    engine is asked again (the old lease may have expired with its blocks) and the
    #    old lease is given back.
    scheduler.requests["r"].looked_up_at -= LOOKUP_MAX_AGE_S + 1
    assert scheduler.get_num_new_matched_tokens(request, 0) == (64, False)
    assert client.lookups == 2 and client.released == [101]
    assert scheduler.requests["r"].lease_ids == (102,)


def test_scheduler_tells_the_workers_once_which_failed_blocks_it_has_rewound():
    # Failed blocks reported by a step's output: the next step's metadata names them (the
    # workers stop holding back saves on their account), the step after does not.
    scheduler = SchedulerSide(ConnectorConfig(), namespaces=[1], block_size=16)
    scheduler.link.use(AnsweringClient())
    output = _step_output()
    scheduler.update_connector_output(SimpleNamespace(finished_sending=None, finished_recving=None,
                                                      invalid_block_ids={3, 4}))
    assert scheduler.build_connector_meta(output).rewound_block_ids == {3, 4}
    assert scheduler.build_connector_meta(output).rewound_block_ids == set()


def _step_output(new_ids=(), running_ids=(), preempted=()):
    """A SchedulerOutput of the fields SchedulerSide reads: new and running requests, no tokens."""
    return SimpleNamespace(preempted_req_ids=set(preempted), num_scheduled_tokens={},
                           scheduled_new_reqs=[SimpleNamespace(req_id=r, block_ids=([],), num_computed_tokens=0)
                                               for r in new_ids],
                           scheduled_cached_reqs=SimpleNamespace(req_ids=list(running_ids),
                                                                 new_block_ids=[None] * len(running_ids),
                                                                 resumed_req_ids=set(),
                                                                 num_computed_tokens=[0] * len(running_ids)))


def test_scheduler_blocks_completed_by_a_requests_last_steps_are_saved_after_it_finishes():
    # 1. Asynchronous scheduling: the steps planned 3 blocks of the request, but its KV
    #    covers 5 full blocks (80 tokens computed) by the time it finishes; the hashes of
    #    blocks 3 and 4 arrived after the last step was planned.
    from pegaflow.connector.scheduler import RequestState
    scheduler = SchedulerSide(ConnectorConfig(), namespaces=[1], block_size=16)
    hashes = [bytes([i]) * 32 for i in range(5)]
    request = SimpleNamespace(request_id="r", num_tokens=81, num_computed_tokens=80, block_hashes=hashes)
    scheduler.requests["r"] = RequestState(request, block_ids=[[20, 21, 22, 23, 24]], num_saved_blocks=3,
                                           has_saves=True)
    # 2. At its finish the blocks are held, and the next step saves exactly blocks 3 and 4.
    assert scheduler.request_finished(request, ([20, 21, 22, 23, 24],)) == (True, None)
    meta = scheduler.build_connector_meta(_step_output())
    assert [(s.req_id, s.block_ids, s.hashes) for s in meta.saves] == [("r", (23, 24), tuple(hashes[3:]))]
    assert meta.held_req_ids == {"r"}
    # 3. Nothing more for it in the step after.
    assert scheduler.build_connector_meta(_step_output()).saves == []


def test_scheduler_finished_request_saves_no_block_whose_kv_is_not_computed():
    # The block holding the last token (never computed) is not saved, nor one vLLM gave
    # no hash; with everything planned already, the request is not held for nothing.
    from pegaflow.connector.scheduler import RequestState
    scheduler = SchedulerSide(ConnectorConfig(), namespaces=[1], block_size=16)
    request = SimpleNamespace(request_id="r", num_tokens=48, num_computed_tokens=47,
                              block_hashes=[b"a" * 32, b"b" * 32, b"c" * 32])
    scheduler.requests["r"] = RequestState(request, block_ids=[[5, 6, 7]], num_saved_blocks=2)
    assert scheduler.request_finished(request, ([5, 6, 7],)) == (False, None)
    assert scheduler.build_connector_meta(_step_output()).saves == []


def test_scheduler_finish_save_stops_at_vllms_null_block():
    # vLLM may hand request_finished a table whose out-of-window entries are its null
    # block (0): no save may store block 0's bytes under a real hash.
    from pegaflow.connector.scheduler import RequestState
    scheduler = SchedulerSide(ConnectorConfig(), namespaces=[1], block_size=16)
    hashes = [bytes([i]) * 32 for i in range(4)]
    request = SimpleNamespace(request_id="r", num_tokens=65, num_computed_tokens=64, block_hashes=hashes)
    scheduler.requests["r"] = RequestState(request, block_ids=[[9, 10, 0, 0]], num_saved_blocks=1,
                                           has_saves=True)
    scheduler.request_finished(request, ([9, 10, 0, 0],))
    saves = scheduler.build_connector_meta(_step_output()).saves
    assert [(s.block_ids, s.hashes) for s in saves] == [((10,), (hashes[1],))]


def test_scheduler_finished_request_whose_saves_are_over_is_freed_at_once():
    # A request saved in step 3 finishes; vLLM frees its blocks at once only when every
    # worker has said the SAVEs of step 3 are over (SavesDone), and holds them otherwise.
    from pegaflow.connector.metadata import SavesDone
    from pegaflow.connector.scheduler import RequestState
    scheduler = SchedulerSide(ConnectorConfig(), namespaces=[1, 2], block_size=16)  # two workers
    request = SimpleNamespace(request_id="r", num_tokens=40, num_computed_tokens=39,
                              block_hashes=[b"a" * 32, b"b" * 32])

    def finish(done) -> bool:
        scheduler.requests["r"] = RequestState(request, block_ids=[[5, 6, 7]], num_saved_blocks=2,
                                               has_saves=True, last_save_step=3)
        scheduler.update_connector_output(SimpleNamespace(
            finished_sending=None, finished_recving=None, invalid_block_ids=set(),
            kv_connector_worker_meta=done))
        held, _ = scheduler.request_finished(request, ([5, 6, 7],))
        return held

    assert finish(None)                                          # nobody said anything
    assert finish(SavesDone(2).aggregate(SavesDone(9)))          # one worker's step-3 SAVE still out
    assert finish(SavesDone(9))                                  # one worker's word only
    assert not finish(SavesDone(3).aggregate(SavesDone(4)))      # both: over
    assert "r" not in scheduler.requests


def test_scheduler_finished_request_with_a_finish_save_is_held_whatever_was_done():
    from pegaflow.connector.metadata import SavesDone
    from pegaflow.connector.scheduler import RequestState
    scheduler = SchedulerSide(ConnectorConfig(), namespaces=[1], block_size=16)
    hashes = [bytes([i]) * 32 for i in range(3)]
    request = SimpleNamespace(request_id="r", num_tokens=49, num_computed_tokens=48, block_hashes=hashes)
    scheduler.requests["r"] = RequestState(request, block_ids=[[5, 6, 7]], num_saved_blocks=2,
                                           has_saves=True, last_save_step=1)
    scheduler.update_connector_output(SimpleNamespace(finished_sending=None, finished_recving=None,
                                                      invalid_block_ids=set(),
                                                      kv_connector_worker_meta=SavesDone(50)))
    # Block 2's KV was computed in its last step and never planned: saved by the next step.
    assert scheduler.request_finished(request, ([5, 6, 7],)) == (True, None)


class DiskAnsweringClient(AnsweringClient):
    """All 4 blocks hit, the last 2 of them being read from the engine's disk tier."""

    def wait(self, request_id, timeout_s):
        return Completion(request_id, Opcode.LOOKUP, Status.OK, 4, 4, 100 + request_id, 2)


def test_scheduler_hit_read_from_disk_loads_between_steps_even_layer_by_layer():
    # 1. Layer-wise loading (the default): a hit wholly in the pool loads in the forward.
    scheduler = SchedulerSide(ConnectorConfig(), namespaces=[1], block_size=16)
    scheduler.link.use(AnsweringClient())
    pooled = SimpleNamespace(request_id="p", num_tokens=80, block_hashes=[b"p" * 32] * 5)
    assert scheduler.get_num_new_matched_tokens(pooled, 0) == (64, False)
    # 2. A hit partly on disk loads asynchronously: vLLM waits for it outside the forward,
    #    so a slow read never stalls a step; its load spec says so to the workers.
    scheduler.link.use(DiskAnsweringClient())
    on_disk = SimpleNamespace(request_id="d", num_tokens=80, block_hashes=[b"d" * 32] * 5)
    assert scheduler.get_num_new_matched_tokens(on_disk, 0) == (64, True)
    blocks = SimpleNamespace(get_block_ids=lambda: ([10, 11, 12, 13, 14],))
    scheduler.update_state_after_alloc(on_disk, blocks, num_external_tokens=64)
    assert scheduler.requests["d"].pending_load.is_async


def test_scheduler_hit_read_from_disk_loads_in_the_step_under_disk_load_mode_layerwise():
    # 1. disk_load_mode layerwise: a hit partly on disk loads inside the forward, like one
    #    wholly in the pool (the step waits for the engine's reads).
    scheduler = SchedulerSide(ConnectorConfig(disk_load_mode="layerwise"), namespaces=[1], block_size=16)
    scheduler.link.use(DiskAnsweringClient())
    on_disk = SimpleNamespace(request_id="d", num_tokens=80, block_hashes=[b"d" * 32] * 5)
    assert scheduler.get_num_new_matched_tokens(on_disk, 0) == (64, False)
    blocks = SimpleNamespace(get_block_ids=lambda: ([10, 11, 12, 13, 14],))
    scheduler.update_state_after_alloc(on_disk, blocks, num_external_tokens=64)
    assert not scheduler.requests["d"].pending_load.is_async
    # 2. load_mode async still loads every hit between steps, whatever disk_load_mode says.
    scheduler = SchedulerSide(ConnectorConfig(load_mode="async", disk_load_mode="layerwise"),
                              namespaces=[1], block_size=16)
    scheduler.link.use(DiskAnsweringClient())
    assert scheduler.get_num_new_matched_tokens(on_disk, 0) == (64, True)


def test_scheduler_auto_load_mode_loads_between_steps_only_while_others_run():
    # 1. load_mode auto, nothing running: a hit loads in the step, layer by layer (a lone
    #    prompt's first token as soon as possible).
    scheduler = SchedulerSide(ConnectorConfig(load_mode="auto"), namespaces=[1], block_size=16)
    scheduler.link.use(AnsweringClient())
    blocks = SimpleNamespace(get_block_ids=lambda: ([10, 11, 12, 13, 14],))
    first = SimpleNamespace(request_id="a", num_tokens=80, num_computed_tokens=80, block_hashes=[b"a" * 32] * 5)
    assert scheduler.get_num_new_matched_tokens(first, 0) == (64, False)
    scheduler.update_state_after_alloc(first, blocks, num_external_tokens=64)
    assert not scheduler.requests["a"].pending_load.is_async
    scheduler.build_connector_meta(_step_output(new_ids=["a"]))
    # 2. While "a" runs, the next hit loads between steps: a's decode never waits for it;
    #    the plan follows what vLLM was told.
    second = SimpleNamespace(request_id="b", num_tokens=80, block_hashes=[b"b" * 32] * 5)
    assert scheduler.get_num_new_matched_tokens(second, 0) == (64, True)
    scheduler.update_state_after_alloc(second, blocks, num_external_tokens=64)
    assert scheduler.requests["b"].pending_load.is_async
    # 3. Once "a" finished, a hit loads in the step again; as after a step that scheduled
    #    nothing (every running request preempted, say).
    scheduler.request_finished(first, ([10, 11, 12, 13, 14],))
    third = SimpleNamespace(request_id="c", num_tokens=80, block_hashes=[b"c" * 32] * 5)
    assert scheduler.get_num_new_matched_tokens(third, 0) == (64, False)
    scheduler.build_connector_meta(_step_output(running_ids=["x"]))
    scheduler.build_connector_meta(_step_output(preempted=["x"]))
    fourth = SimpleNamespace(request_id="d", num_tokens=80, block_hashes=[b"d" * 32] * 5)
    assert scheduler.get_num_new_matched_tokens(fourth, 0) == (64, False)


def _hybrid_with_a_saved_window_block():
    """A hybrid (two-group) scheduler whose step 1 saved blocks 7 (full attention) and 8
    (sliding window) for request "a"; no SAVE answered yet."""
    from pegaflow.connector.scheduler import RequestState
    scheduler = SchedulerSide(ConnectorConfig(), namespaces=[1], block_size=16, num_groups=2)
    request = SimpleNamespace(request_id="a", num_tokens=40, block_hashes=[b"a" * 32])
    scheduler.requests["a"] = RequestState(request, block_ids=[[7], [8]])
    out = _step_output(running_ids=["a"])
    out.scheduled_cached_reqs.num_computed_tokens = [16]
    meta = scheduler.build_connector_meta(out)
    assert [(s.block_ids, [(p.group, p.block_ids) for p in s.groups]) for s in meta.saves] == \
        [((7, 8), [(0, (7,)), (1, (8,))])]
    return scheduler


def test_scheduler_hybrid_async_load_into_a_block_a_save_still_reads_waits_for_that_save():
    # 1. The window lets block 8 go; vLLM gives it to request "b"'s async load at once.
    from pegaflow.connector.metadata import LoadSpec
    from pegaflow.connector.scheduler import RequestState
    scheduler = _hybrid_with_a_saved_window_block()
    request = SimpleNamespace(request_id="b", num_tokens=40, block_hashes=[b"b" * 32])
    state = scheduler.requests["b"] = RequestState(request)
    state.pending_load = LoadSpec("b", (9, 8), (b"b" * 32,), (0,), True)
    # 2. The workers must wait for step 1's SAVEs before the load writes block 8.
    assert scheduler.build_connector_meta(_step_output()).wait_saves_through == 1


def test_scheduler_single_group_prefix_hit_on_blocks_being_saved_waits_for_nothing():
    # A dense model: request "b" hits blocks 1-4 of vLLM's prefix cache while request "a"'s
    # SAVE of them is still out.  They are only read: no wait (as before hybrid support).
    from pegaflow.connector.scheduler import RequestState
    scheduler = SchedulerSide(ConnectorConfig(), namespaces=[1], block_size=16)
    request = SimpleNamespace(request_id="a", num_tokens=70, block_hashes=[bytes([i]) * 32 for i in range(4)])
    scheduler.requests["a"] = RequestState(request, block_ids=[[1, 2, 3, 4]])
    out = _step_output(running_ids=["a"])
    out.scheduled_cached_reqs.num_computed_tokens = [64]
    assert scheduler.build_connector_meta(out).saves
    hit = _step_output(new_ids=["b"])
    hit.scheduled_new_reqs[0].block_ids, hit.scheduled_new_reqs[0].num_computed_tokens = ([1, 2, 3, 4, 5],), 64
    assert scheduler.build_connector_meta(hit).wait_saves_through == 0


def test_scheduler_hybrid_failed_load_rewinds_its_blocks_and_is_not_retried():
    # 1. Request "b"'s hybrid async load into blocks 9 and 8 goes out.
    from pegaflow.connector.metadata import LoadSpec
    from pegaflow.connector.scheduler import RequestState
    scheduler = _hybrid_with_a_saved_window_block()
    request = SimpleNamespace(request_id="b", num_tokens=40, block_hashes=[b"b" * 32])
    state = scheduler.requests["b"] = RequestState(request)
    state.pending_load = LoadSpec("b", (9, 8), (b"b" * 32,), (0,), True)
    scheduler.build_connector_meta(_step_output())
    # 2. It fails; vLLM (policy "fail") has already finished and forgotten the request.
    assert scheduler.request_finished(request, ([9], [8])) == (False, None)
    scheduler.update_connector_output(SimpleNamespace(
        finished_sending=None, finished_recving={"b"}, failed_recving={"b"}, invalid_block_ids=set()))
    # 3. The workers are told the blocks are rewound (their saves may go out again).
    assert scheduler.build_connector_meta(_step_output()).rewound_block_ids == {8, 9}
    # 4. Under "recompute" the request stays; asked again, it is offered no hit.
    retry = SimpleNamespace(request_id="c", num_tokens=40, block_hashes=[b"c" * 32])
    scheduler.requests["c"] = RequestState(retry, has_failed_load=True)
    assert scheduler.get_num_new_matched_tokens(retry, 0) == (0, False)


class LateClient(SlowClient):
    """An engine busy with other replicas' loads: each LOOKUP is answered (all 4 blocks hit)
    ``LATE_S`` after it was submitted."""

    LATE_S = 0.2

    def __init__(self):
        super().__init__()
        self.submitted_at, self.abandoned = {}, []

    def abandon(self, command_id):
        self.abandoned.append(command_id)

    def submit_lookup(self, namespace, records, wait_ms=None, prefill=None):
        command_id = next(self._ids)
        self.submitted_at[command_id] = time.monotonic()
        return command_id

    def wait(self, request_id, timeout_s):
        ready_at = self.submitted_at[request_id] + self.LATE_S
        time.sleep(max(0.0, min(timeout_s, ready_at - time.monotonic())))
        if time.monotonic() < ready_at:
            raise EngineTimeoutError("no answer yet")
        self.num_answered += 1
        return Completion(request_id, Opcode.LOOKUP, Status.OK, 4, 4, 0, 0)


def _ask_each_step(scheduler, request, step_s: float = 0.01):
    """vLLM's scheduler asking every step until the answer is a number."""
    while (answer := scheduler.get_num_new_matched_tokens(request, 0))[0] is None:
        time.sleep(step_s)
    return answer


def test_scheduler_lookup_answered_late_by_a_busy_engine_is_served_by_default():
    # 1. By default, an answer 200 ms late (several replicas' bursts of loads: docs/replicas.md)
    #    is waited for: vLLM is told to ask again meanwhile, then served the 48 tokens it may load.
    scheduler = SchedulerSide(ConnectorConfig(), namespaces=[1], block_size=16)
    scheduler.link.use(LateClient())
    request = SimpleNamespace(request_id="r", num_tokens=64, block_hashes=[b"h" * 32] * 4)
    assert _ask_each_step(scheduler, request)[0] == 48
    assert scheduler.stats.data["lookup_timeouts"] == 0 and scheduler.stats.data["lookup_deferrals"] > 1
    # 2. With a 50 ms deadline the same lookup is a miss: the whole prefix is recomputed.
    #    (Compute once off: a lookup that may wait for another vLLM's claim has longer.)
    scheduler = SchedulerSide(ConnectorConfig(lookup_timeout_ms=50, compute_once=False), namespaces=[1],
                              block_size=16)
    client = LateClient()
    scheduler.link.use(client)
    assert _ask_each_step(scheduler, request)[0] == 0
    assert scheduler.stats.data["lookup_timeouts"] == 1 and client.abandoned == [1]


class RecordingLateClient(LateClient):
    """LateClient that notes how long each wait for an answer was allowed to take."""

    def __init__(self):
        super().__init__()
        self.timeouts, self.prefills = [], []

    def submit_lookup(self, namespace, records, wait_ms=None, prefill=None):
        self.prefills.append(prefill)
        return super().submit_lookup(namespace, records, wait_ms, prefill)

    def wait(self, request_id, timeout_s):
        self.timeouts.append(timeout_s)
        return super().wait(request_id, timeout_s)


def test_scheduler_claiming_lookup_waits_on_its_first_ask_only():
    # Under compute once a lookup may stay out for another vLLM's whole prefill while vLLM
    # asks again every step, for every request waiting so: only the first ask waits for the
    # answer (FIRST_WAIT_S), the later ones look whether it came, so no step is held up.
    scheduler = SchedulerSide(ConnectorConfig(prefill_tokens_per_s=2000), namespaces=[1], block_size=16)
    client = RecordingLateClient()
    scheduler.link.use(client)
    request = SimpleNamespace(request_id="r", num_tokens=64, block_hashes=[b"h" * 32] * 4)
    assert _ask_each_step(scheduler, request)[0] == 48
    assert client.timeouts[0] > 0 and client.timeouts[1:-1] and max(client.timeouts[1:]) == 0
    # The LOOKUP told the engine this vLLM's block size, rate and the most it waits.
    (prefill,) = client.prefills
    assert (prefill.block_tokens, prefill.tokens_per_s, prefill.wait_ms) == (16, 2000, 3000)


def test_scheduler_load_whose_blocks_vllm_writes_while_preparing_goes_out_at_start_load_kv():
    # 1. A request with 4 cached blocks is allocated blocks 10-14 and loads 10-13 in its step.
    from pegaflow.connector.scheduler import RequestState
    scheduler = SchedulerSide(ConnectorConfig(load_mode="layerwise"), namespaces=[1], block_size=16)
    request = SimpleNamespace(request_id="r", num_tokens=80, block_hashes=[b"h" * 32] * 5)
    scheduler.requests["r"] = RequestState(request, lookup_at_tokens=0, lease_ids=(0,))
    scheduler.update_state_after_alloc(request, SimpleNamespace(get_block_ids=lambda: ([10, 11, 12, 13, 14],)),
                                       num_external_tokens=64)
    # 2. vLLM zeroes block 14 only (past the load) and copies 3 -> 4: the load may go out
    #    at handle_preemptions.
    output = _step_output()
    output.new_block_ids_to_zero, output.kv_cache_block_copies = [14], [(3, 4)]
    meta = scheduler.build_connector_meta(output)
    assert len(meta.loads) == 1 and meta.loads_after_input_prep is False
    # 3. A load into a block vLLM zeroes, or copies into, waits for start_load_kv.
    from pegaflow.connector.scheduler import writes_load_blocks
    assert writes_load_blocks(SimpleNamespace(new_block_ids_to_zero=[12]), meta.loads)
    assert writes_load_blocks(SimpleNamespace(kv_cache_block_copies=[(3, 11)]), meta.loads)
    assert not writes_load_blocks(SimpleNamespace(), meta.loads)  # (an older vLLM: neither field)
    # 4. Built from such a step, the plan says so.
    scheduler.requests["r"].pending_load = meta.loads[0]
    output.new_block_ids_to_zero = [13, 14]
    assert scheduler.build_connector_meta(output).loads_after_input_prep is True


class SilentClient:
    """An engine that takes RESETs and never answers them; or one gone at submit."""

    epoch = 1

    def __init__(self, is_gone: bool = False):
        self.is_gone, self.submitted, self.abandoned, self._ids = is_gone, [], [], iter(range(1, 1000))

    def is_engine_up(self):
        return True

    def submit(self, command, timeout_s=None):
        if self.is_gone:
            raise EngineGoneError("engine exited")
        self.submitted.append(command.namespace)
        return next(self._ids)

    def wait(self, command_id, timeout_s):
        raise EngineTimeoutError("no answer")

    def abandon(self, command_id):
        self.abandoned.append(command_id)

    def revoke(self):
        pass

    def close(self, detach=True, timeout_s=0.0):
        pass


def test_scheduler_reset_cache_unanswered_is_false_and_its_late_answers_are_dropped():
    # 1. TP=2 (MLA: both ranks share a namespace, plus a pipeline stage's own): one RESET per
    #    namespace, none answered.
    scheduler = SchedulerSide(ConnectorConfig(command_timeout_ms=50), namespaces=[5, 5, 6], block_size=16)
    client = SilentClient()
    scheduler.link.use(client)
    # 2. False, and each RESET's answer is given up (dropped when it comes, not kept forever).
    assert scheduler.reset_cache() is False
    assert client.submitted == [5, 6] and client.abandoned == [1, 2]
    assert not scheduler.link.is_down  # only slow: the connection stays


def test_scheduler_reset_cache_on_an_engine_gone_is_false_and_drops_the_connection():
    scheduler = SchedulerSide(ConnectorConfig(), namespaces=[5], block_size=16)
    scheduler.link.use(SilentClient(is_gone=True))
    assert scheduler.reset_cache() is False and scheduler.link.is_down
