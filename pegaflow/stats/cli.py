"""``pegaflow-stat``: a read-only view of a running engine's counters.

    pegaflow-stat                 live view, one line a second with rates (like nvidia-smi dmon);
                                  it waits for an engine not running, and goes on when one is
    pegaflow-stat --once          one snapshot, human readable
    pegaflow-stat --once --json   one JSON object
    pegaflow-stat --serve-metrics [HOST:]PORT    Prometheus metrics at /metrics
"""

from __future__ import annotations

import json
import os
import sys
import time

from pegaflow.platform.cli import EXIT_FAILED, EXIT_NOT_RESPONDING, EXIT_OK, EXIT_USAGE, ArgumentParser, say
from pegaflow.platform.errors import (
    ConfigError,
    EngineDeadError,
    EngineNotRespondingError,
    EngineNotRunningError,
    ShmError,
)
from pegaflow.platform.shm import check_engine_name
from pegaflow.platform.values import format_size, version_line
from pegaflow.stats.engine_stats import STALE_AFTER_S, kept_pool_blocks, latency_quantile, read_stats
from pegaflow.stats.in_place_caches import in_place_note

PROG = "pegaflow-stat"
MAX_INTERVAL_S = 3600.0
MAX_STALE_AFTER_S = 3600.0  # the engine beats every 2.5 s at most: an hour of silence is a dead engine

# The live view's rates, a second: blocks saved, loaded, hit by lookups and evicted; lookups
# and errors (commands)
_RATES = [("blocks_saved", "saved blk/s"), ("blocks_loaded", "loaded blk/s"), ("lookups", "lookups/s"),
          ("lookup_hit_blocks", "hit blk/s"), ("evictions", "evicted blk/s"), ("errors", "errors/s")]


def _read_live(name: str, stale_after_s: float = STALE_AFTER_S) -> dict:
    snapshot = read_stats(name, stale_after_s)
    if snapshot["alive"] and not snapshot["responding"]:
        raise EngineNotRespondingError(
            f"engine {name!r} (pid {snapshot['engine_pid']}) is not responding: its last "
            f"heartbeat is {snapshot['heartbeat_age_s']:.0f}s old (stopped with SIGSTOP, or "
            f"stuck); vLLM serves without its cache meanwhile")
    if not snapshot["alive"]:
        raise EngineDeadError(
            f"engine {name!r} (pid {snapshot['engine_pid']}) is not running: what is left is the "
            f"shared memory of a crash (these counters are its last); starting an engine named "
            f"{name!r} removes it, so does `pegaflow-engine --clean {name}`")
    return snapshot


def format_once(s: dict) -> str:
    if s["starting"] and s["alive"]:
        return f"engine {s['name']!r} is starting (preparing its pool)"
    lines = [f"engine {s['name']!r} pid {s['engine_pid']} up {s['uptime_s']:.0f}s, "
             f"{s['clients_attached']} clients, {s['leases_active']} leases "
             f"(pegaflow {s['version']}, wire v{s['wire_version']})",
             f"pool    {format_size(s['pool_bytes_used'])} / {format_size(s['pool_bytes_capacity'])}, "
             f"{s['pool_blocks_used']} blocks, {s['evictions']} evictions",
             *pool_ready_lines(s),
             *disk_lines(s),
             *remote_lines(s),
             f"saved   {s['blocks_saved']} blocks ({format_size(s['bytes_saved'])}), "
             f"{s['save_dedup_blocks']} deduped, {s['save_dropped_blocks']} dropped"
             + (f", {s['save_votes']} votes, {s['save_vote_conflicts']} vote conflicts"
                if s.get("save_votes") or s.get("save_vote_conflicts") else ""),
             f"loaded  {s['blocks_loaded']} blocks ({format_size(s['bytes_loaded'])})",
             f"lookups {s['lookups']}: {s['lookup_hit_blocks']} of {s['lookup_blocks']} blocks hit",
             *claim_lines(s),
             *reset_lines(s),
             f"commands {s['commands']}, errors {s['errors']}"]
    answered = [f"{op} p50 {_ms(latency_quantile(h, 0.5))} p99 {_ms(latency_quantile(h, 0.99))} "
                f"({sum(h['counts'])})" for op, h in s["latency"].items() if sum(h["counts"])]
    if answered:
        lines.append("answered within (ms, bucket bounds): " + "; ".join(answered))
    errors = {k: v for k, v in s["errors_by_status"].items() if v}
    if errors:
        lines.append("errors by status: " + ", ".join(f"{k}={v}" for k, v in errors.items()))
    if s["clients"]:
        lines.append(f"{'slot':>4} {'pid':>8} {'role':<9} {'kv_role':<11} {'rank':>4} {'namespace':<16} "
                     f"{'saved':>9} {'loaded':>9} {'lookups':>8} {'hit':>9} {'inflight':>8}")
    for c in s["clients"]:
        lines.append(f"{c['slot']:>4} {c['pid']:>8} {c['role']:<9} {c['kv_role']:<11} {c['rank']:>4} "
                     f"{c['namespace']:<16} "
                     f"{c['blocks_saved']:>9} {c['blocks_loaded']:>9} {c['lookups']:>8} "
                     f"{c['lookup_hit_blocks']:>9} {c['inflight_copies']:>8}")
    return "\n".join(lines)


