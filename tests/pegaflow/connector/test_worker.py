"""WorkerSide paths that need no vLLM: giving up on copies that never finish, fencing loads."""

import time
from types import SimpleNamespace

from pegaflow.connector.config import ConnectorConfig
from pegaflow.connector.worker import WorkerSide
from pegaflow.platform.errors import CudaError, EngineGoneError


class StuckClient:
    """A client of an engine that is alive but never answers; records what is done to it."""

    epoch, engine_pid = 1, 1

    def __init__(self):
        self.calls = []

    def try_take(self, request_id):
        return None

    def check_engine(self):
        pass

    def is_engine_up(self):
        return True

    def revoke(self):
        self.calls.append("revoke")

    def close(self, detach=True, timeout_s=2.0):
        self.calls.append("close")


def test_worker_save_deadline_revokes_the_saves_before_the_blocks_are_reused():
    # 1. A preempted request's save is outstanding on an engine that never answers.
    worker = WorkerSide(ConnectorConfig(command_timeout_ms=50), namespace=1, rank=0, num_blocks=8)
    client = StuckClient()
    worker.link.use(client)
    worker.saves.sent(11, ("req-a",))
    # 2. Past the deadline the worker lets vLLM reuse the blocks: the link revokes the
    #    saves (the engine must store nothing it copies later), then drops the connection.
    worker.wait_for_saves_of({"req-a"})
    assert client.calls == ["revoke", "close"]
    assert not worker.saves.is_saving({"req-a"}) and worker.link.is_down


def test_worker_async_load_deadline_revokes_before_vllm_reuses_the_blocks():
    # 1. An async load is outstanding on an engine that never answers, past its deadline.
    from pegaflow.connector.metadata import LoadSpec
    worker = WorkerSide(ConnectorConfig(command_timeout_ms=50), namespace=1, rank=0, num_blocks=8)
    client = StuckClient()
    worker.link.use(client)
    spec = LoadSpec("req-b", (3, 4), (b"h" * 32, b"i" * 32), (0,), True)
    worker.loads.asyncs[21] = (spec, time.monotonic() - 1.0)
    # 2. The worker reports it finished with load errors (vLLM recomputes and may reuse
    #    the blocks), so the engine must be stopped from writing them first: revoke, close.
    worker._collect()
    assert client.calls == ["revoke", "close"] and worker.link.is_down
    assert worker.get_block_ids_with_load_errors() == {3, 4}
    assert worker.loads.finished_recving == {"req-b"} and worker.loads.asyncs == {}


class CountingClient(StuckClient):
    """A live client that counts the liveness checks and ring reads made of it."""

    def __init__(self):
        super().__init__()
        self.checks = 0

    def is_engine_up(self):
        self.checks += 1
        return True

    def try_take(self, request_id):
        self.checks += 1
        return None


def test_worker_step_with_nothing_outstanding_touches_neither_engine_nor_ring():
    # 1. An idle decode step: no save sent, no async load waiting.
    worker = WorkerSide(ConnectorConfig(), namespace=1, rank=0, num_blocks=8)
    client = CountingClient()
    worker.link.use(client)
    worker.wait_for_save()
    assert worker.get_finished(set()) == (None, None)
    # 2. Nothing awaits an answer, so the step makes no syscall and reads no ring.
    assert client.checks == 0
    # 3. Once a save is outstanding the same step checks for its answer.
    worker.saves.sent(11, ("req-a",))
    worker.get_finished(set())
    assert client.checks > 0


class FencedMemory:
    """Memory with an event pool (cuda): records what is recorded, on which stream."""

    has_events = True

    def __init__(self, fail=False):
        self.recorded, self.fail = [], fail
        self.events = self

    def current_stream(self):
        return 7

    def record(self, indices, stream):
        if self.fail:
            raise CudaError("record failed")
        self.recorded.append((list(indices), stream))


class LoadClient(StuckClient):
    def __init__(self, memory):
        super().__init__()
        self.memory, self.loads = memory, []

    def submit_load(self, namespace, block_ids, hashes, **kwargs):
        self.loads.append((len(self.memory.recorded), kwargs))
        return 31


