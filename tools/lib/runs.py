"""How a serving bench runs its configurations and tables them (``bench_serving``,
``bench_replicas``): the arguments they share, the runs (``--repeat`` interleaved, or the runs of
``--merge``'s files: a bench split over calls), and one row per configuration with every answer
compared with the first ``none`` run's.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from tools.lib import engine_variants, peers
from tools.lib.gpu import gpu_name
from tools.serving_workload import RequestResult, identical_share


def available_configs(configs: list[str]) -> list[str]:
    """``configs`` less the peers whose packages cannot be imported here (one line each)."""
    kept = []
    for config in configs:
        reason = peers.unavailable(config) if config in peers.PEERS else None
        if reason is None:
            kept.append(config)
        else:
            print(peers.skip_line(config, reason), file=sys.stderr, flush=True)
    return kept


def _as_results(run: dict) -> list[RequestResult]:
    return [RequestResult(key, 0, tokens, 0.0, 0.0, 0.0, error) for key, tokens, error in run["results"]]


def headline_rows(runs: list[dict], figures_of, errors_of) -> dict:
    """One row per configuration (in the order they first ran): the median of each of
    ``figures_of(its runs)`` and their spread, its failed requests (``errors_of``), and
    whether every answer equals the first ``none`` run's that has its request (merged files
    may hold ``none`` runs of different workloads: bench_replicas's chat and its burst).
    A configuration none of whose runs finished (each ``failed``): why, instead of figures."""
    failed = [r for r in runs if "failed" in r]
    runs = [r for r in runs if "failed" not in r]
    firsts: dict = {}
    for run in runs:
        if run["config"] == "none":
            for result in _as_results(run):
                firsts.setdefault(result.key, result)
    reference = list(firsts.values()) or None
    out = {}
    for config in dict.fromkeys(r["config"] for r in runs):
        mine = [r for r in runs if r["config"] == config]
        figures = figures_of(mine)
        row = {k: statistics.median(v) for k, v in figures.items() if v}
        row.update({f"{k}_spread": [min(v), max(v)] for k, v in figures.items() if v})
        # Failed requests are left out of the timings: say how many, so a faster row that
        # dropped requests is seen for what it is.
        row["errors"] = errors_of(mine)
        row["runs"] = len(mine)
        keys = {result.key for result in reference or ()}
        # (a run none of whose requests a none run sent has nothing to be compared with)
        shares = [identical_share(_as_results(r), reference) for r in mine
                  if any(key in keys for key, _, _ in r["results"])]
        if shares:
            row["identical_share"] = min(shares)
            row["outputs_identical"] = all(s == 1.0 for s in shares)
        out[config] = row
    for run in failed:
        out.setdefault(run["config"], {"failed": run["failed"], "errors": 0})
    return out


def add_chat_args(p: argparse.ArgumentParser, users: int) -> None:
    """The multi-round chat's arguments, and how its servers run (shared with bench_replicas)."""
    p.add_argument("--repeat", type=int, default=1)
    p.add_argument("--eager", action="store_true", help="--enforce-eager (default: CUDA graphs)")
    p.add_argument("--users", type=int, default=users)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--context-tokens", type=int, default=8000)
    p.add_argument("--question-tokens", type=int, default=64)
    p.add_argument("--answer-tokens", type=int, default=16)


def add_run_args(p: argparse.ArgumentParser, log_dir: str) -> None:
    """The seed, where logs go, the engine's flags and variants, the JSON in and out (shared with
    bench_replicas)."""
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-dir", default=log_dir)
    p.add_argument("--engine-arg", action="append", default=[], metavar="FLAG",
                   help="a flag for pegaflow's engine, e.g. --engine-arg=--copy-backend=staged (repeatable)")
    engine_variants.add_variants_arg(p)  # each variant a configuration, in pegaflow's place
    p.add_argument("--json", metavar="PATH", help="write every figure here (rewritten after every configuration)")
    p.add_argument("--merge", nargs="+", default=[], metavar="JSON",
                   help="run nothing: one table of the runs in these --json files (a run split over calls)")


def collect_runs(args, run_config, write_json, progress) -> list[dict]:
    """The runs of ``--merge``'s files, or else every configuration ``--repeat`` times,
    interleaved (A B C A B C; a config named twice: its run-to-run agreement), a line of
    ``progress(run)`` after each and the JSON rewritten, so a run cut short keeps what it measured.
    ``--engine-variants``: pegaflow's place in ``args.configs`` taken by one configuration per variant."""
    if args.merge:
        return [run for path in args.merge for run in merged_runs(json.loads(Path(path).read_text()))]
    runs = []
    args.configs = available_configs(engine_variants.with_variants(args.configs, args.engine_variants))
    log_dir = Path(args.log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    for rep in range(args.repeat):
        for i, config in enumerate(args.configs):
            runs.append(run_config(config, args, log_dir, f"{config}{rep}-{i}"))
            print(json.dumps(progress(runs[-1])), flush=True)
            if args.json:
                write_json(args, runs)
    return runs


def merged_runs(data: dict) -> list[dict]:
    """A ``--json`` file's runs; bench_peers's ``CONFIG.failed.json`` (a peer that did not run):
    one run that says why."""
    if "runs" in data:
        return data["runs"]
    if "failed" in data and "config" in data:
        return [{"config": data["config"], "tag": f"{data['config']}-failed", "failed": data["failed"]}]
    raise SystemExit(f"not a bench's --json file (no runs, no failed): keys {sorted(data)}")


def print_failures(table: dict) -> None:
    """One line on stderr naming the configurations some of whose requests failed."""
    if any(row["errors"] for row in table.values()):
        print("requests failed: " + ", ".join(f"{c} {row['errors']}" for c, row in table.items()
                                              if row["errors"]), file=sys.stderr)


def recorded_args(args) -> dict:
    """The arguments the runs were measured with: a merge's, its first file's (a merge's own
    command line says nothing of the workload; a file that kept none: ours); else ours."""
    ours = vars(args) | {key: str(value) for key, value in vars(args).items() if value == float("inf")}
    if args.merge:
        return json.loads(Path(args.merge[0]).read_text()).get("args") or ours
    return ours


def measured_on(args) -> tuple[str, str]:
    """The GPU and model of a run; merged runs keep those they were measured with."""
    if args.merge:
        first = json.loads(Path(args.merge[0]).read_text())
        return first["gpu"], first["model"]
    return gpu_name(), args.model