def _gbps(num_bytes: int, ns: int) -> str:
    return f"{num_bytes / ns:.2f} GB/s" if ns else "-"


def disk_lines(s: dict) -> list[str]:
    """The disk tier, if the engine has one: what it holds, wrote, read back and refused."""
    if not s["disk_bytes_capacity"]:
        return []
    return [f"disk    {format_size(s['disk_bytes_used'])} / {format_size(s['disk_bytes_capacity'])}, "
            f"{s['disk_blocks_used']} blocks, {s['disk_evictions']} evictions; written "
            f"{s['disk_blocks_written']} ({_gbps(s['disk_bytes_written'], s['disk_write_ns'])} per "
            f"thread), read back {s['disk_blocks_read']} ({_gbps(s['disk_bytes_read'], s['disk_read_ns'])} "
            f"per thread); {s['disk_checksum_failures']} corrupt, {s['disk_io_errors']} I/O errors, "
            f"{s['disk_writes_refused']} writes refused (no room)"]


def claim_lines(s: dict) -> list[str]:
    """Compute once, once a claim was made: the claims, the lookups that waited for them, and
    what the waits saved (docs/replicas.md#compute-once)."""
    if not s.get("claims"):
        return []
    return [f"claims  {s['claims']} ({s['claim_blocks']} blocks); {s['claim_waits']} lookups waited "
            f"{s['claim_wait_ns'] / 1e9:.1f} s for them and were served {s['claim_wait_blocks']} blocks "
            f"({s['claim_tokens_saved']} tokens not computed again); {s['claim_declines']} declined, "
            f"{s['claim_timeouts']} past their deadline, {s['claims_dropped']} dropped"]


def reset_lines(s: dict) -> list[str]:
    """RESETs (vLLM's reset_prefix_cache with reset_external), once one came: what they dropped."""
    if not s.get("resets"):
        return []
    return [f"resets  {s['resets']}: {s['reset_blocks_dropped']} pool blocks dropped ({s['reset_blocks_held']} "
            f"in use then, freed when let go), {s['reset_disk_blocks_dropped']} disk blocks"]


def remote_lines(s: dict) -> list[str]:
    """The remote tier, if the engine has one: what it published, found and fetched."""
    if not s["remote_enabled"]:
        return []
    num_lookups = s["remote_lookups"]
    lookup_ms = f"{s['remote_lookup_ns'] / num_lookups / 1e6:.1f} ms" if num_lookups else "-"
    return [f"remote  put {s['remote_blocks_put']} ({format_size(s['remote_bytes_put'])}, "
            f"{_gbps(s['remote_bytes_put'], s['remote_put_ns'])}), {s['remote_put_failures']} failed, "
            f"{s['remote_puts_dropped']} dropped; {num_lookups} lookups asked it (mean {lookup_ms}), "
            f"{s['lookup_remote_blocks']} blocks found, fetched {s['remote_blocks_fetched']} "
            f"({format_size(s['remote_bytes_fetched'])}, {_gbps(s['remote_bytes_fetched'], s['remote_fetch_ns'])}); "
            f"{s['remote_checksum_failures']} corrupt, {s['remote_fetch_failures']} failed, "
            f"{s['remote_lookup_timeouts']} lookups past its deadline, {s['remote_errors']} store errors"]


