"""One block's file on the disk tier: a 4 KiB header, then the block's bytes.

File layout (``block_path``: ``<root>/pegaflow-blocks/<namespace:016x>/<hash[:2]>/<hash>.blk``)::

    0      BLOCK_HEADER (HEADER_BYTES)   magic, version, key, entry_bytes, data checksum, num_layers
    4096   data (entry_bytes)            the pool entry's bytes, as they were

A write goes to ``<file>.tmp`` and is renamed into place, so a torn write never looks like a
block.  Files are made 0600 and directories 0700; only this user's regular files are read
(``ownership.py``).  I/O goes straight between the caller's buffer and the file: O_DIRECT where every
buffer's address and length are 4 KiB multiples and the file system takes it, buffered
otherwise (tmpfs refuses O_DIRECT with EINVAL at open).
"""

from __future__ import annotations

import contextlib
import errno
import mmap
import os
import threading
import time
from pathlib import Path
from typing import NamedTuple

import numpy as np
import xxhash

from pegaflow.platform.errors import WireVersionError
from pegaflow.platform.wire import HASH_BYTES

from ..blocks.entries import Key
from .ownership import DIR_MODE, FILE_MODE, is_own_file

MAGIC = int.from_bytes(b"PFBLOCK1", "little")
BLOCK_VERSION = 1
HEADER_BYTES = 4096
ALIGN_BYTES = 4096
BLOCKS_DIR = "pegaflow-blocks"
BLOCK_SUFFIX = ".blk"
TMP_SUFFIX = ".tmp"
KEY_HASH_BYTES = HASH_BYTES + 1  # the engine's block key: the digest and its length byte

BLOCK_HEADER = np.dtype({
    "names": ["magic", "version", "header_bytes", "namespace", "hash", "entry_bytes", "checksum",
              "written_ns", "num_layers"],
    "formats": ["<u8", "<u4", "<u4", "<u8", f"V{KEY_HASH_BYTES}", "<u8", "<u8", "<u8", "<u4"],
    "offsets": [0, 8, 12, 16, 24, 64, 72, 80, 88],
    "itemsize": HEADER_BYTES,
})
assert BLOCK_HEADER.itemsize == HEADER_BYTES

_O_DIRECT = getattr(os, "O_DIRECT", 0)


class BlockHeader(NamedTuple):
    key: Key
    entry_bytes: int
    checksum: int
    num_layers: int  # the caller's, kept for it (0: not given)


class FoundBlock(NamedTuple):
    """A complete block file that ``list_blocks`` found where its key belongs."""
    key: Key
    file_bytes: int
    num_layers: int
    mtime_ns: int


def checksum(buf) -> int:
    """The data's checksum as stored in the header (xxh3, 64 bits)."""
    return xxhash.xxh3_64_intdigest(buf)


def aligned_buffer(num_bytes: int) -> np.ndarray:
    """A zeroed, page-aligned uint8 array (anonymous mmap), fit for O_DIRECT."""
    return np.frombuffer(mmap.mmap(-1, max(num_bytes, 1)), dtype=np.uint8)[:num_bytes]


def block_path(root: Path, key: Key) -> Path:
    return Path(block_path_text(str(root), key))


def block_path_text(root: str, key: Key) -> str:
    """``block_path`` as a string (the engine thread names thousands a lookup: pathlib's
    joins cost far more; docs/benchmarks.md, "Figures behind the engine's constants")."""
    namespace, block_hash = key
    hex_hash = block_hash.hex()
    return f"{root}/{BLOCKS_DIR}/{namespace:016x}/{hex_hash[:2]}/{hex_hash}{BLOCK_SUFFIX}"


_local = threading.local()


def _header_buffer() -> np.ndarray:
    """This thread's page-aligned header buffer, made once: an mmap and munmap per block
    would cost a page fault each, and the munmap a TLB shootdown across every thread."""
    buf = getattr(_local, "header", None)
    if buf is None:
        buf = _local.header = aligned_buffer(HEADER_BYTES)
    return buf


