"""``pegaflow-proxy`` as a process (``python -m pegaflow.proxy``) in front of fake servers,
all on 127.0.0.1: slow connections past its open-file limit, an endless prefill answer,
failed accepts logged as one line."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import resource
import socket
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
import pytest

from pegaflow.proxy.serve import AcceptFailureLog
from tests.pegaflow.proxy.fakes import FakeServer, serve, url

MAX_RSS_BYTES = 500 << 20
NORMAL_REQUEST_TIMEOUT_S = 30.0  # generous for a loaded machine; the old proxy answered after 75 s


@contextlib.asynccontextmanager
async def _proxy_process(prefill: str, decode: str, log_path: Path, open_files: tuple[int, int], *flags):
    """The proxy as a child process with RLIMIT_NOFILE ``open_files`` (soft, hard); its port."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "pegaflow.proxy", "--port", str(port), "--prefill", prefill,
             "--decode", decode, *flags], stdout=log, stderr=subprocess.STDOUT,
            preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, open_files))
    try:
        deadline = time.monotonic() + 30
        while True:
            assert proc.poll() is None, log_path.read_text()
            with contextlib.suppress(OSError):
                _, writer = await asyncio.open_connection("127.0.0.1", port)
                writer.close()
                break
            assert time.monotonic() < deadline, "the proxy did not listen within 30 s"
            await asyncio.sleep(0.1)
        yield proc, port
    finally:
        proc.kill()
        proc.wait()


