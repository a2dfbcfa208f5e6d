"""A ``vllm serve`` process and its HTTP API, as the serving benches (``bench_serving``,
``bench_replicas``, ``bench_pd``) drive it: dummy weights, token-id prompts.

- ``server_command(config, args, engine_name, peer_args)``: the ``vllm serve`` command line of a
  configuration (``none``, ``native``, pegaflow's, a peer's ``--kv-transfer-config``);
- ``Server``: the process, up once /health answers, in a process group of its own that is stopped
  whole however the bench ends (``tools/lib/processes.py``);
- ``complete`` / ``run_all``: streamed token-id completions, timed (``RequestResult``);
- ``counters`` / ``hits_of`` / ``reset_gpu_cache``: its /metrics (prefix-cache hits by source,
  pegaflow's connector counters) and ``POST /reset_prefix_cache`` retried until it succeeds.
"""

from __future__ import annotations

import concurrent.futures
import http.client
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from tools.lib import processes
from tools.lib.serving_setup import connector_options, pegaflow_transfer_args
from tools.lib.warm_pass import BY_SOURCE, SOURCES, empty_gpu_cache
from tools.serving_workload import RequestResult

ROOT = Path(__file__).resolve().parents[2]
SERVED_NAME = "bench"
START_TIMEOUT_S = 600.0
REQUEST_TIMEOUT_S = 600.0


def complete(port: int, prompt: list[int], max_tokens: int, key: str, host: str = "127.0.0.1",
             chunk_times: list[float] | None = None) -> RequestResult:
    """One streamed token-id completion; the first chunk carrying tokens is the first token.
    ``chunk_times`` gets the arrival time of every chunk that carries tokens (their gaps are
    the inter-token latencies)."""
    body = json.dumps({"model": SERVED_NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
                       "ignore_eos": True, "stream": True, "return_token_ids": True,
                       "stream_options": {"include_usage": True}})
    started = time.monotonic()
    first = done = 0.0
    tokens: list[int] = []
    cached: int | None = None
    conn = http.client.HTTPConnection(host, port, timeout=REQUEST_TIMEOUT_S)
    try:
        conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
        response = conn.getresponse()
        if response.status != 200:
            return RequestResult(key, len(prompt), [], started, started, time.monotonic(),
                                 error=f"HTTP {response.status}: {response.read()[:200]!r}")
        for raw in response:
            line = raw.strip()
            if not line.startswith(b"data:") or (data := line[5:].strip()) == b"[DONE]":
                continue
            chunk = json.loads(data)
            ids = [t for choice in chunk.get("choices") or [] for t in choice.get("token_ids") or []]
            details = (chunk.get("usage") or {}).get("prompt_tokens_details") or {}
            if details.get("cached_tokens") is not None:  # the last chunk: usage
                cached = int(details["cached_tokens"])
            if ids and chunk_times is not None:
                chunk_times.append(time.monotonic())
            if ids and not first:
                first = chunk_times[-1] if chunk_times else time.monotonic()
            tokens += ids
        done = time.monotonic()
    except (OSError, http.client.HTTPException, json.JSONDecodeError) as exc:
        return RequestResult(key, len(prompt), tokens, started, first or started, time.monotonic(),
                             error=f"{type(exc).__name__}: {exc}")
    finally:
        conn.close()
    if not tokens:  # answered, but with no token: not a result to time
        return RequestResult(key, len(prompt), [], started, done, done, error="no token in the answer")
    return RequestResult(key, len(prompt), tokens, started, first, done, cached_tokens=cached)


def run_all(port: int, jobs: list[tuple[str, list[int], float]], max_tokens: int,
            concurrency: int) -> list[RequestResult]:
    """``jobs``: (key, prompt, send at seconds from now); at most ``concurrency`` in flight."""
    t0 = time.monotonic()

    def one(job):
        key, prompt, at = job
        time.sleep(max(0.0, t0 + at - time.monotonic()))
        return complete(port, prompt, max_tokens, key)

    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, concurrency)) as pool:
        return list(pool.map(one, jobs))


def _get(port: int, path: str, method: str = "GET") -> str:
    request = urllib.request.Request(f"http://127.0.0.1:{port}{path}", method=method)
    with urllib.request.urlopen(request, timeout=30) as response:
        return response.read().decode()


HIT_COUNTERS = ("vllm:external_prefix_cache_hits_total", "vllm:prefix_cache_hits_total")  # host, own GPU
PEGAFLOW_SERIES = ("_total", "_seconds_sum", "_seconds_count")


def counters(port: int) -> dict[str, float]:
    """The server's counters a run reports (summed over their labels): vLLM's prefix-cache hits
    (external and its own GPU's), its prompt tokens by source where it has them (one key per
    source, ``vllm:prompt_tokens_by_source:SOURCE``) and every ``vllm:pegaflow_*`` counter
    (lookup deferrals, blocks loaded...) and latency histogram's sum and count."""
    from prometheus_client.parser import text_string_to_metric_families
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(_get(port, "/metrics")):
        for sample in family.samples:
            name = sample.name
            if name in (BY_SOURCE, BY_SOURCE + "_total") and sample.labels.get("source") in SOURCES:
                name = f"{BY_SOURCE}:{sample.labels['source']}"
            elif not (name in HIT_COUNTERS or (name.startswith("vllm:pegaflow_") and name.endswith(PEGAFLOW_SERIES))):
                continue
            out[name] = out.get(name, 0.0) + sample.value
    return out


