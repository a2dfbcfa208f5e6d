"""The LOAD commands of one planned load, and the lease of a load never sent.

A load is one LOAD of every layer, or, for a hybrid model, one LOAD per KV cache group,
all under the lookup's one lease: the group with the most blocks goes last and ends the
lease (a run of the lease's keys).  Each LOAD names the first IPC event its layers record
(``kv_layers.py``): a load slot's base, from the group's first layer on.
"""

from __future__ import annotations

from typing import NamedTuple

from pegaflow.client.connection import EngineClient
from pegaflow.connector.kv_layers import KVLayers
from pegaflow.connector.metadata import LoadSpec
from pegaflow.platform.errors import PegaflowError
from pegaflow.platform.wire import NO_EVENT


class SubmittedLoad(NamedTuple):
    command_id: int  # the engine's id of the LOAD
    group: int | None  # the KV cache group it loads (None: every layer)


def lease_of(spec: LoadSpec, rank: int) -> int:
    """Rank ``rank``'s lease of ``spec``'s blocks (0: none)."""
    return spec.lease_ids[rank] if rank < len(spec.lease_ids) else 0


def submit_loads(client: EngineClient, namespace: int, rank: int, spec: LoadSpec, layers: KVLayers,
                 slot: int | None, has_events: bool) -> list[SubmittedLoad]:
    """Send the LOAD(s) of ``spec`` (none where no group of it has layers here).  ``slot``:
    the load slot whose events fence it (None: unfenced).  Raises what the client raises."""
    base = NO_EVENT if slot is None else layers.load_event_base(slot)
    lease = lease_of(spec, rank)
    if not spec.groups:
        command_id = client.submit_load(namespace, spec.block_ids, list(spec.hashes), lease_id=lease,
                                        event_index=base, after_client=has_events)
        return [SubmittedLoad(command_id, None)]
    # (a group without registered layers, the drafter's, is not stored: nothing to load)
    # (a Mamba group's state, under its own key, goes first and without the lease)
    parts = sorted((p for p in spec.groups if layers.layers_of(p.group)),
                   key=lambda p: (not p.is_state, len(p.hashes)))
    submitted = []
    for i, part in enumerate(parts):
        event = base if slot is None else base + layers.first_layer_of(part.group)
        command_id = client.submit_load(namespace, part.block_ids, list(part.hashes),
                                        lease_id=0 if part.is_state else lease,
                                        event_index=event, after_client=has_events, group=part.group,
                                        ends_lease=i == len(parts) - 1)
        submitted.append(SubmittedLoad(command_id, part.group))
    return submitted


def release_lease(client: EngineClient, spec: LoadSpec, rank: int) -> PegaflowError | None:
    """Give back rank ``rank``'s lease of a load never sent (else it pins its blocks until
    it expires; the scheduler took it on its own link).  The error that broke the
    connection, if one did."""
    lease = lease_of(spec, rank)
    if not lease:
        return None
    try:
        client.release_nowait(lease)
    except PegaflowError as exc:
        return exc
    return None
