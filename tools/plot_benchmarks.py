"""Plots of the committed benchmark results, drawn from the raw JSON and written beside it.

    python -m tools.plot_benchmarks [--dir docs/benchmarks] [--format png|svg]

One plot per figure of docs/benchmarks.md's headline, each from one file (the serving, TTFT and
replicas plots from the runs of README's "Why pegaflow" table); every plot names its card,
and bars start at zero:

- ``serving_rounds``: ``vllm serve`` multi-round chat, each round's wall time per server
  configuration (``bench_serving``'s ``runs[].rounds[].wall_s``);
- ``ttft``: a warm 10k-token prompt's time to first token per system, with the cold and
  GPU-hit bounds (``bench_ttft``'s ``configs`` and ``gpu_hit_ms_*``; a peer whose outputs
  differed from no offload's is marked so);
- ``transfer``: save and load rates of a prefix against the pinned-copy PCIe limit measured
  in the same run (``bench_transfer``'s ``rows`` and ``pinned_*_gbps``);
- ``replicas``: two ``vllm serve`` replicas behind a round-robin router, each round's wall time
  and the later rounds' TTFT p50 per configuration (``bench_replicas``'s ``runs[].rounds`` and
  its headline rows).

A source file that is missing, or lacks what its plot reads, is skipped with one line that
says why; the other plots are still drawn.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from pegaflow.platform.errors import PegaflowError

DEFAULT_DIR = Path(__file__).resolve().parent.parent / "docs" / "benchmarks"

CONFIG_LABELS = {
    "none": "no offload",
    "native": "vLLM native offload",
    "pegaflow": "pegaflow",
    "pegaflow-auto": "pegaflow",
    "pegaflow-rs": "PegaFlow (pegaflow-llm)",
    "lmcache": "LMCache, in-process",
    "lmcache-mp": "LMCache MP server",
}
COLORS = {"no offload": "0.55", "vLLM native offload": "tab:orange", "PegaFlow (pegaflow-llm)": "tab:green",
          "LMCache, in-process": "tab:red", "LMCache MP server": "tab:purple",
          "pegaflow": "tab:blue", "pegaflow --hold-saves": "navy"}
PATH_LABELS = {"kernel": "copy kernel", "copy-engine": "copy engine (page by page)", "staged": "staged (default)"}


class PlotDataError(PegaflowError):
    """A benchmark result file lacks what its plot reads."""


@dataclass(frozen=True, slots=True)
class Bar:
    label: str
    median_ms: float
    p90_ms: float | None


@dataclass(frozen=True, slots=True)
class Series:
    label: str
    xs: tuple[float, ...]
    ys: tuple[float, ...]


def _field(record: dict, key: str):
    if key not in record:
        raise PlotDataError(f"no {key!r}")
    return record[key]


def serving_rounds(result: dict, labels: dict[str, str] = CONFIG_LABELS) -> dict[str, list[float]]:
    """Each configuration's round wall times in seconds, in the order the servers ran."""
    rounds = {}
    for run in _field(result, "runs"):
        label = labels.get(run["config"], run["config"])
        rounds[label] = [float(_field(one, "wall_s")) for one in _field(run, "rounds")]
    if not rounds:
        raise PlotDataError("no runs")
    return rounds


def ttft_bars(result: dict) -> list[Bar]:
    """Cold (no connector), warm from each host cache of the run, and a GPU prefix-cache hit:
    median and p90 in ms; a system whose outputs differed from no offload's says so."""
    configs = _field(result, "configs")
    bars = [Bar("cold (recompute), no connector", float(_field(_field(configs, "none"), "ttft_warm_ms")),
                _field(configs, "none").get("ttft_warm_ms_p90"))]
    for config, run in configs.items():
        if config != "none":
            wrong = "" if run.get("outputs_identical", True) else " (outputs wrong)"
            bars.append(Bar(f"warm from {CONFIG_LABELS.get(config, config)}{wrong}",
                            float(_field(run, "ttft_warm_ms")), run.get("ttft_warm_ms_p90")))
    bars.append(Bar("GPU prefix-cache hit (floor)", float(_field(result, "gpu_hit_ms_median")),
                    result.get("gpu_hit_ms_p90")))
    return bars


