"""pegaflow.platform.wire: descriptor layouts, the fingerprint that guards them, and hash records."""

from __future__ import annotations

import enum
import os
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pegaflow.platform import wire

DESCRIPTORS = {
    "CONTROL_HEADER": (wire.CONTROL_HEADER, 128),
    "SLOT": (wire.SLOT, 32),
    "RING_HEADER": (wire.RING_HEADER, 64),
    "SUBMISSION": (wire.SUBMISSION, 64),
    "COMPLETION": (wire.COMPLETION, 48),
    "HASH": (wire.HASH, 40),
    "REGION": (wire.REGION, 248),
    "LAYER": (wire.LAYER, 24),
    "EVENT_HANDLE": (wire.EVENT_HANDLE, 64),
}


@pytest.mark.parametrize("name", DESCRIPTORS)
def test_wire_descriptor_itemsize_is_the_documented_one(name):
    dtype, itemsize = DESCRIPTORS[name]
    # 1. The record size other processes (and other versions) rely on.
    assert dtype.itemsize == itemsize


@pytest.mark.parametrize("name", [*DESCRIPTORS, "STATS"])
def test_wire_descriptor_fields_are_aligned_and_disjoint(name):
    dtype = getattr(wire, name)
    fields = sorted((offset, sub.itemsize, sub.base.alignment, field)
                    for field, (sub, offset, *_) in dtype.fields.items())
    end = 0
    for offset, size, alignment, field in fields:
        # 1. Each field starts after the previous one ends and inside the record...
        assert offset >= end, f"{name}.{field} overlaps the field before it"
        # 2. ...on its natural alignment (8-byte words are written and read whole).
        assert offset % alignment == 0, f"{name}.{field} at {offset} is not {alignment}-aligned"
        end = offset + size
    assert end <= dtype.itemsize


@pytest.mark.parametrize("dtype", [wire.SUBMISSION, wire.COMPLETION], ids=["SUBMISSION", "COMPLETION"])
def test_wire_ring_records_start_with_an_8_byte_seq(dtype):
    # 1. The ring publishes a record by its first word: an aligned little-endian u8.
    assert dtype.fields["seq"][1] == 0
    assert dtype.fields["seq"][0] == np.dtype("<u8")


def test_wire_stats_has_the_counters_pegaflow_stat_promises():
    # 1. The keys the issue names for ``pegaflow-stat --json``, and one word per counter.
    for name in ("blocks_saved", "blocks_loaded", "lookup_hit_blocks", "pool_bytes_used",
                 "pool_bytes_capacity", "leases_active", "clients_attached", "evictions"):
        assert name in wire.STATS_COUNTER_NAMES
        assert wire.STATS.fields[name][0] == np.dtype("<u8")


def test_wire_opcodes_and_statuses_have_their_own_counter():
    # 1. The last counter of each array is the "anything else" bucket; no real code may share it.
    assert max(wire.Opcode) < wire.NUM_OPCODE_COUNTERS - 1
    assert max(wire.Status) < wire.NUM_STATUS_COUNTERS - 1
    # 2. Codes fit the 16-bit fields they travel in.
    assert max(wire.Opcode) < 2**16 and max(wire.Status) < 2**16


# -- fingerprint ----------------------------------------------------------------------------


def test_wire_fingerprint_recomputes_to_the_same_value():
    # 1. Nothing changed: the same fingerprint.
    assert wire._fingerprint() == wire.FINGERPRINT


def test_wire_fingerprint_is_the_same_in_another_process():
    # 1. Another interpreter with another hash seed computes the same value (no ``hash()``).
    code = "from pegaflow.platform.wire import FINGERPRINT; print(FINGERPRINT)"
    env = dict(os.environ, PYTHONHASHSEED="12345")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         check=True, timeout=60)
    assert int(out.stdout) == wire.FINGERPRINT


def _variant(dtype: np.dtype, field: str = "", fmt: str = "", offset: int = -1, itemsize: int = 0) -> np.dtype:
    """``dtype`` with one field's format or offset, or the record size, changed."""
    names = list(dtype.names)
    formats = [fmt if n == field and fmt else dtype.fields[n][0] for n in names]
    offsets = [offset if n == field and offset >= 0 else dtype.fields[n][1] for n in names]
    return np.dtype({"names": names, "formats": formats, "offsets": offsets,
                     "itemsize": itemsize or dtype.itemsize})


