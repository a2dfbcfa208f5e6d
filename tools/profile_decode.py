"""What runs in an eager decode step (GPU): no connector, pegaflow idle, pegaflow saving,
each its own vLLM process under Python's profiler, and what each connector phase adds.

    python -m tools.profile_decode [--decode-tokens 64] [--repeats 2] [--json]

vLLM runs its engine core in-process here (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), so the
profiler sees the scheduler, the model runner and the connector's hooks.  One request's
prompt is first put in vLLM's GPU prefix cache, then its decode of ``--decode-tokens``
tokens runs under ``cProfile``.  Per function: calls and own time per decode step (steps
counted as calls of vLLM's ``Scheduler.schedule``).  The report lists, per connector
phase, the functions whose own time per step grew most against no connector and those
that run only with the connector.  Times are under the profiler (it slows Python code
several-fold): read them as where time goes, not as TPOT; calls per step are exact.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import statistics
import sys
from pathlib import Path

from tools.lib.decode import KINDS, decode_llm, random_prompts
from tools.lib.gpu import gpu_name
from tools.lib.phases import add_phase_args, engine_unless_named, spawn_phase, write_phase

ROOT = Path(__file__).resolve().parent.parent
STEP_FUNCTION = ("sched/scheduler.py", "schedule")  # one call per engine step


def function_key(filename: str, line: int, name: str) -> str:
    """A function's name that is the same in every process: its file below site-packages
    (or the repository), its line and name."""
    for marker in ("site-packages/", "dist-packages/", f"{ROOT}/"):
        if marker in filename:
            filename = filename.split(marker, 1)[1]
            break
    return f"{filename}:{line}({name})"


def profile_rows(stats: pstats.Stats) -> tuple[int, list[dict]]:
    """(steps, rows): every function's calls and own/cumulative time in microseconds (all of
    them: a function cut from one phase's list would look like one that only another runs)."""
    steps, rows = 0, []
    for (filename, line, name), (_, calls, own_s, cum_s, _) in stats.stats.items():
        if filename.endswith(STEP_FUNCTION[0]) and name == STEP_FUNCTION[1]:
            steps += calls
        rows.append({"function": function_key(filename, line, name), "calls": calls,
                     "own_us": own_s * 1e6, "cum_us": cum_s * 1e6})
    rows.sort(key=lambda r: r["own_us"], reverse=True)
    return steps, rows


def run_phase(args) -> dict:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine core in this process
    from transformers import AutoConfig
    from vllm import SamplingParams, TokensPrompt
    vocab = AutoConfig.from_pretrained(args.model).vocab_size
    args.mode, args.contexts = "eager", [args.context]
    llm = decode_llm(args)
    warm = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, detokenize=False)
    timed = SamplingParams(max_tokens=args.decode_tokens, temperature=0.0, ignore_eos=True, detokenize=False)
    llm.generate([TokensPrompt(prompt_token_ids=p) for p in random_prompts(args.seed, 1, 256, vocab)], warm,
                 use_tqdm=False)  # warm-up
    prompt = [TokensPrompt(prompt_token_ids=random_prompts(args.seed + 1000, 1, args.context, vocab)[0])]
    llm.generate(prompt, SamplingParams(max_tokens=1, temperature=0.0, detokenize=False), use_tqdm=False)
    profiler = cProfile.Profile()
    profiler.enable()
    (out,) = llm.generate(prompt, timed, use_tqdm=False)
    profiler.disable()
    steps, rows = profile_rows(pstats.Stats(profiler))
    metrics, generated = out.metrics, len(out.outputs[0].token_ids)
    return {"steps": steps, "generated": generated, "gpu": gpu_name(),
            "tpot_ms_under_profiler": (metrics.last_token_ts - metrics.first_token_ts) * 1e3 / max(generated - 1, 1),
            "functions": rows}


