"""A running (or crashed) engine's counters, read from its stats segment without attaching
as a client: what ``pegaflow-stat``, the Prometheus exporter, tests and tools show."""

from __future__ import annotations

import time

import numpy as np

from pegaflow.platform import shm
from pegaflow.platform.errors import EngineNotRunningError, ShmError
from pegaflow.platform.pool_layout import POOL_RECORD, POOL_TABLE_HEADER, POOL_TABLE_VERSION, EntryState
from pegaflow.platform.shm import is_pid_alive
from pegaflow.platform.values import package_version
from pegaflow.platform.wire import (
    CLIENT_STATS,
    CONTROL_HEADER,
    KV_ROLE_SHIFT,
    LATENCY_BUCKETS_S,
    LATENCY_OPCODES,
    MAGIC,
    STATS,
    STATS_COUNTER_NAMES,
    WIRE_VERSION,
    ClientRole,
    KvRole,
    Opcode,
    Status,
)

STALE_AFTER_S = 10.0  # the engine beats every 2.5 s at most: four beats missed


def read_stats(name: str, stale_after_s: float = STALE_AFTER_S) -> dict:
    """One snapshot of engine ``name``'s counters as a plain dict; ``responding`` is False
    for a live process whose heartbeat is older than ``stale_after_s``."""
    header = _control_header(name)
    if header is not None and int(header["magic"]) == MAGIC and int(header["version"]) != WIRE_VERSION:
        raise ShmError(f"engine {name!r} speaks wire protocol v{int(header['version'])}, this "
                       f"pegaflow-stat v{WIRE_VERSION}: use the pegaflow-stat of the engine's release")
    segment = shm.attach_segment(shm.ipc_name(name, "stats"), readonly=True)
    try:
        record = segment.array(STATS, 1)[0].copy()
        num_slots = (segment.size - STATS.itemsize) // CLIENT_STATS.itemsize
        clients = segment.array(CLIENT_STATS, num_slots, STATS.itemsize).copy()
    finally:
        segment.close()
    snapshot = {key: int(record[key]) for key in STATS_COUNTER_NAMES}
    snapshot["commands_by_opcode"] = {op.name.lower(): int(record["commands_by_opcode"][op])
                                      for op in Opcode}
    snapshot["errors_by_status"] = {st.name.lower(): int(record["errors_by_status"][st])
                                    for st in Status if st != Status.OK}
    snapshot["uptime_s"] = round(max(0, time.time_ns() - snapshot["start_ns"]) / 1e9, 3)
    snapshot["latency"] = {
        op: {"buckets_s": list(LATENCY_BUCKETS_S),
             "counts": record["latency_buckets"][i].tolist(),
             "sum_s": int(record["latency_sum_ns"][i]) / 1e9}
        for i, op in enumerate(LATENCY_OPCODES)}
    snapshot["clients"] = _clients(clients)
    snapshot["name"] = name
    snapshot["wire_version"] = WIRE_VERSION
    snapshot["version"] = package_version()
    # The stats' engine_pid is written once the pool's first chunk is pinned (the backend
    # and that chunk take a moment); until then the control segment's header names the engine.
    pid = snapshot["engine_pid"]
    snapshot["starting"] = pid == 0
    if snapshot["starting"]:
        pid = snapshot["engine_pid"] = 0 if header is None else int(header["engine_pid"])
    snapshot["alive"] = pid == 0 or is_pid_alive(pid)  # 0: not even the header written yet
    beat = snapshot["heartbeat_ns"]
    snapshot["heartbeat_age_s"] = round(max(0, time.time_ns() - beat) / 1e9, 3) if beat else None
    snapshot["responding"] = snapshot["starting"] or (
        beat != 0 and snapshot["heartbeat_age_s"] < stale_after_s)
    return snapshot


def latency_quantile(histogram: dict, q: float) -> float | None:
    """The bucket bound at or under which a fraction ``q`` of a latency histogram's
    commands were answered (seconds; inf for the open last bucket), None for no command."""
    counts = histogram["counts"]
    total = sum(counts)
    if not total:
        return None
    seen = 0
    for bound, count in zip([*histogram["buckets_s"], float("inf")], counts):
        seen += count
        if seen >= q * total:
            return bound
    return float("inf")


def _clients(records: np.ndarray) -> list[dict]:
    """One dict per attached client slot: who it said it is at ATTACH, and what it did."""
    roles = {int(r): r.name.lower() for r in ClientRole}
    kv_roles = {int(r): f"kv_{r.name.lower()}" for r in KvRole}
    out = []
    for slot in np.flatnonzero(records["is_attached"]).tolist():
        r = records[slot]
        role = int(r["role"])
        out.append({"slot": slot, "pid": int(r["pid"]), "role": roles.get(role & 0xFF, "other"),
                    "kv_role": kv_roles.get(role >> KV_ROLE_SHIFT, "kv_both"),
                    "rank": int(r["rank"]), "namespace": f"{int(r['namespace']):016x}",
                    **{key: int(r[key]) for key in ("blocks_saved", "blocks_loaded", "lookups",
                                                    "lookup_hit_blocks", "inflight_copies")}})
    return out


def _control_header(name: str) -> np.void | None:
    """The engine's control header (its pid, wire version), or None where there is none."""
    try:
        control = shm.attach_segment(shm.ipc_name(name, "control"), readonly=True)
    except EngineNotRunningError:
        return None
    try:
        return control.array(CONTROL_HEADER, 1)[0].copy()
    finally:
        control.close()


def kept_pool_blocks(name: str) -> int | None:
    """READY blocks in the pool an engine named ``name`` kept (--keep-pool), or None if it
    left no pool table."""
    try:
        table = shm.attach_segment(shm.ipc_name(name, "pool.table"), readonly=True)
    except (EngineNotRunningError, ShmError):  # none, or not ours to read: nothing to say
        return None
    try:
        header = table.array(POOL_TABLE_HEADER, 1)[0]
        if int(header["magic"]) != MAGIC or int(header["version"]) != POOL_TABLE_VERSION:
            return None  # not a table this version writes (the next engine removes it)
        records = table.array(POOL_RECORD, int(header["num_records"]), POOL_TABLE_HEADER.itemsize)
        count = int((records["state"] == EntryState.READY).sum())
        del header, records
        return count
    except ShmError:  # shorter than its header says: torn, not counted
        return None
    finally:
        table.close()
