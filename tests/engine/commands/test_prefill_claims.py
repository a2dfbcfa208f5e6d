"""Compute once (``engine/prefill_claims.py``): a claimer's LOOKUP misses and claims the blocks
its vLLM is about to compute; another instance's LOOKUP that reaches them waits for their
saves, and is answered with what is READY once the claim ends some other way (released on an
abort or a preemption, its save failed, its deadline passed, its client killed).

Most tests drive one in-process dispatcher whose copy backend holds every copy until the test
ends it (the saves "in flight"), with the clock as the test sets it; the killed claimer is a
real engine process and a real client process.
"""

from __future__ import annotations

import os
import signal
import time
from types import SimpleNamespace

import numpy as np
import pytest

from engine.blocks.index import BlockIndex
from engine.clients.client import ClientState
from engine.commands import prefill_claims
from engine.commands.dispatcher import Dispatcher
from engine.copy.base import CopyBackend, CopyDone, LayerPlacement
from engine.memory.pool import PagePool
from engine.stats import StatsWriter
from pegaflow.client.connection import EngineClient
from pegaflow.platform import protocol
from pegaflow.platform.protocol import Lookup, Prefill, ReleaseClaim, Save
from pegaflow.platform.ring import RingConsumer, RingProducer, RingSegmentView, record_type, reset_slots
from pegaflow.platform.wire import COMPLETION, STATS, SUBMISSION, Status, encode_hashes
from tests.spawn import start_child

NAMESPACE = 7
BLOCK_TOKENS = 16
SLOW = Prefill(BLOCK_TOKENS, 16, 60_000)  # one block a second: a claim outlives any test step
WAIT_DEADLINE_S = 60.0  # how long a test waits for an answer it is owed (generous)
_make = record_type(SUBMISSION)


class HeldBackend(CopyBackend):
    """Holds every copy until the test ends it (``finish``), as saves still in flight."""

    name = "held"

    def __init__(self):
        self.held = []

    def open_pool(self, pool): pass
    def register_region(self, *args): pass
    def register_events(self, *args): pass
    def unregister_client(self, slot): pass
    def num_inflight(self): return len(self.held)
    def poll(self): return []
    def submit(self, op): self.held.append(op.token)


class _Memory:
    def __init__(self, size): self.buf, self.name = np.zeros(size, np.uint8), "mem"
    def array(self, dtype, count, offset=0): return np.frombuffer(self.buf, dtype, count, offset)


class Harness:
    """One dispatcher; ``client(instance)`` adds an attached client of that vLLM instance."""

    def __init__(self, compute_once: bool = True, pool_bytes: int = 1 << 20):
        self.backend = HeldBackend()
        self.stats = StatsWriter(np.zeros(1, STATS))
        self.dispatcher = Dispatcher(BlockIndex(PagePool(pool_bytes, pool_bytes), 60.0), self.backend, self.stats,
                                     lookup_wait_s=0.04, compute_once=compute_once)
        self.ids = iter(range(1, 10_000))

    def client(self, slot: int, instance: int) -> SimpleNamespace:
        num_slots, arena = 16, 1 << 16
        view = RingSegmentView(_Memory(64 + num_slots * (SUBMISSION.itemsize + COMPLETION.itemsize) + arena),
                               num_slots, arena)
        reset_slots(view.submissions)
        reset_slots(view.completions)
        state = ClientState(slot, view, RingConsumer(view.submissions), RingProducer(view.completions),
                            pid=os.getpid(), is_attached=True, instance=instance)
        state.layers, state.region_blocks, state.page_bytes = {0: LayerPlacement(0, 0, 0, 4096)}, {0: 16}, 4096
        return SimpleNamespace(state=state, answers=RingConsumer(view.completions))

    def send(self, client, command) -> int:
        encoded = protocol.encode(command)
        payload = (np.concatenate([np.ascontiguousarray(p).view(np.uint8).ravel() for p in encoded.payload])
                   if encoded.payload else protocol.NO_PAYLOAD)
        command_id = next(self.ids)
        rec = _make(0, *protocol.record_fields(command_id, encoded, 0, payload.nbytes))
        client.state.view.arena[:payload.nbytes] = payload.view(np.uint8)  # where the engine reads it
        self.dispatcher.handle(client.state, rec)
        return command_id

    def lookup(self, client, hashes, prefill: Prefill | None = SLOW, namespace: int = NAMESPACE) -> int:
        return self.send(client, Lookup(namespace, encode_hashes(hashes), prefill=prefill))

    def save(self, client, hashes, namespace: int = NAMESPACE) -> int:
        return self.send(client, Save(namespace, np.arange(len(hashes), dtype=np.int32), encode_hashes(hashes)))

    def finish_saves(self, error: str | None = None) -> None:
        """Every copy held so far ends (``error``: failed)."""
        held, self.backend.held = self.backend.held, []
        for token in held:
            self.dispatcher.on_copy_done(CopyDone(token, error))

    def resume(self, now: float | None = None) -> None:
        """A turn of the server's loop for the parked LOOKUPs."""
        self.dispatcher.waiting.resume(time.monotonic() if now is None else now)

    def stat(self, name: str) -> int:
        return self.stats._words[self.stats._at[name]]


