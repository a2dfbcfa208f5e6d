"""The layout of the stats segment (``stats``): one STATS record of counters, gauges and
latency histograms, then one CLIENT_STATS record per client slot.  Written by the engine
only (``engine/stats.py``); ``pegaflow-stat`` reads it without attaching.  Part of the
wire's fingerprint (``wire.py``)."""

from __future__ import annotations

from pegaflow.platform.records import struct_dtype

# heartbeat_ns: the last housekeeping pass (every housekeeping_s to 2.5 s, clients attached
# or not): older than a few seconds means a stopped or stuck engine.  pool_bytes_ready: the
# pool's part pinned and in use (below pool_bytes_capacity while the rest is pinned in the
# background); pool_pin_ns: how long pinning the whole pool took (0 until it is done).
_STATS_COUNTERS = [
    "engine_pid", "start_ns", "heartbeat_ns",
    "commands", "errors",
    "blocks_saved", "bytes_saved", "blocks_loaded", "bytes_loaded",
    "save_dedup_blocks", "save_dropped_blocks",
    # voting (module docstring): blocks a voter's SAVE vouched for without copying them (its
    # vote on another voter's copy), and blocks a SAVE left alone for another tag's copy
    "save_votes", "save_vote_conflicts",
    "lookups", "lookup_blocks", "lookup_hit_blocks",
    "evictions", "lease_expiries",
    "pool_bytes_used", "pool_bytes_capacity", "pool_bytes_ready", "pool_pin_ns", "pool_blocks_used",
    "leases_active", "clients_attached", "inflight_copies",
    # claims refused and clients closed for what they wrote into shared memory (a pid not
    # theirs, a slot state rewritten, no ATTACH within the attach timeout)
    "clients_refused",
    # the disk tier (all 0 without one): bytes and blocks on disk, blocks written from the
    # pool and read (promoted) back into it, their bytes and I/O time, blocks found corrupt
    # (checksum or key) and I/O errors (each a miss), writes refused for room
    "disk_bytes_used", "disk_bytes_capacity", "disk_blocks_used",
    "disk_blocks_written", "disk_bytes_written", "disk_write_ns",
    "disk_blocks_read", "disk_bytes_read", "disk_read_ns",
    "disk_checksum_failures", "disk_io_errors", "disk_writes_refused", "disk_evictions",
    "lookup_disk_blocks", "disk_late_loads",
    # the remote tier (all 0 without one): blocks published to the store and fetched back,
    # their bytes and time (summed over batches), put failures and puts dropped for a full
    # queue, lookups that asked the store and the blocks it held, fetched blocks found
    # corrupt or gone mid-fetch (each a miss), lookups answered past the store's deadline
    # or while it was unreachable, and store calls that failed
    "remote_enabled", "remote_blocks_put", "remote_bytes_put", "remote_put_ns", "remote_put_failures",
    "remote_puts_dropped", "remote_lookups", "remote_lookup_ns", "lookup_remote_blocks",
    "remote_blocks_fetched", "remote_bytes_fetched", "remote_fetch_ns", "remote_fetch_failures",
    "remote_checksum_failures", "remote_lookup_timeouts", "remote_errors",
    # LOOKUPs that waited for saves in flight or not yet read (``engine/commands/lookup_waits.py``),
    # the blocks the wait gained them, those answered at the deadline with the READY part, the
    # time waited, and LOOKUPs answered at once because too many were waiting
    "lookup_waits", "lookup_wait_blocks", "lookup_wait_timeouts", "lookup_wait_ns",
    "lookup_waits_refused",
    # compute once (``engine/prefill_claims.py``): claims made and the blocks they claimed;
    # LOOKUPs that waited for another instance's claim, the blocks and tokens that wait served
    # them (computed once, not again), the time waited; LOOKUPs that reached a claim and did
    # not wait (longer than computing); claims past their deadline; claims that ended before
    # their blocks were saved (claimer gone, request aborted or preempted, a save failed)
    "claims", "claim_blocks", "claim_waits", "claim_wait_blocks", "claim_tokens_saved", "claim_wait_ns",
    "claim_declines", "claim_timeouts", "claims_dropped",
    # RESETs (``engine/commands/reset.py``): namespaces emptied, the pool's blocks they dropped,
    # of those the ones still in use then (freed when let go), and the disk tier's blocks
    "resets", "reset_blocks_dropped", "reset_blocks_held", "reset_disk_blocks_dropped",
]
NUM_OPCODE_COUNTERS = 16
NUM_STATUS_COUNTERS = 16
# Engine-side latency (receipt to answer) of the commands on vLLM's path, per opcode: counts
# per bucket (not cumulative), the last bucket open-ended, and the sum in nanoseconds.
LATENCY_OPCODES = ("lookup", "load", "save")
LATENCY_BUCKETS_S = (25e-6, 50e-6, 100e-6, 250e-6, 500e-6, 1e-3, 2.5e-3, 5e-3, 10e-3, 25e-3,
                     50e-3, 100e-3, 250e-3, 1.0)
NUM_LATENCY_BUCKETS = len(LATENCY_BUCKETS_S) + 1
_OPCODE_COUNTERS_AT = 8 * len(_STATS_COUNTERS)
_STATUS_COUNTERS_AT = _OPCODE_COUNTERS_AT + 8 * NUM_OPCODE_COUNTERS
_LATENCY_AT = _STATUS_COUNTERS_AT + 8 * NUM_STATUS_COUNTERS
_LATENCY_SUM_AT = _LATENCY_AT + 8 * NUM_LATENCY_BUCKETS * len(LATENCY_OPCODES)
STATS = struct_dtype(
    [(name, "<u8", 8 * i) for i, name in enumerate(_STATS_COUNTERS)]
    + [("commands_by_opcode", f"({NUM_OPCODE_COUNTERS},)<u8", _OPCODE_COUNTERS_AT),
       ("errors_by_status", f"({NUM_STATUS_COUNTERS},)<u8", _STATUS_COUNTERS_AT),
       ("latency_buckets", f"({len(LATENCY_OPCODES)},{NUM_LATENCY_BUCKETS})<u8", _LATENCY_AT),
       ("latency_sum_ns", f"({len(LATENCY_OPCODES)},)<u8", _LATENCY_SUM_AT)],
    _LATENCY_SUM_AT + 8 * len(LATENCY_OPCODES),
)
STATS_COUNTER_NAMES = tuple(_STATS_COUNTERS)

# One record per client slot after STATS; zeroed when the slot is freed.  ``rank``,
# ``namespace`` and ``role`` are what the client said at ATTACH (a worker: its TP/PP rank
# index and namespace; a scheduler: its first rank's namespace).
CLIENT_STATS = struct_dtype([
    ("pid", "<u4", 0),
    ("role", "<u2", 4),
    ("rank", "<u2", 6),
    ("namespace", "<u8", 8),
    ("blocks_saved", "<u8", 16),
    ("blocks_loaded", "<u8", 24),
    ("lookups", "<u8", 32),
    ("lookup_hit_blocks", "<u8", 40),
    ("inflight_copies", "<u8", 48),
    ("is_attached", "<u4", 56),
], 64)

assert CLIENT_STATS.itemsize == 64
assert STATS.itemsize == 8 * (len(_STATS_COUNTERS) + NUM_OPCODE_COUNTERS + NUM_STATUS_COUNTERS
                             + (NUM_LATENCY_BUCKETS + 1) * len(LATENCY_OPCODES))
