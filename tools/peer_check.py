"""One peer, one small vLLM, bounded: the first thing to run on a GPU machine before a bench that
measures a peer (``tools/lib/peers.py``), so that a peer that cannot start, or a vLLM that waits on
it, says so within ``--timeout`` seconds instead of holding a whole bench.

    python -m tools.peer_check lmcache-mp --model tools/models/llama-1b-shape --timeout 90

Steps, each with a time-stamped line: the import check (``peers.unavailable``); the peer's server
started as the benches start it (its health check answered); one vLLM process in eager mode
(``bench_ttft``'s phase for that peer: a cold pass of ``--num-prompts`` prompts, vLLM's GPU cache
emptied and overwritten, a warm pass).  Then one line per warm request (the prompt tokens the
peer served, whether its tokens equal the cold pass's) and the exit status: 0 when every warm
request was served in full with equal tokens, 1 otherwise.  On any failure the server's log ends
the output (its last ``--log-lines`` lines); vLLM's own log streams to stderr throughout.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from tools.lib import peers, processes
from tools.lib.phases import spawn_phase
from tools.lib.warm_pass import SCRUB_ENV

ROOT = Path(__file__).resolve().parent.parent


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("config", choices=peers.PEERS)
    p.add_argument("--model", default=str(ROOT / "tools/models/llama-1b-shape"))
    p.add_argument("--timeout", type=float, default=90.0, help="seconds for the vLLM process, init included")
    p.add_argument("--pool-gib", type=float, default=8.0, help="the peer's host cache")
    p.add_argument("--num-prompts", type=int, default=2)
    p.add_argument("--prompt-tokens", type=int, default=2048)
    p.add_argument("--log-lines", type=int, default=40)
    return p.parse_args(argv)


def phase_flags(args: argparse.Namespace, run: peers.Plan) -> list[str]:
    """``bench_ttft``'s flags for one small eager phase of ``run``'s peer."""
    return ["--model", str(Path(args.model).resolve()), "--num-prompts", str(args.num_prompts),
            "--prompt-tokens", str(args.prompt_tokens), "--decode-tokens", "4", "--decode-prompts", "1",
            "--gpu-memory-utilization", "0.5", "--eager",
            "--kv-transfer-config", json.dumps(run.kv_transfer_config)]


def verdict(result: dict, block_size: int = 16) -> tuple[bool, list[str]]:
    """Whether every warm request was served in full (its cacheable tokens: full blocks short of
    the last token) with the cold pass's tokens; a line per request."""
    lines, ok = [], True
    for i, (cached, warm, cold) in enumerate(zip(result["warm_cached_tokens"], result["warm_tokens"],
                                                 result["cold_tokens"])):
        lines.append(f"warm request {i}: {cached} prompt tokens served by the peer, tokens equal: {warm == cold}")
        ok = ok and warm == cold
    per_prompt = result["cacheable_tokens"] // max(1, len(result["warm_cached_tokens"]))
    full = all(cached >= per_prompt for cached in result["warm_cached_tokens"])
    lines.append(f"cacheable per prompt {per_prompt}; every warm request served in full: {full}")
    return ok and full, lines


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    processes.handle_signals()
    with processes.phase("peer_check", f"{args.config} import check"):
        reason = peers.unavailable(args.config)
    if reason is not None:
        print(peers.skip_line(args.config, reason))
        return 1
    from pegaflow.platform.errors import PeerError
    run = peers.plan(args.config, int(args.pool_gib * (1 << 30)))
    log = Path(tempfile.gettempdir()) / f"peer_check.{args.config}.server.log"
    print(f"server: {' '.join(run.server_argv) or '(none: in vLLM)'}\nvLLM kv_transfer_config: "
          f"{json.dumps(run.kv_transfer_config)}", flush=True)
    env = dict(os.environ, PYTHONHASHSEED="0", **SCRUB_ENV, **run.env)
    try:
        with contextlib.ExitStack() as server:
            with processes.phase("peer_check", f"{args.config} server start"):
                server.enter_context(peers.side_process(run, log, start_timeout_s=args.timeout))
            with processes.phase("peer_check", f"{args.config} vLLM"):
                result = spawn_phase("tools.bench_ttft", args.config, phase_flags(args, run), timeout_s=args.timeout,
                                     env=env, cwd=run.cwd,
                                     leftovers=processes.new_segments_since(processes.shm_snapshot()))
    except (PeerError, subprocess.CalledProcessError, subprocess.TimeoutExpired) as exc:
        print(f"peer_check: {args.config} failed: {exc}")
        _print_log(log, args.log_lines)
        return 1
    if "failed" in result:
        print(f"peer_check: {args.config} failed: {result['failed']}")
        _print_log(log, args.log_lines)
        return 1
    ok, lines = verdict(result)
    print("\n".join(lines))
    return 0 if ok else 1


def _print_log(log: Path, num_lines: int) -> None:
    if log.exists():
        print(f"--- the last {num_lines} lines of {log} ---")
        print("\n".join(log.read_text(errors="replace").splitlines()[-num_lines:]))


if __name__ == "__main__":
    sys.exit(main())