def transfer_series(result: dict, direction: str) -> tuple[list[Series], float]:
    """GB/s against prefix tokens per copy path (64 KiB pages, the copy alone), and the limit."""
    limit = float(_field(result, f"pinned_{direction}_gbps"))
    series = []
    for path, label in PATH_LABELS.items():
        rows = sorted((row["tokens"], row["gbps"]) for row in _field(result, "rows")
                      if row["through"] == "direct" and row["path"] == path and row["block"] == 16
                      and row["dir"] == direction)
        if rows:
            series.append(Series(label, tuple(r[0] for r in rows), tuple(r[1] for r in rows)))
    engine = [(row["tokens"], row["gbps"]) for row in result["rows"]
              if row["through"] == "engine" and row["path"] == "auto" and row["dir"] == direction]
    if engine:
        label = f"through the engine process (auto, {engine[0][0]} tokens)"
        series.append(Series(label, tuple(r[0] for r in engine), tuple(r[1] for r in engine)))
    if not series:
        raise PlotDataError(f"no {direction} rows")
    return series, limit


def _draw_rounds(ax, rounds: dict[str, list[float]]) -> None:
    width = 0.8 / len(rounds)
    for i, (label, walls) in enumerate(rounds.items()):
        xs = [n + (i - (len(rounds) - 1) / 2) * width for n in range(len(walls))]
        bars = ax.bar(xs, walls, width, label=label, color=COLORS.get(label))
        ax.bar_label(bars, fmt="%.2f", fontsize=7)
    num_rounds = max(len(walls) for walls in rounds.values())
    ax.set_xticks(range(num_rounds), ["round 1 (cold)"] + [f"round {n + 1}" for n in range(1, num_rounds)])
    ax.set_ylabel("round wall time, s (lower is better)")


REPLICA_LABELS = {"none": "no offload", "native": "vLLM native offload", "pegaflow": "pegaflow",
                  "pegaflow-hold": "pegaflow --hold-saves"}


def chat_runs(result: dict) -> dict:
    """``result`` with only its runs that ran bench_replicas's chat (a burst-only run merged
    into the file has no rounds to draw)."""
    return result | {"runs": [run for run in _field(result, "runs") if "rounds" in run]}


def replicas_ttft(result: dict) -> dict[str, float]:
    """The later rounds' TTFT p50 (ms) of each configuration's headline row."""
    ttft = {REPLICA_LABELS.get(config, config): float(_field(result[config], "ttft_p50_ms"))
            for config in dict.fromkeys(run["config"] for run in _field(result, "runs"))}
    if not ttft:
        raise PlotDataError("no runs")
    return ttft


def draw_replicas(result: dict, axes_of: Callable) -> object:
    result = chat_runs(result)
    rounds, ttft = serving_rounds(result, REPLICA_LABELS), replicas_ttft(result)
    figure, axes = axes_of(2)
    _draw_rounds(axes[0], rounds)
    axes[0].set_ylim(0, max(max(walls) for walls in rounds.values()) * 1.35)  # room for the legend
    axes[0].legend(loc="upper right", fontsize=8)
    axes[0].set_title("each round")
    ys = list(range(len(ttft)))[::-1]
    axes[1].barh(ys, list(ttft.values()), color=[COLORS.get(label, "0.55") for label in ttft])
    for y, value in zip(ys, ttft.values()):
        axes[1].text(value + 10, y, f"{value:.0f} ms", va="center")
    axes[1].set_yticks(ys, list(ttft))
    axes[1].set_xlim(0, max(ttft.values()) * 1.25)
    axes[1].set_xlabel("TTFT p50 of the later rounds, ms (lower is better)")
    axes[1].set_title("time to first token")
    args = result.get("args", {})
    context = f"{args.get('context_tokens', 0):,}".replace(",", " ")
    figure.suptitle(f"{result.get('replicas', 2)} vllm serve replicas on one GPU, {result.get('router', '')} router, "
                    f"{args.get('users', '?')} users of {context} tokens, {_field(result, 'gpu')}, CUDA graphs on")
    return figure


def draw_serving_rounds(result: dict, axes_of: Callable) -> object:
    figure, axes = axes_of(1)
    rounds = serving_rounds(result)
    _draw_rounds(axes[0], rounds)
    axes[0].set_ylim(0, max(max(walls) for walls in rounds.values()) * 1.1)
    args = result.get("args", {})
    context = f"{args.get('context_tokens', 0):,}".replace(",", " ")
    axes[0].set_title(f"vllm serve, multi-round chat: {args.get('users', '?')} users of {context} tokens\n"
                      f"{_field(result, 'gpu')}, {'eager' if args.get('eager') else 'CUDA graphs on'}")
    axes[0].legend(loc="center right", fontsize=8)
    return figure