def _answer(client, command_id: int):
    """The answer to ``command_id`` if it came (None: not yet), others' skipped."""
    while (record := client.answers.try_get()) is not None:
        if int(record["command_id"]) == command_id:
            return record
    return None


def _hashes(count: int, tag: bytes = b"d") -> list[bytes]:
    return [tag + bytes([i]) * 31 for i in range(count)]


@pytest.fixture
def burst():
    """A harness, a claimer (instance 1) whose LOOKUP of 4 new blocks missed and claimed
    them, and a waiter (instance 2) whose LOOKUP of the same blocks is parked."""
    return _burst(Harness())


def _burst(h: Harness) -> SimpleNamespace:
    claimer, waiter = h.client(0, instance=1), h.client(1, instance=2)
    hashes = _hashes(4)
    found = _answer(claimer, h.lookup(claimer, hashes))
    assert found is not None and found["value"] == 0 and h.stat("claims") == 1
    waited = h.lookup(waiter, hashes)
    h.resume()
    assert _answer(waiter, waited) is None, "the waiter was answered while the claim held"
    return SimpleNamespace(h=h, claimer=claimer, waiter=waiter, hashes=hashes, waited=waited)


def test_prefill_claims_waiter_is_served_the_claimers_blocks_once_saved(burst):
    h = burst.h
    # 1. The claimer's vLLM computed the blocks; its SAVE is in flight: the waiter waits on.
    h.save(burst.claimer, burst.hashes)
    h.resume()
    assert _answer(burst.waiter, burst.waited) is None
    # 2. The saves land: the waiter is answered with all four blocks, leased.
    h.finish_saves()
    h.resume()
    found = _answer(burst.waiter, burst.waited)
    assert found["status"] == Status.OK and found["value"] == 4 and found["value2"] != 0
    assert (h.stat("claim_waits"), h.stat("claim_wait_blocks")) == (1, 4)
    assert h.stat("claim_tokens_saved") == 4 * BLOCK_TOKENS and h.stat("claims_dropped") == 0


def test_prefill_claims_lookup_reaching_the_claimers_save_in_flight_waits_for_the_claim():
    h = Harness()
    claimer, asker = h.client(0, instance=1), h.client(1, instance=2)
    hashes = _hashes(4)
    # 1. The claimer claims the blocks and its forward starts: its SAVE is in flight (WRITING).
    h.lookup(claimer, hashes)
    h.save(claimer, hashes)
    h.dispatcher.claims.sweep(time.monotonic())  # (a housekeeping pass: the claim stands)
    # 2. The asker's LOOKUP reaches them now: it waits for the claim, far past the engine's
    #    wait for saves in flight (40 ms: a forward on a shared GPU lasts longer).
    waited = h.lookup(asker, hashes)
    h.resume(time.monotonic() + 1.0)
    assert _answer(asker, waited) is None
    # 3. The saves land: served the whole run, counted as a wait for a claim.
    h.finish_saves()
    h.resume()
    assert _answer(asker, waited)["value"] == 4
    assert (h.stat("claim_waits"), h.stat("claim_wait_blocks")) == (1, 4)


