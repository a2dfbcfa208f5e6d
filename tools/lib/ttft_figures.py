"""bench_ttft's figures from its phases' measurements: the headline (pegaflow against native and
no connector, TPOT), the disk tier's, each copy path's or engine variant's, and ``--tpot-only``'s;
the phases of a run split over calls merged first (``merged_phases``).  The rows per
configuration are ``tools/lib/ttft_configs.py``'s.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

from tools.lib.ttft_configs import NO_FIGURES, logprobs_match
from tools.lib.ttft_configs import stats as _stats
from tools.lib.warm_pass import invalid_reason


def summarize_disk(peg: dict, disks: dict[str, dict], none: dict) -> dict:
    """The disk tier's figures: the first ``disk_load_mode``'s under the plain keys, each
    mode's under keys ending in its name; outputs must equal no connector's in every one."""
    first = disks[next(iter(disks))]
    result = {"warm_from_pool_ms": _stats(peg["warm_ms"])[0], "cold_ms": _stats(peg["cold_ms"])[0],
              "outputs_identical_disk": all(d["disk_tokens"] == d["pool_tokens"] == none["cold_tokens"]
                                            for d in disks.values())}
    for suffix, disk in [("", first), *((f"_{mode}", d) for mode, d in disks.items())]:
        stats = disk["engine_stats"]
        result[f"warm_from_disk_ms{suffix}"], result[f"warm_from_disk_ms_p90{suffix}"] = _stats(disk["disk_ms"])
        result[f"warm_from_pool_after_disk_ms{suffix}"] = _stats(disk["pool_ms"])[0]
        result[f"disk_blocks_read{suffix}"] = stats["disk_blocks_read"]
        result[f"lookup_disk_blocks{suffix}"] = stats["lookup_disk_blocks"]
        result[f"disk_engine_stats{suffix}"] = stats
        for key, value in disk["beside"].items():  # a new request sent with a disk hit
            result[f"beside_disk_{key}{suffix}"] = value
    return result



def summarize(peg: dict, native: dict | None, none: dict, gpu: str) -> dict:
    """The table's figures; ``native`` None (--skip-native): its columns are left out."""
    cold, cold_p90 = _stats(peg["cold_ms"])
    warm, warm_p90 = _stats(peg["warm_ms"])
    hit, hit_p90 = _stats(none["gpu_hit_ms"])
    timings = [("cold", peg, "cold"), ("cold_none", none, "cold"), ("warm_pegaflow", peg, "warm"),
               ("gpu_hit", none, "gpu_hit")]
    native_figures, native_tokens = {}, []
    if native is not None:
        nat, nat_p90 = _stats(native["warm_ms"])
        timings += [("warm_native", native, "warm"), ("gpu_hit_native_phase", native, "gpu_hit")]
        native_figures = {"warm_native_ms_median": nat, "warm_native_ms_p90": nat_p90,
                          "gpu_hit_native_phase_ms_median": _stats(native["gpu_hit_ms"])[0],
                          "warm_pegaflow_over_native": warm / nat}
        native_tokens = [native["cold_tokens"], native["warm_tokens"]]
    return {
        "gpu": gpu, "cold_ms_median": cold, "cold_ms_p90": cold_p90,
        "warm_pegaflow_ms_median": warm, "warm_pegaflow_ms_p90": warm_p90,
        "gpu_hit_ms_median": hit, "gpu_hit_ms_p90": hit_p90,
        "cold_none_ms_median": _stats(none["cold_ms"])[0],
        **native_figures,
        "warm_batch8_pegaflow_ms": peg["warm_batch_ms"], "cold_batch8_ms": none["cold_batch_ms"],
        "tpot_saving_ms": statistics.median(peg["tpot_ms"]),
        "tpot_none_ms": statistics.median(none["tpot_ms"]),
        "tpot_ratio_saving_vs_none": statistics.median(peg["tpot_ms"]) / statistics.median(none["tpot_ms"]),
        "tpot_saving_ms_each": peg["tpot_ms"], "tpot_none_ms_each": none["tpot_ms"],
        "external_hit_tokens": peg["external_hit_tokens"],
        "engine_blocks_loaded": peg.get("engine_stats", {}).get("blocks_loaded"),
        "engine_blocks_saved": peg.get("engine_stats", {}).get("blocks_saved"),
        # vLLM's own timings of the same requests: first-token latency (arrival to first
        # token), queued -> scheduled and scheduled -> first token (engine core):
        **{f"{name}_{kind}_ms_median": statistics.median(phase[f"{key}_{kind}_ms"])
           for name, phase, key in timings for kind in ("engine", "queue", "step")
           if phase.get(f"{key}_{kind}_ms")},
        "outputs_identical": all(tokens == none["cold_tokens"] for tokens in
                                 [peg["cold_tokens"], peg["warm_tokens"], *native_tokens, none["gpu_hit_tokens"]]),
    }