def encode_header(key: Key, entry_bytes: int, data_checksum: int, num_layers: int = 0,
                  out: np.ndarray | None = None) -> np.ndarray:
    """The header of ``key``'s file, as a page-aligned HEADER_BYTES uint8 array (``out``, or
    a new one)."""
    namespace, block_hash = key
    assert len(block_hash) == KEY_HASH_BYTES, f"a block key's hash has {KEY_HASH_BYTES} bytes"
    raw = aligned_buffer(HEADER_BYTES) if out is None else out
    raw[:] = 0
    record = raw.view(BLOCK_HEADER)[0]
    record["magic"] = MAGIC
    record["version"] = BLOCK_VERSION
    record["header_bytes"] = HEADER_BYTES
    record["namespace"] = namespace
    record["hash"] = np.void(block_hash)
    record["entry_bytes"] = entry_bytes
    record["checksum"] = data_checksum
    record["written_ns"] = time.time_ns()
    record["num_layers"] = num_layers
    return raw


def decode_header(raw) -> BlockHeader:
    """The header in a file's first HEADER_BYTES bytes.

    Raises WireVersionError for a short header, another magic, version or header size."""
    view = memoryview(raw).cast("B")
    if view.nbytes < HEADER_BYTES:
        raise WireVersionError(f"block header is {view.nbytes} bytes, not {HEADER_BYTES}")
    record = np.frombuffer(view, dtype=BLOCK_HEADER, count=1)[0]
    if int(record["magic"]) != MAGIC:
        raise WireVersionError(f"block header magic {int(record['magic']):#x} is not {MAGIC:#x}")
    if int(record["version"]) != BLOCK_VERSION or int(record["header_bytes"]) != HEADER_BYTES:
        raise WireVersionError(f"block file version {int(record['version'])} "
                               f"(header {int(record['header_bytes'])} bytes) is not {BLOCK_VERSION}")
    key = (int(record["namespace"]), record["hash"].tobytes())
    return BlockHeader(key, int(record["entry_bytes"]), int(record["checksum"]), int(record["num_layers"]))


def write_block(path: Path | str, key: Key, src: memoryview, num_layers: int = 0) -> bool:
    """Write ``key``'s file from ``src`` (tmp file, then rename); True if O_DIRECT was used.

    Raises OSError; the tmp file is gone then and no file of ``key`` was made."""
    path = Path(path)  # (on an I/O thread: the engine's names it as a string)
    header = encode_header(key, src.nbytes, checksum(src), num_layers, _header_buffer())
    tmp_path = path.with_name(path.name + TMP_SUFFIX)
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
    try:
        try:
            num_bytes, is_direct = _transfer(tmp_path, flags, [memoryview(header), src], is_write=True)
        except FileNotFoundError:
            make_private_dirs(path.parent)
            num_bytes, is_direct = _transfer(tmp_path, flags, [memoryview(header), src], is_write=True)
        if num_bytes != HEADER_BYTES + src.nbytes:
            raise OSError(errno.EIO, f"short write ({num_bytes} bytes)", str(tmp_path))
        os.rename(tmp_path, path)
    except OSError:
        with contextlib.suppress(OSError):  # it may never have been created
            os.unlink(tmp_path)
        raise
    return is_direct


def make_private_dirs(path: Path) -> None:
    """``path`` and its missing parents, each made 0700 (``mkdir(parents=True)`` makes the
    parents world-readable)."""
    missing = []
    while not path.exists():
        missing.append(path)
        path = path.parent
    for directory in reversed(missing):
        with contextlib.suppress(FileExistsError):  # made meanwhile by another I/O thread
            directory.mkdir(mode=DIR_MODE)


