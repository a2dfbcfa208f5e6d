"""A pipelined stream of random commands of every opcode, valid and not: each is answered
exactly once, the engine keeps serving, and another client's blocks stay byte-exact.

Hypothesis draws each example's seed, batch size and mix; a numpy generator built from
them makes the commands (random opcodes, flags, layers, event indices, namespaces, lease
ids, payloads of random bytes or of well-formed records with random values, bogus payload
offsets; REGISTERs of the fuzzer's own memory whose GPU is the host's or another value, every
one of the latter refused).  25 examples of 400-480 commands: over 10 000 commands a CI run.
"""

from __future__ import annotations

import time

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.process.server import MAX_UNREAD_ANSWERS
from pegaflow.client.host_memory import layer_records
from pegaflow.platform.wire import BLOCK_ID, GPU_UUID_BYTES, HOST_GPU_UUID, CommandFlag, Opcode, Status, encode_hashes
from tests.engine.conftest import KVClient, random_hashes

NUM_EXAMPLES = 25
OPCODES = [int(op) for op in Opcode if op != Opcode.DETACH] + [0, max(Opcode) + 1, 200, 65535]
NUM_COMMANDS = st.integers(400, 480)
ANSWER_TIMEOUT_S = 20.0

pytestmark = pytest.mark.slow


def _payload(rng: np.random.Generator, opcode: int, num_items: int) -> list[np.ndarray]:
    kind = rng.integers(4)
    if kind == 0:
        return []
    if kind == 1:  # random bytes
        return [rng.integers(0, 256, int(rng.integers(1, 2048)), dtype=np.uint8)]
    if kind == 2 and opcode in (Opcode.SAVE, Opcode.LOAD):  # ids and hashes, random values
        ids = rng.integers(-5, 80, num_items).astype(BLOCK_ID)
        return [ids, encode_hashes(random_hashes(rng, num_items))]
    return [encode_hashes(random_hashes(rng, max(num_items, 1)))]  # hash records


def _pick(rng: np.random.Generator, values: list):
    return values[int(rng.integers(len(values)))]  # rng.choice would turn big ints into floats


def _register(rng: np.random.Generator, fuzz: KVClient) -> tuple[int, bool]:
    """Submit a REGISTER of a well-formed REGION of the fuzzer's own buffer with one new layer,
    its GPU the host's stand-in or not (random bytes, zeros, all ones, the stand-in a byte off);
    returns its command id and whether it names another GPU."""
    off_by_one = bytes([HOST_GPU_UUID[0] ^ 1]) + HOST_GPU_UUID[1:]
    gpu_uuid = _pick(rng, [HOST_GPU_UUID, rng.bytes(GPU_UUID_BYTES), bytes(GPU_UUID_BYTES),
                           b"\xff" * GPU_UUID_BYTES, off_by_one])
    region = fuzz.kv.region_record(fuzz.NUM_BLOCKS, fuzz.PAGE_BYTES, 1)
    region["gpu_uuid"], region["client_device"] = np.void(gpu_uuid), _pick(rng, [0, 3, 2**32 - 1])
    layers = layer_records([int(rng.integers(fuzz.NUM_LAYERS, 64))], [0], [fuzz.PAGE_BYTES])
    command_id = fuzz.client.submit(Opcode.REGISTER, payload=[region, layers], num_items=1,
                                    region_id=int(rng.integers(1, 65536)))
    return command_id, gpu_uuid != HOST_GPU_UUID


def _command(rng: np.random.Generator, fuzz: KVClient, foreign: set[int], resets: set[int],
             honest_namespace: int) -> int:
    """Submit one random command; returns its request id (added to ``foreign`` for a
    REGISTER whose GPU is not the host's, to ``resets`` for a RESET).  Namespaces include
    the honest client's: a RESET of it is not the fuzzer's to make."""
    opcode = _pick(rng, OPCODES)
    if opcode == Opcode.REGISTER and rng.random() < 0.5:
        command_id, is_foreign = _register(rng, fuzz)
        if is_foreign:
            foreign.add(command_id)
        return command_id
    num_items = _pick(rng, [0, 1, 2, 7, 64, 2**31])
    fields = dict(layer=_pick(rng, [0, 1, 3, 0xFFFF, int(rng.integers(65536))]),
                  region_id=_pick(rng, [0, 1, int(rng.integers(65536))]),
                  event_index=_pick(rng, [0, 3, 0xFFFFFFFF, int(rng.integers(2**32))]),
                  namespace=_pick(rng, [1, 2, int(rng.integers(2**63)), honest_namespace]),
                  arg=_pick(rng, [0, 1, int(rng.integers(2**63)), 2**64 - 1]),
                  flags=_pick(rng, [0, CommandFlag.RELEASE_LEASE, CommandFlag.AFTER_CLIENT,
                                        CommandFlag.ONE_EVENT, int(rng.integers(65536))]))
    if opcode == Opcode.ATTACH and rng.random() < 0.5:
        fields["arg"] = _pick(rng, [1, 2**31 - 1])  # a pid that is not ours
    if rng.random() < 0.05:  # a payload the arena never held
        fields["arg"] &= 2**63 - 1  # numpy's record fields take what fits an int64 here
        return fuzz.submit_raw(opcode=opcode, num_items=num_items,
                               payload_offset=int(rng.integers(2**40)),
                               payload_bytes=int(rng.integers(1, 2**20)), **fields)
    is_plain_reset = opcode == Opcode.RESET and rng.random() < 0.5  # well-formed: its namespace alone
    if is_plain_reset:
        num_items, fields["flags"] = 0, 0
    payload = [] if is_plain_reset else _payload(rng, opcode, min(num_items, 64))
    command_id = fuzz.client.submit(Opcode(opcode) if opcode in Opcode._value2member_map_ else opcode,
                                    payload=payload, num_items=num_items, **fields)
    if opcode == Opcode.RESET:
        resets.add(command_id)
    return command_id


