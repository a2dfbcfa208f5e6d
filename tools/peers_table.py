"""Every system on every workload in one table, from the JSON that bench_ttft, bench_serving and
bench_replicas write when run with every configuration side by side: the raw file
(``docs/benchmarks/peers.json``) and the headline table that opens docs/benchmarks.md.

    python -m tools.peers_table --ttft ttft.json --serving serving.json --replicas replicas.json \\
        --out docs/benchmarks/peers.json --date 2026-12-06

Per configuration and workload: the workload's figure (``ttft_warm_ms``, ``later_rounds_wall_s``
or ``throughput_rps``), ``served_share`` where its bench reports one and ``outputs_identical``; a
configuration a bench skipped or that failed keeps that reason.  Per workload, pegaflow against
the fastest other system that ran with outputs not known wrong (``none`` and pegaflow's own
variants, e.g. ``pegaflow-hold``, aside): the ratio of their figures.  A system whose outputs were
wrong on any workload is known wrong on every one (``wrong``: where it was seen): its bytes are the
same on each, and a workload whose outputs hide a wrong byte (dummy weights, stale GPU pages) does
not make them right.  Every input is
optional; the workloads of a bench not given are left out.  A configuration whose bench found
its figures not valid (bench_ttft: its warm pass hit vLLM's GPU prefix cache) is ``invalid``, with
the reason, like a skipped one: never a figure.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path

# workload: (bench, figure, unit, higher is better, title)
WORKLOADS = {
    "warm_ttft_10k": ("ttft", "ttft_warm_ms", "ms", False, "warm 10k-token TTFT"),
    "multi_round": ("serving", "later_rounds_wall_s", "s", False, "multi-round serving, later rounds"),
    "shared_prefix": ("serving", "throughput_rps", "req/s", True, "shared prefix throughput"),
    "replicas": ("replicas", "later_rounds_wall_s", "s", False, "replicas, later rounds"),
}
SHARED_WITH = {"shared_prefix"}  # workloads whose bench row's served_share is another workload's
SYSTEMS = ("none", "native", "lmcache", "lmcache-mp", "pegaflow-rs", "pegaflow")
NOT_RUN = ("skipped", "failed", "invalid")  # no figures: why, instead


def own_variant(name: str) -> bool:
    """pegaflow under other settings (``pegaflow-hold``, ``pegaflow-layerwise``...), not a peer."""
    return name.startswith("pegaflow-") and name != "pegaflow-rs"


def _rows(bench: str, data: dict) -> dict[str, dict]:
    """A bench's row per configuration: bench_ttft keeps them under ``configs``; the serving
    benches at the top level beside ``gpu``, ``args`` and ``runs``."""
    if bench == "ttft":
        return data["configs"]
    return {name: row for name, row in data.items() if isinstance(row, dict) and name not in ("args",)
            and ({"later_rounds_wall_s", *NOT_RUN} & set(row))}


def _cell(row: dict, figure: str) -> dict | None:
    """None: this configuration's bench ran without this workload."""
    if reason := next((row[k] for k in NOT_RUN if k in row), None):
        return {next(k for k in NOT_RUN if k in row): reason}
    if figure not in row:
        return None
    cell = {figure: row[figure], "outputs_identical": row.get("outputs_identical")}
    if "served_share" in row:
        cell["served_share"] = row["served_share"]
    if row.get("logprobs_identical") is not None:  # bench_ttft: against the GPU hit's, on a scrubbed cache
        cell["logprobs_identical"] = row["logprobs_identical"]
    return cell


def _wrong(cell: dict) -> bool:
    """Tokens that differ from no offload's, or (bench_ttft) top-5 logprobs that differ from a
    GPU prefix-cache hit's of the same step: some KV byte it served was not the computed one."""
    return cell.get("outputs_identical") is False or cell.get("logprobs_identical") is False


def _versus(cells: dict[str, dict], figure: str, higher_better: bool, wrong: set[str]) -> dict | None:
    """pegaflow's figure over the best other system's that ran with outputs not known wrong
    (``none`` and pegaflow's variants aside): a fast peer with wrong outputs is no mark to beat."""
    others = {n: c[figure] for n, c in cells.items()
              if n not in ("pegaflow", "none") and not own_variant(n) and n not in wrong and figure in c}
    if "pegaflow" not in cells or figure not in cells["pegaflow"] or not others:
        return None
    best = (max if higher_better else min)(others, key=others.get)
    ratio = cells["pegaflow"][figure] / others[best]
    ahead = ratio > 1 if higher_better else ratio < 1
    return {"best_other": best, "pegaflow_over_best": ratio, "pegaflow_ahead": ahead}


