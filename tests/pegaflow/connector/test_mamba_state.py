"""A hybrid SSM model's saves, loads and lookups (mamba_state.py): the attention blocks
under their hashes, the Mamba state at a hit's last block under its state key."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from pegaflow.connector import mamba_state
from pegaflow.connector.config import ConnectorConfig
from pegaflow.connector.layout import derive_sublayers
from pegaflow.connector.prefix_lookups import Lookups
from pegaflow.connector.stats import PegaKVConnectorStats
from pegaflow.platform.wire import HASH, HASH_BYTES, Status

STATES = frozenset({0, 1, 2})  # three Mamba groups, then one full attention group (Qwen3-Next's shape)
H = [bytes([i]) * 32 for i in range(1, 9)]


def _spec(name: str, block_size: int = 288):
    return type(name, (), {"block_size": block_size})()


def _config(*specs) -> SimpleNamespace:
    return SimpleNamespace(kv_cache_groups=[SimpleNamespace(layer_names=[f"l{i}"], kv_cache_spec=s)
                                            for i, s in enumerate(specs)])


def test_mamba_state_key_is_another_key_of_the_same_length_and_the_same_for_the_same_hash():
    assert mamba_state.state_key(H[0]) != H[0] and len(mamba_state.state_key(H[0])) == 32
    assert mamba_state.state_key(H[0]) == mamba_state.state_key(bytes(H[0]))
    assert mamba_state.state_key(H[0]) != mamba_state.state_key(H[1])


def test_mamba_state_save_stores_every_position_and_the_state_where_the_mamba_groups_hold_one():
    # vLLM's tables after a 576-token chunk (read from vLLM CPU 0.32): the Mamba groups keep
    # a state at position 1 only (block 0 is vLLM's null block), attention blocks 4 and 5.
    tables = ([0, 1], [0, 2], [0, 3], [4, 5])
    spec = mamba_state.save_spec("r", tables, 0, H[:2], STATES)
    s1 = mamba_state.state_key(H[1])
    assert [(p.group, p.block_ids, p.hashes) for p in spec.groups] == [
        (0, (0, 1, 1), (H[0], H[1], s1)), (1, (0, 2, 2), (H[0], H[1], s1)),
        (2, (0, 3, 3), (H[0], H[1], s1)), (3, (4, 5, 5), (H[0], H[1], s1))]
    assert not any(p.is_state for p in spec.groups)
    assert spec.block_ids == (1, 2, 3, 4, 5)  # vLLM's null block is never a block a save holds


def test_mamba_state_save_without_a_state_in_range_stores_positions_only():
    spec = mamba_state.save_spec("r", ([0, 0, 6], [0, 0, 7], [0, 0, 8], [4, 5, 9]), 0, H[:2], STATES)
    assert [p.hashes for p in spec.groups] == [(H[0], H[1])] * 4
    assert spec.groups[3].block_ids == (4, 5)


def test_mamba_state_save_where_an_attention_group_has_no_block_is_none():
    assert mamba_state.save_spec("r", ([0, 1], [0, 2], [0, 3], [0, 5]), 0, H[:2], STATES) is None


def test_mamba_state_load_takes_attention_blocks_and_the_state_at_the_last_position_only():
    tables = ([0, 7, 11], [0, 8, 12], [0, 9, 13], [4, 5, 14])
    spec = mamba_state.load_spec("r", tables, 0, H[:2], (42,), STATES)
    s1 = mamba_state.state_key(H[1])
    assert [(p.group, p.block_ids, p.hashes, p.is_state) for p in spec.groups] == [
        (0, (7,), (s1,), True), (1, (8,), (s1,), True), (2, (9,), (s1,), True), (3, (4, 5), (H[0], H[1]), False)]
    assert spec.is_async and spec.lease_ids == (42,) and set(spec.block_ids) == {7, 8, 9, 4, 5}


def test_mamba_state_hit_ends_at_the_last_stored_state_within_the_run():
    assert mamba_state.hit_with_state(4, {3: False, 2: False, 1: True, 0: True}) == 2
    assert mamba_state.hit_with_state(4, {3: True, 1: True}) == 4
    assert mamba_state.hit_with_state(4, {}) == 0
    assert mamba_state.hit_with_state(0, {0: True}) == 0
    assert mamba_state.candidates(3) == [2, 1, 0]
    assert len(mamba_state.candidates(1000)) == mamba_state.STATE_CANDIDATES


def _keys(records) -> list[bytes]:
    raw = records.view("u1").reshape(len(records), HASH.itemsize)
    return [bytes(row[:row[HASH_BYTES]]) for row in raw]


class _Answer:
    def __init__(self, num_hit_blocks: int, lease_id: int):
        self.is_ok, self.status = True, Status.OK
        self.result = SimpleNamespace(num_hit_blocks=num_hit_blocks, lease_id=lease_id, num_disk_blocks=0)


class _Engine:
    """A client whose engine holds ``stored`` keys: a LOOKUP finds its run of them."""

    def __init__(self, stored: set[bytes]):
        self.stored, self.asked, self.released = stored, [], []
        self._answers: dict[int, _Answer] = {}

    def submit_lookup(self, namespace: int, records, wait_ms=None, prefill=None) -> int:
        keys = _keys(records)
        self.asked.append(keys)
        run = next((i for i, k in enumerate(keys) if k not in self.stored), len(keys))
        request_id = len(self.asked)
        self._answers[request_id] = _Answer(run, 1000 + request_id if run else 0)
        return request_id

    def wait(self, request_id: int, timeout_s: float):
        return self._answers[request_id]

    def take_orphans(self):
        return []

    def release_nowait(self, lease_id: int) -> None:
        self.released.append(lease_id)

    def release_claim_nowait(self, hashes) -> None:
        pass


def _lookup(stored: set[bytes], prompt_blocks: int):
    engine = _Engine(stored)
    link = SimpleNamespace(client=lambda: engine, fail=lambda exc: None)
    lookups = Lookups(ConnectorConfig.from_sources({}), [7], 288, link, PegaKVConnectorStats(), has_states=True)
    state = SimpleNamespace(request=SimpleNamespace(request_id="r"), lookup=None, num_hit_tokens=0, lease_ids=(),
                            is_from_disk=False, claimed={})
    request = SimpleNamespace(num_tokens=prompt_blocks * 288 + 5, block_hashes=H[:prompt_blocks])
    lookups.start(state, request, 0)
    assert lookups.finish(state)
    return state, engine


def test_mamba_state_lookup_serves_the_run_up_to_its_last_stored_state():
    # Blocks 0-3 stored, a state after block 1 only: 2 blocks are served, the main lookup's
    # lease kept for the load, every state lookup's lease given back.
    state, engine = _lookup(set(H[:4]) | {mamba_state.state_key(H[1])}, 5)
    assert state.num_hit_tokens == 2 * 288 and state.lease_ids == (1001,)
    assert engine.asked[0] == H[:5]
    assert engine.asked[1:] == [[mamba_state.state_key(H[j])] for j in (3, 2, 1, 0)]
    assert engine.released == [1004]  # (the state lookup of position 1, the fourth LOOKUP)


def test_mamba_state_lookup_without_a_stored_state_is_a_miss():
    state, engine = _lookup(set(H[:4]), 5)
    assert state.num_hit_tokens == 0 and state.lease_ids == ()
    assert 1001 in engine.released  # the run's lease, of no use without a state


def test_mamba_state_lookup_of_a_model_without_states_asks_no_state_key():
    engine = _Engine(set(H[:3]))
    link = SimpleNamespace(client=lambda: engine, fail=lambda exc: None)
    lookups = Lookups(ConnectorConfig.from_sources({}), [7], 288, link, PegaKVConnectorStats())
    state = SimpleNamespace(request=SimpleNamespace(request_id="r"), lookup=None, num_hit_tokens=0, lease_ids=(),
                            is_from_disk=False, claimed={})
    lookups.start(state, SimpleNamespace(num_tokens=4 * 288 + 5, block_hashes=H[:4]), 0)
    assert lookups.finish(state) and state.num_hit_tokens == 3 * 288 and len(engine.asked) == 1


def test_mamba_state_page_view_is_the_whole_padded_block():
    torch = pytest.importorskip("torch")
    storage = torch.zeros(8 * 64, dtype=torch.int8)
    view = storage.as_strided((8, 1, 1, 60), (64, 60, 60, 1))  # a state of 60 bytes in 64-byte blocks
    info = mamba_state.page_view("m", view)
    assert info.shape == (8, 64) and info.strides == (64, 1) and info.data_ptr == storage.data_ptr()
    assert [s.page_bytes for s in derive_sublayers(info, 8)] == [64]
    states = [storage.as_strided((8, 20), (64, 1), 16), storage.as_strided((8, 10), (64, 1))]  # (ssm, conv)
    assert mamba_state.page_view("m", states).data_ptr == storage.data_ptr()


@pytest.fixture
def on_cpu(monkeypatch):
    import vllm.platforms
    monkeypatch.setattr(vllm.platforms, "current_platform", SimpleNamespace(is_cpu=lambda: True))


def _vllm(mode: str = "align") -> SimpleNamespace:
    return SimpleNamespace(cache_config=SimpleNamespace(mamba_cache_mode=mode))


def test_mamba_state_served_only_with_failed_requests_align_mode_and_an_attention_group(on_cpu):
    hybrid = _config(_spec("MambaSpec"), _spec("FullAttentionSpec"))
    assert mamba_state.state_groups(hybrid) == {0}
    assert mamba_state.refusal(_vllm(), hybrid, True) is None
    assert "failed_recving" in mamba_state.refusal(_vllm(), hybrid, False)  # vLLM 0.26: off, as before
    assert "'align'" in mamba_state.refusal(_vllm("none"), hybrid, True)
    assert "no attention group" in mamba_state.refusal(_vllm(), _config(_spec("MambaSpec")), True)
    sizes = _config(_spec("MambaSpec", 288), _spec("FullAttentionSpec", 32))
    assert "block sizes" in mamba_state.refusal(_vllm(), sizes, True)
    assert "every 32 tokens" in mamba_state.refusal(_vllm(), hybrid, True, hash_unit=32)


def test_mamba_state_not_served_off_the_cpu_build(monkeypatch):
    import vllm.platforms
    monkeypatch.setattr(vllm.platforms, "current_platform", SimpleNamespace(is_cpu=lambda: False))
    assert "CPU build" in mamba_state.refusal(_vllm(), _config(_spec("MambaSpec"), _spec("FullAttentionSpec")), True)


class _LoadingClient:
    """Records each LOAD; the engine has lost the state of ``lost_group`` (its LOAD fails)."""

    def __init__(self, lost_group: int | None = None):
        self.loads, self.lost_group = [], lost_group

    def submit_load(self, namespace, block_ids, hashes, *, lease_id=0, event_index=0, after_client=False,
                    group=None, ends_lease=True) -> int:
        self.loads.append((group, tuple(block_ids), tuple(hashes), lease_id, ends_lease))
        return len(self.loads)

    def try_take(self, command_id: int):
        group = self.loads[command_id - 1][0]
        return SimpleNamespace(is_ok=group != self.lost_group, status="NOT_FOUND")


def _step_loads(client):
    from pegaflow.connector.kv_layers import KVLayers
    from pegaflow.connector.step_loads import StepLoads
    from pegaflow.connector.taint import Taint
    from pegaflow.connector.trace import StepTrace

    config = ConnectorConfig.from_sources({})
    link = SimpleNamespace(client=lambda: client, fail=lambda exc: None)
    loads = StepLoads(config, 7, 0, link, PegaKVConnectorStats(), Taint(), StepTrace())
    loads.memory = SimpleNamespace(has_events=False)
    loads.layers = KVLayers(config.num_load_slots, num_virtual=4, group_layers=[(0, 1), (1, 1), (2, 1), (3, 1)])
    return loads


@pytest.mark.parametrize("lost_group", [None, 1])
def test_mamba_state_load_sends_states_first_without_the_lease_and_a_lost_state_fails_the_request(lost_group):
    import time

    from pegaflow.connector.metadata import PegaConnectorMetadata

    client = _LoadingClient(lost_group)
    loads = _step_loads(client)
    spec = mamba_state.load_spec("r", ([0, 7], [0, 8], [0, 9], [4, 5]), 0, H[:2], (42,), STATES)
    assert loads.start(PegaConnectorMetadata(loads=[spec]), lambda: client) is None
    s1 = mamba_state.state_key(H[1])
    # 1. Each Mamba group's state under its state key, with no lease; then the attention
    #    blocks under the lookup's lease, which that LOAD ends.
    assert client.loads == [(0, (7,), (s1,), 0, False), (1, (8,), (s1,), 0, False), (2, (9,), (s1,), 0, False),
                            (3, (4, 5), (H[0], H[1]), 42, True)]
    # 2. Done once every LOAD is answered: loaded, or (a state the engine lost) a failed
    #    request, which vLLM recomputes whole.
    assert loads.collect(client, time.monotonic())
    if lost_group is None:
        assert loads.take_finished_recving() == {"r"} and loads.take_failed_recving() == set()
    else:
        assert loads.take_failed_recving() == {"r"} and loads.take_finished_recving() == {"r"}
