"""A hybrid SSM model's prefix (Jamba, Qwen3-Next shapes): attention blocks and the Mamba
state at the hit's last token.

vLLM's hybrid KV cache manager gives such a model one KV cache group per attention kind and
per Mamba layer set, all of one block size (vLLM pads the Mamba page to the attention page).
Under ``mamba_cache_mode`` ``align`` a Mamba group's block table holds a state only where a
chunk of the request ended on a block boundary; its other positions are vLLM's null block.
A prefix of ``k`` blocks is usable when the attention groups hold blocks ``0..k-1`` and every
Mamba group holds the state after block ``k-1``: vLLM's own prefix cache serves no more.

The engine stores a block as one entry of every registered layer and serves a key once all
of them are in, so the connector stores two kinds of key per request, in its one namespace:

- the block's hash, for every position: the attention groups' blocks; the Mamba groups'
  layers of such an entry are copied from whatever block their table holds there (vLLM's
  null block where it kept no state) and are never loaded;
- ``state_key(hash)``, for the positions where the Mamba groups hold a state: every group's
  block at that position, the Mamba groups' layers loaded at a hit's last position.

A lookup finds the stored run of block hashes, then the longest prefix of it whose last
position has a state key (the state lookups, ``STATE_CANDIDATES`` positions from the run's
end).  A load fetches the attention blocks under their hashes and the state under its state
key, one LOAD per group; the state's LOAD names no lease (the lookup's lease covers the run
of hashes), so a state evicted in between fails the load: vLLM recomputes the request
(``failed_recving``).
"""

from __future__ import annotations

import hashlib

from pegaflow.connector.metadata import NULL_BLOCK, GroupBlocks, LoadSpec, SaveSpec

STATE_SPECS = frozenset({"MambaSpec"})
STATE_CANDIDATES = 32  # positions from the end of a stored run whose state key is looked up
_STATE_SALT = b"pegaflow.mamba-state"


def state_key(block_hash: bytes) -> bytes:
    """The key of the whole block (the Mamba state after it included) at a position whose
    hash is ``block_hash``: another key than the hash's own, of the same length."""
    size = min(max(len(block_hash), 1), 32)
    return hashlib.blake2b(bytes(block_hash), digest_size=size, key=_STATE_SALT).digest()


def state_groups(kv_cache_config) -> frozenset[int]:
    """The KV cache groups whose blocks hold Mamba states rather than positions."""
    from pegaflow.connector.namespace import scheduler_view

    groups = getattr(kv_cache_config, "kv_cache_groups", None) or []
    return frozenset(i for i, g in enumerate(groups)
                     if type(scheduler_view(g.kv_cache_spec)).__name__ in STATE_SPECS)


def refusal(vllm_config, kv_cache_config, can_fail_requests: bool, hash_unit: int | None = None) -> str | None:
    """Why a model with Mamba groups cannot be served here (None: it can)."""
    from vllm.platforms import current_platform

    groups = list(kv_cache_config.kv_cache_groups)
    states = state_groups(kv_cache_config)
    if not can_fail_requests:
        return ("a hybrid SSM model needs a vLLM that takes a failed load as a failed request "
                "(failed_recving, vLLM 0.30 on)")
    if not current_platform.is_cpu():
        return ("a hybrid SSM model is served on vLLM's CPU build only: a Mamba layer runs no save "
                "hook, so a GPU save of its state has no event to wait for")
    mode = getattr(vllm_config.cache_config, "mamba_cache_mode", "none")
    if mode != "align":
        return (f"mamba_cache_mode {mode!r}: vLLM keeps Mamba states at block boundaries only under "
                "'align' (start vLLM with --mamba-cache-mode align and prefix caching on)")
    if len(states) == len(groups):
        return "no attention group: nothing positions a stored prefix"
    sizes = {getattr(g.kv_cache_spec, "block_size", None) for g in groups}
    if len(sizes) != 1:
        return f"KV cache groups of several block sizes ({sorted(map(str, sizes))})"
    if hash_unit not in (None, *sizes):
        return f"vLLM hashes prefixes every {hash_unit} tokens (prefix_match_unit), not every block"
    return None


def page_view(name: str, tensor):
    """A Mamba layer's KV memory as the engine copies it: one raw page per block, the whole
    block stride (vLLM pads the state to the attention page; the padding travels along).
    ``tensor``: the layer's tensor, or the list of views (conv, SSM state) vLLM gives it."""
    from pegaflow.connector.layout import TensorInfo

    views = list(tensor) if isinstance(tensor, (list, tuple)) else [tensor]
    first = min(views, key=lambda t: t.data_ptr())
    stride_bytes = first.stride(0) * first.element_size()
    return TensorInfo(name, first.data_ptr(), (first.shape[0], stride_bytes), (stride_bytes, 1), 1)


