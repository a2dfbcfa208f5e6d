"""N ``vllm serve`` replicas of one configuration on one GPU (``bench_replicas``): started
together or one by one, each stopped, restarted and scraped on its own, their step timelines
and pegaflow warnings read from their logs.  ``send_all`` sends requests to chosen replicas.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
from pathlib import Path
from types import SimpleNamespace

from tools import step_timeline
from tools.lib import processes
from tools.lib.serving_setup import is_pegaflow, peer_leftovers, vllm_settings
from tools.lib.vllm_serve import Server, complete, counters, reset_gpu_cache, server_command
from tools.serving_workload import RequestResult

BLOCK_SIZE = 16


def compile_cache_warm() -> bool:
    """Whether vLLM's compile cache on this machine holds anything yet."""
    cache_home = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    root = os.environ.get("VLLM_CACHE_ROOT") or cache_home / "vllm"
    cache = Path(root) / "torch_compile_cache"
    return cache.is_dir() and any(cache.iterdir())


def kv_cache_bytes(model: str, blocks: int) -> int:
    """The GPU memory ``blocks`` KV blocks of ``model`` take (16-token blocks, 2-byte cache),
    from its ``config.json``."""
    config = json.loads((Path(model) / "config.json").read_text())
    heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    per_token = 2 * config["num_hidden_layers"] * config.get("num_key_value_heads", heads) * head_dim * 2
    return blocks * BLOCK_SIZE * per_token


class Fleet:
    """N ``vllm serve`` replicas of one configuration on ports ``port``, ``port+1``, ...

    ``--start together`` (the default) launches them at once, each with its KV cache given
    (``--kv-cache-memory-bytes`` beside ``--num-gpu-blocks-override``) so that no replica's
    memory profile counts another's allocations; where vLLM's compile cache is still empty,
    replica 0 starts alone first (it fills the cache) and the rest together after it.
    ``at-once`` launches them together even then (each compiles; the cache is keyed by what
    changes the graphs, so configurations may need their own entries anyway: a connector that
    makes vLLM run piecewise CUDA graphs, native offloading's settings).
    ``one-by-one`` starts each after the previous one is up."""

    def __init__(self, config: str, args, engine_name: str, log_dir: Path, tag: str, plan=None,
                 extra_args: tuple[str, ...] = ()):
        self.config, self.args, self.engine_name, self.log_dir, self.tag = config, args, engine_name, log_dir, tag
        self.plan = plan  # a peer's settings (tools/lib/peers.py), shared by every replica
        self.extra_args = extra_args  # more ``vllm serve`` arguments, the same for every replica
        self.servers: list[Server | None] = [None] * args.replicas
        self.ready_s: list[float] = [0.0] * args.replicas
        try:
            self._start_all()
        except BaseException:  # one that would not start: the others go too (the GPU memory they hold)
            self.close()
            raise

    def port(self, replica: int) -> int:
        return self.args.port + replica

    def _start_all(self) -> None:
        a = self.args
        if a.start == "one-by-one":
            for replica in range(a.replicas):
                self.start(replica)
            return
        rest = range(a.replicas)
        if a.start == "together" and not (a.eager or compile_cache_warm()):  # replica 0 fills the cache alone
            self.start(0)
            rest = range(1, a.replicas)
        with processes.phase(None, f"{self.tag} replicas {list(rest)} start"):
            for replica in rest:
                self.launch(replica)
            for replica in rest:
                self.ready_s[replica] = round(self.servers[replica].wait_ready(), 2)

    def launch(self, replica: int) -> Server:
        """Launches one replica (not waiting for it to be up)."""
        a = self.args
        one = SimpleNamespace(**vars(a))
        one.port = self.port(replica)
        one.host_gib = max(1, a.host_gib // a.replicas) if self.config == "native" else a.host_gib
        log_path = self.log_path(replica)
        peer_args, env, cwd = vllm_settings(self.plan)
        if (trace_path := self.trace_path(replica)) is not None:  # the connector's step timeline
            logging_path = self.log_dir / f"{self.tag}.r{replica}.logging.json"
            logging_path.write_text(json.dumps(step_timeline.logging_config(trace_path)))
            env["VLLM_LOGGING_CONFIG_PATH"] = str(logging_path)
        cmd = server_command(self.config, one, self.engine_name, peer_args) + list(self.extra_args)
        if a.start != "one-by-one":
            cmd += ["--kv-cache-memory-bytes", str(kv_cache_bytes(a.model, a.gpu_blocks))]
        self.servers[replica] = Server(cmd, one.port, log_path, env, cwd, wait=False,
                                       leftovers=peer_leftovers(self.plan))
        return self.servers[replica]

    def start(self, replica: int) -> float:
        """Starts one replica; its time from launch to /health answering."""
        with processes.phase(None, f"{self.tag} replica {replica} start"):
            self.ready_s[replica] = round(self.launch(replica).wait_ready(), 2)
        return self.ready_s[replica]

    def log_path(self, replica: int) -> Path:
        """Replica ``replica``'s vllm serve log."""
        return self.log_dir / f"{self.tag}.r{replica}.log"

    def trace_path(self, replica: int) -> Path | None:
        """Where replica ``replica``'s step timeline goes (``--trace``, pegaflow only)."""
        if not (self.args.trace and is_pegaflow(self.config)):
            return None
        return self.log_dir / f"{self.tag}.r{replica}.trace.log"

    def step_timelines(self, window: tuple[float, float]) -> dict[int, dict] | None:
        """Per replica, its steps that loaded within ``window`` (``tools/step_timeline.py``)."""
        if self.trace_path(0) is None:
            return None
        out = {}
        for replica in range(self.args.replicas):
            path = self.trace_path(replica)
            lines = path.read_text().splitlines() if path.exists() else []
            out[replica] = step_timeline.summarize(step_timeline.parse(lines), *window)
        return out

    def stop(self, replica: int) -> None:
        if (server := self.servers[replica]) is not None:
            server.stop()
            self.servers[replica] = None

    def counters(self) -> dict[int, dict[str, float]]:
        """Each replica's counters now (``tools/lib/vllm_serve.py`` ``counters``: one scrape of its /metrics)."""
        return {r: counters(self.port(r)) for r in range(self.args.replicas)}

    def reset_prefix_caches(self) -> float:
        """Empty every replica's GPU prefix cache (each reset retried until vLLM accepts it);
        the seconds that took."""
        return sum(reset_gpu_cache(self.port(replica)) for replica in range(self.args.replicas))

    def close(self) -> None:
        """Every replica stopped, all at once (each waits for its vLLM to exit)."""
        with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, self.args.replicas)) as pool:
            list(pool.map(self.stop, range(self.args.replicas)))

    def warnings(self, most: int = 20) -> dict[int, list[str]]:
        """Per replica, the first ``most`` WARNING or ERROR lines of its log that name pegaflow."""
        out = {}
        for replica in range(self.args.replicas):
            path = self.log_path(replica)
            lines = path.read_text(errors="replace").splitlines() if path.exists() else []
            out[replica] = [line[-400:] for line in lines
                            if ("WARNING" in line or "ERROR" in line) and "pegaflow" in line][:most]
        return out


def send_all(fleet: Fleet, jobs: list[tuple[str, list[int], int]], max_tokens: int,
             concurrency: int) -> list[RequestResult]:
    """``jobs``: (key, prompt, replica); at most ``concurrency`` in flight."""
    def one(job):
        key, prompt, replica = job
        return complete(fleet.port(replica), prompt, max_tokens, key)

    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, concurrency)) as pool:
        return list(pool.map(one, jobs))
