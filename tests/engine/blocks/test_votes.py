"""Voting (``engine/blocks/votes.py``): one stored copy that every voter of its namespace vouches
for, on the in-memory dispatcher whose backend holds each copy until the test ends it."""

from __future__ import annotations

import os
import time

import numpy as np

from engine.copy.base import CopyDone
from pegaflow.platform.wire import CommandFlag, Opcode, Status, encode_hashes, hash_keys
from tests.engine.commands.held_dispatcher import held_dispatcher, save_payload

NAMESPACE = 7  # the in-memory clients' commands' namespace
HASH_A, HASH_B = b"a" * 32, b"b" * 32
TAG_1, TAG_2 = 0x1111, 0x2222


def _voters(num_voters: int = 2):
    """The held dispatcher with ``num_voters`` clients, each ATTACHed as voter i of them."""
    h = held_dispatcher()
    sides = [h] + [h.add_client(slot) for slot in range(1, num_voters)]
    for voter, side in enumerate(sides):
        _attach(side, voter, num_voters)
        assert side.completions.try_get().status == Status.OK
    return h, sides


def _attach(side, voter: int, num_voters: int, namespace: int = NAMESPACE, again: bool = False) -> None:
    side.client.is_attached = again
    words = np.array([0, num_voters, voter], "<u8").view(np.uint8)
    side.send(100, Opcode.ATTACH, words, arg=os.getpid(), namespace=namespace)


def _vote(side, request_id: int, ids, hashes, tags) -> None:
    payload = np.concatenate([save_payload(ids, hashes), np.asarray(tags, "<u8").view(np.uint8)])
    side.send(request_id, Opcode.SAVE, payload, len(ids), flags=int(CommandFlag.VOTE_TAGS))


def _land(h) -> None:
    """Every held copy ends."""
    for token in list(h.backend.held):
        h.backend.held.remove(token)
        h.dispatcher.on_copy_done(CopyDone(token))


def _key(block_hash: bytes):
    return (NAMESPACE, hash_keys(encode_hashes([block_hash]))[0])


def _stat(h, name: str) -> int:
    return int(h.dispatcher.stats._words[h.dispatcher.stats._at[name]])


def test_votes_first_voter_copies_block_is_ready_only_once_the_second_votes():
    h, (first, second) = _voters()
    index = h.dispatcher.index
    # 1. Voter 0 saves block A under tag 1: copied, in the pool, but not servable.
    _vote(first, 1, [3], [HASH_A], [TAG_1])
    _land(h)
    assert first.completions.try_get().status == Status.OK
    assert index.get_ready(_key(HASH_A)) is None
    assert index.lookup(0, [_key(HASH_A)]) == (0, 0)
    # 2. Voter 1 saves it under the same tag: no second copy, only its vote, and it is READY.
    _vote(second, 2, [5], [HASH_A], [TAG_1])
    assert h.backend.held == []
    answer = second.completions.try_get()
    assert (answer.status, answer.value, answer.value2) == (Status.OK, 0, 1)
    assert index.get_ready(_key(HASH_A)) is not None
    assert index.pool.num_entries == 1 and _stat(h, "save_votes") == 1
    assert _stat(h, "blocks_saved") == 1


def test_votes_vote_while_the_copy_is_in_flight_makes_it_ready_when_it_lands():
    h, (first, second) = _voters()
    _vote(first, 1, [3], [HASH_A], [TAG_1])
    _vote(second, 2, [5], [HASH_A], [TAG_1])  # the first copy still held
    assert len(h.backend.held) == 1 and h.dispatcher.index.get_ready(_key(HASH_A)) is None
    _land(h)
    assert h.dispatcher.index.get_ready(_key(HASH_A)) is not None


def test_votes_other_tag_never_makes_the_copy_ready():
    h, (first, second) = _voters()
    index = h.dispatcher.index
    # 1. Voter 0's copy under tag 1 (say, computed from a failed load elsewhere).
    _vote(first, 1, [3], [HASH_A], [TAG_1])
    _land(h)
    # 2. Voter 1 saves the same hash under tag 2 (a later, correct computation): it is left
    #    alone, not copied, and does not complete voter 0's copy.
    _vote(second, 2, [5], [HASH_A], [TAG_2])
    assert h.backend.held == [] and index.get_ready(_key(HASH_A)) is None
    assert _stat(h, "save_vote_conflicts") == 1 and _stat(h, "save_votes") == 0
    # 3. Voter 0 saving it under tag 2 too changes nothing: the waiting copy is tag 1's.
    _vote(first, 3, [3], [HASH_A], [TAG_2])
    assert h.backend.held == [] and index.get_ready(_key(HASH_A)) is None
    assert index.lookup(0, [_key(HASH_A)]) == (0, 0)


def test_votes_never_quorate_copy_expires_and_frees_its_page():
    h, (first, _) = _voters()
    index = h.dispatcher.index
    _vote(first, 1, [3, 4], [HASH_A, HASH_B], [TAG_1, TAG_1])
    _land(h)
    assert index.pool.num_entries == 2 and index.pool.bytes_used > 0
    # Housekeeping drops writes that never completed: the pages go back to the pool.
    assert index.drop_stale_writes(time.monotonic() + 1) == 2
    assert index.pool.num_entries == 0 and index.pool.bytes_used == 0 and not index.entries