def by_source_of_counters(found: dict[str, float]) -> dict[str, int] | None:
    """``vllm:prompt_tokens_by_source`` per source, of a server's ``counters()`` (summed over
    engines); None when this vLLM has no such counter."""
    if not any(f"{BY_SOURCE}:{source}" in found for source in SOURCES):
        return None
    return {source: int(found.get(f"{BY_SOURCE}:{source}", 0.0)) for source in SOURCES}


def reset_gpu_cache(port: int, external: bool = False) -> float:
    """Empty the server's GPU prefix cache: ``POST /reset_prefix_cache`` until it answers
    ``{"success": true}`` (it refuses while a connector's saves hold blocks; tools/lib/warm_pass.py);
    the seconds that took.  ``external``: its connector's cache too (``?reset_external=true``:
    vLLM calls the connector's ``reset_cache``; native offloading's CPU cache is emptied)."""
    path = "/reset_prefix_cache?reset_external=true" if external else "/reset_prefix_cache"
    return empty_gpu_cache(lambda: json.loads(_get(port, path, method="POST"))["success"])


def reset_connector_cache(port: int) -> bool:
    """``POST /reset_prefix_cache?reset_external=true`` once: whether the server's GPU prefix
    cache and its connector's cache were both reset (vLLM calls the connector's ``reset_cache``;
    pegaflow's drops its model's blocks in the engine, and False says the engine did not)."""
    return bool(json.loads(_get(port, "/reset_prefix_cache?reset_external=true", method="POST"))["success"])


def hits_of(found: dict[str, float]) -> dict[str, float]:
    """Prefix-cache hits (tokens) in a server's ``counters()``: its GPU cache's and the
    external (host) ones.  From ``vllm:prompt_tokens_by_source`` where this vLLM has it (added
    once per request, at its first output; on the GPU it agreed with the connector's own
    count of tokens found to 0.2 %, docs/replicas.md's runs); else from the
    hit counters, which count a request again each time it is scheduled (an asynchronous
    load schedules it twice)."""
    if (by_source := by_source_of_counters(found)) is not None:
        return {"gpu_hit_tokens": float(by_source["local_cache_hit"]),
                "host_hit_tokens": float(by_source["external_kv_transfer"])}
    return {"gpu_hit_tokens": found.get("vllm:prefix_cache_hits_total", 0.0),
            "host_hit_tokens": found.get("vllm:external_prefix_cache_hits_total", 0.0)}


def hit_counters(port: int) -> dict[str, float]:
    """``hits_of`` a server's counters now."""
    return hits_of(counters(port))


def external_hit_tokens(port: int) -> float:
    return hit_counters(port)["host_hit_tokens"]


def server_command(config: str, args, engine_name: str, peer_args: list[str] | None = None) -> list[str]:
    """``peer_args``: a peer's ``--kv-transfer-config`` (``tools/lib/peers.py``'s ``Plan.serve_args``)."""
    cmd = [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", str(Path(args.model).resolve()),
           "--load-format", "dummy",
           "--skip-tokenizer-init", "--served-model-name", SERVED_NAME, "--port", str(args.port),
           "--enable-prompt-tokens-details",  # each answer's usage says how many prompt tokens were cached
           "--seed", "0", "--max-model-len", str(args.max_model_len),
           "--gpu-memory-utilization", str(args.gpu_memory_utilization),
           "--num-gpu-blocks-override", str(args.gpu_blocks)]
    if args.eager:
        cmd.append("--enforce-eager")
    if config == "native":
        cmd += ["--kv-offloading-size", str(args.host_gib), "--kv-offloading-backend", "native"]
    elif (options := connector_options(config)) is not None:
        cmd += pegaflow_transfer_args(engine_name, **options)
    return cmd + list(peer_args or ())


class Server:
    """A ``vllm serve`` process, up once /health answers; its log in ``log_path``.  ``extra_env``
    may set PYTHONPATH whole (a peer's package ahead of this repo's) and ``cwd`` move it out of
    the repository (``tools/lib/peers.py`` says why)."""

    def __init__(self, cmd: list[str], port: int, log_path: Path, extra_env: dict | None = None,
                 cwd: Path | None = None, wait: bool = True, leftovers=None):
        env = dict(os.environ, PYTHONHASHSEED="0", VLLM_SERVER_DEV_MODE="1", PYTHONUNBUFFERED="1",
                   PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
        env.update(extra_env or {})
        self.port, self.log_path, self.log = port, log_path, open(log_path, "w")
        self.launched = time.monotonic()
        # its own process group, stopped whole (its engine core too) however the bench ends
        self.proc = processes.start(cmd, label=f"vllm serve :{port}", stop_signal=signal.SIGINT,
                                    stop_timeout_s=60.0, leftovers=leftovers, cwd=cwd or ROOT, env=env,
                                    stdout=self.log, stderr=subprocess.STDOUT)
        if wait:
            self.wait_ready()

    def wait_ready(self) -> float:
        """Waits for /health to answer; the seconds from launch (stopped and raised if it exits
        or is not up within ``START_TIMEOUT_S``)."""
        deadline = self.launched + START_TIMEOUT_S
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vllm serve exited ({self.proc.returncode}); see {self.log_path}")
            try:
                _get(self.port, "/health")
                return time.monotonic() - self.launched
            except OSError:
                if time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(f"vllm serve not up after {START_TIMEOUT_S:.0f}s; see {self.log_path}")
                time.sleep(0.5)

    def stop(self) -> None:
        processes.stop(self.proc)
        self.log.close()