async def _open_slow_connections(port: int, num: int) -> list[asyncio.StreamWriter]:
    """``num`` callers that send half a request and wait: half stop inside the head, half
    inside the body.  Those the proxy cannot accept yet wait in its listen queue, or fail."""
    heads = [b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nX-Slow: ",
             b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n{"]
    writers = []
    for i in range(num):
        with contextlib.suppress(OSError, asyncio.TimeoutError):
            _, writer = await asyncio.wait_for(asyncio.open_connection("127.0.0.1", port), 2)
            writer.write(heads[i % 2])
            writers.append(writer)
    return writers


async def _trickle(writers: list[asyncio.StreamWriter]) -> None:
    """One more byte from every slow caller every half second, while the test runs."""
    while True:
        await asyncio.sleep(0.5)
        for writer in writers:
            if not writer.is_closing():
                writer.write(b"a")  # (a header value or a body that grows, never ends)


async def _normal_requests(port: int, num: int) -> list[tuple[int, float]]:
    """(status, seconds) of ``num`` requests sent one after another, each while the slow
    callers hold on."""
    results = []
    async with aiohttp.ClientSession() as session:
        for i in range(num):
            started = time.monotonic()
            async with session.post(f"http://127.0.0.1:{port}/v1/completions", json={"prompt": f"n{i}"},
                                    timeout=aiohttp.ClientTimeout(total=NORMAL_REQUEST_TIMEOUT_S)) as answer:
                await answer.read()
                results.append((answer.status, time.monotonic() - started))
    return results


def _slow_connection_scenario(tmp_path: Path, num_slow: int, open_files: tuple[int, int], *flags):
    async def scenario():
        log = []
        servers = await serve(FakeServer("p", log), FakeServer("d", log))
        try:
            async with _proxy_process(url(servers[0]), url(servers[1]), tmp_path / "proxy.log",
                                      open_files, *flags) as (proc, port):
                slow = await _open_slow_connections(port, num_slow)
                trickle = asyncio.ensure_future(_trickle(slow))
                try:
                    return len(slow), await _normal_requests(port, 5)
                finally:
                    trickle.cancel()
                    for writer in slow:
                        writer.close()
        finally:
            for server in servers:
                await server.close()

    return asyncio.run(scenario())


@pytest.fixture
def open_files_for(request):
    """This test process's own soft open-file limit raised for ``num`` sockets (restored
    after); skips where the hard limit is too low."""
    saved = resource.getrlimit(resource.RLIMIT_NOFILE)

    def ensure(num: int) -> None:
        soft, hard = saved
        if hard != resource.RLIM_INFINITY and hard < num:
            pytest.skip(f"needs {num} open files, the hard limit is {hard}")
        if soft != resource.RLIM_INFINITY and soft < num:
            resource.setrlimit(resource.RLIMIT_NOFILE, (num, hard))

    yield ensure
    resource.setrlimit(resource.RLIMIT_NOFILE, saved)


@pytest.mark.slow
def test_serve_1100_slow_connections_past_soft_open_file_limit_normal_requests_answered(tmp_path, open_files_for):
    # The proxy starts with a soft limit of 1024 open files and a hard one of 4096, as many
    # hosts give; 1,100 slow callers would exhaust 1024 (the proxy raises its soft limit).
    open_files_for(2048)
    num_slow, answers = _slow_connection_scenario(tmp_path, 1100, (1024, 4096))
    log = (tmp_path / "proxy.log").read_text()
    assert num_slow == 1100
    assert [status for status, _ in answers] == [200] * 5, log[-2000:]
    assert "open-file limit 4096" in log and "Traceback" not in log


@pytest.mark.slow
def test_serve_slow_connections_at_hard_open_file_limit_are_cut_by_timeouts(tmp_path, open_files_for):
    # Here the proxy cannot raise its limit (256, soft and hard): 300 slow callers exhaust
    # it, and only the idle and body timeouts free descriptors for the normal requests.
    # Failed accepts meanwhile log a line per 10 s, no traceback.
    open_files_for(1024)
    num_slow, answers = _slow_connection_scenario(tmp_path, 300, (256, 256), "--idle-timeout-s", "2",
                                                  "--body-timeout-s", "2")
    log = (tmp_path / "proxy.log").read_text()
    assert num_slow > 256
    assert [status for status, _ in answers] == [200] * 5, log[-2000:]
    assert "Traceback" not in log
    assert 1 <= log.count("not accepted") <= 1 + NORMAL_REQUEST_TIMEOUT_S * 5 / 10


def _rss_bytes(pid: int, key: str = "VmRSS") -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no {key} for pid {pid}")


def test_serve_endless_prefill_answer_keeps_the_proxy_under_500_mb(tmp_path):
    async def scenario():
        log = []
        servers = await serve(FakeServer("p", log, mode="endless"), FakeServer("d", log))
        try:
            async with _proxy_process(url(servers[0]), url(servers[1]), tmp_path / "proxy.log",
                                      resource.getrlimit(resource.RLIMIT_NOFILE)) as (proc, port):
                # A watchdog: a proxy past the bound is killed at once (the old one reached
                # 3 GB in 3 s), so the requests below fail rather than fill the machine.
                async def watchdog():
                    while proc.poll() is None and _rss_bytes(proc.pid) < MAX_RSS_BYTES:
                        await asyncio.sleep(0.01)
                    proc.kill()

                guard = asyncio.ensure_future(watchdog())
                try:
                    answers = await _normal_requests(port, 3)
                    return answers, _rss_bytes(proc.pid, "VmHWM")
                finally:
                    guard.cancel()
        finally:
            for server in servers:
                await server.close()

    answers, peak_rss = asyncio.run(scenario())
    assert [status for status, _ in answers] == [200] * 3
    assert peak_rss < MAX_RSS_BYTES


def test_accept_failure_log_is_one_line_per_period_and_passes_other_errors_on(caplog):
    loop = asyncio.new_event_loop()
    try:
        handler = AcceptFailureLog(open_files_limit=256, every_s=3600)
        out_of_files = OSError(errno.EMFILE, "Too many open files")
        with caplog.at_level(logging.WARNING):
            for _ in range(1000):
                handler(loop, {"message": "socket.accept() out of system resource", "exception": out_of_files})
            handler(loop, {"message": "something else", "exception": ValueError("other")})
    finally:
        loop.close()
    lines = [r for r in caplog.records if "not accepted" in r.getMessage()]
    assert len(lines) == 1 and not lines[0].exc_info
    assert "Too many open files (open-file limit 256)" in lines[0].getMessage()
    assert handler.num_failures == 999  # counted, for the next line
    assert any("something else" in r.getMessage() for r in caplog.records if r.levelno == logging.ERROR)


def test_serve_malformed_requests_get_400_and_one_log_line_each_without_traceback(tmp_path):
    async def scenario():
        log = []
        servers = await serve(FakeServer("p", log), FakeServer("d", log))
        try:
            async with _proxy_process(url(servers[0]), url(servers[1]), tmp_path / "proxy.log",
                                      resource.getrlimit(resource.RLIMIT_NOFILE)) as (proc, port):
                answers = []
                for _ in range(20):  # (a folded header line: not valid HTTP/1.1)
                    reader, writer = await asyncio.open_connection("127.0.0.1", port)
                    writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n folded\r\n\r\n")
                    answers.append(await asyncio.wait_for(reader.read(100), 20))
                    writer.close()
                return answers, await _normal_requests(port, 1)
        finally:
            for server in servers:
                await server.close()

    answers, normal = asyncio.run(scenario())
    log = (tmp_path / "proxy.log").read_text()
    assert all(answer.split(b"\r\n")[0].endswith(b" 400 Bad Request") for answer in answers), answers
    assert normal[0][0] == 200
    assert "Traceback" not in log and "ERROR" not in log
    assert log.count("Error handling request") == 20