def _worker_with_a_load(memory):
    from pegaflow.connector.metadata import LoadSpec, PegaConnectorMetadata
    worker = WorkerSide(ConnectorConfig(num_load_slots=2), namespace=1, rank=0, num_blocks=8)
    worker.layers.num_virtual, worker.memory = 4, memory
    client = LoadClient(memory)
    worker.link.use(client)
    meta = PegaConnectorMetadata(held_req_ids=set(), preempted_req_ids=set())
    meta.loads.append(LoadSpec("req-c", (5, 6), (b"j" * 32, b"k" * 32), (0,), False))
    worker.bind(meta)
    return worker, client


def test_worker_loads_start_after_vllms_queued_kernels():
    # 1. A step with a load: the pool's last event is recorded on vLLM's stream first...
    memory = FencedMemory()
    worker, client = _worker_with_a_load(memory)
    worker.start_load_kv()
    fence = (1 + 2) * 4  # after the save events and 2 load slots of 4 layers
    assert memory.recorded == [([fence], 7)]
    # 2. ...and the LOAD, sent after it, tells the engine to copy only after that point.
    assert client.loads == [(1, {"lease_id": 0, "event_index": 4, "after_client": True})]


def test_worker_load_that_cannot_be_fenced_is_recomputed():
    # 1. The fence cannot be recorded: no LOAD goes out, vLLM recomputes the blocks.
    worker, client = _worker_with_a_load(FencedMemory(fail=True))
    worker.start_load_kv()
    assert client.loads == []
    assert worker.get_block_ids_with_load_errors() == {5, 6}


class AcceptingClient(LoadClient):
    """Accepts every load at issue (fenced); ``gone`` makes the engine's liveness check fail."""

    def __init__(self, memory):
        super().__init__(memory)
        self.gone = False

    def wait(self, request_id, timeout_s):
        return SimpleNamespace(is_ok=True, status=0)

    def check_engine(self):
        if self.gone:
            raise EngineGoneError("engine exited")


def _step_with_a_fenced_load(gone: bool):
    memory = FencedMemory()
    worker, _ = _worker_with_a_load(memory)
    client = AcceptingClient(memory)
    worker.link.use(client)
    worker.start_load_kv()
    worker.wait_for_layer_load("layer")  # the load is accepted: vLLM's stream waits on events
    client.gone = gone
    worker.get_finished(set())
    return worker, client


def test_worker_fenced_loads_of_an_engine_that_went_away_are_recomputed():
    # 1. The engine accepted the step's load, then died before the step ended: its copies
    #    may not have finished, so the blocks are reported failed (vLLM drops the step's
    #    token of that request and recomputes) and the connection is dropped.
    worker, client = _step_with_a_fenced_load(gone=True)
    assert worker.get_block_ids_with_load_errors() == {5, 6}
    assert client.calls == ["revoke", "close"] and worker.link.is_down


def test_worker_fenced_loads_of_a_live_engine_are_kept():
    worker, client = _step_with_a_fenced_load(gone=False)
    assert worker.get_block_ids_with_load_errors() == set() and client.calls == []


def test_worker_fenced_loads_reach_vllms_metrics_as_loaded_or_failed_once():
    # What vLLM's metrics get: a kept load counts its blocks loaded, a recomputed one failed,
    # never both (each planned block once).
    for gone, loaded, failed in ((False, 2, 0), (True, 0, 2)):
        worker, _ = _step_with_a_fenced_load(gone=gone)
        data = worker.stats.data
        assert (data["load_blocks"], data["loaded_blocks"], data["load_failed_blocks"]) == (2, loaded, failed)


def test_worker_fenced_loads_of_a_dropped_connection_are_recomputed_even_after_a_reconnect():
    # 1. The step's load was accepted; then the connection was dropped (say, a save hit a
    #    full ring) and a new one made to a live engine before the step ended.
    memory = FencedMemory()
    worker, _ = _worker_with_a_load(memory)
    first = AcceptingClient(memory)
    worker.link.use(first)
    worker.start_load_kv()
    worker.wait_for_layer_load("layer")
    worker.link.fail(RuntimeError("ring full"))
    second = AcceptingClient(memory)
    worker.link.use(second)
    # 2. The new connection says nothing about the copies of the old one: the loads are
    #    reported failed, and the new connection is left alone.
    worker.get_finished(set())
    assert worker.get_block_ids_with_load_errors() == {5, 6}
    assert second.calls == [] and worker.link.current() is second


