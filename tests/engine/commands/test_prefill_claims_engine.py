"""Compute once through a real engine process: a burst of new documents, each sent at the
same moment to every one of four vLLM instances, is prefilled by one instance per document
(``engine/commands/prefill_claims.py``, docs/replicas.md "Compute once").

Each instance is replayed as vLLM's scheduler drives its connector: its queue of requests
(documents d0, d1, ... in order) is looked up in order, each LOOKUP carrying a ``Prefill``;
a request whose answer is not in yet is skipped (deferred) and asked again at the
instance's next turn; the first request answered short of its whole document is scheduled
and fills the turn's budget, so the requests behind it are looked up only once it is done.
A scheduled request computes its blocks a chunk a turn, the way a forward saves them: its
SAVE of the chunk's first layer goes out as the forward starts, the other layers at the
instance's next turn (the forward ended).  The four instances take turns, a fixed pause
after each (the GPU they share), so another instance's forward lasts four pauses: longer
than the engine's wait for saves in flight.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from pegaflow.platform.protocol import Prefill

NAMESPACE = 7
NUM_INSTANCES = 4
NUM_DOCS = 4
DOC_BLOCKS = 8
CHUNK_BLOCKS = 4  # a chunk a forward: a document takes two
TURN_S = 0.05  # the pause after each instance's turn
FIRST_WAIT_S = 2e-3  # a request's first ask waits this long for its answer, as the connector's
MAX_TURNS = 400  # every request answered by then, or the test fails (no hang)
# States 80 tokens a second: five 16-token blocks a second, slow enough that no claim's
# deadline passes during the replay on a loaded machine; waits for at most 60 s.
PREFILL = Prefill(16, 80, 60_000)


@dataclass
class Replica:
    """One vLLM instance's scheduler: its queue, its LOOKUPs out, the request it computes."""

    kv: object  # a KVClient (tests/engine/conftest.py)
    queue: list[int]  # documents not answered yet, in order
    lookups: dict[int, int] = field(default_factory=dict)  # document -> its LOOKUP's command id
    running: list[int] | None = None  # [document, first block of the chunk in flight, of the next]
    computed: dict[int, int] = field(default_factory=dict)  # document -> blocks it computed

    def turn(self, docs: list[list[bytes]]) -> None:
        """One scheduler step: the last forward ends, then lookups and the next forward."""
        if self.running is not None:
            self._end_forward(docs)
        if self.running is None:
            self._schedule(docs)
        if self.running is not None:
            self._start_forward(docs)

    def _schedule(self, docs: list[list[bytes]]) -> None:
        client = self.kv.client
        for doc in list(self.queue):
            is_first = doc not in self.lookups
            if is_first:
                self.lookups[doc] = client.submit_lookup(NAMESPACE, docs[doc], prefill=PREFILL)
            found = _ask(client, self.lookups[doc], FIRST_WAIT_S if is_first else 0.0)
            if found is None:
                continue  # deferred: vLLM asks again next step, and looks at the next request
            assert found.is_ok
            if found.result.lease_id:  # (the load is not replayed: its blocks are READY)
                client.wait(client.release(found.result.lease_id))
            self.queue.remove(doc)
            num_hits = found.result.num_hit_blocks
            if num_hits < DOC_BLOCKS:  # scheduled: it takes the step's budget
                self.computed[doc] = DOC_BLOCKS - num_hits
                self.running = [doc, -1, num_hits]
                return

    def _start_forward(self, docs: list[list[bytes]]) -> None:
        doc, _, first = self.running
        blocks = range(first, min(first + CHUNK_BLOCKS, DOC_BLOCKS))
        assert self.kv.save(NAMESPACE, blocks, [docs[doc][b] for b in blocks], layer=0).is_ok
        self.running[1:] = [first, blocks.stop]

    def _end_forward(self, docs: list[list[bytes]]) -> None:
        doc, first, end = self.running
        blocks = range(first, end)
        for layer in range(1, self.kv.NUM_LAYERS):
            assert self.kv.save(NAMESPACE, blocks, [docs[doc][b] for b in blocks], layer=layer).is_ok
        if end == DOC_BLOCKS:
            self.running = None


def _ask(client, command_id: int, wait_s: float):
    """The answer to ``command_id`` if it comes within ``wait_s`` (None: not yet)."""
    deadline = time.monotonic() + wait_s
    while (found := client.try_take(command_id)) is None and time.monotonic() < deadline:
        time.sleep(1e-4)
    return found


def test_prefill_claims_engine_burst_to_four_instances_computes_each_document_once(
        engine_factory, kv_client, rng, make_hashes):
    engine = engine_factory()
    docs = [make_hashes(DOC_BLOCKS) for _ in range(NUM_DOCS)]
    replicas = []
    for instance in range(1, NUM_INSTANCES + 1):
        replica = Replica(kv_client(engine, instance=instance), list(range(NUM_DOCS)))
        replica.kv.fill(rng, range(DOC_BLOCKS))
        replicas.append(replica)
    # 1. The burst: every instance takes its turns until each has every document, computed or served.
    for _ in range(MAX_TURNS):
        if not any(r.queue or r.running for r in replicas):
            break
        for replica in replicas:
            replica.turn(docs)
            time.sleep(TURN_S)
    assert not any(r.queue or r.running for r in replicas), "the burst never ended"
    # 2. Each document was computed once, by one instance; the others were served its blocks.
    computed = np.array([[r.computed.get(doc, 0) for r in replicas] for doc in range(NUM_DOCS)])
    assert computed.sum(axis=1).tolist() == [DOC_BLOCKS] * NUM_DOCS, f"blocks computed, doc x instance:\n{computed}"
    stats = engine.fresh_stats()
    assert stats["claim_declines"] == 0 and stats["claim_timeouts"] == 0 and stats["claims_dropped"] == 0
    assert stats["claim_waits"] > 0  # (followers that came once the blocks were READY simply hit)
