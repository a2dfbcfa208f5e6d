"""Decode speed (TPOT) on real vLLM: no connector, pegaflow idle (no save, no load), and
pegaflow saving, each phase its own vLLM process, phases interleaved (A B C A B C).

    python -m tools.bench_decode --model tools/models/llama-3.1-8b-shape [--json]
    python -m tools.bench_decode --modes graphs --out-dir raw/ ...   # each phase saved as it ends
    python -m tools.bench_decode --from-dir raw/ more/ --json        # the table of saved phases

For each compilation mode (vLLM's default, CUDA graphs on; and ``--enforce-eager``), each
batch size and context length: TPOT of every request from vLLM's own first/last-token
timestamps.  A batch's prompts are first put in vLLM's GPU prefix cache (one token each),
so the timed batch prefills in one step and then only decodes; with pegaflow saving, the
blocks its decode completes are stored.  Each phase uses prompts of its own, so nothing
is a hit.  The cudagraph mode vLLM chose is printed beside each phase's figures.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from tools.lib.decode import KINDS, decode_llm, random_prompts
from tools.lib.gpu import gpu_name
from tools.lib.phases import add_phase_args, engine_unless_named, spawn_phase, write_phase

ROOT = Path(__file__).resolve().parent.parent
def _tpots(llm, prompts: list[list[int]], batch: int, decode_tokens: int) -> list[float]:
    """TPOT (ms) of each request, ``batch`` requests at a time, prompts already cached."""
    from vllm import SamplingParams, TokensPrompt
    warm = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False)
    timed = SamplingParams(max_tokens=decode_tokens, temperature=0.0, ignore_eos=True, detokenize=False)
    tpots = []
    for start in range(0, len(prompts), batch):
        group = [TokensPrompt(prompt_token_ids=p) for p in prompts[start:start + batch]]
        llm.generate(group, warm, use_tqdm=False)
        for out in llm.generate(group, timed, use_tqdm=False):
            metrics, generated = out.metrics, len(out.outputs[0].token_ids)
            if generated < 2 or not metrics.last_token_ts:
                raise RuntimeError(f"no decode timing from vLLM ({generated} tokens)")
            tpots.append((metrics.last_token_ts - metrics.first_token_ts) * 1e3 / (generated - 1))
    return tpots


def run_phase(args) -> dict:
    """One vLLM process: every (batch, context) cell of one phase."""
    from transformers import AutoConfig
    vocab = AutoConfig.from_pretrained(args.model).vocab_size
    llm = decode_llm(args)
    mode = llm.llm_engine.vllm_config.compilation_config.cudagraph_mode
    _tpots(llm, random_prompts(args.seed, max(args.batches), 256, vocab), max(args.batches), 8)  # warm-up
    cells = {}
    for context in args.contexts:
        for batch in args.batches:
            count = max(batch, args.requests)
            prompts = random_prompts(hash((args.seed, context, batch)) & 0xFFFFFFF, count, context, vocab)
            cells[f"bs{batch}_ctx{context}"] = _tpots(llm, prompts, batch, args.decode_tokens)
    return {"cudagraph_mode": getattr(mode, "name", str(mode)), "tpot_ms": cells,
            "gpu": gpu_name(), "decode_tokens": args.decode_tokens}


def _spawn(args, kind: str, seed: int) -> dict:
    return spawn_phase("tools.bench_decode", kind, [
        "--seed", str(seed), "--mode", args.mode, "--model", args.model, "--engine-name", args.engine_name,
        "--decode-tokens", str(args.decode_tokens), "--requests", str(args.requests),
        "--gpu-memory-utilization", str(args.gpu_memory_utilization),
        "--batches", *map(str, args.batches), "--contexts", *map(str, args.contexts)])


def summarize(runs: list[tuple[str, int, dict]], mode: str) -> dict:
    """Per kind and cell: the median over every request of every repeat, each repeat's
    median (the spread), and the ratios to no connector."""
    out: dict = {"mode": mode}
    cells = sorted({cell for _, _, r in runs for cell in r["tpot_ms"]})
    for kind in KINDS:
        mine = [r for k, _, r in runs if k == kind]
        out[f"cudagraph_mode_{kind}"] = sorted({r["cudagraph_mode"] for r in mine})
        for cell in cells:
            values = [v for r in mine for v in r["tpot_ms"][cell]]
            repeats = [statistics.median(r["tpot_ms"][cell]) for r in mine]
            out[f"{kind}_{cell}_ms"] = statistics.median(values)
            out[f"{kind}_{cell}_repeat_medians_ms"] = repeats
    for kind in ("idle", "saving"):
        for cell in cells:
            out[f"{kind}_vs_none_{cell}"] = out[f"{kind}_{cell}_ms"] / out[f"none_{cell}_ms"]
    return out


def _table(summary: dict) -> list[str]:
    lines = [f"mode {summary['mode']}: vLLM cudagraph mode none={summary['cudagraph_mode_none']} "
             f"idle={summary['cudagraph_mode_idle']} saving={summary['cudagraph_mode_saving']}",
             f"{'cell':<14}{'none ms':>9}{'idle ms':>9}{'saving ms':>11}{'idle/none':>11}"
             f"{'saving/none':>13}  repeat medians none | idle | saving"]
    for key in sorted(k for k in summary if k.startswith("none_") and k.endswith("_ms")
                      and "repeat" not in k):
        cell = key[len("none_"):-len("_ms")]
        spread = " | ".join(",".join(f"{v:.2f}" for v in summary[f"{kind}_{cell}_repeat_medians_ms"])
                            for kind in KINDS)
        lines.append(f"{cell:<14}{summary[key]:>9.2f}{summary[f'idle_{cell}_ms']:>9.2f}"
                     f"{summary[f'saving_{cell}_ms']:>11.2f}{summary[f'idle_vs_none_{cell}']:>11.3f}"
                     f"{summary[f'saving_vs_none_{cell}']:>13.3f}  {spread}")
    return lines


def headline(summaries: dict[str, dict]) -> dict:
    """Every ratio under a flat name (``graphs_saving_vs_none_bs1_ctx1024``), and the
    shortest context's also without its context (``graphs_saving_vs_none_bs1``)."""
    out = {}
    for mode, s in summaries.items():
        out[f"cudagraph_mode_pegaflow_{mode}"] = s["cudagraph_mode_saving"]
        ratios = {k: v for k, v in s.items() if "_vs_none_" in k}
        shortest = min(int(k.rsplit("_ctx", 1)[1]) for k in ratios)
        for key, value in ratios.items():
            out[f"{mode}_{key}"] = value
            if key.endswith(f"_ctx{shortest}"):
                out[f"{mode}_{key.rsplit('_ctx', 1)[0]}"] = value
    if "graphs" in summaries:
        out["cudagraph_mode_pegaflow"] = out["cudagraph_mode_pegaflow_graphs"]
    return out