def per_step(phases: list[dict]) -> dict[str, dict]:
    """Each function's calls and own time per step, the median over repeats of a phase
    (a function a repeat did not run counts as 0 there)."""
    by_name = [{r["function"]: r for r in p["functions"]} for p in phases]
    table = {}
    for name in {n for rows in by_name for n in rows}:
        calls, own = [], []
        for p, rows in zip(phases, by_name):
            row = rows.get(name)
            steps = max(p["steps"], 1)
            calls.append(row["calls"] / steps if row else 0.0)
            own.append(row["own_us"] / steps if row else 0.0)
        table[name] = {"calls_per_step": statistics.median(calls), "own_us_per_step": statistics.median(own),
                       "own_us_per_step_each": own}
    return table


def compare(base: dict[str, dict], other: dict[str, dict], most: int = 25) -> dict:
    """What ``other`` adds to ``base``: the functions whose own time per step grew most,
    and those that run only in ``other`` (with their calls per step)."""
    grown = []
    for name, row in other.items():
        before = base.get(name, {"own_us_per_step": 0.0, "calls_per_step": 0.0})
        grown.append({"function": name, "extra_own_us_per_step": row["own_us_per_step"] - before["own_us_per_step"],
                      "calls_per_step": row["calls_per_step"], "base_calls_per_step": before["calls_per_step"]})
    grown.sort(key=lambda r: r["extra_own_us_per_step"], reverse=True)
    only = sorted(({"function": n, "calls_per_step": r["calls_per_step"], "own_us_per_step": r["own_us_per_step"]}
                   for n, r in other.items() if n not in base and r["calls_per_step"] > 0),
                  key=lambda r: r["own_us_per_step"], reverse=True)
    total = sum(r["own_us_per_step"] for r in other.values()) - sum(r["own_us_per_step"] for r in base.values())
    return {"extra_own_us_per_step_total": total, "grown": grown[:most], "only_here": only[:most]}


def _spawn(args, kind: str, seed: int) -> dict:
    return spawn_phase("tools.profile_decode", kind, [
        "--seed", str(seed), "--model", args.model, "--engine-name", args.engine_name,
        "--context", str(args.context), "--decode-tokens", str(args.decode_tokens),
        "--gpu-memory-utilization", str(args.gpu_memory_utilization)])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=str(ROOT / "tools/models/llama-3.1-8b-shape"))
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--decode-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=1, help="rounds of the three phases (A B C A B C)")
    p.add_argument("--engine-name", default="")
    p.add_argument("--pool-size", default="8GiB")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.6)
    p.add_argument("--most", type=int, default=25, help="functions listed per comparison")
    p.add_argument("--json", metavar="PATH", help="write the report (and each phase's steps) here")
    add_phase_args(p, KINDS)
    p.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.phase:
        write_phase(args, run_phase(args))
        return 0
    runs: dict[str, list[dict]] = {kind: [] for kind in KINDS}
    with engine_unless_named(args.engine_name, "profile", args.pool_size) as args.engine_name:
        seed = 1
        for _ in range(args.repeats):
            for kind in KINDS:
                runs[kind].append(_spawn(args, kind, seed))
                seed += 1
    tables = {kind: per_step(phases) for kind, phases in runs.items()}
    report = {"gpu": runs["none"][0]["gpu"], "context": args.context, "decode_tokens": args.decode_tokens,
              "steps": {k: [p["steps"] for p in v] for k, v in runs.items()},
              "tpot_ms_under_profiler": {k: [p["tpot_ms_under_profiler"] for p in v] for k, v in runs.items()},
              **{f"{kind}_vs_none": compare(tables["none"], tables[kind], args.most) for kind in ("idle", "saving")}}
    for kind in ("idle", "saving"):
        c = report[f"{kind}_vs_none"]
        print(f"{kind} vs none: {c['extra_own_us_per_step_total']:+.0f} us of own time per step (under the profiler)")
        for row in c["grown"][:10]:
            print(f"  {row['extra_own_us_per_step']:+8.1f} us  {row['calls_per_step']:6.1f} calls/step "
                  f"(none {row['base_calls_per_step']:.1f})  {row['function']}")
        for row in c["only_here"][:10]:
            print(f"  only here: {row['own_us_per_step']:8.1f} us  {row['calls_per_step']:6.1f} calls/step  "
                  f"{row['function']}")
    if args.json:
        Path(args.json).write_text(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
