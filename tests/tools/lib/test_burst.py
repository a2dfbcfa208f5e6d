"""tools/lib/burst.py: the burst's requests, sent at once to their replicas (fake servers that
answer only once every request has arrived), and its accounting."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from tools.lib import burst
from tools.lib.evidence import tokens_sha256
from tools.serving_workload import RequestResult

DOC_TOKENS, QUESTION_TOKENS = 64, 8


class BurstReplica(BaseHTTPRequestHandler):
    """A replica that holds every completion of a burst's length until all the burst's requests
    (over every replica) have arrived (a barrier the servers share: requests sent one after
    another never all arrive, and the barrier breaks), then answers with the prompt's first
    ``max_tokens`` ids.  Its usage says a document is cached on every replica but the first to
    be sent it (``server.computed``: the documents computed, shared by the replicas).  Other
    requests (a warm-up) are answered at once; its /metrics is empty."""

    def log_message(self, *args):
        pass

    def do_GET(self):
        self.send_response(200)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        prompt = body["prompt"]
        if len(prompt) != DOC_TOKENS + QUESTION_TOKENS:
            self.server.warmups += 1
            self._answer(prompt[:body["max_tokens"]], len(prompt), 0)
            return
        with self.server.lock:
            self.server.received.append(prompt)
            doc = tuple(prompt[:DOC_TOKENS])
            cached = DOC_TOKENS if doc in self.server.computed else 0
            self.server.computed.add(doc)
        try:
            self.server.arrived.wait()
        except threading.BrokenBarrierError:
            self.send_response(503)
            self.end_headers()
            return
        self._answer(prompt[:body["max_tokens"]], len(prompt), cached)

    def _answer(self, tokens: list[int], prompt_tokens: int, cached: int) -> None:
        chunks = [{"choices": [{"token_ids": tokens}]},
                  {"choices": [], "usage": {"prompt_tokens": prompt_tokens,
                                            "prompt_tokens_details": {"cached_tokens": cached}}}]
        text = "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Content-Length", str(len(text)))
        self.end_headers()
        self.wfile.write(text.encode())


class BurstFleet:
    """``num_replicas`` ``BurstReplica`` servers sharing one barrier of ``expected`` requests."""

    def __init__(self, num_replicas: int, expected: int):
        arrived, computed, lock = threading.Barrier(expected, timeout=10.0), set(), threading.Lock()
        self.servers = []
        for _ in range(num_replicas):
            server = ThreadingHTTPServer(("127.0.0.1", 0), BurstReplica)
            server.arrived, server.computed, server.lock, server.received = arrived, computed, lock, []
            server.warmups = 0
            threading.Thread(target=server.serve_forever, daemon=True).start()
            self.servers.append(server)

    def port(self, replica: int) -> int:
        return self.servers[replica].server_address[1]

    def counters(self) -> dict[int, dict[str, float]]:
        return {r: {} for r in range(len(self.servers))}

    def close(self) -> None:
        for server in self.servers:
            server.shutdown()
            server.server_close()


@pytest.fixture
def fleet3x2():
    made = BurstFleet(2, expected=3 * 2)
    yield made
    made.close()


def test_burst_requests_send_every_document_to_every_replica_with_its_own_question():
    requests = burst.burst_requests(3, DOC_TOKENS, 2, QUESTION_TOKENS, seed=5)
    # 1. Request (d, r): document d, replica r, one each.
    assert [(q.key, q.doc, q.replica) for q in requests] == [
        ("b0r0", 0, 0), ("b1r0", 1, 0), ("b2r0", 2, 0), ("b0r1", 0, 1), ("b1r1", 1, 1), ("b2r1", 2, 1)]
    # 2. The two requests of a document share its tokens and differ in their questions; the
    #    documents differ.
    docs = {q.doc: q.prompt[:DOC_TOKENS] for q in requests}
    assert len({tuple(d) for d in docs.values()}) == 3
    assert all(len(q.prompt) == DOC_TOKENS + QUESTION_TOKENS and q.prompt[:DOC_TOKENS] == docs[q.doc]
               for q in requests)
    assert len({tuple(q.prompt[DOC_TOKENS:]) for q in requests}) == 6
    # 3. The same seed, the same burst (a configuration's answers are compared with none's).
    assert burst.burst_requests(3, DOC_TOKENS, 2, QUESTION_TOKENS, seed=5) == requests
    # 4. Each document once and every question: what computing each token once costs.
    assert burst.unique_prompt_tokens(3, DOC_TOKENS, 2, QUESTION_TOKENS) == 3 * DOC_TOKENS + 6 * QUESTION_TOKENS


def test_send_burst_has_every_request_in_flight_at_once_each_at_its_replica(fleet3x2):
    # 1. The servers answer nothing until all six requests have arrived: the burst is answered
    #    whole (requests sent a few at a time would break their barrier: HTTP 503).
    requests = burst.burst_requests(3, DOC_TOKENS, 2, QUESTION_TOKENS, seed=1)
    results = burst.send_burst(fleet3x2.port, requests, max_tokens=4)
    assert [r.error for r in results] == [""] * 6
    # 2. Each replica got exactly its own requests: every document, with its questions.
    for replica, server in enumerate(fleet3x2.servers):
        assert sorted(server.received) == sorted(q.prompt for q in requests if q.replica == replica)
    # 3. Results come back in the order of the requests, with their keys and answers.
    assert [r.key for r in results] == [q.key for q in requests]
    assert all(r.tokens == q.prompt[:4] for q, r in zip(requests, results))


def test_burst_figures_count_what_the_replicas_computed_against_the_unique_tokens(fleet3x2):
    # 1. Each document computed by the replica sent it first, served to the other (the fake's
    #    usage): computed = every document once and every question, the unique tokens exactly.
    requests = burst.burst_requests(3, DOC_TOKENS, 2, QUESTION_TOKENS, seed=1)
    results = burst.send_burst(fleet3x2.port, requests, max_tokens=4)
    unique = burst.unique_prompt_tokens(3, DOC_TOKENS, 2, QUESTION_TOKENS)
    figures = burst.burst_figures(requests, results, 2, unique)
    assert figures["prefill_tokens_computed"] == unique == 3 * 64 + 6 * 8
    assert figures["computed_per_unique"] == 1.0
    assert sum(figures["per_replica_computed"]) == unique and figures["errors"] == 0
    assert figures["wall_s"] > 0 and figures["ttft_p99_ms"] >= figures["ttft_p50_ms"] > 0
    assert [a["tokens_sha256"] for a in figures["answers"]] == [tokens_sha256(q.prompt[:4]) for q in requests]


def _result(key: str, prompt_tokens: int, cached: int | None, tokens=(1, 2), error: str = "") -> RequestResult:
    return RequestResult(key, prompt_tokens, list(tokens), 10.0, 10.5, 11.0, error=error, cached_tokens=cached)


def test_burst_figures_every_replica_computing_every_document_is_twice_the_unique_tokens():
    # 1. No cache shared: each replica computes each document (100 tokens, 10 of question).
    requests = [burst.BurstRequest(f"b{d}r{r}", d, r, [0] * 110) for r in range(2) for d in range(2)]
    results = [_result(q.key, 110, 0) for q in requests]
    figures = burst.burst_figures(requests, results, 2, burst.unique_prompt_tokens(2, 100, 2, 10))
    assert figures["prefill_tokens_computed"] == 440 and figures["unique_prompt_tokens"] == 240
    assert figures["per_replica_computed"] == [220, 220]
    # 2. A request whose answer did not say what was cached, or that failed: not counted as
    #    computed nothing; the total is unknown.
    for bad in (_result("b0r0", 110, None), _result("b0r0", 110, 0, tokens=(), error="HTTP 500")):
        figures = burst.burst_figures(requests, [bad] + results[1:], 2, 240)
        assert figures["prefill_tokens_computed"] is None and figures["computed_per_unique"] is None


def test_burst_identical_share_matches_answers_by_key():
    requests = [burst.BurstRequest(f"b0r{r}", 0, r, [0] * 8) for r in range(2)]
    reference = burst.burst_figures(requests, [_result("b0r0", 8, 0, (1, 2)), _result("b0r1", 8, 0, (3, 4))], 2, 8)
    same = burst.burst_figures(requests[::-1], [_result("b0r1", 8, 0, (3, 4)), _result("b0r0", 8, 0, (1, 2))], 2, 8)
    wrong = burst.burst_figures(requests, [_result("b0r0", 8, 0, (1, 2)), _result("b0r1", 8, 0, (3, 5))], 2, 8)
    failed = burst.burst_figures(requests, [_result("b0r0", 8, 0, (1, 2)), _result("b0r1", 8, 0, (), "x")], 2, 8)
    assert burst.identical_share(same, reference) == 1.0
    assert burst.identical_share(wrong, reference) == 0.5
    assert burst.identical_share(failed, reference) == 0.5
    other = burst.burst_figures([burst.BurstRequest("b9r0", 9, 0, [0])], [_result("b9r0", 1, 0)], 1, 1)
    assert burst.identical_share(other, reference) is None
