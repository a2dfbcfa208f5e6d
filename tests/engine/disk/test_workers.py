"""engine/disk/workers.py: a lookup's reads go before queued writes; a failed read or write is
a result with its error, never an exception; every result wakes the engine; a close may drop
what is queued and says whether its threads stopped.  The file I/O itself is replaced here
(blockfile's own tests: test_blockfile.py)."""

from __future__ import annotations

import errno
import logging
import threading
import time

from engine.disk import workers as workers_module
from engine.disk.workers import DiskJob, IoWorkers

WAIT_S = 30.0


class FakeFiles:
    """blockfile's read and write, recording the order of the jobs run; the first one holds
    its thread until ``release`` is set."""

    def __init__(self, monkeypatch, fail: dict[str, OSError] | None = None):
        self.order: list[str] = []
        self.started, self.release = threading.Event(), threading.Event()
        self.fail = fail or {}
        monkeypatch.setattr(workers_module.blockfile, "read_block", self._read)
        monkeypatch.setattr(workers_module.blockfile, "write_block", self._write)

    def _run(self, path: str):
        if not self.order:
            self.started.set()
            assert self.release.wait(WAIT_S)
        self.order.append(path)
        if path in self.fail:
            raise self.fail[path]

    def _read(self, path, key, buf):
        self._run(path)
        return None

    def _write(self, path, key, buf, num_layers):
        self._run(path)


def _job(token: int, is_read: bool, path: str) -> DiskJob:
    return DiskJob(token, (1, bytes(33)), is_read, path, memoryview(bytearray(64)))


def _results(workers: IoWorkers, count: int) -> list:
    done, deadline = [], time.monotonic() + WAIT_S
    while len(done) < count:
        assert time.monotonic() < deadline, f"{len(done)} of {count} results"
        done += list(workers.take_results())
        time.sleep(0.001)
    return done


def test_io_workers_run_queued_reads_before_queued_writes(monkeypatch):
    files = FakeFiles(monkeypatch)
    woken = []
    workers = IoWorkers(1, wake=lambda: woken.append(1))
    try:
        # 1. A write holds the one thread; two writes and then two reads queue behind it.
        workers.submit(_job(0, False, "w0"))
        assert files.started.wait(WAIT_S)
        for token, is_read, path in ((1, False, "w1"), (2, False, "w2"), (3, True, "r3"), (4, True, "r4")):
            workers.submit(_job(token, is_read, path))
        files.release.set()
        # 2. The reads (a LOAD waits on them) go first, each kind in the order submitted.
        done = _results(workers, 5)
        assert files.order == ["w0", "r3", "r4", "w1", "w2"]
        assert [d.token for d in done] == [0, 3, 4, 1, 2] and len(woken) == 5
        assert all(d.error is None and d.num_bytes == 64 for d in done)
    finally:
        files.release.set()
        assert workers.close(WAIT_S)


def test_io_workers_failed_io_is_a_result_and_each_errno_warns_once(monkeypatch, caplog):
    full = OSError(errno.ENOSPC, "No space left on device")
    files = FakeFiles(monkeypatch, fail={"w1": full, "w2": full})
    files.release.set()
    workers = IoWorkers(1)
    caplog.set_level(logging.DEBUG, logger=workers_module.__name__)
    try:
        for token, path in ((1, "w1"), (2, "w2"), (3, "w3")):
            workers.submit(_job(token, False, path))
        done = _results(workers, 3)
        assert [(d.token, d.num_bytes, d.error is None) for d in done] == [(1, 0, False), (2, 0, False), (3, 64, True)]
        assert "No space left" in done[0].error
        assert [r.levelno for r in caplog.records if "disk write failed" in r.message] == [logging.WARNING,
                                                                                          logging.DEBUG]
    finally:
        assert workers.close(WAIT_S)


def test_io_workers_close_dropping_queued_jobs_says_a_busy_thread_is_still_running(monkeypatch):
    files = FakeFiles(monkeypatch)
    workers = IoWorkers(1)
    workers.submit(_job(0, True, "r0"))
    assert files.started.wait(WAIT_S)
    workers.submit(_job(1, True, "r1"))
    # 1. The thread is busy past the close's wait: not stopped, and the queued read dropped.
    assert workers.close(0.01, drop_queued=True) is False
    # 2. Once its job ends the thread stops, never having run the dropped read.
    files.release.set()
    for thread in workers._threads:
        thread.join(WAIT_S)
        assert not thread.is_alive()
    assert files.order == ["r0"] and [d.token for d in workers.take_results()] == [0]


def test_io_workers_close_runs_the_queued_jobs_first(monkeypatch):
    files = FakeFiles(monkeypatch)
    files.release.set()
    workers = IoWorkers(1)
    for token in range(3):
        workers.submit(_job(token, False, f"w{token}"))
    assert workers.close(WAIT_S)
    assert files.order == ["w0", "w1", "w2"]