def test_prefill_claims_waiter_waits_past_the_claims_deadline_for_blocks_being_written(burst, monkeypatch):
    h, claims = burst.h, burst.h.dispatcher.claims
    # 1. The claimer's forward starts late: its SAVE goes out, then the claim's deadline passes
    #    and a housekeeping pass runs: the claim stands (its blocks are on their way).
    h.save(burst.claimer, burst.hashes)
    later = time.monotonic() + prefill_claims.MAX_CLAIM_S + 1
    monkeypatch.setattr(prefill_claims.time, "monotonic", lambda: later)
    claims.sweep(later)
    assert len(claims.claims) == 1 and h.stat("claim_timeouts") == 0
    # 2. The waiter waits on (within its own wait), and so does a new asker's LOOKUP, far past
    #    the engine's 40 ms wait for saves in flight.
    late = h.client(2, instance=3)
    waited = h.lookup(late, burst.hashes)
    h.resume(later + 1.0)
    assert _answer(burst.waiter, burst.waited) is None and _answer(late, waited) is None
    # 3. The saves land: both get the four blocks.
    h.finish_saves()
    h.resume(later + 1.0)
    assert _answer(burst.waiter, burst.waited)["value"] == 4 and _answer(late, waited)["value"] == 4


def test_prefill_claims_released_on_abort_lets_the_waiter_compute(burst):
    h = burst.h
    # 1. Another instance cannot release the claim: the waiter still waits.
    h.send(h.client(2, instance=3), ReleaseClaim(encode_hashes(burst.hashes)))
    h.resume()
    assert _answer(burst.waiter, burst.waited) is None
    # 2. The claimer's request is aborted (or preempted) before it computed anything: its
    #    connector releases the claim; the waiter is answered at once with a miss.
    h.send(burst.claimer, ReleaseClaim(encode_hashes(burst.hashes)))
    h.resume()
    found = _answer(burst.waiter, burst.waited)
    assert found["status"] == Status.OK and found["value"] == 0
    assert h.stat("claims_dropped") == 1 and h.stat("claim_wait_blocks") == 0


def test_prefill_claims_release_of_the_blocks_not_computed_keeps_the_rest_claimed(burst):
    h = burst.h
    # 1. The claimer's request was aborted after its first chunk: it releases the blocks it
    #    will not compute; the first two (their SAVE may still be unread) stay claimed.
    h.send(burst.claimer, ReleaseClaim(encode_hashes(burst.hashes[2:])))
    h.resume()
    assert _answer(burst.waiter, burst.waited) is None
    assert h.stat("claims_dropped") == 1
    # 2. The first chunk's saves land: the waiter gets those two blocks and computes the rest.
    h.save(burst.claimer, burst.hashes[:2])
    h.finish_saves()
    h.resume()
    assert _answer(burst.waiter, burst.waited)["value"] == 2
    # 3. Saved and released, the claim is gone at the next housekeeping, not timed out.
    h.dispatcher.claims.sweep(time.monotonic())
    assert not h.dispatcher.claims.claims and h.stat("claim_timeouts") == 0


def test_prefill_claims_waiter_of_a_failed_save_is_answered_with_what_is_ready(burst):
    h = burst.h
    # 1. The claimer saves the first two blocks (they land), then the last two, whose copy fails.
    h.save(burst.claimer, burst.hashes[:2])
    h.finish_saves()
    h.save(burst.claimer, burst.hashes[2:])
    h.resume()
    assert _answer(burst.waiter, burst.waited) is None
    h.finish_saves(error="copy failed")
    # 2. The claim ends with the failure: the waiter gets the two READY blocks, computes the rest.
    h.resume()
    found = _answer(burst.waiter, burst.waited)
    assert found["status"] == Status.OK and found["value"] == 2
    assert h.stat("claims_dropped") == 1 and h.stat("claim_wait_blocks") == 2


def test_prefill_claims_waiter_of_a_save_that_found_no_room_is_answered_with_what_is_ready():
    # 1. A pool of two pages: the claimer's SAVE of its four blocks stores the first two and
    #    drops the last two (no room, nothing evictable: the two are being written).
    b = _burst(Harness(pool_bytes=2 * 4096))
    h = b.h
    h.save(b.claimer, b.hashes)
    h.resume()
    assert _answer(b.waiter, b.waited) is None
    # 2. The SAVE is done with two blocks dropped: the claim ends (those two will not come);
    #    the waiter gets the two stored blocks and computes the rest.
    h.finish_saves()
    assert h.stat("save_dropped_blocks") == 2
    h.resume()
    found = _answer(b.waiter, b.waited)
    assert found["status"] == Status.OK and found["value"] == 2
    assert h.stat("claims_dropped") == 1 and h.stat("claim_wait_blocks") == 2


