"""engine/copy/releases.py: every release runs even when the driver refuses one (logged, never
raised), and a gone client's releases run off the caller's thread with a bounded wait at the end."""

from __future__ import annotations

import logging
import threading

from engine.copy.releases import Releaser, release_logged
from pegaflow.platform.errors import CudaError


def _refuse(handle):
    raise CudaError(f"cuEventDestroy: CUDA_ERROR_INVALID_HANDLE ({handle})")


def test_release_logged_a_refused_release_is_logged_and_the_rest_still_run(caplog):
    done = []
    assert release_logged([(done.append, "a"), (_refuse, "b"), (done.append, "c")], "slot 4: its events") == 1
    assert done == ["a", "c"]
    assert "slot 4: its events: _refuse failed" in caplog.text and "CUDA_ERROR_INVALID_HANDLE" in caplog.text


def test_releaser_runs_handed_over_releases_in_order_and_closes_once_done():
    done = []
    releaser = Releaser()
    releaser.submit([(done.append, 1), (_refuse, 2)], "first")
    releaser.submit([(done.append, 3)], "second")
    assert releaser.close(30.0)
    assert done == [1, 3] and releaser.num_pending == 0


def test_releaser_close_gives_up_on_a_release_that_never_returns(caplog):
    # A release blocked in the driver: the caller never waits for it, close only up to its bound.
    unblock, entered = threading.Event(), threading.Event()
    releaser = Releaser()
    caplog.set_level(logging.ERROR)
    try:
        releaser.submit([(lambda handle: (entered.set(), unblock.wait(60.0)), "unmap")],
                        "slot 2: a gone client's memory")
        assert entered.wait(30.0) and releaser.num_pending == 1  # submit returned while it runs
        assert not releaser.close(0.05)
        assert "did not end within 0.1 s (1 left, now: slot 2: a gone client's memory)" in caplog.text
    finally:
        unblock.set()
