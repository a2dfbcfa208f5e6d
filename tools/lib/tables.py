"""Every system on every workload in one table, from the JSON that bench_ttft, bench_serving and
bench_replicas write when run with every configuration side by side: the raw file
(``docs/benchmarks/peers.json``) and the headline table that opens docs/benchmarks.md.

    python -m tools.peers_table --ttft ttft.json --serving serving.json --replicas replicas.json \\
        --out docs/benchmarks/peers.json --date 2026-12-06

Per configuration and workload: the workload's figure (``ttft_warm_ms``, ``later_rounds_wall_s``
or ``throughput_rps``), ``served_share`` where its bench reports one, ``outputs_identical`` (and,
bench_ttft, ``logprobs_identical``); a configuration a bench skipped or that failed keeps that
reason.  Marks are as narrow as their evidence: ``marks`` names each configuration by its release
and mode (``tools/lib/peers.py`` ``LABELS``) and gives its mark on each workload, measured there and
nowhere else: ``wrong`` (tokens or first-token logprobs that differ, with an upstream report where
one is known), ``right`` (tokens and logprobs equal), ``tokens identical`` (nothing finer was
compared), or ``not run`` (with the reason where the bench gave one).  Nothing is inferred from
one mode to another (LMCache in-process and LMCache multi-process are two configurations) or from
one workload to another.  Per workload, pegaflow against the fastest other system that ran (``none``
and pegaflow's own variants, e.g. ``pegaflow-hold``, aside), leaving out a configuration measured
wrong on any workload: a configuration whose copies were seen wrong is no mark to beat, and the
comparison says which it left out and why.  Every input is optional; the workloads of a bench
not given are left out.  A configuration whose bench found its figures not valid (bench_ttft: its
warm pass hit vLLM's GPU prefix cache) is ``invalid``, with the reason, like a skipped one: never a
figure.
"""

from __future__ import annotations

from tools.lib.peers import KNOWN_ISSUES, LABELS

# workload: (bench, figure, unit, higher is better, title)
WORKLOADS = {
    "warm_ttft_10k": ("ttft", "ttft_warm_ms", "ms", False, "warm 10k-token TTFT"),
    "multi_round": ("serving", "later_rounds_wall_s", "s", False, "multi-round serving, later rounds"),
    "shared_prefix": ("serving", "throughput_rps", "req/s", True, "shared prefix throughput"),
    "replicas": ("replicas", "later_rounds_wall_s", "s", False, "replicas, later rounds"),
}
SHARED_WITH = {"shared_prefix"}  # workloads whose bench row's served_share is another workload's
SYSTEMS = ("none", "native", "lmcache", "lmcache-mp", "pegaflow-rs", "pegaflow")  # the columns' order
NOT_RUN = ("skipped", "failed", "invalid")  # no figures: why, instead


def own_variant(name: str) -> bool:
    """pegaflow under other settings (``pegaflow-hold``, ``pegaflow-layerwise``, an engine
    variant's ``pegaflow+hold-saves``...), not a peer."""
    return name.startswith(("pegaflow-", "pegaflow+")) and name != "pegaflow-rs"


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
        cell["logprobs_compared"] = row.get("logprobs_compared")
    return cell


def mark(cell: dict | None) -> str:
    """A configuration's mark on one workload, from that workload's cell alone."""
    if cell is None:
        return "not run"
    if reason := next((f"{k}: {cell[k]}" for k in NOT_RUN if k in cell), None):
        return f"not run ({reason})"
    compared = f", {cell['logprobs_compared']} requests compared" if cell.get("logprobs_compared") else ""
    logprobs = f"first-token logprobs differ from the GPU prefix-cache hit's{compared}"
    if cell.get("outputs_identical") is False:
        both = f"; {logprobs}" if cell.get("logprobs_identical") is False else ""
        return f"wrong: output tokens differ from no offload's{both}"
    if cell.get("logprobs_identical") is False:
        return f"wrong: {logprobs}"
    if cell.get("logprobs_identical") is True:
        return f"right: tokens and first-token logprobs equal{compared}"
    return "tokens identical" if cell.get("outputs_identical") else "not checked"


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
        if out["versus"][workload] is not None:
            out["versus"][workload]["left_out_wrong"] = sorted(n for n in out["wrong"] if figure in cells.get(n, {}))
    out["marks"] = {name: {"who": LABELS.get(name, name),
                           "on": {w: mark(cells.get(name)) for w, cells in by_workload.items()}}
                    for name in out["configs"]}
    for name, issue in KNOWN_ISSUES.items():
        if name in out["wrong"]:
            out["marks"][name]["known_issue"] = issue
    return out


def _format(cell: dict | None, figure: str, unit: str) -> str:
    """A cell's figure and share, marked wrong where its outputs were on this workload."""
    if cell is None:
        return "not run"
    if figure not in cell:
        kind = next(iter(cell))  # skipped / failed / invalid: why, in its marks
        return "not run" if kind == "failed" else kind  # (a failed start may be the bench's own)
    text = f"{cell[figure]:.3g} {unit}" if cell[figure] < 100 else f"{cell[figure]:.0f} {unit}"
    if "served_share" in cell:
        text += f" ({cell['served_share']:.0%} served)"
    if cell["outputs_identical"] is False:
        return text + " **wrong outputs**"
    if cell.get("logprobs_identical") is False:
        return text + " **logprobs differ**"
    return text


def markdown(table: dict) -> str:
    """The headline table (a row per workload, a column per system, the card and the date), then
    each configuration's marks, by release and mode, workload by workload."""
    systems = [s for s in SYSTEMS if s in table["configs"]] + sorted(set(table["configs"]) - set(SYSTEMS))
    lines = [f"{table['gpu']}, {table['date']}", "",
             "| workload | " + " | ".join(systems) + " | pegaflow vs fastest correct other |",
             "|---" * (len(systems) + 2) + "|"]
    for workload, versus in table["versus"].items():
        _, figure, unit, _, title = WORKLOADS[workload]
        cells = [_format(table["configs"][s].get(workload), figure, unit) for s in systems]
        lines.append(f"| {title} | " + " | ".join(cells) + f" | {_versus_text(versus)} |")
    lines += ["", "Marks (each measured on that workload only):"]
    for name in systems:
        marks = table["marks"][name]
        issue = f" ({marks['known_issue']})" if "known_issue" in marks else ""
        lines.append(f"- {marks['who']}{issue}: " + "; ".join(f"{WORKLOADS[w][4]}: {m}"
                                                              for w, m in marks["on"].items()))
    return "\n".join(lines)


def _versus_text(versus: dict | None) -> str:
    if versus is None:
        return "-"
    why = "ahead" if versus["pegaflow_ahead"] else "behind"
    if versus.get("left_out_wrong"):
        why += f"; left out, measured wrong: {', '.join(versus['left_out_wrong'])}"
    return f"{versus['pegaflow_over_best']:.2f}x {versus['best_other']}'s ({why})"