def test_prefill_claims_past_its_deadline_ends_and_is_counted(burst, monkeypatch):
    h, claims = burst.h, burst.h.dispatcher.claims
    # 1. The claimer never saves.  Past the claim's deadline (MAX_CLAIM_S at most) the waiter
    #    is answered with a miss.
    later = time.monotonic() + prefill_claims.MAX_CLAIM_S + 1
    h.resume(later)
    found = _answer(burst.waiter, burst.waited)
    assert found["status"] == Status.OK and found["value"] == 0
    # 2. A LOOKUP after the deadline (the housekeeping has not swept the claim yet) does not
    #    wait for the dead claim: answered at once, it claims the blocks anew.
    monkeypatch.setattr(prefill_claims.time, "monotonic", lambda: later)
    late = h.client(2, instance=3)
    assert _answer(late, h.lookup(late, burst.hashes))["value"] == 0
    assert h.stat("claims") == 2 and h.stat("claim_waits") == 1
    # 3. The housekeeping counts the dead claim timed out; the new one stands.
    claims.sweep(later)
    assert h.stat("claim_timeouts") == 1 and [c.instance for c in claims.claims] == [3]


def test_prefill_claims_waiter_of_absent_blocks_wakes_at_the_claims_deadline():
    h = Harness()
    claimer, waiter = h.client(0, instance=1), h.client(1, instance=2)
    hashes = _hashes(4)
    h.lookup(claimer, hashes)
    h.lookup(waiter, hashes)
    (claim,) = h.dispatcher.claims.claims
    # 1. Parked on blocks no SAVE has reached: the loop wakes for it at the claim's deadline,
    #    sooner than the end of the waiter's own wait.
    assert h.dispatcher.waiting.next_deadline() == claim.deadline
    # 2. The first two blocks' SAVE is in flight: they are waited for past the claim's deadline
    #    (the copy's end is work that wakes the loop).
    h.save(claimer, hashes[:2])
    h.resume()
    assert h.dispatcher.waiting.next_deadline() > claim.deadline
    # 3. They land; the last two are still absent: the claim's deadline again.
    h.finish_saves()
    h.resume()
    assert h.dispatcher.waiting.next_deadline() == claim.deadline


def test_prefill_claims_wait_longer_than_computing_is_declined():
    h = Harness()
    claimer, asker = h.client(0, instance=1), h.client(1, instance=2)
    hashes = _hashes(8)
    # 1. A slow claimer (one block a second) claims 8 blocks.
    h.lookup(claimer, hashes)
    # 2. An asker that would compute the blocks in a millisecond does not wait 8 s for them.
    fast = Prefill(BLOCK_TOKENS, 1_000_000, 60_000)
    assert _answer(asker, h.lookup(asker, hashes, fast))["value"] == 0
    assert h.stat("claim_declines") == 1 and h.stat("claim_waits") == 0


def _claim_measured(h: Harness, client, hashes: list[bytes], prefill: Prefill, spent_s: float) -> None:
    """``client``'s LOOKUP of ``hashes`` claims them; their SAVEs land, begun ``spent_s`` after
    the claim; the housekeeping measures the claim."""
    claims = h.dispatcher.claims
    assert _answer(client, h.lookup(client, hashes, prefill))["value"] == 0
    claim = claims.claims[-1]
    h.save(client, hashes)
    h.finish_saves()
    for key in protocol.keys_of(NAMESPACE, encode_hashes(hashes)):
        h.dispatcher.index.entries[key].started_at = claim.made_at + spent_s
    claims.sweep(time.monotonic())


def test_prefill_claims_measured_time_lengthens_a_deadline_never_shortens_it():
    h = Harness()
    claims = h.dispatcher.claims
    claimer = h.client(0, instance=1)
    quick = Prefill(BLOCK_TOKENS, 1600, 60_000)  # states 10 ms a block
    # 1. The claimer's 4 blocks' SAVEs came 0.4 s after its claim (it was queued in its vLLM).
    _claim_measured(h, claimer, _hashes(4), quick, 0.4)
    assert claims.measured[1] == pytest.approx(0.1)
    # 2. Its next claim's deadline follows the slower measured time (twice 0.4 s, plus the margin),
    h.lookup(claimer, _hashes(4, b"e"), quick)
    assert claims.claims[-1].deadline - claims.claims[-1].made_at == pytest.approx(2 * 0.4 + prefill_claims.MARGIN_S)
    # 3. but a claim stating a slower rate (one block a second) keeps the deadline it states.
    h.lookup(claimer, _hashes(4, b"f"))
    assert claims.claims[-1].deadline - claims.claims[-1].made_at == pytest.approx(
        min(2 * 4.0 + prefill_claims.MARGIN_S, prefill_claims.MAX_CLAIM_S))