CHANGED_DTYPES = {
    "submission_arg_signed": ("SUBMISSION", dict(field="arg", fmt="<i8")),
    "completion_value3_signed": ("COMPLETION", dict(field="value3", fmt="<i8")),
    "hash_length_u2": ("HASH", dict(field="length", fmt="<u2")),
    "region_name_shorter": ("REGION", dict(field="shm_name", fmt="S64")),
    "region_gpu_uuid_moved": ("REGION", dict(field="gpu_uuid", offset=240, itemsize=256)),
    "slot_claim_ns_moved": ("SLOT", dict(field="claim_ns", offset=24)),
    "control_header_grown": ("CONTROL_HEADER", dict(itemsize=256)),
    "stats_pid_signed": ("STATS", dict(field="engine_pid", fmt="<i8")),
}


@pytest.mark.parametrize("case", CHANGED_DTYPES)
def test_wire_fingerprint_changes_when_a_descriptor_changes(case, monkeypatch):
    name, change = CHANGED_DTYPES[case]
    # 1. Replace one descriptor with a variant (a type, an offset or a size differs).
    changed = _variant(getattr(wire, name), **change)
    assert changed != getattr(wire, name)
    monkeypatch.setattr(wire, name, changed)
    # 2. The fingerprint an engine of that layout would publish differs from ours.
    assert wire._fingerprint() != wire.FINGERPRINT


def test_wire_fingerprint_changes_with_the_wire_version(monkeypatch):
    monkeypatch.setattr(wire, "WIRE_VERSION", wire.WIRE_VERSION + 1)
    assert wire._fingerprint() != wire.FINGERPRINT


def test_wire_fingerprint_changes_when_an_opcode_is_added(monkeypatch):
    # A client of this version that knows no RESET (RESET came within version 16) is told
    # at attach by the fingerprint, not by an engine answering BAD_OPCODE later.
    without_reset = enum.IntEnum("Opcode", [(m.name, int(m)) for m in wire.Opcode if m is not wire.Opcode.RESET])
    monkeypatch.setattr(wire, "Opcode", without_reset)
    assert wire._fingerprint() != wire.FINGERPRINT


def _renumbered(enum_type: type[enum.Enum]) -> type[enum.Enum]:
    """The same enum with its last member's value moved (what a careless edit would do)."""
    members = [(m.name, int(m.value)) for m in enum_type]
    members[-1] = (members[-1][0], members[-1][1] + 64)
    base = enum.IntFlag if issubclass(enum_type, enum.IntFlag) else enum.IntEnum
    return base(enum_type.__name__, members)


@pytest.mark.parametrize("enum_name", ["Opcode", "Status", "SlotState", "RegionKind", "CommandFlag"])
def test_wire_fingerprint_changes_when_a_wire_enum_is_renumbered(enum_name, monkeypatch):
    # 1. Each of these enums' values crosses the process boundary (a field or the slot table).
    monkeypatch.setattr(wire, enum_name, _renumbered(getattr(wire, enum_name)))
    # 2. So renumbering one must change the fingerprint, or two versions attach silently.
    assert wire._fingerprint() != wire.FINGERPRINT


def test_wire_region_names_its_gpu_by_uuid_and_keeps_the_clients_ordinal_for_messages_only():
    # 1. No field a reader could take for the engine's device number (v16: it was ``device``).
    assert "device" not in wire.REGION.names and "client_device" in wire.REGION.names
    # 2. The UUID's 16 raw bytes, and a host stand-in of that size that prints as such.
    assert wire.REGION.fields["gpu_uuid"][0] == np.dtype(f"V{wire.GPU_UUID_BYTES}") and wire.GPU_UUID_BYTES == 16
    assert len(wire.HOST_GPU_UUID) == wire.GPU_UUID_BYTES and wire.gpu_uuid_text(wire.HOST_GPU_UUID) == "host"
    assert wire.WIRE_VERSION >= 16


def test_wire_gpu_uuid_text_is_written_as_nvidia_smi_and_cuda_visible_devices_write_it():
    uuid = bytes.fromhex("5e1f0c2a9b7d4e61a3c8f0d2b4e6a8c0")
    assert wire.gpu_uuid_text(uuid) == "GPU-5e1f0c2a-9b7d-4e61-a3c8-f0d2b4e6a8c0"


# -- hash records ---------------------------------------------------------------------------

hash_bytes = st.binary(min_size=1, max_size=wire.HASH_BYTES)


