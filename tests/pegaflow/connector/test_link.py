"""pegaflow.connector.link: a connection that survives the engine, and one the engine refuses."""

from __future__ import annotations

import logging
import time

from pegaflow.connector.link import REFUSED_RETRY_S, EngineLink
from pegaflow.platform.wire import Opcode


def test_link_refused_setup_is_logged_once_as_an_error_and_retried_rarely(engine, caplog):
    # 1. The engine answers our setup with a refusal (a REGISTER it cannot use).
    attempts = []

    def register_garbage(client):
        attempts.append(client.slot)
        client.call(Opcode.REGISTER, timeout_s=2.0)

    caplog.set_level(logging.WARNING, logger="pegaflow.connector.link")
    link = EngineLink(engine.name, 0.01, "test worker", on_connect=register_garbage)
    # 2. No client: an ERROR naming the refusal and where to look, not "unreachable".
    assert link.client() is None and len(attempts) == 1
    errors = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1 and "refused" in errors[0].getMessage()
    assert "REGISTER" in errors[0].getMessage() and "unreachable" not in caplog.text
    # 3. A retry interval of 10 ms is stretched: no new attempt well past it.
    time.sleep(0.05)
    assert REFUSED_RETRY_S >= 60 and link.client() is None and len(attempts) == 1
    # 4. The engine says why, at WARNING, in its own log.
    engine.wait_stats(lambda s: s["errors"] >= 1)
    assert "REGISTER refused" in engine.stderr_text()
    link.close()


def test_link_engine_stopping_during_setup_is_down_not_refused(engine, caplog):
    # An answer that says nothing about our setup (the engine is stopping) is a passing
    # outage: the usual warning and retry period, not a refusal.
    from pegaflow.platform.errors import CommandError
    from pegaflow.platform.wire import Status

    def stopping(client):
        raise CommandError(Status.SHUTTING_DOWN, "REGISTER failed: SHUTTING_DOWN")

    caplog.set_level(logging.WARNING, logger="pegaflow.connector.link")
    link = EngineLink(engine.name, 0.01, "test worker", on_connect=stopping)
    assert link.client() is None
    assert "unreachable" in caplog.text and not [r for r in caplog.records if r.levelno >= logging.ERROR]
    link.close()


def test_link_refusal_after_an_outage_is_still_reported(engine, caplog):
    # 1. The engine is first unreachable (a passing outage: one warning)...
    from pegaflow.platform.errors import CommandError, EngineNotRunningError
    from pegaflow.platform.wire import Status
    answers = [EngineNotRunningError("not yet"), CommandError(Status.BAD_ARGUMENT, "REGISTER: no")]

    def setup(client):
        raise answers.pop(0)

    caplog.set_level(logging.WARNING, logger="pegaflow.connector.link")
    link = EngineLink(engine.name, 0.01, "test worker", on_connect=setup)
    assert link.client() is None and "unreachable" in caplog.text
    # 2. ...then it answers with a refusal: that is still said, as an ERROR.
    time.sleep(0.02)
    assert link.client() is None
    assert [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR][0].count("refused") == 1
    link.close()


def test_link_closed_never_connects_again(engine):
    # 1. A link is connected, then closed by its owner (a connector shutting down).
    attempts = []
    link = EngineLink(engine.name, 0.0, "test worker", on_connect=lambda c: attempts.append(c.slot))
    assert link.client() is not None and len(attempts) == 1
    link.close()
    # 2. A later call (a second shutdown collecting answers) answers None and does not
    #    attach again: a closed connector's buffers may be gone, and registering them
    #    would offer the engine memory nobody maps.
    assert link.client() is None and link.client() is None and len(attempts) == 1