def drop_hookless(layers, groups: dict[str, int], states: frozenset[int]) -> None:
    """vLLM calls no ``save_kv_layer`` for a Mamba layer: a step's saves go once its
    attention layers are saved (on the CPU the forward, Mamba layers included, is over by
    ``wait_for_save``)."""
    layers.save_layers -= {name for name, group in groups.items() if group in states}


def _state_positions(tables, states: frozenset[int], start: int, end: int) -> list[int]:
    """Positions in ``[start, end)`` where every Mamba group's table holds a block."""
    return [j for j in range(start, end)
            if all(j < len(tables[g]) and tables[g][j] != NULL_BLOCK for g in states)]


def save_spec(req_id: str, tables, start: int, hashes, states: frozenset[int]) -> SaveSpec | None:
    """The save of positions ``start .. start + len(hashes)``: every group's block under each
    position's hash (a Mamba group's null block where it kept no state), and every group's
    block under the state key where the Mamba groups hold a state."""
    hashes = tuple(hashes)
    end = start + len(hashes)
    with_state = _state_positions(tables, states, start, end)
    keys = hashes + tuple(state_key(hashes[j - start]) for j in with_state)
    parts = []
    for group, table in enumerate(tables):
        ids = [table[j] if j < len(table) else NULL_BLOCK for j in range(start, end)]
        if group not in states and NULL_BLOCK in ids:
            return None  # an attention group without a block there: not a servable prefix
        ids += [table[j] for j in with_state]
        parts.append(GroupBlocks(group, tuple(ids), keys))
    real = tuple(dict.fromkeys(b for p in parts for b in p.block_ids if b != NULL_BLOCK))
    return SaveSpec(req_id, real, hashes, tuple(parts)) if parts and hashes else None


def load_spec(req_id: str, tables, first: int, hashes, lease_ids, states: frozenset[int]) -> LoadSpec:
    """The load of positions ``first .. first + len(hashes)``: the attention groups' blocks
    under their hashes, and the Mamba groups' block at the last position under its state key
    (no lease: ``is_state``)."""
    hashes = tuple(hashes)
    last = first + len(hashes) - 1
    parts = []
    for group, table in enumerate(tables):
        if group in states:
            parts.append(GroupBlocks(group, (table[last],), (state_key(hashes[-1]),), is_state=True))
        else:
            parts.append(GroupBlocks(group, tuple(table[first:last + 1]), hashes))
    ids = tuple(b for p in parts for b in p.block_ids)
    return LoadSpec(req_id, ids, hashes, tuple(lease_ids), True, tuple(parts))


def candidates(num_hits: int) -> list[int]:
    """The positions whose state key a lookup asks for, the last first."""
    return list(range(num_hits - 1, max(num_hits - STATE_CANDIDATES, 0) - 1, -1))


def submit_state_lookups(client, lookups, pending) -> None:
    """Once the run of stored hashes is known (``pending``'s answers): one LOOKUP per rank of
    each candidate position's state key."""
    from pegaflow.platform.wire import encode_hashes

    answers = [pending.answers[i] for i in pending.command_ids]
    pending.num_run = min([pending.num_blocks] + [a.result.num_hit_blocks if a.is_ok else 0 for a in answers])
    wait_ms = lookups.config.lookup_wait_arg
    for position in candidates(pending.num_run):
        records = encode_hashes([state_key(pending.hashes[position])])
        pending.state_ids[position] = tuple(client.submit_lookup(namespace, records, wait_ms=wait_ms)
                                            for namespace in lookups.namespaces)


def finish_state_lookups(lookups, pending, num_hits: int) -> int:
    """The hit cut to the last position with a state, the state lookups' leases given back
    (a state's LOAD pins it anew)."""
    found, leases = {}, []
    for position, command_ids in pending.state_ids.items():
        answers = [pending.answers[i] for i in command_ids]
        found[position] = all(a.is_ok and a.result.num_hit_blocks == 1 for a in answers)
        leases += [a.result.lease_id for a in answers if a.is_ok and a.result.lease_id]
    lookups.release(tuple(leases))
    return hit_with_state(num_hits, found)


def hit_with_state(num_hits: int, found: dict[int, bool]) -> int:
    """The longest prefix of ``num_hits`` stored blocks whose last position has a state on
    every rank (``found``: position -> all ranks found its state key); 0: none."""
    for position in candidates(num_hits):
        if found.get(position):
            return position + 1
    return 0
