"""Child processes for tests that need a second process (CUDA IPC cannot open a handle in
the process that exported it; rings are tested across processes)."""

from __future__ import annotations

import multiprocessing


def start_child(target, *args):
    """``target(conn, *args)`` in a spawned daemon process: (our end of the pipe, the process)."""
    ctx = multiprocessing.get_context("spawn")
    conn, child = ctx.Pipe()
    proc = ctx.Process(target=target, args=(child, *args), daemon=True)
    proc.start()
    return conn, proc


def stop_child(conn, proc, timeout_s: float) -> None:
    """Send None (every child's "stop"), then the child must exit cleanly within ``timeout_s``."""
    conn.send(None)
    proc.join(timeout_s)
    assert proc.exitcode == 0