def _run_phases(args) -> list[tuple[str, str, int, dict]]:
    """Every phase, interleaved (A B C A B C) per mode, against one engine started here."""
    runs, contexts, seed = [], args.contexts, args.first_seed
    with engine_unless_named(args.engine_name, "decode", args.pool_size) as args.engine_name:
        for mode in args.modes:
            args.mode, args.contexts = mode, (args.eager_contexts if mode == "eager" else contexts)
            for _ in range(args.repeats):
                for kind in KINDS:
                    result = _spawn(args, kind, seed)
                    runs.append((mode, kind, seed, result))
                    if args.out_dir:
                        Path(args.out_dir).mkdir(parents=True, exist_ok=True)
                        Path(args.out_dir, f"{mode}_{seed:03d}_{kind}.json").write_text(json.dumps(
                            {"mode": mode, "kind": kind, "seed": seed, **result}))
                    print(f"phase {mode} {kind} (seed {seed}): {result}", file=sys.stderr, flush=True)
                    seed += 1
    return runs


def _saved_runs(dirs: list[str]) -> list[tuple[str, str, int, dict]]:
    """The phases ``--out-dir`` runs saved, in the order they ran (by seed)."""
    saved = [json.loads(f.read_text()) for d in dirs for f in sorted(Path(d).glob("*.json"))]
    saved.sort(key=lambda r: r["seed"])
    return [(r.pop("mode"), r.pop("kind"), r.pop("seed"), r) for r in saved]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=str(ROOT / "tools/models/llama-3.1-8b-shape"))
    p.add_argument("--modes", nargs="+", default=["graphs", "eager"], choices=["graphs", "eager"])
    p.add_argument("--repeats", type=int, default=2, help="rounds of the three phases per mode")
    p.add_argument("--batches", nargs="+", type=int, default=[1, 32])
    p.add_argument("--contexts", nargs="+", type=int, default=[1024, 8192])
    p.add_argument("--eager-contexts", nargs="+", type=int, default=[1024],
                   help="contexts of the eager mode (its decode is ~4x slower)")
    p.add_argument("--requests", type=int, default=16, help="requests per cell, at least")
    p.add_argument("--decode-tokens", type=int, default=96)
    p.add_argument("--engine-name", default="")
    p.add_argument("--pool-size", default="8GiB")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.6)
    p.add_argument("--out-dir", help="also save each phase's raw result here as it ends")
    p.add_argument("--from-dir", nargs="+", help="only summarize phases saved by --out-dir runs")
    p.add_argument("--first-seed", type=int, default=1, help="seed of the first phase (prompts)")
    p.add_argument("--json", action="store_true")
    add_phase_args(p, KINDS)
    p.add_argument("--mode", default="graphs", help=argparse.SUPPRESS)
    p.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.phase:
        write_phase(args, run_phase(args))
        return 0
    runs = _saved_runs(args.from_dir) if args.from_dir else _run_phases(args)
    summaries = {mode: summarize([(k, s, r) for m, k, s, r in runs if m == mode], mode)
                 for mode in dict.fromkeys(m for m, _, _, _ in runs)}
    decode_tokens = {m: sorted({r.get("decode_tokens", args.decode_tokens) for mm, _, _, r in runs
                                if mm == m}) for m in summaries}
    result = {"gpu": sorted({r.get("gpu", "?") for _, _, _, r in runs}), "decode_tokens": decode_tokens,
              **headline(summaries), "modes": summaries,
              "phases": [{"mode": m, "kind": k, "seed": s, **r} for m, k, s, r in runs]}
    if args.json:
        print(json.dumps(result))
    else:
        for mode in summaries:
            print("\n".join(_table(summaries[mode])))
    return 0


if __name__ == "__main__":
    sys.exit(main())
