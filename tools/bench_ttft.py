"""Time to first token on real vLLM: cold, warm from pegaflow, warm from vLLM's native CPU
offloading, warm from each peer (LMCache, PegaFlow: ``tools/lib/peers.py``; one that cannot run
here is skipped with one line), and a GPU prefix-cache hit, all measured in one run; plus TPOT
with the connector saving against no connector, and 8 prompts at once.  Per configuration:
warm TTFT, the share of cacheable prompt tokens its host cache served on the warm pass, and
whether its outputs equal no connector's (``configs`` in the JSON).

    python -m tools.bench_ttft --model tools/models/llama-3.1-8b-shape [--json]
    python -m tools.bench_ttft --configs none pegaflow --phases-out a.json   # a run split over calls,
    python -m tools.bench_ttft --configs native lmcache-mp --phases-out b.json
    python -m tools.bench_ttft --merge a.json b.json --json                  # then one table

``--configs`` picks of none, native, pegaflow and the peers (default: all but lmcache-mp); each
phase logs a time-stamped line when it starts and ends, and one that runs past
``--phase-timeout`` is stopped with its whole process group.

Each vLLM runs in its own process, one after another (dummy weights, greedy), in vLLM's
default compilation (CUDA graphs on) unless ``--eager``.
The pegaflow engine is started here with the cuda backend unless --engine-name names a
running one; a started engine is stopped before the native and peer phases (their host caches
would otherwise sit beside its pool).  The native and peer phases keep vLLM's prefix caching
on, as their users run them.  Before every warm pass vLLM's GPU prefix cache is emptied (the
reset retried while saves hold blocks), and a warm pass that vLLM counted any GPU prefix-cache
hit in is reported invalid, not as a figure (``tools/lib/warm_pass.py``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tools.lib import engine_variants, peers, processes
from tools.lib.engine_variants import variant_name
from tools.lib.gpu import gpu_name
from tools.lib.phases import PHASE_TIMEOUT_S, add_phase_args, engine_unless_named, spawn_phase, write_phase
from tools.lib.ttft_configs import config_rows
from tools.lib.ttft_figures import backend_figures, merged_phases, summarize_disk, summarize_tpot, table_figures
from tools.lib.ttft_phase import load_modes, run_phase
from tools.lib.warm_pass import (
    SCRUB_ENV,
    GpuCacheNotEmptyError,
)

# Nothing of this repo's pegaflow is imported at the top: a pegaflow-rs phase runs with
# PegaFlow's package of the same name first on its path (tools/lib/peers.py).
ROOT = Path(__file__).resolve().parent.parent


def engine_flags(variant: str | None, is_flags: bool) -> list[str]:
    """The engine's flags for one pegaflow phase: a copy path's (``--copy-backends``), or a
    variant's own (``--engine-variants``, ``tools/lib/engine_variants.py``)."""
    if is_flags or not variant or variant == "default":
        return engine_variants.engine_flags(variant)
    return ["--copy-backend", variant]


def _spawn(args, phase: str, run: peers.Plan | None = None) -> dict:
    """One phase in its own process; ``run``: a peer's, with its environment and directory."""
    flags = _passthrough(args)
    if run is not None:
        flags += ["--kv-transfer-config", json.dumps(run.kv_transfer_config)]
    # vLLM 0.26 seeds its block hashes per process unless PYTHONHASHSEED is set: the disk
    # phase's vLLM must hash the prompts as the first one did
    env = dict(os.environ, PYTHONHASHSEED=os.environ.get("PYTHONHASHSEED", "0"), **SCRUB_ENV,
               **(run.env if run else {}))
    # a peer's connector may make segments in vLLM's process that a killed vLLM cannot remove
    leftovers = processes.new_segments_since(processes.shm_snapshot()) if run else None
    with processes.phase("bench_ttft", phase):
        return spawn_phase("tools.bench_ttft", phase, flags, timeout_s=args.phase_timeout, env=env,
                           cwd=run.cwd if run else None, leftovers=leftovers)