def test_prefill_claims_measured_instance_still_waits_for_a_claim_at_the_same_stated_rate():
    h = Harness()
    claimer, asker = h.client(0, instance=1), h.client(1, instance=2)
    # 1. The asker's instance had a claim whose SAVEs came at once (its request ran at once):
    #    measured almost nothing a block.
    _claim_measured(h, asker, _hashes(4, b"a"), SLOW, 1e-4)
    assert h.dispatcher.claims.measured[2] < 1e-3
    # 2. A claimer stating the same rate claims a new prefix; the asker's LOOKUP of it waits
    #    (the rates compared are the stated ones: its measurement is no prefill rate).
    h.lookup(claimer, _hashes(4))
    waited = h.lookup(asker, _hashes(4))
    assert _answer(asker, waited) is None and h.stat("claim_declines") == 0


def test_prefill_claims_never_wait_for_own_instance_or_without_prefill():
    h = Harness()
    claimer, twin, other = h.client(0, instance=1), h.client(1, instance=1), h.client(2, instance=2)
    hashes = _hashes(3)
    h.lookup(claimer, hashes)
    # Another client of the claimer's own instance (a second request of it) is answered at once,
    assert _answer(twin, h.lookup(twin, hashes))["value"] == 0
    # and so is a LOOKUP that takes no part in compute once (its vLLM turned it off), or one
    # that claims but never waits (compute_once_wait_ms 0).
    assert _answer(other, h.lookup(other, hashes, prefill=None))["value"] == 0
    assert _answer(other, h.lookup(other, hashes, prefill=Prefill(BLOCK_TOKENS, 16, 0)))["value"] == 0
    assert h.stat("claims") == 1 and h.stat("claim_waits") == h.stat("claim_declines") == 0


def test_prefill_claims_lookup_of_another_model_is_answered_at_once():
    h = Harness()
    claimer, other = h.client(0, instance=1), h.client(1, instance=2)
    hashes = _hashes(4)
    # 1. A model's vLLM claims a new prompt's blocks in its namespace.
    h.lookup(claimer, hashes)
    # 2. Another model's vLLM is sent the same prompt: the same (token-based) hashes in a
    #    namespace of its own, where the claimer's blocks will never land.  It is answered at
    #    once with a miss (its vLLM computes them), neither waiting nor declining, and claims
    #    nothing the claimer holds.
    found = _answer(other, h.lookup(other, hashes, namespace=NAMESPACE + 1))
    assert found is not None and found["value"] == 0
    assert h.stat("claim_waits") == h.stat("claim_declines") == 0 and h.stat("claims") == 1
    # 3. A replica of the claimer's model still waits for it.
    twin = h.client(2, instance=3)
    waited = h.lookup(twin, hashes)
    h.resume()
    assert _answer(twin, waited) is None


def test_prefill_claims_follower_with_two_tp_ranks_waits_on_both():
    h = Harness()
    claimer, follower = h.client(0, instance=1), h.client(1, instance=2)
    hashes, ranks = _hashes(4), (NAMESPACE, NAMESPACE + 1)  # a namespace for each TP rank
    # 1. Both instances' LOOKUPs of one prompt, a LOOKUP a rank, interleaved: the claimer's
    #    first rank claims the blocks, its second names its namespace; the follower waits on
    #    both ranks.
    waited = []
    for namespace in ranks:
        assert _answer(claimer, h.lookup(claimer, hashes, namespace=namespace))["value"] == 0
        waited.append(h.lookup(follower, hashes, namespace=namespace))
    h.resume()
    assert [w.received.command_id for w in h.dispatcher.waiting.items] == waited and h.stat("claims") == 1
    # 2. The claimer's ranks save the blocks: the follower's ranks are served all four.
    for namespace in ranks:
        h.save(claimer, hashes, namespace)
    h.finish_saves()
    h.resume()
    assert [_answer(follower, w)["value"] for w in waited] == [4, 4]
    assert (h.stat("claim_waits"), h.stat("claim_declines")) == (2, 0)


