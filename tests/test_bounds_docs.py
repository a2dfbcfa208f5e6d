"""docs/security.md and docs/disaggregation.md state every bound and timeout with its default:
each figure here is read from the code that holds it and must stand in the row (or line) of
the page that names it, so a constant changed without its page fails."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

DOCS = Path(__file__).resolve().parents[1] / "docs"


def _row(page: str, first_cell: str) -> str:
    """The one table row of ``page`` whose first cell starts with ``first_cell``."""
    rows = [line for line in (DOCS / page).read_text().splitlines()
            if line.startswith("| " + first_cell)]
    assert len(rows) == 1, f"{page}: {len(rows)} rows start with {first_cell!r}"
    return rows[0]


def _security_rows() -> list[tuple[str, list[str]]]:
    from engine.clients.client import MAX_UNREAD_ANSWERS
    from engine.clients.client_table import ATTACH_TIMEOUT_S
    from engine.commands import lookup_waits as waits
    from engine.commands.issuing import ISSUE_SLICE_S, TOUCH_STEP
    from engine.commands.load_waits import PARKED_LOAD_DEADLINE_S
    from engine.commands.pending_copy import FIRST_CHUNK, MAX_CHUNK
    from engine.commands.slow_commands import REFUSAL_EVERY_S, REPORT_EVERY_S, SLOW_COMMAND_S
    from engine.commands.transfers import LOAD_OP_BLOCKS
    from engine.config import MAX_LOOKUP_WAIT_S, EngineConfig
    from engine.process.server import LIVENESS_ONLY_S
    defaults = EngineConfig()
    return [
        ("LOOKUPs parked waiting for saves, one client", [
            f"{waits.MAX_WAITING_PER_CLIENT:,}, and {waits.MAX_WAITING_KEYS_PER_CLIENT:,} "
            f"(2^{int(math.log2(waits.MAX_WAITING_KEYS_PER_CLIENT))}) hashes", "`WAIT_REFUSED`"]),
        ("LOOKUPs parked, every client", [
            f"{waits.MAX_WAITING:,}, and {waits.MAX_WAITING_KEYS:,} "
            f"(2^{int(math.log2(waits.MAX_WAITING_KEYS))}) hashes"]),
        ("a parked LOOKUP's wait", [
            f"`--lookup-wait-ms` ({defaults.lookup_wait_s * 1e3:g} ms; at most {MAX_LOOKUP_WAIT_S:g} s)",
            f"own `wait_ms` (at most {MAX_LOOKUP_WAIT_S:g} s)"]),
        ("a block being written that no copy fills", [f"{waits.ABANDONED_WRITE_S:g} s after it began"]),
        ("a dead client", [f"every {defaults.housekeeping_s:g} s while", f"else every {LIVENESS_ONLY_S:g} s"]),
        ("a claim never ATTACHed", [f"{ATTACH_TIMEOUT_S:g} s"]),
        ("answers queued behind a full completion ring", [f"{MAX_UNREAD_ANSWERS:,} per client"]),
        ("one command's handling", [
            f"at most {ISSUE_SLICE_S * 1e3:g} ms a loop turn", f"chunks of {FIRST_CHUNK} doubling to {MAX_CHUNK:,}",
            f"ops of {LOAD_OP_BLOCKS:,} blocks", f"{TOUCH_STEP:,} keys a step"]),
        ("a LOAD waiting for the disk tier's reads", [f"| {PARKED_LOAD_DEADLINE_S:g} s |"]),
        ("WARNING for a refused ATTACH", [f"every {REFUSAL_EVERY_S:g} s"]),
        ("WARNING for commands that held up the loop", [f"(over {SLOW_COMMAND_S * 1e3:g} ms)",
                                                        f"one every {REPORT_EVERY_S:g} s"]),
    ]


def _duration_rows() -> list[tuple[str, list[str]]]:
    from engine import config
    from pegaflow.stats.cli import MAX_INTERVAL_S, MAX_STALE_AFTER_S
    return [
        ("engine `--lease-ttl`", [f"(0, {config.MAX_LEASE_TTL_S:g}] seconds"]),
        ("engine `--idle-spin-ms`", [f"[0, {config.MAX_IDLE_SPIN_S * 1e3:g}]"]),
        ("engine `--remote-timeout-ms`", [f"(0, {config.MAX_REMOTE_TIMEOUT_S * 1e3:g}]"]),
        ("engine `--lookup-wait-ms`", [f"[0, {config.MAX_LOOKUP_WAIT_S * 1e3:g}]"]),
        ("engine `--remote-start-timeout`", [f"(0, {config.MAX_REMOTE_START_TIMEOUT_S:g}] seconds"]),
        ("`pegaflow-stat --interval`", [f"(0, {MAX_INTERVAL_S:g}] seconds"]),
        ("`pegaflow-stat --stale-after`", [f"(0, {MAX_STALE_AFTER_S:g}] seconds"]),
    ]


def _proxy_rows() -> list[tuple[str, list[str]]]:
    from pegaflow.proxy.app import HEALTH_TIMEOUT_S, PREFILL_ANSWER_MAX_BYTES
    from pegaflow.proxy.config import ProxyConfig
    proxy = ProxyConfig(("http://p",), ("http://d",))
    return [
        ("`--idle-timeout-s`", [f"| {proxy.idle_timeout_s:g} |"]),
        ("`--body-timeout-s`", [f"| {proxy.body_timeout_s:g} |"]),
        ("`--max-body-size`", [f"| {proxy.max_body_bytes >> 20}MiB |"]),
        ("`--max-body-bytes-in-flight`", [f"| {proxy.max_body_bytes_in_flight >> 20}MiB |"]),
        ("`--max-in-flight`", [f"| {proxy.max_in_flight} |"]),
        ("`--prefill-timeout-s`", [f"| {proxy.prefill_timeout_s:g} |"]),
        ("`--prefill-retry-s`", [f"| {proxy.prefill_retry_s:g} |"]),
        ("`--decode-timeout-s`", [f"| {proxy.decode_timeout_s:g} |"]),
        ("(fixed) | 1 MiB", [f"| {PREFILL_ANSWER_MAX_BYTES >> 20} MiB |", "prefill answer"]),
        ("(fixed) | 5 s", [f"| {HEALTH_TIMEOUT_S:g} s |", "`/health`"]),
    ]


@pytest.mark.parametrize("page, rows", [("security.md", _security_rows), ("security.md", _duration_rows),
                                        ("disaggregation.md", _proxy_rows)],
                         ids=["security-bounds", "security-durations", "disaggregation-proxy"])
def test_bounds_docs_rows_state_the_codes_defaults(page, rows):
    for first_cell, figures in rows():
        row = _row(page, first_cell)
        for figure in figures:
            assert figure in row, f"{page}: the row of {first_cell!r} lacks {figure!r}:\n{row}"


def test_bounds_docs_prose_states_the_codes_defaults():
    # The figures said in sentences: the lease TTL, the proxy's usage line and its failing
    # rule, the waiting LOOKUPs' bounds in disaggregation.md, the fixed attach timeout.
    from engine.clients.client_table import ATTACH_TIMEOUT_S
    from engine.commands import lookup_waits as waits
    from engine.config import EngineConfig
    from pegaflow.proxy.app import MODELS_ANSWER_MAX_BYTES
    from pegaflow.proxy.config import ProxyConfig
    from pegaflow.proxy.routing import FAILURES_TO_DEGRADE
    security, disaggregation = (DOCS / "security.md").read_text(), (DOCS / "disaggregation.md").read_text()
    flat = " ".join(disaggregation.split())  # (sentences wrap)
    assert f"`--lease-ttl`, {EngineConfig().lease_ttl_s:g} s by default" in " ".join(security.split())
    assert f"The attach timeout ({ATTACH_TIMEOUT_S:g} s) is fixed." in security
    proxy = ProxyConfig(("http://p",), ("http://d",))
    for flag, value in (("--prefill-timeout-s", f"{proxy.prefill_timeout_s:g}"),
                        ("--prefill-retry-s", f"{proxy.prefill_retry_s:g}"),
                        ("--decode-timeout-s", f"{proxy.decode_timeout_s:g}"),
                        ("--idle-timeout-s", f"{proxy.idle_timeout_s:g}"),
                        ("--body-timeout-s", f"{proxy.body_timeout_s:g}"),
                        ("--max-body-size", f"{proxy.max_body_bytes >> 20}MiB"),
                        ("--max-body-bytes-in-flight", f"{proxy.max_body_bytes_in_flight >> 20}MiB"),
                        ("--max-in-flight", f"{proxy.max_in_flight}")):
        assert f"[{flag} {value}]" in flat, f"disaggregation.md's usage lacks [{flag} {value}]"
    assert f"whose last {FAILURES_TO_DEGRADE} requests failed" in flat
    assert f"at most {MODELS_ANSWER_MAX_BYTES >> 20} MiB" in flat
    assert f"At most {waits.MAX_WAITING_PER_CLIENT} LOOKUPs of one client and {waits.MAX_WAITING:,} of all" in flat