def _peer_phases(args, configs: list[str]) -> dict[str, dict]:
    """Per peer of ``configs``: its phase beside the server it needs, or ``skipped``: why."""
    from pegaflow.platform.errors import PeerError
    from pegaflow.platform.values import parse_size
    results = {}
    for config in configs:
        reason = peers.unavailable(config)
        if reason is not None:
            print("bench_ttft: " + peers.skip_line(config, reason), file=sys.stderr)
            results[config] = {"skipped": reason}
            continue
        run = peers.plan(config, parse_size(args.pool_size))
        log = Path(tempfile.gettempdir()) / f"bench_ttft.{config}.server.log"
        try:  # a peer that fails at run time is a row that says so, not the end of the bench
            with contextlib.ExitStack() as server:
                with processes.phase("bench_ttft", f"{config} server start"):
                    server.enter_context(peers.side_process(run, log))
                results[config] = _spawn(args, config, run)
        except (PeerError, subprocess.CalledProcessError, subprocess.TimeoutExpired) as exc:
            print(f"bench_ttft: {config} failed: {exc} (its server's log: {log})", file=sys.stderr)
            results[config] = {"failed": str(exc)}
    return results


def _disk_phases(engine, start, args) -> dict[str, dict]:
    """Once the engine has written every block it stored to disk: per connector
    ``disk_load_mode``, a new engine on the same disk (its pool empty) serves a new vLLM the
    prompts from disk, then from its pool."""
    from pegaflow.stats.engine_stats import read_stats
    from tools.engine_process import LARGE_POOL_STOP_S
    deadline = time.monotonic() + 300
    while (s := read_stats(engine.name))["disk_blocks_written"] < s["blocks_saved"]:
        if time.monotonic() > deadline:
            raise RuntimeError(f"the disk tier wrote {s['disk_blocks_written']} of {s['blocks_saved']} blocks")
        time.sleep(0.1)
    engine.stop(timeout_s=LARGE_POOL_STOP_S)
    results = {}
    for mode in args.disk_load_modes:
        fresh = start(None, keep_disk=True)
        try:
            args.disk_load_mode = mode
            results[mode] = _spawn(args, "disk")
            results[mode]["engine_stats"] = read_stats(fresh.name)
        finally:
            fresh.stop(timeout_s=LARGE_POOL_STOP_S)
    return results


def _passthrough(args) -> list[str]:
    flags = [flag for flag, on in (("--tpot-only", args.tpot_only), ("--eager", args.eager),
                                   ("--no-async-scheduling", args.no_async_scheduling)) if on]
    return ["--model", str(Path(args.model).resolve()), "--num-prompts", str(args.num_prompts),
            "--prompt-tokens", str(args.prompt_tokens), "--decode-tokens", str(args.decode_tokens),
            "--decode-prompts", str(args.decode_prompts), "--engine-name", args.engine_name,
            "--gpu-memory-utilization", str(args.gpu_memory_utilization),
            "--native-offload-gib", str(args.native_offload_gib),
            "--disk-load-mode", args.disk_load_mode, *flags]


CONFIGS = ("pegaflow", "native", *peers.PEERS, "none")  # the order they run in


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    _add_workload_args(p)
    _add_run_args(p)
    args = p.parse_args(argv)
    if args.phase:
        return args
    if unknown := sorted(set(args.disk_load_modes) - set(load_modes())):
        p.error(f"--disk-load-modes: unknown {unknown}; choose from {list(load_modes())}")
    if args.copy_backends and args.engine_variants:
        p.error("--copy-backends or --engine-variants, not both")
    if args.repeat < 1:
        p.error(f"--repeat must be at least 1, not {args.repeat}")
    if args.disk_path and args.num_prompts < 2:
        p.error("--disk-path needs --num-prompts 2 or more (the last one is sent beside a new request)")
    if args.engine_name and (args.copy_backends or args.engine_variants or args.disk_path):
        p.error("--copy-backends, --engine-variants and --disk-path start engines of their own: leave out "
                "--engine-name")
    chosen = args.configs or ["pegaflow", *([] if args.skip_native else ["native"]), *args.peers, "none"]
    args.configs = [c for c in CONFIGS if c in chosen]
    return args


