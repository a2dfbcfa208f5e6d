"""The engine's stop: copies in flight finished (within SHUTDOWN_DRAIN_S), every command not
answered yet answered SHUTTING_DOWN, the threads that use the pool stopped, and its shared
memory unlinked (the pool left mapped while a thread may still use it)."""

from __future__ import annotations

import logging
import time

logger = logging.getLogger(__name__)

SHUTDOWN_DRAIN_S = 5.0


def shut_down(server) -> None:
    """``EngineServer.shutdown``: its loop has ended."""
    logger.info("engine %r stopping", server.config.name)
    server.segments.mark_stopping()
    pinner_stopped = server.pinner.stop()  # before the backend closes: it unpins only what is over
    dispatcher = server.dispatcher
    for received in dispatcher.transfers.parked.take_all():  # waiting for disk reads
        dispatcher.answer_stopping(received)
    for waiting in dispatcher.waiting.take_all():  # LOOKUPs waiting for saves
        dispatcher.answer_stopping(waiting.received)
    is_disk_stopped = server.disk is None or server.disk.close()  # its I/O uses the pool's pages
    is_disk_stopped = (server.remote is None or server.remote.close()) and is_disk_stopped
    deadline = time.monotonic() + SHUTDOWN_DRAIN_S
    while server.backend.num_inflight() and time.monotonic() < deadline:
        for done in server.backend.poll():
            server.dispatcher.on_copy_done(done)
        time.sleep(1e-3)
    for client in server.table.clients.values():
        while (rec := client.submissions.try_get()) is not None:
            dispatcher.answer_stopping(dispatcher.received_unread(client, rec))
        client.flush()
    if not pinner_stopped or not is_disk_stopped:  # a thread may still use the pool: leave it to the exit
        logger.error("engine %r: the pool's %s thread is still running; the pool stays "
                     "mapped until the process exits", server.config.name,
                     "pinning" if not pinner_stopped else "disk or remote I/O")
        server.segments.unlink_all(release_pool=False)
        return
    is_closed = False
    try:
        server.backend.close()
        is_closed = True
    finally:  # a backend that failed to close: its shared memory and lock files go all the same
        server.segments.unlink_all(release_pool=is_closed and server.backend.num_inflight() == 0)
    logger.info("engine %r stopped; its shared memory is unlinked", server.config.name)