def test_prefill_claims_engine_with_compute_once_off_claims_nothing():
    h = Harness(compute_once=False)
    claimer, asker = h.client(0, instance=1), h.client(1, instance=2)
    hashes = _hashes(3)
    h.lookup(claimer, hashes)
    assert _answer(asker, h.lookup(asker, hashes))["value"] == 0
    assert h.stat("claims") == 0 and not h.dispatcher.claims.by_hash


def test_prefill_claims_waiter_gets_the_run_as_the_claimer_saves_it_chunk_by_chunk(burst):
    h = burst.h
    # With chunked prefill the claimer saves its prefix a chunk at a time: the waiter waits
    # through the first chunk (READY) and the second (still claimed), then gets them all.
    h.save(burst.claimer, burst.hashes[:2])
    h.finish_saves()
    h.resume()
    assert _answer(burst.waiter, burst.waited) is None
    h.save(burst.claimer, burst.hashes[2:])
    h.finish_saves()
    h.resume()
    assert _answer(burst.waiter, burst.waited)["value"] == 4


# -- the claimer killed mid-prefill: a real engine, a real client process ------------------


def _claimer_main(conn, engine_name: str, hashes: list[bytes]) -> None:
    """A vLLM scheduler of instance 1: its LOOKUP misses and claims; then it hangs until killed."""
    client = EngineClient.connect(engine_name, instance=1)
    found = client.lookup(NAMESPACE, hashes, prefill=SLOW)
    conn.send(found.num_hit_blocks)
    time.sleep(3600)


def test_prefill_claims_claimer_killed_mid_prefill_lets_the_waiter_compute(engine_factory, kv_client, rng,
                                                                           make_hashes):
    engine = engine_factory()
    hashes = make_hashes(10)
    # 1. The claimer (another process) looks the new prefix up: a miss, claimed.
    conn, proc = start_child(_claimer_main, engine.name, hashes)
    try:
        assert conn.poll(WAIT_DEADLINE_S) and conn.recv() == 0
        engine.wait_stats(lambda s: s["claims"] == 1)
        # 2. The waiter's LOOKUP reaches the claim and is parked.
        waiter = kv_client(engine, instance=2)
        waited = waiter.client.submit_lookup(NAMESPACE, hashes, prefill=SLOW)
        time.sleep(0.2)
        assert waiter.client.try_take(waited) is None, "answered while the claimer lived"
        # 3. The claimer dies mid-prefill: the engine reclaims its slot (a housekeeping pass
        #    finds it dead), its claim ends, and the waiter is answered with a miss (no hang),
        #    well before the claim's deadline (MAX_CLAIM_S: its 10 blocks take 10 s "to compute").
        os.kill(proc.pid, signal.SIGKILL)
        killed_at = time.monotonic()
        found = waiter.client.wait(waited, WAIT_DEADLINE_S)
        waited_s = time.monotonic() - killed_at
    finally:
        proc.kill()
        proc.join(WAIT_DEADLINE_S)
    assert found.is_ok and found.result.num_hit_blocks == 0
    assert waited_s < prefill_claims.MAX_CLAIM_S - 1  # (not at the deadline: the reclaim ended it)
    stats = engine.wait_stats(lambda s: s["claims_dropped"] == 1)
    assert stats["claim_timeouts"] == 0 and stats["claim_wait_blocks"] == 0
    # 4. The waiter's vLLM computes the blocks itself and saves them: exact when loaded back.
    saved = waiter.fill(rng, range(10))
    assert waiter.save(NAMESPACE, range(10), hashes).is_ok
    reader = kv_client(engine, instance=3)
    found, done, loaded = reader.look_up_and_load(NAMESPACE, hashes)
    assert found.num_hit_blocks == 10 and done.is_ok
    np.testing.assert_array_equal(loaded, saved)


def test_prefill_claims_engine_flag_off_answers_at_once(engine_factory, kv_client, make_hashes):
    engine = engine_factory(extra=("--no-compute-once",))
    hashes = make_hashes(3)
    claimer, asker = kv_client(engine, instance=1), kv_client(engine, instance=2)
    assert claimer.client.lookup(NAMESPACE, hashes, prefill=SLOW).num_hit_blocks == 0
    assert asker.client.lookup(NAMESPACE, hashes, prefill=SLOW, timeout_s=WAIT_DEADLINE_S).num_hit_blocks == 0
    assert engine.fresh_stats()["claims"] == 0