def _add_workload_args(p: argparse.ArgumentParser) -> None:
    """The prompts, the model and how every phase's vLLM runs."""
    p.add_argument("--model", default=str(ROOT / "tools/models/llama-3.1-8b-shape"))
    p.add_argument("--num-prompts", type=int, default=8)
    p.add_argument("--prompt-tokens", type=int, default=10000)
    p.add_argument("--decode-tokens", type=int, default=256)
    p.add_argument("--decode-prompts", type=int, default=6)
    p.add_argument("--engine-name", default="")
    p.add_argument("--pool-size", default="48GiB")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.8)
    p.add_argument("--native-offload-gib", type=float, default=40)
    p.add_argument("--no-async-scheduling", action="store_true",
                   help="turn vLLM's asynchronous scheduling off in every phase")
    p.add_argument("--eager", action="store_true",
                   help="enforce_eager in every phase (default: vLLM's default compilation)")
    p.add_argument("--tpot-only", action="store_true",
                   help="only TPOT: saving, the connector idle (no save, no load), no connector")
    p.add_argument("--copy-backends", nargs="+", choices=["auto", "kernel", "copy-engine", "staged"],
                   help="run the pegaflow phase once per engine copy path, each with a fresh engine "
                        "(the first one's figures are the table's; default: the engine's default)")
    engine_variants.add_variants_arg(p)  # each variant's figures under keys named for it
    p.add_argument("--repeat", type=int, default=1, metavar="N",
                   help="run the pegaflow phase of every copy path or variant N times, interleaved (A B A B), "
                        "each time with a fresh engine: each one's figures over every repeat, and the spread")
    p.add_argument("--kv-transfer-config", help=argparse.SUPPRESS)
    add_phase_args(p, ["pegaflow", "idle", "native", "none", "disk", *peers.PEERS])


def _add_run_args(p: argparse.ArgumentParser) -> None:
    """Which configurations and variants run, and where the figures go."""
    p.add_argument("--json", action="store_true")
    p.add_argument("--disk-path", default="",
                   help="also measure warm TTFT from the engine's disk tier, in a new folder under this "
                        "directory: every block is written to disk as it is stored (in every pegaflow "
                        "phase: their figures then include that), then a new engine (empty pool) serves "
                        "the prompts from it")
    p.add_argument("--disk-load-modes", nargs="+", default=["async"],
                   help="with --disk-path: run the disk phase once per connector disk_load_mode, each "
                        "with a new engine on the same disk (the first one's figures are the plain keys)")
    p.add_argument("--disk-load-mode", default="async", help=argparse.SUPPRESS)
    p.add_argument("--configs", nargs="+", choices=CONFIGS, metavar="CONFIG",
                   help=f"the configurations to run, of {', '.join(CONFIGS)} (run in that order; default: "
                        "pegaflow, native unless --skip-native, --peers, none). A run of some of them "
                        "writes its phases with --phases-out; --merge makes one table of several such files")
    p.add_argument("--skip-native", action="store_true",
                   help="leave out the vLLM native offload phase (and its columns)")
    p.add_argument("--peers", nargs="*", choices=peers.PEERS, default=["lmcache", "pegaflow-rs"],
                   help="peers measured beside pegaflow, each with a host cache of --pool-size "
                        "(tools/lib/peers.py; one that cannot run here is skipped with one line)")
    p.add_argument("--phases-out", metavar="PATH",
                   help="write every phase's measurements here, rewritten after each phase (for --merge)")
    p.add_argument("--merge", nargs="+", default=[], metavar="PATH",
                   help="run nothing: the table of the phases in these --phases-out files (a run split over "
                        "calls; a configuration in two files: the later file's)")
    p.add_argument("--phase-timeout", type=float, default=PHASE_TIMEOUT_S, metavar="S",
                   help="stop a phase (one vLLM process) that runs longer than this, with a clear error")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.phase:
        try:
            result = run_phase(args)
        except GpuCacheNotEmptyError as exc:  # the configuration's row says so; the bench goes on
            result = {"failed": str(exc)}
        write_phase(args, result)
        return 0
    processes.handle_signals()  # SIGTERM / timeout: every engine, server and vLLM stopped
    if args.tpot_only:
        return _tpot_only(args)
    phases = merged_phases(args.merge) if args.merge else run_configs(args)
    return report(args, phases)