class SavingClient(StuckClient):
    """Loads are answered failed (their blocks were evicted); saves are recorded."""

    def __init__(self):
        super().__init__()
        self.saved = []

    def submit_load(self, *args, **kwargs):
        return 40

    def wait(self, request_id, timeout_s):
        return SimpleNamespace(is_ok=False, status="MISSING_BLOCK")

    def submit_save(self, namespace, ids, records, event_index, one_event=False):
        self.saved.append(sorted(int(i) for i in ids))
        return 41


def test_worker_saves_of_blocks_whose_load_failed_are_dropped_for_every_request():
    # 1. Request x's load of blocks 1-2 fails; request c, in the same step, reads the same
    #    blocks (vLLM's own prefix cache gave them to it) and would save them with its own;
    #    request d is unrelated.
    from pegaflow.connector.metadata import LoadSpec, PegaConnectorMetadata, SaveSpec
    worker = WorkerSide(ConnectorConfig(), namespace=1, rank=0, num_blocks=16)
    worker.memory = SimpleNamespace(has_events=False)
    worker.layers.save_layers = {"layer"}
    client = SavingClient()
    worker.link.use(client)

    def step(loads, saves, rewound=()):
        meta = PegaConnectorMetadata(held_req_ids=set(), preempted_req_ids=set(),
                                     rewound_block_ids=set(rewound))
        meta.loads.extend(loads)
        meta.saves.extend(SaveSpec(r, ids, tuple(b"s" * 32 for _ in ids)) for r, ids in saves)
        worker.bind(meta)
        worker.start_load_kv()
        worker.save_kv_layer("layer")
        worker.wait_for_save()
        worker.get_finished(set())
        errors = worker.get_block_ids_with_load_errors()
        saved, client.saved = client.saved, []
        return saved, errors

    x_load = LoadSpec("x", (1, 2), (b"h" * 32, b"i" * 32), (0,), False)
    # 2. That step stores only d's blocks, and reports blocks 1-2 to vLLM.
    assert step([x_load], [("c", (1, 2, 3)), ("d", (7, 8))]) == ([[7, 8]], {1, 2})
    # 3. The next step (planned before the scheduler saw the failure) stores none of x's or
    #    c's blocks.
    assert step([], [("x", (4,)), ("c", (5,)), ("d", (9,))]) == ([[9]], set())
    # 4. Once the scheduler has seen it (and rewound them), their recomputed blocks go out.
    assert step([], [("x", (1, 2, 4)), ("c", (1, 2, 3, 5))], rewound={1, 2}) == (
        [[1, 1, 2, 2, 3, 4, 5]], set())


class ReleasingClient(StuckClient):
    def __init__(self):
        super().__init__()
        self.released = []

    def release_nowait(self, lease_id):
        self.released.append(lease_id)


def test_worker_load_never_sent_gives_its_lease_back():
    # The step's loads cannot be fenced (recording the start event failed): none is sent,
    # and this rank's lease is released at once instead of pinning the blocks until expiry.
    from pegaflow.connector.metadata import LoadSpec, PegaConnectorMetadata
    worker = WorkerSide(ConnectorConfig(num_load_slots=2), namespace=1, rank=1, num_blocks=8)
    worker.layers.num_virtual, worker.memory = 4, FencedMemory(fail=True)
    client = ReleasingClient()
    worker.link.use(client)
    meta = PegaConnectorMetadata(held_req_ids=set(), preempted_req_ids=set())
    meta.loads.append(LoadSpec("req-e", (5,), (b"j" * 32,), (70, 71), False))
    worker.bind(meta)
    worker.start_load_kv()
    assert client.released == [71]
    assert worker.get_block_ids_with_load_errors() == {5}


class DroppingClient(SavingClient):
    """Saves get request ids 100, 101, ...; SAVEs and DROPs are logged in the order sent
    (DROP hashes as the engine would key them)."""

    def __init__(self):
        super().__init__()
        self.dropped, self.sent = [], []

    def submit_save(self, namespace, ids, records, event_index, one_event=False):
        super().submit_save(namespace, ids, records, event_index)
        self.sent.append(("save", sorted(int(i) for i in ids)))
        return 99 + len(self.saved)

    def drop_nowait(self, namespace, records, since_command):
        from pegaflow.platform.wire import hash_keys
        self.dropped.append((namespace, hash_keys(records), since_command))
        self.sent.append(("drop", sorted(k[0] for k in hash_keys(records))))


