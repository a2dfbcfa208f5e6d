"""pegaflow.connector.save_ledger: when a held request's blocks may be freed."""

from __future__ import annotations

from pegaflow.connector.save_ledger import SaveLedger
from pegaflow.connector.stats import PegaKVConnectorStats
from pegaflow.platform.protocol import Completion
from pegaflow.platform.wire import Opcode, Status


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


def test_save_ledger_done_through_is_the_last_step_with_no_save_out():
    from types import SimpleNamespace

    from pegaflow.connector.save_ledger import SaveLedger
    from pegaflow.connector.stats import PegaKVConnectorStats
    ledger = SaveLedger(PegaKVConnectorStats())
    ok = SimpleNamespace(is_ok=True, status="OK", result=SimpleNamespace(num_stored=1, num_deduped=0,
                                                                         num_dropped=0))
    ledger.new_step(1)              # no save
    ledger.new_step(2)
    ledger.sent(20, ("a",))         # step 2's SAVE
    ledger.new_step(3)
    ledger.sent(30, ("b",))         # step 3's SAVE
    ledger.new_step(4)              # no save
    assert ledger.done_through() == 1
    ledger.answered(30, ok)         # a later step's answer first: step 2 still holds the line
    assert ledger.done_through() == 1
    ledger.answered(20, ok)
    assert ledger.done_through() == 4
    ledger.new_step(5)
    ledger.sent(50, ("c",))
    ledger.forget()                 # the link dropped (and revoked) it: nothing reads the blocks
    assert ledger.done_through() == 5