def _tpot_only(args) -> int:
    with engine_unless_named(args.engine_name, "ttft", args.pool_size) as args.engine_name:
        tpot = {phase: _spawn(args, phase)["tpot_ms"] for phase in ("pegaflow", "idle", "none")}
    print(json.dumps(summarize_tpot(tpot, gpu_name())))
    return 0


def run_configs(args) -> dict:
    """Each configuration of ``args.configs``'s phase, in order; ``pegaflow``'s with its copy
    paths or variants (``pegaflow_variants``) and disk phases (``disks``).  With
    ``--phases-out`` the file is rewritten after each, so a run cut short keeps what it measured."""
    phases: dict = {"gpu": gpu_name(), "model": args.model, "configs_run": list(args.configs)}

    def keep(name: str, value) -> None:
        phases[name] = value
        if args.phases_out:
            Path(args.phases_out).write_text(json.dumps(phases))
    if "pegaflow" in args.configs:
        repeats, disks = _pegaflow_phases(args)
        keep("pegaflow_variants", {name: runs[0] for name, runs in repeats.items()})
        keep("pegaflow_repeats", repeats)
        keep("disks", disks)
        keep("pegaflow", next(iter(repeats.values()))[0])
    if "native" in args.configs:
        keep("native", _spawn(args, "native"))
    for config, result in _peer_phases(args, [c for c in args.configs if c in peers.PEERS]).items():
        keep(config, result)
    if "none" in args.configs:
        keep("none", _spawn(args, "none"))
    return phases


def _pegaflow_phases(args) -> tuple[dict[str, list[dict]], dict[str, dict] | None]:
    """pegaflow's phase once per copy path or variant and ``--repeat``, interleaved, each with a
    fresh engine (or the one ``--engine-name`` names), then the disk phases; every engine started
    here stopped after.  Per copy path or variant: its phases, in the order they ran."""
    from pegaflow.stats.engine_stats import read_stats
    from tools.engine_process import LARGE_POOL_STOP_S, EngineProcess
    backends = args.copy_backends or args.engine_variants or [None]
    given_engine, engine = args.engine_name, None
    disk_dir = tempfile.mkdtemp(prefix="pegaflow-ttft-", dir=args.disk_path) if args.disk_path else ""

    def start(backend: str | None, keep_disk: bool = False):
        extra = tuple(engine_flags(backend, bool(args.engine_variants)))
        if disk_dir:  # every block written to disk as it is stored, in a folder of our own
            if not keep_disk:
                shutil.rmtree(Path(disk_dir) / "pegaflow-blocks", ignore_errors=True)
            extra += ("--disk-path", disk_dir, "--disk-admission", "all")
        with processes.phase("bench_ttft", f"engine start ({variant_name(backend)})"):
            started = EngineProcess(f"ttft{os.getpid()}", *extra, backend="cuda", pool_size=args.pool_size,
                                    start_timeout_s=300)
        args.engine_name = started.name
        return started

    by_backend: dict[str, list[dict]] = {}
    try:
        for backend in [b for _ in range(args.repeat) for b in backends]:
            if not given_engine:  # each copy path its own fresh engine
                if engine is not None:
                    engine.stop(timeout_s=LARGE_POOL_STOP_S)
                engine = start(backend)
            by_backend.setdefault(variant_name(backend), []).append(peg := _spawn(args, "pegaflow"))
            peg["engine_stats"] = read_stats(args.engine_name)
        disks = _disk_phases(engine, start, args) if disk_dir else None
    finally:
        if engine is not None:
            engine.stop(timeout_s=LARGE_POOL_STOP_S)
        if disk_dir:
            shutil.rmtree(disk_dir, ignore_errors=True)
    return by_backend, disks


