"""Every shared cache on every workload, one fleet per configuration (GPU): two ``vllm serve``
replicas serve the multi-round serving, the scrubbed warm TTFT, then the replicas chat behind a
round-robin router ``--repeat`` times and the rolling restart, one after another.

    python -m tools.bench_peers --configs none --repeat 1 --out-dir $OUT       # one call each
    python -m tools.bench_peers --configs pegaflow --restart --out-dir $OUT
    python -m tools.bench_peers --merge-ttft out/*.ttft.json --json ttft.json   # then, anywhere

Per configuration (``tools/lib/peers.py`` for the peers), in one set of processes (its side process
first: pegaflow's engine or the peer's server, with ``--host-gib``; then the replicas, all started
at once, each ``--gpu-blocks`` of GPU cache and ``--worker-extension-cls`` for the scrub):

1. ``bench_serving``'s multi-round chat (and shared prefix, ``--prefix-requests``) on replica 0, a
   fresh server as that bench's are (``tools/lib/serving_run.py``: ``--serving-users`` users, seed
   ``--seed`` + 1);
2. the GPU prefix caches and every host cache that one call empties (``tools/lib/cache_reset.py``;
   pegaflow's is not: that takes an engine restart, and its pool holds the serving's blocks beside
   the TTFT's without evicting, none of them a hit), then the warm TTFT on replica 0
   (``tools/lib/served_ttft.py``: ``--ttft-prompts`` prompts of ``--ttft-prompt-tokens``, cold, then
   on a scrubbed GPU cache, the first token's top-5 logprobs kept);
3. the chat of ``bench_replicas`` (``tools/lib/replica_workloads.py``: ``--users`` users, ``--rounds``
   rounds, every turn routed), ``--repeat`` times with the same prompts, every cache emptied before
   each (``tools/lib/cache_reset.py`` says how, per configuration); each repeat's round 0 must be
   served nothing from any cache (``round0_hit_tokens``); ``--restart``: after the last repeat,
   replica 0 stopped, started again and sent one more round.

After each step the configuration's files in ``--out-dir`` are rewritten (a call cut short keeps
what it finished): ``CONFIG.serving.json`` (``bench_serving --merge`` reads it),
``CONFIG.ttft.json`` (``--merge-ttft`` turns the files of every configuration into bench_ttft's
rows for ``tools/peers_table.py``) and ``CONFIG.replicas.json`` (``bench_replicas --merge``: one
run per repeat).  A peer that fails keeps ``failed`` in ``CONFIG.failed.json``; the next goes on.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from types import SimpleNamespace

from tools.lib import cache_reset, peers, processes, served_ttft
from tools.lib.fleet import Fleet
from tools.lib.gpu import gpu_name
from tools.lib.replica_workloads import run_workloads
from tools.lib.runs import add_chat_args, available_configs, recorded_args
from tools.lib.scrub_extension import SERVE_ARGS
from tools.lib.serving_run import measure, record
from tools.lib.serving_setup import PEGAFLOW_CONFIGS, side_processes
from tools.lib.ttft_configs import config_rows
from tools.lib.ttft_phase import random_prompts
from tools.replica_router import ROUTERS

ROOT = Path(__file__).resolve().parent.parent
WORKLOADS = ("chat", "ttft", "serving")
RESET_SEED = 7100  # the short requests after each emptying: prompts no workload sends


class Files:
    """One configuration's files in ``out_dir``, each rewritten whole when it grows, each with the
    card, the model and the arguments its workload ran with (the ones a ``--merge`` reports)."""

    def __init__(self, out_dir: Path, config: str, args):
        self.out_dir, self.config, self.args = out_dir, config, args
        self.head = {"gpu": gpu_name(), "model": args.model, "config": config}

    def write(self, kind: str, body: dict, args=None) -> None:
        path = self.out_dir / f"{self.config}.{kind}.json"
        recorded = recorded_args(args or self.args)
        path.write_text(json.dumps(self.head | {"args": recorded} | body, indent=1))


def run_config(config: str, args, out_dir: Path, log_dir: Path) -> None:
    files, name = Files(out_dir, config, args), f"peers{os.getpid()}"
    split = args.replicas if config == "lmcache" else 1  # LMCache in vLLM's process: a private cache each
    with side_processes(config, name, args.engine_arg, args.host_gib, log_dir, config,
                        peer_pool_bytes=(args.host_gib << 30) // split, engine_start_timeout_s=600,
                        num_vllms=args.replicas // split) as sides:
        fleet = Fleet(config, args, name, log_dir, config, sides.plan, SERVE_ARGS)
        try:
            if "serving" in args.workloads:  # a fresh server, as bench_serving's
                one = serving_args(args)
                run = record(config, f"{config}-serving", one, measure(fleet.port(0), one, f"{config} serving"),
                             sides.engine_stats(), None)
                files.write("serving", {"runs": [run]}, one)
            if "ttft" in args.workloads:
                # pegaflow's engine keeps the serving's blocks: no prompt of the TTFT's can hit them, and
                # its pool holds both without evicting
                reset = cache_reset.empty_caches(config, fleet, sides, args.seed + RESET_SEED, empty_engine=False)
                with processes.phase(None, f"{config} warm TTFT"):
                    phase = served_ttft.measure(fleet.port(0), config, _ttft_prompts(args))
                files.write("ttft", {"phase": phase | {"reset_before": reset}})
            if "chat" in args.workloads:
                _chat(config, args, fleet, sides, files)
        finally:
            fleet.close()


def _chat(config: str, args, fleet: Fleet, sides, files: Files) -> None:
    """The chat ``--repeat`` times, every cache emptied before each (the same prompts each time)."""
    runs = []
    for k in range(args.repeat):
        reset = cache_reset.empty_caches(config, fleet, sides, args.seed + RESET_SEED + 10 * (k + 1))
        one = SimpleNamespace(**vars(args) | {"restart": args.restart and k == args.repeat - 1})
        run = run_workloads(config, one, fleet, f"{config}-k{k}")
        runs.append(run | {"engine": sides.engine_stats(), "repeat": k, "reset_before": reset})
        print(json.dumps({"config": config, "repeat": k, "later_rounds_wall_s": run["later_rounds_wall_s"],
                          "ttft_p50_ms": run["later_rounds"]["ttft_p50_ms"],
                          "round0_hit_tokens": run["round0_hit_tokens"]}), flush=True)
        files.write("replicas", {"replicas": args.replicas, "router": args.router, "runs": runs})


def serving_args(args) -> SimpleNamespace:
    """bench_serving's workload on one replica: its users, its seed (not the chat's prompts)."""
    return SimpleNamespace(**vars(args) | {"users": args.serving_users, "seed": args.seed + 1,
                                           "arrival_rate": float("inf")})


def _ttft_prompts(args) -> list[list[int]]:
    vocab = json.loads((Path(args.model) / "config.json").read_text())["vocab_size"]
    return random_prompts(1, args.ttft_prompts, args.ttft_prompt_tokens, vocab)


def run_or_fail(config: str, args, out_dir: Path, log_dir: Path) -> None:
    """``run_config``; a peer that fails at run time leaves ``failed`` in its files, and the next
    configuration runs."""
    from pegaflow.platform.errors import PeerError
    try:
        run_config(config, args, out_dir, log_dir)
    except (PeerError, RuntimeError, OSError) as exc:  # (OSError: a server's HTTP call)
        if config not in peers.PEERS:
            raise
        print(f"bench_peers: {config} failed: {exc}", file=sys.stderr, flush=True)
        Files(out_dir, config, args).write("failed", {"failed": str(exc)})


def merge_ttft(paths: list[str]) -> dict:
    """bench_ttft's rows (``tools/lib/ttft_configs.py``) of the ``CONFIG.ttft.json`` files (a
    ``CONFIG.failed.json`` among them: that configuration's row says why it has no figures)."""
    files = [json.loads(Path(path).read_text()) for path in paths]
    failed = {f["config"]: {"failed": f["failed"]} for f in files if "failed" in f}
    files = [f for f in files if "failed" not in f]
    gpus = sorted({f["gpu"] for f in files})
    if len(gpus) != 1:
        raise SystemExit(f"bench_peers: the TTFT files ran on {gpus}: one card's run only")
    phases = {f["config"]: f["phase"] for f in files}
    for needed in ("none", "pegaflow"):
        if needed not in phases:
            raise SystemExit(f"bench_peers: no {needed} among the TTFT files: its row is the reference")
    rows = config_rows(phases["pegaflow"], phases.get("native"), phases["none"],
                       {c: p for c, p in phases.items() if c in peers.PEERS})
    rows |= {config: row for config, row in failed.items() if config not in rows}  # why, instead of figures
    return {"gpu": gpus[0], "model": files[0]["model"], "method": "vllm serve, POST /v1/completions of one token "
            "with top-5 logprobs, one prompt at a time, on one replica of a two-replica fleet", "configs": rows}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--configs", nargs="+", default=["none"],
                   choices=["none", "native", *PEGAFLOW_CONFIGS, *peers.PEERS],
                   help="lmcache (in vLLM's process, a private cache each: the budget split) only with --repeat 1")
    p.add_argument("--workloads", nargs="+", choices=WORKLOADS, default=list(WORKLOADS))
    p.add_argument("--model", default=str(ROOT / "tools/models/llama-3.1-8b-shape"))
    add_chat_args(p, users=32)
    p.set_defaults(repeat=3, merge=[])  # --repeat: the chat's repeats in one fleet, every cache emptied between
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--router", choices=ROUTERS, default="round-robin")
    p.add_argument("--restart", action="store_true", help="after the last repeat, restart replica 0, one more round")
    p.add_argument("--restart-warmup", type=int, default=1, metavar="N")
    p.add_argument("--gpu-blocks", type=int, default=4000, help="each replica's GPU KV cache, in blocks")
    p.add_argument("--host-gib", type=int, default=64, help="the host cache, in all (native: split evenly)")
    p.add_argument("--max-model-len", type=int, default=16384)
    p.add_argument("--port", type=int, default=8011, help="replica i listens on port + i")
    p.add_argument("--start", choices=("at-once", "together", "one-by-one"), default="at-once",
                   help="at-once: every replica launched together even while vLLM's compile cache is cold "
                        "(each configuration compiles its own graphs; they write the same cache safely)")
    p.add_argument("--ttft-prompts", type=int, default=8)
    p.add_argument("--ttft-prompt-tokens", type=int, default=10000)
    # 20 users of 8 000 tokens: 2.6x one replica's 4 000 GPU blocks (bench_serving: 12 users, 2 500 blocks)
    p.add_argument("--serving-users", type=int, default=20)
    # 26 x 4 000 tokens: 1.6x a replica's GPU cache, as bench_serving's 16 over 2 500 blocks
    p.add_argument("--prefixes", type=int, default=26)
    p.add_argument("--prefix-tokens", type=int, default=4000)
    p.add_argument("--prefix-requests", type=int, default=0, help="shared-prefix requests after the "
                   "multi-round chat (0: none; 104 keeps bench_serving's 4 a prefix)")
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--engine-arg", action="append", default=[], metavar="FLAG")
    p.add_argument("--log-dir", default="/tmp/bench_peers")
    p.add_argument("--out-dir", help="where each configuration's files go (rewritten after each step)")
    p.add_argument("--merge-ttft", nargs="+", default=[], metavar="JSON", help="run nothing: bench_ttft's rows "
                   "of these CONFIG.ttft.json files (--json: write them there, else print)")
    p.add_argument("--json", metavar="PATH")
    args = p.parse_args(argv)
    if not args.merge_ttft and not args.out_dir:
        p.error("--out-dir is needed to run (or --merge-ttft to merge)")
    if args.repeat > 1 and not all(cache_reset.can_empty(c) for c in args.configs):
        p.error(f"--repeat {args.repeat}: the cache of {args.configs} cannot be emptied in one fleet")
    args.gpu_memory_utilization = round(0.85 / args.replicas, 3)
    # bench_replicas's workloads that this bench does not run
    args.trace, args.doc_requests, args.docs, args.doc_tokens, args.burst_docs = False, 0, 0, 0, 0
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.merge_ttft:
        text = json.dumps(merge_ttft(args.merge_ttft), indent=1)
        if args.json:
            Path(args.json).write_text(text)
        else:
            print(text)
        return 0
    processes.handle_signals()  # SIGTERM / timeout: every engine, server and vLLM stopped
    out_dir, log_dir = Path(args.out_dir), Path(args.log_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    log_dir.mkdir(parents=True, exist_ok=True)
    for config in available_configs(args.configs):
        with processes.phase(None, f"{config} (every workload)"):
            run_or_fail(config, args, out_dir, log_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