def test_votes_ready_block_is_deduplicated_whatever_the_tag():
    h, (first, second) = _voters()
    for side, request_id in ((first, 1), (second, 2)):
        _vote(side, request_id, [3], [HASH_A], [TAG_1])
        _land(h)
        side.completions.try_get()
    # A later computation's SAVE of a READY block: deduplicated as without voting.
    _vote(first, 3, [3], [HASH_A], [TAG_2])
    answer = first.completions.try_get()
    assert (answer.status, answer.value2) == (Status.OK, 1) and h.backend.held == []
    assert h.dispatcher.index.get_ready(_key(HASH_A)) is not None
    assert _stat(h, "save_vote_conflicts") == 0


def test_votes_block_named_twice_under_two_tags_is_copied_once_under_the_first():
    h, (first, second) = _voters()
    # One SAVE names block A twice (two requests of a step): only the first is copied.
    _vote(first, 1, [3, 4], [HASH_A, HASH_A], [TAG_1, TAG_2])
    assert len(h.backend.held) == 1 and len(h.backend.ops[h.backend.held[0]].block_ids) == 1
    assert h.backend.ops[h.backend.held[0]].block_ids.tolist() == [3]
    _land(h)
    _vote(second, 2, [4], [HASH_A], [TAG_2])  # the second request's tag: not the copy's
    assert h.dispatcher.index.get_ready(_key(HASH_A)) is None


def test_votes_attach_with_another_number_of_voters_is_refused():
    h, (first, _) = _voters()
    third = h.add_client(2)
    _attach(third, 0, 3)  # the namespace has 2 voters
    assert third.completions.try_get().status == Status.BAD_ARGUMENT and not third.client.is_attached
    _attach(third, 2, 2)  # voter index outside 0..1
    assert third.completions.try_get().status == Status.BAD_ARGUMENT
    _attach(third, 1, 2)  # another instance's rank 1: agrees
    assert third.completions.try_get().status == Status.OK


def test_votes_voters_gone_let_the_namespace_take_another_number():
    h, sides = _voters()
    for request_id, side in enumerate(sides, 1):
        side.send(request_id, Opcode.DETACH)
        assert side.completions.try_get().status == Status.OK
    fresh = h.add_client(3)
    _attach(fresh, 0, 4)
    assert fresh.completions.try_get().status == Status.OK


def test_votes_attach_again_under_another_namespace_leaves_no_stale_voter():
    # 1. Two voters of namespace 7; the first ATTACHes again, a voter of namespace 8 now.
    h, (first, second) = _voters()
    _attach(first, 0, 2, namespace=8, again=True)
    assert first.completions.try_get().status == Status.OK
    # 2. The second leaves: namespace 7 has no voter left, so it may take another number of
    #    voters (a stale vote of the first would refuse it).
    second.send(1, Opcode.DETACH)
    assert second.completions.try_get().status == Status.OK
    fresh = h.add_client(2)
    _attach(fresh, 0, 3)
    assert fresh.completions.try_get().status == Status.OK
    # 3. The first ATTACHes again under namespace 8, as no voter: it leaves 8's voters (a
    #    client may make 8 a namespace of 5 voters), and saves as a non-voter (no tags).
    first.send(101, Opcode.ATTACH, np.zeros(1, "<u8").view(np.uint8), arg=os.getpid(), namespace=8)
    assert first.completions.try_get().status == Status.OK
    other = h.add_client(3)
    _attach(other, 0, 5, namespace=8)
    assert other.completions.try_get().status == Status.OK
    first.send(2, Opcode.SAVE, save_payload([3], [HASH_A]), 1, namespace=8)
    _land(h)
    assert first.completions.try_get().status == Status.OK


def test_votes_voter_save_without_tags_and_tags_from_a_non_voter_are_refused():
    h, (first, _) = _voters()
    first.send(1, Opcode.SAVE, save_payload([3], [HASH_A]), 1)
    assert first.completions.try_get().status == Status.BAD_ARGUMENT
    plain = h.add_client(2)  # attached without voting
    _vote(plain, 2, [3], [HASH_A], [TAG_1])
    assert plain.completions.try_get().status == Status.BAD_ARGUMENT
    assert h.backend.held == [] and not h.dispatcher.index.entries


def test_votes_each_kv_cache_group_is_copied_once_and_the_block_ready_after_every_vote():
    from engine.copy.base import LayerPlacement
    h, sides = _voters()
    for side in sides:  # two layers, one KV cache group each (a hybrid model's SAVE per group)
        side.client.layers[1] = LayerPlacement(1, 0, 16 * 4096, 4096)
        side.client.groups = {0: [0], 1: [1]}
    first, second = sides
    group = int(CommandFlag.VOTE_TAGS | CommandFlag.LAYER_GROUP)
    payload = np.concatenate([save_payload([3], [HASH_A]), np.asarray([TAG_1], "<u8").view(np.uint8)])
    # 1. Voter 0's SAVE of each group copies that group's layer (the second is not taken
    #    for a vote on the first's copy).
    for request_id, layer in ((1, 0), (2, 1)):
        first.send(request_id, Opcode.SAVE, payload, 1, flags=group, layer=layer)
    assert len(h.backend.held) == 2
    _land(h)
    index = h.dispatcher.index
    assert index.entries[_key(HASH_A)].done_mask == 0b11 and index.get_ready(_key(HASH_A)) is None
    # 2. Voter 1's SAVEs of both groups only vote: no copy, and the block is READY.
    for request_id, layer in ((3, 0), (4, 1)):
        second.send(request_id, Opcode.SAVE, payload, 1, flags=group, layer=layer)
    assert h.backend.held == [] and index.get_ready(_key(HASH_A)) is not None