def read_block(path: Path | str, key: Key, dst: memoryview) -> str | None:
    """Read ``key``'s data into ``dst``: None if it checks out, else what is wrong with the file
    (another key, another size, a short file, a checksum mismatch).  Raises OSError."""
    header = _header_buffer()
    num_bytes, _ = _transfer(path, os.O_RDONLY, [memoryview(header), dst], is_write=False)
    if num_bytes < 0:
        return "the file is not a regular file of this user"
    try:
        file_key, entry_bytes, expected, _ = decode_header(header[:num_bytes])
    except WireVersionError as exc:
        return str(exc)
    if file_key != key:
        return "the header names another key"
    if entry_bytes != dst.nbytes:
        return f"the header says {entry_bytes} bytes, not {dst.nbytes}"
    if num_bytes != HEADER_BYTES + entry_bytes:
        return f"the file ends after {num_bytes - HEADER_BYTES} of {entry_bytes} data bytes"
    if checksum(dst) != expected:
        return "the data's checksum does not match the header's"
    return None


def list_blocks(root: Path) -> tuple[list[FoundBlock], list[Path]]:
    """The complete blocks under ``root``, and its leftovers: tmp files, block files with a bad
    header, the wrong size or in the wrong place.  Other files are not ours and not listed."""
    found: list[FoundBlock] = []
    leftovers: list[Path] = []
    for dirpath, _, filenames in os.walk(root / BLOCKS_DIR):
        for name in filenames:
            path = Path(dirpath, name)
            block = _inspect(root, path) if name.endswith(BLOCK_SUFFIX) else None
            if block is not None:
                found.append(block)
            elif name.endswith((BLOCK_SUFFIX, TMP_SUFFIX)):
                leftovers.append(path)
    return found, leftovers


def _inspect(root: Path, path: Path) -> FoundBlock | None:
    try:
        with open(os.open(path, os.O_RDONLY | os.O_NOFOLLOW), "rb", buffering=0) as f:
            raw = f.read(HEADER_BYTES)
            stat = os.fstat(f.fileno())
        header = decode_header(raw)
    except (OSError, WireVersionError):
        return None
    if not is_own_file(stat):
        return None
    if stat.st_size != HEADER_BYTES + header.entry_bytes or block_path(root, header.key) != path:
        return None
    return FoundBlock(header.key, stat.st_size, header.num_layers, stat.st_mtime_ns)


def _is_aligned(views: list[memoryview]) -> bool:
    return all(view.nbytes % ALIGN_BYTES == 0
               and np.frombuffer(view, dtype=np.uint8).ctypes.data % ALIGN_BYTES == 0 for view in views)


def _open(path: Path, flags: int, want_direct: bool) -> tuple[int, bool]:
    flags |= os.O_NOFOLLOW  # (a link is never the engine's: ownership.py)
    if want_direct and _O_DIRECT:
        try:
            return os.open(path, flags | _O_DIRECT, FILE_MODE), True
        except OSError as exc:
            if exc.errno != errno.EINVAL:
                raise
    return os.open(path, flags, FILE_MODE), False


def _transfer(path: Path, flags: int, views: list[memoryview], is_write: bool) -> tuple[int, bool]:
    """Move ``views`` to or from the file's start; (bytes moved, whether O_DIRECT was used).
    A read of a file that is not this user's regular file moves nothing: (-1, False)."""
    fd, is_direct = _open(path, flags, _is_aligned(views))
    try:
        if not is_write and not is_own_file(os.fstat(fd)):
            return -1, False
        return _move_all(fd, views, is_write), is_direct
    finally:
        os.close(fd)


def _move_all(fd: int, views: list[memoryview], is_write: bool) -> int:
    """pwritev/preadv until done or end of file; the bytes moved."""
    views = [view for view in views if view.nbytes]
    offset = 0
    while views:
        num = os.pwritev(fd, views, offset) if is_write else os.preadv(fd, views, offset)
        if num == 0:
            break
        offset += num
        while views and num >= views[0].nbytes:
            num -= views.pop(0).nbytes
        if num:
            views[0] = views[0][num:]
    return offset
