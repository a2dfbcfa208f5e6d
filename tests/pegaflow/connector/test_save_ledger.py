"""pegaflow.connector.save_ledger: when a held request's blocks may be freed."""

from __future__ import annotations

from pegaflow.completion import Completion
from pegaflow.connector.save_ledger import SaveLedger
from pegaflow.connector.stats import PegaKVConnectorStats
from pegaflow.wire import Opcode, Status


def _answer(request_id, stored=2, dropped=0, status=Status.OK):
    return Completion(request_id, Opcode.SAVE, status, stored, stored, 0, dropped)


def test_save_ledger_held_request_is_finished_once_its_last_save_is_answered():
    # 1. Request a is in two SAVEs, b in one; vLLM holds both for us.
    ledger = SaveLedger(PegaKVConnectorStats())
    ledger.sent(1, ("a", "b"))
    ledger.sent(2, ("a",))
    ledger.held |= {"a", "b"}
    assert ledger.take_finished() == set() and ledger.is_saving({"a"})
    # 2. The first answer frees b only; the second frees a.
    ledger.answered(1, _answer(1))
    assert ledger.take_finished() == {"b"} and ledger.is_saving({"a"})
    ledger.answered(2, _answer(2, dropped=1))
    assert ledger.take_finished() == {"a"} and not ledger.held
    # 3. What was stored and dropped reaches vLLM's metrics; a short SAVE is counted.
    assert ledger.stats.data["saved_blocks"] == 4 and ledger.stats.data["save_dropped_blocks"] == 1
    assert ledger.num_short == 1 and len(ledger.stats.data["save_s"]) == 2


def test_save_ledger_forget_frees_every_held_request():
    # A dropped connection revoked our saves: nothing reads the blocks any more.
    ledger = SaveLedger(PegaKVConnectorStats())
    ledger.sent(7, ("x",))
    ledger.held.add("x")
    ledger.forget()
    assert ledger.take_finished() == {"x"} and not ledger.commands