def _rank_steps(num_ranks: int):
    from pegaflow.connector.metadata import PegaConnectorMetadata, SaveSpec
    worker = WorkerSide(ConnectorConfig(), namespace=5, rank=1, num_blocks=16, num_ranks=num_ranks)
    worker.memory = SimpleNamespace(has_events=False)
    worker.layers.save_layers = {"layer"}
    client = DroppingClient()
    worker.link.use(client)

    def step(saves, rewound=()):
        meta = PegaConnectorMetadata(held_req_ids=set(), preempted_req_ids=set(),
                                     rewound_block_ids=set(rewound))
        meta.saves.extend(SaveSpec(r, ids, tuple(bytes([i]) * 32 for i in ids)) for r, ids in saves)
        worker.bind(meta)
        worker.start_load_kv()
        worker.save_kv_layer("layer")
        worker.wait_for_save()
        worker.get_finished(set())

    return step, client


def test_worker_of_a_parallel_rank_drops_its_recent_saves_when_a_load_failed_elsewhere():
    # 1. A rank of a 2-rank vLLM whose own loads never fail saves in four steps.
    step, client = _rank_steps(num_ranks=2)
    for i, ids in enumerate([(1,), (2,), (3, 4), (5,)]):
        step([(f"r{i}", ids)])
    assert client.dropped == []
    # 2. The scheduler reports a failed load (another rank's): before this step's save, the
    #    engine is told to forget what this rank's SAVEs of the last three steps stored
    #    (SAVEs 101-103; the first byte of each hash is its block here).
    step([("r9", (6,))], rewound={40})
    [(namespace, keys, since)] = client.dropped
    assert (namespace, sorted(k[0] for k in keys), since) == (5, [2, 3, 4, 5], 101)
    assert client.sent[-2:] == [("drop", [2, 3, 4, 5]), ("save", [6])]
    # 3. The window starts over: a later report drops only what came after.
    step([], rewound={41})
    assert [(sorted(k[0] for k in keys), since) for _, keys, since in client.dropped[1:]] == \
        [([6], 104)]


def test_worker_of_a_single_rank_leaves_failed_loads_to_its_taint():
    step, client = _rank_steps(num_ranks=1)
    step([("a", (1, 2))])
    step([("b", (3,))], rewound={1})
    assert client.dropped == []


def test_worker_window_covers_a_deep_pipeline():
    from pegaflow.connector.metadata import PegaConnectorMetadata
    worker = WorkerSide(ConnectorConfig(), namespace=5, rank=0, num_blocks=16, num_ranks=8,
                        pipeline_stages=8)
    for _ in range(12):
        worker.bind(PegaConnectorMetadata(held_req_ids=set(), preempted_req_ids=set()))
    assert len(worker._recent_saves) == 10  # a batch per stage in flight, and two more


class FullGraphMemory(FencedMemory):
    """Also records the GPU-side waits vLLM's stream is given, in order with the records."""

    def __init__(self):
        super().__init__()
        self.waits = []

    def record(self, indices, stream):
        super().record(indices, stream)
        self.waits.append(("record", list(indices)))

    def wait(self, indices, stream):
        self.waits.append(("wait", list(indices)))


class FencedSavingClient(AcceptingClient):
    def __init__(self, memory):
        super().__init__(memory)
        self.saves = []

    def submit_save(self, namespace, ids, records, event_index, one_event=False):
        self.saves.append((len(self.memory.recorded), event_index, one_event))
        return 50


def _full_graph_worker(num_load_slots=2):
    from pegaflow.connector.metadata import PegaConnectorMetadata, SaveSpec
    memory = FullGraphMemory()
    worker = WorkerSide(ConnectorConfig(num_load_slots=num_load_slots), namespace=1, rank=0,
                        num_blocks=8)
    worker.layers.num_virtual, worker.memory = 4, memory
    worker.layers.virtual = {f"l{i}": (i,) for i in range(4)}
    worker.layers.save_layers = set(worker.layers.virtual)
    client = FencedSavingClient(memory)
    worker.link.use(client)
    meta = PegaConnectorMetadata(held_req_ids=set(), preempted_req_ids=set())
    meta.saves.append(SaveSpec("req-s", (2, 3), (b"s" * 32, b"t" * 32)))
    return worker, client, memory, meta