def _collect(fuzz: KVClient, seen: dict[int, list[int]], wanted: set[int]) -> None:
    """Each answer's status under its request id, until every id of ``wanted`` has one (or
    the deadline)."""
    deadline = time.monotonic() + ANSWER_TIMEOUT_S
    while True:
        for done in fuzz.client.poll():
            seen.setdefault(done.command_id, []).append(done.status)
        if wanted <= seen.keys() or time.monotonic() > deadline:
            return
        time.sleep(1e-4)


@pytest.fixture(scope="module")
def fuzz_engine(tmp_path_factory):
    from tests.conftest import EngineHarness
    harness = EngineHarness(tmp_path_factory.mktemp("fuzz"))
    yield harness.start(max_clients=256)  # slots are freed a second after each example
    harness.stop_all()


@settings(max_examples=NUM_EXAMPLES, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 2**32 - 1), num_commands=NUM_COMMANDS, batch=st.sampled_from([1, 16, 64]))
def test_fuzz_every_command_is_answered_once_and_others_stay_exact(fuzz_engine, seed, num_commands,
                                                                  batch):
    rng = np.random.default_rng(seed)
    honest, fuzz = KVClient(fuzz_engine.name), KVClient(fuzz_engine.name)
    try:
        # 1. An honest client stores blocks of its own namespace.
        namespace = 1000 + seed % 1000
        hashes, saved = honest.store(rng, namespace, [3, 4, 5])
        # 2. The fuzzer pipelines its commands, ``batch`` at a time, reading answers after
        #    each batch (never more unread than the engine holds back for it).
        commands_before = fuzz_engine.stats()["commands"]  # the answers the engine sent so far
        seen, sent, foreign, resets = {}, [], set(), set()
        for start in range(0, num_commands, batch):
            ids = [_command(rng, fuzz, foreign, resets, namespace)
                   for _ in range(min(batch, num_commands - start))]
            sent += ids
            _collect(fuzz, seen, set(ids))
            assert set(ids) <= seen.keys(), sorted(set(ids) - seen.keys())
        assert batch < MAX_UNREAD_ANSWERS
        # 3. Nothing is left in flight (the PING's answer comes after every answer published
        #    before it), and the engine answered as many commands as were sent: so no answer
        #    is still to come, and each request id was answered once.
        assert fuzz.client.ping() == 0
        _collect(fuzz, seen, set())
        num_answered = fuzz_engine.stats()["commands"] - commands_before  # (counted before answered)
        assert num_answered == len(sent) + 1  # and the PING
        assert sorted(seen) == sorted(sent) and {len(statuses) for statuses in seen.values()} == {1}
        # A REGISTER of memory on a GPU the engine does not see is never taken.
        assert [seen[i] for i in sorted(foreign) if seen[i] != [Status.BAD_ARGUMENT]] == []
        # No RESET of the fuzzer's is taken: it attached under no namespace (step 4 loads the
        # honest client's blocks, which a RESET of its namespace would have dropped).
        assert resets and [seen[i] for i in sorted(resets) if seen[i] == [Status.OK]] == []
        # 4. A DETACH with commands pipelined behind it: each is answered once, the DETACH
        #    OK, the rest NOT_ATTACHED (the slot is not freed under them).
        detach = fuzz.client.submit(Opcode.DETACH)
        after = [fuzz.client.submit(_pick(rng, [Opcode.PING, Opcode.LOOKUP, Opcode.SAVE, Opcode.RELEASE]),
                                    payload=[encode_hashes(random_hashes(rng, 2))], num_items=2)
                 for _ in range(int(rng.integers(1, 9)))]
        answers = {}
        deadline = time.monotonic() + ANSWER_TIMEOUT_S
        while len(answers) < 1 + len(after) and time.monotonic() < deadline:
            for done in fuzz.client.poll():
                assert done.command_id not in answers, "answered twice"
                answers[done.command_id] = done.status
            time.sleep(1e-4)
        assert answers[detach] == Status.OK and [answers.get(i) for i in after] == [Status.NOT_ATTACHED] * len(after)
        honest.pages[:, [10, 11, 12]] = 0
        assert honest.load(namespace, [10, 11, 12], hashes).is_ok
        np.testing.assert_array_equal(honest.pages[:, [10, 11, 12]], saved)
    finally:
        fuzz.close()
        honest.close()
