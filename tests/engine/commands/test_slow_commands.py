"""engine/commands/slow_commands.py: a command whose handling held up the engine's loop is logged."""

from __future__ import annotations

import logging
import os
import threading
import time

from engine.commands.slow_commands import REPORT_EVERY_S, SLOW_COMMAND_S, SlowCommands
from engine.config import EngineConfig
from engine.process.server import EngineServer
from pegaflow.client.connection import EngineClient
from pegaflow.platform.wire import Opcode


def test_slow_commands_report_counts_per_opcode_and_the_slowest_at_most_every_interval(caplog):
    slow = SlowCommands()
    assert not slow.report(100.0)  # nothing noted: no line
    slow.note(int(Opcode.LOAD), 0.120, slot=3, num_items=514)
    slow.note(int(Opcode.LOAD), 0.030, slot=1, num_items=64)
    slow.note(int(Opcode.LOOKUP), 0.025, slot=0, num_items=520)
    with caplog.at_level(logging.WARNING, logger="engine.commands.slow_commands"):
        assert slow.report(100.0)
    line = caplog.records[-1].getMessage()
    assert "3 command(s) took over 20 ms" in line and "(2 LOAD, 1 LOOKUP)" in line
    assert "LOAD of 514 items from slot 3, 120.0 ms (0.0 ms of it issuing copies)" in line
    # The next report waits REPORT_EVERY_S, and says only what came since.
    slow.note(int(Opcode.SAVE), 0.040, slot=2, num_items=9)
    assert not slow.report(100.0 + REPORT_EVERY_S / 2)
    assert slow.report(100.0 + REPORT_EVERY_S)
    assert "(1 SAVE)" in caplog.records[-1].getMessage() and slow.num_reported == 4


def test_engine_notes_a_command_that_held_its_loop():
    # An engine whose PING handler comes to take 1.5x SLOW_COMMAND_S: that PING is noted,
    # with its slot (the quick PINGs before it, in the microseconds, are not: a stall of the
    # test machine's scheduler could note one, so this counts PINGs from the slow one on).
    server = EngineServer(EngineConfig(name=f"t{os.getpid()}_slow", backend="host", pool_bytes=4 << 20,
                                       slab_bytes=1 << 20, num_slots=2), serve_own_process=True)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        client = EngineClient.connect(server.config.name, timeout_s=10.0)
        for _ in range(20):
            client.ping()
        quick = server.slow.by_opcode.get("PING", 0)
        handler = server.dispatcher.handlers[Opcode.PING]

        def slow_ping(received, command):
            time.sleep(1.5 * SLOW_COMMAND_S)
            return handler(received, command)

        server.dispatcher.handlers[Opcode.PING] = slow_ping
        client.ping()
        deadline = time.monotonic() + 10.0  # noted just after its answer went out
        while server.slow.by_opcode.get("PING", 0) == quick and time.monotonic() < deadline:
            time.sleep(1e-3)
        assert server.slow.by_opcode["PING"] == quick + 1 and server.slow.slowest_s >= 1.5 * SLOW_COMMAND_S
        assert "PING of 0 items from slot" in server.slow.slowest
        client.close()
    finally:
        server.request_stop()
        thread.join(10)
    assert not thread.is_alive()


def test_engine_says_how_much_of_a_slow_save_went_to_issuing_its_copies(kv_client, rng, make_hashes, caplog):
    # An engine whose copy backend takes 25x SLOW_COMMAND_S to issue each op: a SAVE is noted,
    # and the report puts that time in the copy issue, not the engine's bookkeeping.  (25x: a
    # loaded machine's REGISTER has taken 47 ms, and the slowest command is the one reported.)
    delay_s = 25 * SLOW_COMMAND_S
    server = EngineServer(EngineConfig(name=f"t{os.getpid()}_slowsave", backend="host", pool_bytes=4 << 20,
                                       slab_bytes=1 << 20, num_slots=2), serve_own_process=True)
    submit = server.dispatcher.transfers.backend.submit

    def slow_submit(op):
        time.sleep(delay_s)
        submit(op)

    server.dispatcher.transfers.backend.submit = slow_submit
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        kv = kv_client(server.config)  # (it reads the engine's name)
        kv.fill(rng, range(2))
        assert kv.save(0x51, range(2), make_hashes(2)).value == 2
        deadline = time.monotonic() + 10.0  # noted just after its answer went out
        while "SAVE" not in server.slow.by_opcode and time.monotonic() < deadline:
            time.sleep(1e-3)
        assert server.slow.slowest.startswith("SAVE of 2 items")
        assert delay_s <= server.slow.slowest_issue_s <= server.slow.slowest_s
        with caplog.at_level(logging.WARNING, logger="engine.commands.slow_commands"):
            assert server.slow.report(time.monotonic())
        issued = float(caplog.records[-1].getMessage().split("(")[-1].split(" ms of it issuing copies")[0])
        assert issued >= delay_s * 1e3
        kv.close()
    finally:
        server.request_stop()
        thread.join(10)
    assert not thread.is_alive()


def test_refused_commands_forget_clients_not_refused_lately(caplog):
    # Thousands of clients refused once each (a fuzzer, clients coming and going): once past
    # 4096 remembered, those not refused within the interval are forgotten.
    from types import SimpleNamespace

    from engine.commands.slow_commands import REFUSAL_EVERY_S, RefusedCommands
    refusals = RefusedCommands()
    with caplog.at_level(logging.WARNING, logger="engine.commands.slow_commands"):
        for uid in range(5000):
            refusals.note(SimpleNamespace(uid=uid, slot=0, pid=1), int(Opcode.ATTACH), "why", 100.0)
        assert len(caplog.records) == 5000 and len(refusals.last) == 5000
        refusals.note(SimpleNamespace(uid=-1, slot=0, pid=1), int(Opcode.ATTACH), "why", 100.0 + REFUSAL_EVERY_S)
    assert len(refusals.last) == 1