def test_worker_full_graph_step_saves_behind_one_event_after_the_forward():
    # 1. A decode step replayed as a full CUDA graph: vLLM calls no per-layer hook.
    worker, client, memory, meta = _full_graph_worker()
    worker.bind(meta)
    worker.start_load_kv(runs_layer_hooks=False)
    # 2. At the step's end one event is recorded where vLLM's stream stands (after the
    #    whole forward), and the SAVE of every layer waits for that event alone.
    worker.wait_for_save()
    assert memory.recorded == [([0], 7)]
    assert client.saves == [(1, 0, True)]


def test_worker_step_with_layer_hooks_saves_layer_by_layer():
    # A piecewise or eager step: each layer's event is recorded as the layer is written,
    # and the SAVE waits for event k before copying layer k (no one-event flag).
    worker, client, memory, meta = _full_graph_worker()
    worker.bind(meta)
    worker.start_load_kv(runs_layer_hooks=True)
    for name in sorted(worker.layers.virtual):
        worker.save_kv_layer(name)
    worker.wait_for_save()
    assert [indices for indices, _ in memory.recorded] == [[0], [1], [2], [3]]
    assert client.saves == [(4, 0, False)]


def test_worker_step_that_wrote_some_layers_only_drops_its_saves():
    worker, client, memory, meta = _full_graph_worker()
    worker.bind(meta)
    worker.start_load_kv()
    worker.save_kv_layer("l0")
    worker.wait_for_save()
    assert client.saves == []


def test_worker_full_graph_step_fences_every_layer_of_its_loads_before_the_forward():
    # 1. A step with a layer-wise load that vLLM replays as a full graph (e.g. every
    #    request of the batch computes one token): no wait_for_layer_load will come.
    from pegaflow.connector.metadata import LoadSpec
    worker, client, memory, meta = _full_graph_worker()
    meta.loads.append(LoadSpec("req-c", (5, 6), (b"j" * 32, b"k" * 32), (0,), False))
    worker.bind(meta)
    worker.start_load_kv(runs_layer_hooks=False)
    # 2. Before start_load_kv returns, vLLM's stream waits for every layer's event of the
    #    load's slot (events 4..7: slot 0 after the 4 save events), after the start fence.
    fence = (1 + 2) * 4
    assert memory.waits == [("record", [fence]), ("wait", [4, 5, 6, 7])]
    worker.get_finished(set())
    assert worker.get_block_ids_with_load_errors() == set()


def test_worker_step_whose_engine_was_replaced_mid_step_saves_nothing_computed_from_its_loads():
    # 1. A step's fenced load is accepted; then its engine dies and the link is already on a
    #    new engine when the step's save goes out (the loaded pages may be half copied).
    from pegaflow.connector.metadata import SaveSpec
    memory = FullGraphMemory()
    worker, _ = _worker_with_a_load(memory)
    first = FencedSavingClient(memory)
    worker.link.use(first)
    worker.layers.virtual = {"layer": (0, 1, 2, 3)}
    worker.layers.save_layers = {"layer"}
    worker._meta.saves.append(SaveSpec("req-c", (5, 6, 7), (b"j" * 32, b"k" * 32, b"l" * 32)))
    worker.start_load_kv()
    worker.wait_for_layer_load("layer")
    worker.save_kv_layer("layer")
    second = FencedSavingClient(memory)
    worker.link.use(second)  # what a reconnect inside client() leaves
    # 2. The save is held back (its blocks were computed from those pages) and vLLM is told
    #    the load failed, so it recomputes; nothing goes to the new engine.
    worker.wait_for_save()
    worker.get_finished(set())
    assert second.saves == [] and first.saves == []
    assert worker.get_block_ids_with_load_errors() == {5, 6}


