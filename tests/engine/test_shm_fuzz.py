"""Random bytes in every field a client can write where the engine reads it: a rogue client
writes them into its own slot record and ring header between its commands, while an
honest client's loads are checked byte for byte.

Rounds of a fresh rogue client each: MUTATIONS_PER_ROUND writes (a random field or a
random run of bytes, random values or the extremes of a field), each followed by a PING;
a round lasts at least one housekeeping pass of the engine, so its checks read what the
round wrote; then the rogue goes without a DETACH.  Over NUM_MUTATIONS writes in all, the
engine must live, answer every command of the honest client (its loads exact), and have
closed rogues for what they wrote.
"""

from __future__ import annotations

import time

import numpy as np
import pytest

from pegaflow.client.connection import EngineClient
from pegaflow.platform.errors import NoFreeSlotError
from pegaflow.platform.wire import RING_HEADER, SLOT, Opcode
from tests.engine.conftest import KVClient
from tests.engine.shm_fields import ring_header, slot_record, write_bytes

NUM_MUTATIONS = 10_000
MUTATIONS_PER_ROUND = 625
LOAD_EVERY = 20  # mutations between two checked loads of the honest client
NUM_SLOTS = 32
WAIT_S = 30.0
NAMESPACE = 77
SAVED_IDS, LOAD_IDS = [0, 1, 2, 3], [40, 41, 42, 43]
EXTREMES = [0, 1, 2, 3, 2**31 + 5, 2**32 - 1, 2**63, 2**64 - 1]


@pytest.fixture(scope="module")
def fuzz_engine(tmp_path_factory):
    from tests.conftest import EngineHarness
    harness = EngineHarness(tmp_path_factory.mktemp("shmfuzz"))
    yield harness.start(max_clients=NUM_SLOTS)
    harness.stop_all()


def _mutate(rng: np.random.Generator, rogue: EngineClient) -> None:
    """One write into the rogue's slot record or ring header: a whole field set to a random
    or extreme value, or a random run of random bytes."""
    record, dtype = (slot_record(rogue), SLOT) if rng.random() < 0.5 else (ring_header(rogue), RING_HEADER)
    if rng.random() < 0.6:
        field = dtype.names[int(rng.integers(len(dtype.names)))]
        bits = dtype.fields[field][0].itemsize * 8
        is_extreme = rng.random() < 0.5
        value = EXTREMES[int(rng.integers(len(EXTREMES)))] if is_extreme else \
            int.from_bytes(rng.bytes(bits // 8), "little")
        record[field] = value % 2**bits
        return
    offset = int(rng.integers(dtype.itemsize))
    length = int(rng.integers(1, dtype.itemsize - offset + 1))
    write_bytes(record, offset, rng.integers(0, 256, length, dtype=np.uint8).tobytes())


def _connect_rogue(name: str) -> EngineClient:
    """A new rogue client, once a slot is free (the engine frees the last rounds' within
    a housekeeping pass or two)."""
    deadline = time.monotonic() + WAIT_S
    while True:
        try:
            return EngineClient.connect(name, timeout_s=10.0)
        except NoFreeSlotError:
            if time.monotonic() >= deadline:
                raise
            time.sleep(0.02)


def _check_load(honest: KVClient, hashes: list[bytes], saved: np.ndarray) -> None:
    honest.pages[:, LOAD_IDS] = 0
    done = honest.load(NAMESPACE, LOAD_IDS, hashes)
    assert done.is_ok, done
    np.testing.assert_array_equal(honest.pages[:, LOAD_IDS], saved)


def _round(engine, rng, honest: KVClient, hashes, saved) -> int:
    """One rogue's round; returns how many loads of the honest client it checked."""
    rogue = _connect_rogue(engine.name)
    started_ns, num_loads = time.time_ns(), 0
    try:
        for i in range(MUTATIONS_PER_ROUND):
            _mutate(rng, rogue)
            rogue.submit(Opcode.PING)
            if i % LOAD_EVERY == 0:
                _check_load(honest, hashes, saved)
                num_loads += 1
        # The engine's housekeeping reads the slot and ring header as the round left them
        # (loads checked meanwhile; a housekeeping that never comes fails the test).
        deadline = time.monotonic() + WAIT_S
        while engine.stats()["heartbeat_ns"] <= started_ns:
            assert time.monotonic() < deadline, "the engine's housekeeping never ran after the round"
            _check_load(honest, hashes, saved)
            num_loads += 1
            time.sleep(0.05)
    finally:
        rogue.close(detach=False)
    return num_loads


def test_shm_fuzz_rogue_fields_never_stop_the_engine_or_touch_others(fuzz_engine, rng):
    # 1. An honest client stores blocks it loads back after every few mutations.
    honest = KVClient(fuzz_engine.name)
    try:
        hashes, saved = honest.store(rng, NAMESPACE, SAVED_IDS)
        refused_before = fuzz_engine.stats()["clients_refused"]
        # 2. Rounds of rogues writing random bytes into their own slot and ring header.
        num_mutations = num_loads = 0
        while num_mutations < NUM_MUTATIONS:
            num_loads += _round(fuzz_engine, rng, honest, hashes, saved)
            num_mutations += MUTATIONS_PER_ROUND
            assert fuzz_engine.proc.poll() is None, fuzz_engine.stderr_text()[-3000:]
        # 3. The engine serves: the honest client's every command was answered (each load
        #    exact), it closed rogues for what they wrote, and a new client attaches.
        assert num_mutations >= NUM_MUTATIONS and num_loads >= NUM_MUTATIONS // LOAD_EVERY
        assert honest.client.ping() == 0
        assert fuzz_engine.stats()["clients_refused"] > refused_before
        last = _connect_rogue(fuzz_engine.name)
        assert last.ping() == 0
        last.close()
    finally:
        honest.close()
