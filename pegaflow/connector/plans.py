"""Which blocks a planned load or save covers: a request's block ids at some positions,
with the hashes of those positions, per KV cache group (a hybrid model's) or of its one
table.  vLLM's null block stands where a sliding window let a position go: left out."""

from __future__ import annotations

from typing import NamedTuple

from pegaflow.connector import mamba_state
from pegaflow.connector.metadata import NULL_BLOCK, GroupBlocks, LoadSpec, SaveSpec


def load_spec(req_id: str, tables, first: int, count: int, hashes: tuple[bytes, ...],
              lease_ids: tuple[int, ...], is_async: bool, states: frozenset[int] = frozenset()) -> LoadSpec:
    """The load of positions ``first`` to ``first + count`` of a request's tables
    (``states``: a hybrid SSM model's Mamba groups, mamba_state.py)."""
    if len(tables) == 1:  # (a sliding-window-only model's null blocks are left out)
        ids, kept = _non_null(tables[0][first:first + count], hashes)
        return LoadSpec(req_id, ids, kept, lease_ids, is_async)
    if states:
        return mamba_state.load_spec(req_id, tables, first, hashes, lease_ids, states)
    parts = _group_parts(tables, first, hashes)
    return LoadSpec(req_id, tuple(b for p in parts for b in p.block_ids), hashes, lease_ids, is_async, parts)


class PlannedSave(NamedTuple):
    spec: SaveSpec | None  # None: no table holds a block at those positions
    num_full: int  # the request's full blocks, saved once this save is


def next_save(request, tables, num_saved: int, num_computed_blocks: int,
              states: frozenset[int] = frozenset()) -> PlannedSave | None:
    """The save of ``request``'s full blocks past its first ``num_saved``, up to
    ``num_computed_blocks`` (its computed tokens, in whole blocks), as far as its hashes
    and every table reach; None when no block is newly full."""
    hashes = request.block_hashes
    num_full = min(num_computed_blocks, len(hashes), *map(len, tables))
    if num_full <= num_saved:
        return None
    return PlannedSave(save_spec(request.request_id, tables, num_saved, hashes[num_saved:num_full], states),
                       num_full)


def extend_tables(tables: list[list[int]], new_ids) -> None:
    """Append a step's new block ids to each KV cache group's table."""
    if len(tables) < len(new_ids):
        tables += [[] for _ in range(len(new_ids) - len(tables))]
    for table, ids in zip(tables, new_ids):
        table.extend(ids)


def _non_null(block_ids, hashes) -> tuple[tuple[int, ...], tuple[bytes, ...]]:
    """The positions of one table that hold a block (not vLLM's null block), with their hashes."""
    if NULL_BLOCK not in block_ids:
        return tuple(block_ids), tuple(hashes)
    kept = [(b, h) for b, h in zip(block_ids, hashes) if b != NULL_BLOCK]
    return tuple(b for b, _ in kept), tuple(h for _, h in kept)


def save_spec(req_id: str, tables, start: int, hashes, states: frozenset[int] = frozenset()) -> SaveSpec | None:
    """The save of positions ``start`` to ``start + len(hashes)`` of a request's tables (one,
    or one per KV cache group; ``states``: the Mamba groups); None when no table holds a
    block there."""
    hashes = tuple(hashes)
    if states:
        return mamba_state.save_spec(req_id, tables, start, hashes, states)
    if len(tables) == 1:
        ids, kept = _non_null(tables[0][start:start + len(hashes)], hashes)
        return SaveSpec(req_id, ids, kept) if ids else None
    parts = _group_parts(tables, start, hashes)
    return SaveSpec(req_id, tuple(b for p in parts for b in p.block_ids), hashes, parts) if parts else None


def _group_parts(tables, start: int, hashes: tuple[bytes, ...]) -> tuple[GroupBlocks, ...]:
    """Each KV cache group's blocks at positions ``start`` to ``start + len(hashes)``, with
    the hashes of those positions; a group's null blocks (positions a sliding window let
    go) are left out, and so is a group with none left."""
    parts = []
    for group, table in enumerate(tables):
        kept = [(b, h) for b, h in zip(table[start:start + len(hashes)], hashes) if b != NULL_BLOCK]
        if kept:
            parts.append(GroupBlocks(group, tuple(b for b, _ in kept), tuple(h for _, h in kept)))
    return tuple(parts)