@settings(max_examples=60, deadline=None)
@given(hashes=st.lists(hash_bytes, max_size=40))
def test_wire_hash_records_round_trip_through_keys(hashes):
    # 1. Encode and key the hashes.
    records = wire.encode_hashes(hashes)
    keys = wire.hash_keys(records)
    assert records.dtype == wire.HASH and len(keys) == len(hashes)
    # 2. Each key holds its hash's bytes, zero padding, and the length.
    for h, key, record in zip(hashes, keys, records):
        assert int(record["length"]) == len(h)
        assert key[:len(h)] == h
        assert key[len(h):wire.HASH_BYTES] == bytes(wire.HASH_BYTES - len(h))
        assert key[wire.HASH_BYTES] == len(h)
    # 3. Equal hashes give equal keys, different hashes different keys.
    assert len(set(keys)) == len(set(hashes))


@settings(max_examples=60, deadline=None)
@given(h=st.binary(min_size=1, max_size=wire.HASH_BYTES // 2))
def test_wire_short_hash_and_its_zero_padded_long_form_never_collide(h):
    # 1. A 16-byte hash and the 32-byte hash of the same bytes plus zeros: same digest bytes.
    short = h.ljust(16, b"\0")
    long = short + bytes(16)
    # 2. Their keys differ (the length is part of the key), whether encoded apart or together.
    [short_key], [long_key] = wire.hash_keys(wire.encode_hashes([short])), wire.hash_keys(wire.encode_hashes([long]))
    assert short_key != long_key
    assert len(set(wire.hash_keys(wire.encode_hashes([short, long])))) == 2


def test_wire_hash_keys_same_for_uniform_and_mixed_length_batches():
    # 1. A batch of one length and a batch of mixed lengths key the same hash the same way.
    h16, h32 = b"\x01" * 16, b"\x02" * 32
    uniform = wire.hash_keys(wire.encode_hashes([h16, h16]))
    mixed = wire.hash_keys(wire.encode_hashes([h16, h32]))
    assert uniform[0] == mixed[0]


def test_wire_hash_keys_of_a_zero_length_record_keep_all_their_bytes():
    # 1. A malformed record (length 0, digest ending in zeros) next to a good one.
    records = wire.encode_hashes([b"\x05" * 32, b"\x06" * 32])
    records["length"][1] = 0
    raw = records.view(np.uint8).reshape(2, wire.HASH.itemsize)
    raw[1, 16:wire.HASH_BYTES] = 0
    # 2. Every key is still digest plus length, byte for byte.
    keys = wire.hash_keys(records)
    assert keys == [b"\x05" * 32 + b"\x20", b"\x06" * 16 + bytes(17)]


@pytest.mark.parametrize("hashes", [[b""], [b"\x01" * 33], [b"\x01" * 16, b""], [b"\x01" * 16, b"\x02" * 40],
                                    [b"\x01" * 33, b"\x02" * 33]],
                         ids=["empty", "33_bytes", "mixed_with_empty", "mixed_with_40", "uniform_33"])
def test_wire_encode_hashes_bad_length_raises_value_error(hashes):
    with pytest.raises(ValueError, match="block hash"):
        wire.encode_hashes(hashes)


def test_wire_encode_hashes_empty_list_gives_no_records():
    records = wire.encode_hashes([])
    assert len(records) == 0 and wire.hash_keys(records) == []


def test_wire_every_named_result_fits_a_completion_and_decodes_by_name():
    # Each opcode's named values fit the three value words, and a Completion decodes them.
    from pegaflow.platform.protocol import ANSWERS, Completion
    from pegaflow.platform.wire import Opcode, Status
    RESULT_FIELDS = {opcode: answer._fields for opcode, answer in ANSWERS.items() if answer._fields}
    assert all(1 <= len(fields) <= 3 for fields in RESULT_FIELDS.values())
    done = Completion(1, Opcode.SAVE, Status.OK, 5, 3, 1, 1)
    assert (done.result.num_stored, done.result.num_deduped, done.result.num_dropped) == (3, 1, 1)
    lookup = Completion(2, Opcode.LOOKUP, Status.OK, 4, 4, 77, 0).result
    assert (lookup.num_hit_blocks, lookup.lease_id) == (4, 77)
    assert Completion(3, Opcode.RELEASE, Status.OK, 0, 0, 0, 0).result == ()


def test_wire_records_name_their_command_id_as_such():
    # The id a COMPLETION echoes is the client's count of its commands (v14 renamed the field
    # from request_id, which a reader took for vLLM's request id).
    assert "command_id" in wire.SUBMISSION.names and "command_id" in wire.COMPLETION.names
    assert "request_id" not in wire.SUBMISSION.names + wire.COMPLETION.names
    assert wire.WIRE_VERSION >= 14