def test_worker_namespace_unlike_the_schedulers_is_said_once_as_an_error(caplog):
    from pegaflow.connector.metadata import PegaConnectorMetadata
    # 1. Rank 1's own namespace agrees with what the scheduler sends for it: nothing said.
    worker = WorkerSide(ConnectorConfig(), namespace=7, rank=1, num_blocks=8)
    with caplog.at_level("ERROR", logger="pegaflow.connector.worker"):
        worker.bind(PegaConnectorMetadata(step=1, namespaces=(5, 7)))
    assert not caplog.records
    # 2. A worker that read the config otherwise: one ERROR naming both, however many steps.
    other = WorkerSide(ConnectorConfig(), namespace=9, rank=1, num_blocks=8)
    with caplog.at_level("ERROR", logger="pegaflow.connector.worker"):
        for step in (1, 2, 3):
            other.bind(PegaConnectorMetadata(step=step, namespaces=(5, 7)))
    assert len(caplog.records) == 1
    assert "0000000000000009" in caplog.text and "0000000000000007" in caplog.text


class BrokenSaveClient(StuckClient):
    """A live engine whose ring is full when the step's SAVE goes out."""

    def submit_save(self, *args, **kwargs):
        from pegaflow.platform.errors import RingFullError
        raise RingFullError("submission ring full")


def test_worker_save_that_breaks_the_connection_voids_what_was_sent_on_it():
    # 1. A SAVE of an earlier step and an async load are out on the connection.
    from pegaflow.connector.metadata import LoadSpec, PegaConnectorMetadata, SaveSpec
    worker = WorkerSide(ConnectorConfig(), namespace=1, rank=0, num_blocks=8)
    worker.memory = SimpleNamespace(has_events=False)
    worker.layers.save_layers = {"layer"}
    client = BrokenSaveClient()
    worker.link.use(client)
    worker.saves.sent(11, ("req-a",))
    worker.loads.asyncs[21] = (LoadSpec("req-b", (3,), (b"h" * 32,), (0,), True), time.monotonic())
    # 2. This step's SAVE cannot go out: the connection is dropped (revoked first), the
    #    earlier SAVE will never be answered and the async load failed; vLLM is told so.
    meta = PegaConnectorMetadata(saves=[SaveSpec("req-c", (5,), (b"s" * 32,))])
    worker.bind(meta)
    worker.start_load_kv()
    worker.save_kv_layer("layer")
    worker.wait_for_save()
    assert client.calls == ["revoke", "close"] and worker.link.is_down
    assert not worker.saves.is_saving({"req-a", "req-c"})
    assert worker.get_finished(set()) == (None, {"req-b"})
    assert worker.get_block_ids_with_load_errors() == {3}


class SavingThenLoadingClient(AcceptingClient):
    """Answers a preempted request's SAVE on the third poll; records, per LOAD, whether that
    SAVE was still out when it went."""

    def __init__(self, memory, worker):
        super().__init__(memory)
        self.worker, self.polls = worker, 0

    def try_take(self, command_id):
        self.polls += 1
        if self.polls < 3:
            return None
        result = SimpleNamespace(num_stored=1, num_deduped=0, num_dropped=0)
        return SimpleNamespace(is_ok=True, status=0, result=result)

    def submit_load(self, namespace, block_ids, hashes, **kwargs):
        self.loads.append(self.worker.saves.is_saving({"req-p"}))
        return 31


def _early_step(memory, **meta_fields):
    """A worker whose step has a preempted request's SAVE out and one layer-wise load."""
    from pegaflow.connector.metadata import LoadSpec, PegaConnectorMetadata
    worker = WorkerSide(ConnectorConfig(num_load_slots=2), namespace=1, rank=0, num_blocks=8)
    worker.layers.num_virtual, worker.memory = 4, memory
    worker.layers.virtual = {f"l{i}": (i,) for i in range(4)}
    client = SavingThenLoadingClient(memory, worker)
    worker.link.use(client)
    worker.saves.sent(11, ("req-p",))
    meta = PegaConnectorMetadata(**{"held_req_ids": set(), "preempted_req_ids": {"req-p"}, **meta_fields})
    meta.loads.append(LoadSpec("req-c", (5, 6), (b"j" * 32, b"k" * 32), (0,), False))
    return worker, client, meta


