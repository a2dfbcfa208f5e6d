import numpy as np

from pegaflow.client.answers import Answers
from pegaflow.platform.protocol import completion_of
from pegaflow.platform.wire import COMPLETION, Status


def _answer(request_id: int, status: Status = Status.OK):
    record = np.zeros(1, dtype=COMPLETION)[0]
    record["command_id"], record["status"] = request_id, int(status)
    return completion_of(record)


def test_answers_kept_answer_is_taken_once():
    answers = Answers()
    answers.keep(_answer(3))
    assert answers.take(3).command_id == 3
    assert answers.take(3) is None


def test_answers_ignored_answer_is_dropped_on_arrival():
    answers = Answers()
    answers.ignore(4)
    assert not answers.is_awaited(4)
    answers.keep(_answer(4, Status.BAD_ARGUMENT))
    assert answers.take(4) is None and answers.take_orphans() == []
    assert answers.is_awaited(4)  # dropped once; the id is nobody's now


def test_answers_abandoned_answer_becomes_an_orphan_whether_read_before_or_after():
    answers = Answers()
    answers.keep(_answer(5))
    answers.abandon(5)   # read already
    answers.abandon(6)   # not yet arrived
    assert not answers.is_awaited(6)
    answers.keep(_answer(6))
    assert sorted(c.command_id for c in answers.take_orphans()) == [5, 6]
    assert answers.take(5) is None and answers.take(6) is None and answers.take_orphans() == []