def draw_ttft(result: dict, axes_of: Callable) -> object:
    bars = ttft_bars(result)
    figure, axes = axes_of(1)
    ys = list(range(len(bars)))[::-1]
    colors = [COLORS.get(bar.label.removeprefix("warm from ").removesuffix(" (outputs wrong)"), "0.8")
              for bar in bars]
    drawn = axes[0].barh(ys, [bar.median_ms for bar in bars], color=["0.55", *colors[1:]])
    for patch, bar in zip(drawn, bars):
        patch.set_hatch("//" if "wrong" in bar.label else "")
    for y, bar in zip(ys, bars):
        if bar.p90_ms is not None:
            axes[0].plot([bar.p90_ms], [y], marker="|", markersize=14, color="black")
        axes[0].text(max(bar.median_ms, bar.p90_ms or 0) + 4, y, f"{bar.median_ms:.1f} ms", va="center")
    axes[0].set_yticks(ys, [bar.label for bar in bars])
    axes[0].set_xlabel("time to first token, ms: bar the median, black tick the p90 (lower is better)")
    axes[0].set_xlim(0, max(bar.median_ms for bar in bars) * 1.2)
    axes[0].set_title(f"10 000-token prompt, Llama-3.1-8B shape, one at a time, vLLM offline LLM API\n"
                      f"{_field(result, 'gpu')}, {result.get('compilation', '')}".rstrip(", "), fontsize=9)
    return figure


def draw_transfer(result: dict, axes_of: Callable) -> object:
    figure, axes = axes_of(2)
    for ax, direction, title in ((axes[0], "h2d", "load (pool -> GPU)"), (axes[1], "d2h", "save (GPU -> pool)")):
        series, limit = transfer_series(result, direction)
        for one in series:
            style = {"marker": "*", "markersize": 12, "linestyle": "none"} if one.label.startswith("through") else \
                {"marker": "o"}
            ax.plot(one.xs, one.ys, label=one.label, **style)
        ax.axhline(limit, color="black", linestyle="--", label=f"PCIe limit: one 4 GiB pinned copy, {limit:.1f}")
        ax.set_xscale("log", base=2)
        ticks = sorted({x for one in series for x in one.xs if x & (x - 1) == 0})  # powers of two
        ax.set_xticks(ticks, [str(x) for x in ticks], fontsize=8)
        ax.minorticks_off()
        ax.set_xlabel("prefix tokens (Llama-3.1-8B shape, 64 KiB pages)")
        ax.set_title(title)
        ax.set_ylim(0, limit * 1.08)
    axes[0].set_ylabel("GB/s")
    axes[1].legend(loc="lower right", fontsize=8)
    figure.suptitle(f"KV transfer against the PCIe limit, {_field(result, 'gpu')}, {result.get('date', '')}")
    return figure


@dataclass(frozen=True, slots=True)
class Plot:
    name: str
    source: str
    draw: Callable


PLOTS = (
    Plot("serving_rounds", "serving_peers.json", draw_serving_rounds),
    Plot("ttft", "ttft_peers.json", draw_ttft),
    Plot("transfer", "transfer.json", draw_transfer),
    Plot("replicas", "replicas.json", draw_replicas),
)


def _axes_of(num_panels: int):
    import matplotlib.pyplot as plt
    figure, axes = plt.subplots(1, num_panels, figsize=(6.5 * num_panels if num_panels > 1 else 9, 5),
                                squeeze=False)
    return figure, list(axes[0])


def write_plot(plot: Plot, directory: Path, fmt: str) -> Path:
    """Draws ``plot`` from its source in ``directory``; raises FileNotFoundError or PlotDataError."""
    import matplotlib.pyplot as plt
    with open(directory / plot.source) as source:
        result = json.load(source)
    try:
        figure = plot.draw(result, _axes_of)
    except PlotDataError as exc:
        plt.close("all")
        raise PlotDataError(f"{plot.source}: {exc}") from exc
    except (KeyError, TypeError, ValueError) as exc:
        plt.close("all")
        raise PlotDataError(f"{plot.source}: unexpected layout ({exc!r})") from exc
    out = directory / f"{plot.name}.{fmt}"
    figure.tight_layout()
    figure.savefig(out, dpi=110, metadata={"Software": None} if fmt == "png" else {"Date": None})
    plt.close(figure)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", type=Path, default=DEFAULT_DIR, help="where the JSON is and the plots go")
    parser.add_argument("--format", choices=("png", "svg"), default="png")
    args = parser.parse_args(argv)
    import matplotlib
    matplotlib.use("Agg")
    for plot in PLOTS:
        try:
            print(f"wrote {write_plot(plot, args.dir, args.format)}")
        except FileNotFoundError:
            print(f"skip {plot.name}: {args.dir / plot.source} not found")
        except (PlotDataError, json.JSONDecodeError) as exc:
            print(f"skip {plot.name}: {exc}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