def test_worker_loads_go_out_at_handle_preemptions_after_the_preempted_saves():
    # 1. vLLM's first hook of the step: the preempted request's SAVE (which reads blocks the
    #    load may write) is waited for, then the LOAD goes out, fenced, before input prep.
    memory = FullGraphMemory()
    worker, client, meta = _early_step(memory)
    worker.handle_preemptions(meta)
    assert client.loads == [False]
    assert memory.waits == [("record", [(1 + 2) * 4])]
    # 2. vLLM binds the same plan and starts the loads: nothing is sent or fenced again.
    worker.bind(meta)
    worker.start_load_kv()
    assert client.loads == [False] and len(memory.recorded) == 1
    # 3. The forward's layers wait for their own events; the step ends with the load kept.
    worker.wait_for_layer_load("l0")
    assert memory.waits[1:] == [("wait", [4])]
    worker.get_finished(set())
    assert worker.get_block_ids_with_load_errors() == set()
    assert worker.stats.data.get("loaded_blocks") == 2


def test_worker_full_graph_step_of_early_loads_fences_every_layer_at_start_load_kv():
    # Loads sent at handle_preemptions; the forward replays a full CUDA graph (no per-layer
    # hook): start_load_kv makes vLLM's stream wait for every layer before the forward.
    memory = FullGraphMemory()
    worker, client, meta = _early_step(memory)
    worker.handle_preemptions(meta)
    worker.bind(meta)
    worker.start_load_kv(runs_layer_hooks=False)
    assert memory.waits == [("record", [(1 + 2) * 4]), ("wait", [4, 5, 6, 7])]
    assert client.loads == [False]


def test_worker_loads_whose_blocks_vllm_writes_while_preparing_go_out_at_start_load_kv():
    # 1. vLLM zeroes (or copies into) a load block after handle_preemptions: the loads wait.
    memory = FullGraphMemory()
    worker, client, meta = _early_step(memory, loads_after_input_prep=True)
    worker.handle_preemptions(meta)
    assert client.loads == [] and memory.waits == []
    # 2. They go out at start_load_kv, behind a fence recorded there (after vLLM's writes).
    worker.bind(meta)
    worker.start_load_kv()
    assert client.loads == [False] and memory.waits == [("record", [(1 + 2) * 4])]


def test_worker_of_a_vllm_without_handle_preemptions_sends_loads_at_start_load_kv_once():
    memory = FullGraphMemory()
    worker, client, meta = _early_step(memory, preempted_req_ids=set())
    worker.bind(meta)
    worker.bind(meta)  # (bound twice: still one plan)
    worker.start_load_kv()
    assert len(client.loads) == 1 and len(memory.recorded) == 1


def test_worker_plan_bound_unlike_handle_preemptions_ones_judges_those_loads_and_sends_its_own():
    # 1. handle_preemptions sent plan A's load; vLLM then binds another plan B.
    from pegaflow.connector.metadata import LoadSpec, PegaConnectorMetadata
    memory = FullGraphMemory()
    worker, client, meta = _early_step(memory)
    worker.handle_preemptions(meta)
    other = PegaConnectorMetadata(held_req_ids=set(), preempted_req_ids=set())
    other.loads.append(LoadSpec("req-d", (7,), (b"m" * 32,), (0,), False))
    worker.bind(other)
    # 2. A's load is waited for and judged (loaded, not failed), B's goes out at start_load_kv.
    assert worker.stats.data.get("loaded_blocks") == 2
    worker.start_load_kv()
    assert len(client.loads) == 2 and len(memory.recorded) == 2
    worker.get_finished(set())
    assert worker.stats.data.get("loaded_blocks") == 3 and worker.get_block_ids_with_load_errors() == set()


def test_worker_plan_bound_at_handle_preemptions_and_again_is_one_step():
    # vLLM binds the plan handle_preemptions bound already: the rank's window of recent
    # saves advances once, not twice (it would forget a step's SAVEs a step early).
    from pegaflow.connector.metadata import PegaConnectorMetadata
    worker = WorkerSide(ConnectorConfig(), namespace=5, rank=0, num_blocks=16, num_ranks=2)
    for _ in range(2):
        meta = PegaConnectorMetadata(held_req_ids=set(), preempted_req_ids=set())
        worker.bind(meta)
        worker.bind(meta)
    assert len(worker._recent_saves) == 2