def table_figures(rows: dict[str, dict], peg: dict, native: dict | None, none: dict, gpu: str) -> dict | None:
    """``summarize``'s figures, from phases whose rows have figures: native's left out when its
    row has none; None when pegaflow's has none.  Each row without figures: one line on stderr."""
    for config, row in rows.items():
        if reason := next((row[key] for key in NO_FIGURES if key in row), None):
            print(f"bench_ttft: no figures for {config}: {reason}", file=sys.stderr)
    if "ttft_warm_ms" not in rows["pegaflow"]:
        return None
    return summarize(peg, native if "ttft_warm_ms" in rows.get("native", {}) else None, none, gpu)



def backend_figures(by_backend: dict[str, dict], none: dict, repeats: dict[str, list[dict]] | None = None) -> dict:
    """``--copy-backends`` (or ``--engine-variants``): each one's own warm figures, under keys
    named for it, its first tokens' top-5 logprobs against the GPU hit's among them; one whose
    warm pass hit vLLM's GPU prefix cache gets ``invalid_<path>`` (why) and no figures.
    ``repeats`` (``--repeat``): each one's phases, its figures over every repeat's prompts and
    ``warm_pegaflow_ms_repeats_<path>``, each repeat's median (their spread: min and max)."""
    out = {}
    for name, phase in by_backend.items():
        mine = [p for p in (repeats or {}).get(name, [phase]) if "failed" not in p]
        if not mine:
            continue
        if reason := next(filter(None, (invalid_reason(p.get("warm_by_source")) for p in mine)), None):
            out[f"invalid_{name}"] = reason
            print(f"bench_ttft: no warm figures for copy path {name}: {reason}", file=sys.stderr)
            continue
        warm, warm_p90 = _stats([ms for p in mine for ms in p["warm_ms"]])
        out[f"warm_pegaflow_ms_median_{name}"], out[f"warm_pegaflow_ms_p90_{name}"] = warm, warm_p90
        out[f"cold_ms_median_{name}"] = _stats([ms for p in mine for ms in p["cold_ms"]])[0]
        out[f"outputs_identical_{name}"] = all(p["cold_tokens"] == p["warm_tokens"] == none["cold_tokens"]
                                               for p in mine)
        matches = [logprobs_match(p, none) for p in mine]
        out[f"logprobs_identical_{name}"] = None if any(m[0] is None for m in matches) else all(m[0] for m in matches)
        out[f"logprobs_compared_{name}"] = sum(m[1] for m in matches)
        if len(mine) > 1:
            out[f"warm_pegaflow_ms_repeats_{name}"] = each = [_stats(p["warm_ms"])[0] for p in mine]
            out[f"warm_pegaflow_ms_spread_{name}"] = [min(each), max(each)]
    return out



def summarize_tpot(tpot: dict[str, list[float]], gpu: str) -> dict:
    """Medians of --tpot-only's three phases and their ratios."""
    med = {phase: statistics.median(values) for phase, values in tpot.items()}
    return {"gpu": gpu, "tpot_saving_ms": med["pegaflow"], "tpot_idle_ms": med["idle"],
            "tpot_none_ms": med["none"], "tpot_ratio_saving_vs_none": med["pegaflow"] / med["none"],
            "tpot_ratio_saving_vs_idle": med["pegaflow"] / med["idle"],
            "tpot_ratio_idle_vs_none": med["idle"] / med["none"],
            **{f"tpot_{phase}_ms_each": values for phase, values in tpot.items()}}


def merged_phases(paths: list[str]) -> dict:
    """The phases of several ``--phases-out`` files as one run's (the first file's GPU and model;
    another GPU in a later file: a warning, the merge goes on).  pegaflow's variants of every
    file are kept (a sweep split over calls; a variant in two files: its repeats of both), its
    table's figures the first file's."""
    files = [json.loads(Path(path).read_text()) for path in paths]
    phases, repeats = dict(files[0]), {}
    for path, data in zip(paths, files):
        if data["gpu"] != phases["gpu"]:
            print(f"bench_ttft: {path} ran on {data['gpu']}, not {phases['gpu']}", file=sys.stderr)
        mine = data.get("pegaflow_repeats") or {n: [p] for n, p in data.get("pegaflow_variants", {}).items()}
        for name, runs in mine.items():
            repeats[name] = repeats.get(name, []) + runs
        phases.update({k: v for k, v in data.items() if k not in ("gpu", "model", "configs_run")})
        phases["configs_run"] = list(dict.fromkeys(phases["configs_run"] + data["configs_run"]))
    if repeats:
        phases.update(pegaflow_repeats=repeats, pegaflow_variants={n: runs[0] for n, runs in repeats.items()},
                      pegaflow=next(iter(repeats.values()))[0])
    return phases