def pool_ready_lines(s: dict) -> list[str]:
    """While the engine pins its pool in the background: how much of it is in use so far."""
    ready, capacity = s["pool_bytes_ready"], s["pool_bytes_capacity"]
    if ready >= capacity:
        return []
    unit, scale = ("GiB", 2**30) if capacity >= 2**30 else ("MiB", 2**20)
    digits = 0 if capacity / scale >= 10 else 1
    return [f"pool    {ready / scale:.{digits}f} / {capacity / scale:.{digits}f} {unit} ready"]


def _ms(seconds: float) -> str:
    return "over 1000" if seconds == float("inf") else f"{seconds * 1e3:g}"


def live(name: str, interval_s: float, stale_after_s: float = STALE_AFTER_S) -> None:
    """One line every ``interval_s`` with rates, a header every 20; while the engine is not
    running or not responding, one line saying so, and the view goes on when it is back."""
    prev, prev_t, num_rows, waiting = None, 0.0, 0, None
    while True:
        try:
            cur, now = _read_live(name, stale_after_s), time.monotonic()
        except (EngineNotRunningError, EngineNotRespondingError) as exc:
            if type(exc) is not waiting:  # said once per state (a stuck one's age grows)
                print(f"{time.strftime('%H:%M:%S')}  {_waiting_line(name, exc)}", flush=True)
            prev, waiting = None, type(exc)
            time.sleep(interval_s)
            continue
        if not cur["start_ns"]:  # an engine this moment starting: its stats not yet written
            time.sleep(interval_s)
            continue
        if prev is None or cur["start_ns"] != prev["start_ns"]:  # first, back, or another engine
            print(_live_header(), flush=True)
            num_rows = 0
        else:
            if num_rows and num_rows % 20 == 0:
                print(_live_header(), flush=True)
            print(_live_row(prev, cur, max(now - prev_t, 1e-9)), flush=True)
            num_rows += 1
        prev, prev_t, waiting = cur, now, None
        time.sleep(interval_s)


def _waiting_line(name: str, exc: Exception) -> str:
    if isinstance(exc, (EngineDeadError, EngineNotRespondingError)):
        return f"{exc}; waiting..."
    return f"engine {name!r} not running, waiting..."


def _live_header() -> str:
    return "  ".join([f"{'time':>8}", f"{'pool used':>10}", f"{'pool ready':>10}"]
                     + [f"{label:>{_width(label)}}" for _, label in _RATES]
                     + [f"{'clients':>7}", f"{'leases':>6}"])


def _live_row(prev: dict, cur: dict, dt: float) -> str:
    rates = [f"{(cur[k] - prev[k]) / dt:>{_width(label)}.0f}" for k, label in _RATES]
    return "  ".join([time.strftime("%H:%M:%S"), f"{format_size(cur['pool_bytes_used']):>10}",
                      f"{format_size(cur['pool_bytes_ready']):>10}"] + rates
                     + [f"{cur['clients_attached']:>7}", f"{cur['leases_active']:>6}"])


def _width(label: str) -> int:
    return max(len(label), 8)


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    _check_args(parser, args)
    if args.serve_metrics:
        return serve_metrics(args.name, args.serve_metrics, args.stale_after)
    try:
        return _show(args)
    except EngineNotRespondingError as exc:
        say(PROG, str(exc))
        return EXIT_NOT_RESPONDING
    except EngineDeadError as exc:
        say(PROG, f"{exc}{in_place_note(args.name)}")
        return EXIT_FAILED
    except EngineNotRunningError:  # (a ShmError: caught before the others)
        say(PROG, _not_running(args.name))
        return EXIT_FAILED
    except ShmError as exc:
        say(PROG, str(exc))
        return EXIT_FAILED
    except KeyboardInterrupt:
        return EXIT_OK
    except BrokenPipeError:  # e.g. `pegaflow-stat | head`: the reader is gone, and so are we
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_OK