def build(inputs: dict[str, dict], date: str) -> dict:
    """``inputs``: bench name (ttft, serving, replicas) -> its JSON."""
    gpus = sorted({data["gpu"] for data in inputs.values()})
    out = {"gpu": gpus[0] if len(gpus) == 1 else gpus, "date": date, "configs": {}, "versus": {}, "wrong": {}}
    by_workload = {}
    for workload, (bench, figure, _, _, _) in WORKLOADS.items():
        if bench not in inputs:
            continue
        cells = by_workload[workload] = {name: cell for name, row in _rows(bench, inputs[bench]).items()
                                         if (cell := _cell(row, figure)) is not None}
        if workload in SHARED_WITH:  # bench_serving's share is of its multi-round chat
            for cell in cells.values():
                cell.pop("served_share", None)
        for name, cell in cells.items():
            out["configs"].setdefault(name, {})[workload] = cell
            if _wrong(cell):
                out["wrong"].setdefault(name, []).append(workload)
    for workload, cells in by_workload.items():
        _, figure, _, higher_better, _ = WORKLOADS[workload]
        out["versus"][workload] = _versus(cells, figure, higher_better, set(out["wrong"]))
    return out


def _format(cell: dict | None, figure: str, unit: str, wrong_in: list[str]) -> str:
    """A cell's figure and share, marked wrong where its outputs were, or where this system's
    were on another workload (``wrong_in``)."""
    if cell is None:
        return "-"
    if figure not in cell:
        return next(iter(cell))  # skipped / failed
    text = f"{cell[figure]:.3g} {unit}" if cell[figure] < 100 else f"{cell[figure]:.0f} {unit}"
    if "served_share" in cell:
        text += f" ({cell['served_share']:.0%} served)"
    if cell["outputs_identical"] is False:
        return text + " **wrong outputs**"
    if cell.get("logprobs_identical") is False:
        return text + " **logprobs differ**"
    if wrong_in:
        return text + " (**wrong** on " + ", ".join(WORKLOADS[w][4] for w in wrong_in) + ")"
    return text


def markdown(table: dict) -> str:
    """The headline table: a row per workload, a column per system, the card and the date."""
    systems = [s for s in SYSTEMS if s in table["configs"]] + sorted(set(table["configs"]) - set(SYSTEMS))
    wrong = table.get("wrong", {})
    lines = [f"{table['gpu']}, {table['date']}", "",
             "| workload | " + " | ".join(systems) + " | pegaflow vs fastest correct other |",
             "|---" * (len(systems) + 2) + "|"]
    for workload, versus in table["versus"].items():
        _, figure, unit, _, title = WORKLOADS[workload]
        cells = [_format(table["configs"][s].get(workload), figure, unit, wrong.get(s, [])) for s in systems]
        vs = "-" if versus is None else (f"{versus['pegaflow_over_best']:.2f}x {versus['best_other']}'s "
                                         f"({'ahead' if versus['pegaflow_ahead'] else 'behind'})")
        lines.append(f"| {title} | " + " | ".join(cells) + f" | {vs} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ttft", help="bench_ttft --json output (its stdout, saved)")
    p.add_argument("--serving", help="bench_serving --json file")
    p.add_argument("--replicas", help="bench_replicas --json file")
    p.add_argument("--out", help="write the table's JSON here (e.g. docs/benchmarks/peers.json)")
    p.add_argument("--date", default=datetime.date.today().isoformat())
    args = p.parse_args(argv)
    inputs = {bench: json.loads(Path(path).read_text()) for bench, path in
              (("ttft", args.ttft), ("serving", args.serving), ("replicas", args.replicas)) if path}
    if not inputs:
        p.error("give at least one of --ttft, --serving, --replicas")
    table = build(inputs, args.date)
    if args.out:
        Path(args.out).write_text(json.dumps(table, indent=1) + "\n")
    print(markdown(table))
    return 0


if __name__ == "__main__":
    sys.exit(main())
