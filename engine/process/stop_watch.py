"""The engine's stop signals, taken by a thread of their own, so that a stop ends within a
bound even while the loop's thread is stuck in a driver call (a Python signal handler runs in
that thread, only once the call returns: maybe never).

    StopWatch(server).start()   SIGTERM and SIGINT (blocked in every thread since start-up)
                                waited for with ``sigwait``; the first asks the loop to stop
                                (``request_stop``).  If the engine has not stopped
                                ``STOP_GRACE_S`` later, and is not giving its memory back
                                (its names are gone by then: that only takes time), every
                                thread's stack goes to stderr, the engine's names are removed
                                from /dev/shm (``EngineSegments.unlink_names``) and the process
                                exits at once with status 1: the kernel and the driver free
                                the rest.
    done()                      the stop is over: no exit is forced
"""

from __future__ import annotations

import faulthandler
import logging
import os
import signal
import sys
import threading

from pegaflow.platform.cli import EXIT_FAILED

logger = logging.getLogger(__name__)

STOP_SIGNALS = {signal.SIGTERM, signal.SIGINT}
STOP_GRACE_S = 8.0  # past the bounded waits of a stop (copies 5 s, then the backend's close)


class StopWatch:
    def __init__(self, server, grace_s: float = STOP_GRACE_S) -> None:
        self.server, self.grace_s = server, grace_s
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="pegaflow-stop", daemon=True)

    def start(self) -> None:
        """(From the main thread.)  A thread started before the stop signals were blocked
        (an embedder's, or one an import started ahead of ``engine.__main__``) would take them
        with their default action, killing the engine with nothing removed: a handler asks the
        loop to stop instead, as the watch's thread does with the signals it takes."""
        for signum in STOP_SIGNALS:
            signal.signal(signum, self._handle)
        self._thread.start()

    def _handle(self, signum: int, _frame) -> None:
        logger.info("%s: stopping", signal.Signals(signum).name)
        self.server.request_stop()

    def done(self) -> None:
        self._stopped.set()

    def _watch(self) -> None:
        signum = signal.sigwait(STOP_SIGNALS)
        logger.info("%s: stopping", signal.Signals(signum).name)
        self.server.request_stop()
        if self._stopped.wait(self.grace_s) or self.server.segments.is_unlinking:
            return  # (giving the pool's memory back takes as long as it takes, names gone)
        logger.error("the engine did not stop within %.1f s of %s (a call that never returns, "
                     "its stack below): removing its names from /dev/shm and exiting",
                     self.grace_s, signal.Signals(signum).name)
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        try:
            self.server.segments.unlink_names()
        finally:
            logging.shutdown()
            os._exit(EXIT_FAILED)