def _parser() -> ArgumentParser:
    parser = ArgumentParser(prog=PROG, description="a read-only view of a running engine's counters")
    parser.add_argument("--version", action="version", version=version_line(PROG))
    parser.add_argument("--name", default=os.environ.get("PEGAFLOW_NAME", "pegaflow"),
                        help="engine name (env PEGAFLOW_NAME; default %(default)s)")
    parser.add_argument("--once", action="store_true", help="print one snapshot and exit")
    parser.add_argument("--json", action="store_true", help="with --once: one JSON object")
    parser.add_argument("--interval", type=float, default=1.0,
                        help=f"live refresh, seconds, in (0, {MAX_INTERVAL_S:g}] (default %(default)s)")
    parser.add_argument("--stale-after", type=float, default=STALE_AFTER_S,
                        help="an engine whose heartbeat is older than this many seconds is not "
                             "responding: exit 3, or pegaflow_up 0 with --serve-metrics; in "
                             f"(0, {MAX_STALE_AFTER_S:g}] (default %(default)s)")
    parser.add_argument("--serve-metrics", metavar="[HOST:]PORT",
                        help="serve Prometheus metrics of the engine at /metrics until stopped; "
                             "HOST defaults to 127.0.0.1 (0.0.0.0: every interface)")
    return parser


def _check_args(parser: ArgumentParser, args) -> None:
    """A bad flag: one line and exit 2, as argparse says any other."""
    try:
        check_engine_name(args.name)
    except ConfigError as exc:
        parser.error(str(exc))
    for flag, value, most in (("--interval", args.interval, MAX_INTERVAL_S),
                              ("--stale-after", args.stale_after, MAX_STALE_AFTER_S)):
        if not 0 < value <= most:  # nan fails too
            parser.error(f"{flag} {value:g}: must lie in (0, {most:g}] seconds")


def _show(args) -> int:
    """One snapshot (JSON or text) or the live view; the exit status."""
    if args.json:
        snapshot = read_stats(args.name, args.stale_after)  # a crashed engine's too
        print(json.dumps(snapshot))
        return EXIT_OK if snapshot["alive"] and snapshot["responding"] else (
            EXIT_NOT_RESPONDING if snapshot["alive"] else EXIT_FAILED)
    if args.once:
        print(format_once(_read_live(args.name, args.stale_after)) + in_place_note(args.name))
    else:
        live(args.name, args.interval, args.stale_after)
    return EXIT_OK


def _not_running(name: str) -> str:
    kept = kept_pool_blocks(name)
    return (f"no engine named {name!r} is running on this host "
            f"(start one with `pegaflow-engine --name {name}`)"
            + ("" if kept is None else f"; the pool it kept holds {kept} blocks, which an "
               f"engine started with --keep-pool and the same pool geometry takes in")
            + in_place_note(name))


def serve_metrics(name: str, where: str, stale_after_s: float = STALE_AFTER_S) -> int:
    from prometheus_client import CollectorRegistry, start_http_server

    from pegaflow.stats.metrics import EngineCollector
    host, _, port = where.rpartition(":")
    try:
        port_number = int(port)
    except ValueError:
        port_number = -1
    if not 0 <= port_number <= 65535:
        say(PROG, f"--serve-metrics {where!r}: expected [HOST:]PORT, PORT in 0..65535")
        return EXIT_USAGE
    registry = CollectorRegistry()
    registry.register(EngineCollector(name, stale_after_s))
    try:
        server, _ = start_http_server(port_number, addr=host or "127.0.0.1", registry=registry)
    except OSError as exc:
        say(PROG, f"cannot serve metrics on {where}: {exc}")
        return EXIT_FAILED
    print(f"{PROG}: Prometheus metrics of engine {name!r} at "
          f"http://{host or '127.0.0.1'}:{server.server_port}/metrics", flush=True)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        server.shutdown()
        return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