def report(args, phases: dict) -> int:
    """The table of ``phases`` (JSON with ``--json``); without both ``none`` and ``pegaflow``, only
    which configurations ran, for a later ``--merge``."""
    if "none" not in phases or "pegaflow" not in phases:
        print(json.dumps({"gpu": phases["gpu"], "configs_run": phases["configs_run"],
                          "phases_out": args.phases_out}))
        print("bench_ttft: no table without both none and pegaflow: --merge this run's --phases-out file "
              "with the others'", file=sys.stderr)
        return 0
    peg, none, native = phases["pegaflow"], phases["none"], phases.get("native")
    peer_runs = {c: phases[c] for c in peers.PEERS if c in phases}
    rows = config_rows(peg, native, none, peer_runs)
    if (result := table_figures(rows, peg, native, none, phases["gpu"])) is None:
        print(json.dumps({"gpu": phases["gpu"], "configs": rows}))  # pegaflow's own figures invalid
        return 1
    disks = phases.get("disks")
    if disks:
        result.update(summarize_disk(peg, disks, none))
        for mode in disks:
            if not result[f"lookup_disk_blocks_{mode}"]:
                print(f"bench_ttft: the disk phase ({mode}) found nothing on disk: its figure is a "
                      "recompute, not a read from disk", file=sys.stderr)
    result["configs"] = rows
    first = next(iter(phases["pegaflow_variants"]))
    if args.engine_variants:  # the first variant's figures are the table's
        result["engine_variant"] = first
    else:
        result["copy_backend"] = args.copy_backends[0] if args.copy_backends else "engine default"
    result.update(backend_figures(phases["pegaflow_variants"], none, phases.get("pegaflow_repeats")))
    result["async_scheduling"] = "off" if args.no_async_scheduling else "vLLM default"
    result["compilation"] = "eager" if args.eager else "vLLM default (CUDA graphs)"
    if args.json:
        print(json.dumps(result))
    else:
        print_table(result, disks or {}, phases["pegaflow_variants"])
    return 0


def print_table(result: dict, disks: dict, by_backend: dict) -> None:
    print(f"{'case':<34}{'median ms':>10}{'p90 ms':>10}")
    for label, key in [("cold (pegaflow saving)", "cold_ms"), ("warm from pegaflow", "warm_pegaflow_ms"),
                       ("warm from vLLM native offload", "warm_native_ms"), ("GPU prefix-cache hit", "gpu_hit_ms")]:
        if key + "_median" in result:  # (native: not with --skip-native)
            print(f"{label:<34}{result[key + '_median']:>10.1f}{result[key + '_p90']:>10.1f}")
    print(f"{'cold, no connector':<34}{result['cold_none_ms_median']:>10.1f}")
    for name in ("cold", "warm_pegaflow", "warm_native", "gpu_hit"):
        print(f"vLLM's own {name}: first token {result.get(name + '_engine_ms_median', 0):.1f} ms, "
              f"queued {result.get(name + '_queue_ms_median', 0):.1f} ms, "
              f"step {result.get(name + '_step_ms_median', 0):.1f} ms")
    over_native = result.get("warm_pegaflow_over_native", float("nan"))
    print(f"pegaflow / native warm: {over_native:.2f}x; "
          f"TPOT saving {result['tpot_saving_ms']:.2f} ms vs none {result['tpot_none_ms']:.2f} ms "
          f"({result['tpot_ratio_saving_vs_none']:.3f}x); 8 warm prompts at once "
          f"{result['warm_batch8_pegaflow_ms']:.0f} ms; outputs identical: {result['outputs_identical']}")
    for mode in disks:
        print(f"warm from disk ({mode} load) {result['warm_from_disk_ms_' + mode]:.1f} ms "
              f"(p90 {result['warm_from_disk_ms_p90_' + mode]:.1f}), from pool {result['warm_from_pool_ms']:.1f} "
              f"ms, cold {result['cold_ms']:.1f} ms; outputs identical: {result['outputs_identical_disk']}; "
              f"a new request sent with a disk hit: first token {result['beside_disk_new_ttft_ms_' + mode]:.1f} "
              f"ms, TPOT {result['beside_disk_new_tpot_ms_' + mode]:.2f} ms")
    for name, row in result["configs"].items():
        print(f"{name}: {next(iter(row))}: {next(iter(row.values()))}" if "ttft_warm_ms" not in row else
              f"{name}: warm {row['ttft_warm_ms']:.1f} ms, served {row['served_share']:.1%} of the cacheable "
              f"tokens, outputs identical: {row['outputs_identical']}")
    for name in by_backend:
        print(f"copy path {name}: warm {result['warm_pegaflow_ms_median_' + name]:.1f} ms "
              f"(p90 {result['warm_pegaflow_ms_p90_' + name]:.1f}), cold {result['cold_ms_median_' + name]:.1f} ms")


if __name__ == "__main__":
    sys.exit(main())
