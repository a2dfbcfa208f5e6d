"""The peers a benchmark measures pegaflow against, each run with vLLM the way its own
documentation runs it, so that every system stands in the same table of the same run.

Configurations (``PEERS``):

- ``lmcache``: LMCache inside vLLM's process, through vLLM's ``LMCacheConnectorV1``; its local
  CPU backend holds as much as pegaflow's pool (``LMCACHE_MAX_LOCAL_CPU_SIZE``, GiB), chunks of
  256 tokens (its default).  vLLM's prefix caching stays on, as its docs run it.
- ``lmcache-mp``: LMCache's multi-process mode, the one its docs recommend for several vLLMs
  sharing one cache: one ``lmcache server`` whose L1 is the pool's size (LRU eviction, 256-token
  chunks, a worker thread per vLLM it serves), reached over ZMQ by every vLLM through vLLM's
  ``LMCacheMPConnector``.
- ``pegaflow-rs``: PegaFlow (the Rust engine): its ``PegaKVConnector`` and one
  ``pegaflow-server`` with a pinned pool of the same size, reached over gRPC.

Where the packages come from: ``tools/peers_bundle.sh`` unpacks each peer into
``peers_dir()/<config's peer>/site`` (``$PEGAFLOW_PEERS_DIR``, else ``$HOME/vb/peers``).
PegaFlow's package is also called ``pegaflow``: its processes run with its folder first on
PYTHONPATH and a working directory outside this repo, so this repo's ``pegaflow`` never
shadows it.  This module therefore imports nothing of this repo's ``pegaflow`` at import time.

Interface, for ``bench_ttft``, ``bench_serving`` and ``bench_replicas``:

- ``unavailable(config) -> str | None``: why ``config`` cannot run here, in one line (the
  exact import or loader error), or None; print ``skip_line(config, reason)`` and go on.
- ``plan(config, pool_bytes, num_vllms) -> Plan``: what a vLLM of that configuration needs:
  ``plan.serve_args()`` (extra ``vllm serve`` arguments), ``plan.kv_transfer_config`` (for
  ``LLM(kv_transfer_config=KVTransferConfig(**...))``), ``plan.env`` (added to the vLLM
  process's environment; it sets PYTHONPATH, so merge, don't prepend this repo) and
  ``plan.cwd`` (run the vLLM process there; None: anywhere, e.g. the repo root).
  Ports are free ones picked here; one plan serves every replica of a run.
- ``side_process(plan, log_path)``: a context manager that starts the server the plan needs
  (``pegaflow-server``, ``lmcache server``; nothing for ``lmcache``), returns once its health
  check answers (a server that exits first, or does not answer within ``START_TIMEOUT_S``:
  ``PeerError`` naming its log, whose last lines it carries), and stops it (SIGINT to its
  process group, then SIGKILL; ``tools/lib/processes.py``) on exit, however the bench ends.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from tools.lib import processes

ROOT = Path(__file__).resolve().parents[2]
PEERS = ("lmcache", "lmcache-mp", "pegaflow-rs")
PEER_PACKAGE = {"lmcache": "lmcache", "lmcache-mp": "lmcache", "pegaflow-rs": "pegaflow-rs"}
# Every configuration a bench runs, as a mark about it names it: the release (tools/peers_bundle.sh
# pins the peers'; the benches run vLLM 0.26.0, ../shared/gpu/README.md) and how it reaches vLLM.
LABELS = {"none": "vLLM 0.26.0, prefix caching only",
          "native": "vLLM 0.26.0, native CPU offloading (OffloadingConnector)",
          "lmcache": "LMCache 0.5.3, in-process LMCacheConnectorV1",
          "lmcache-mp": "LMCache 0.5.3, multi-process LMCacheMPConnector + lmcache server",
          "pegaflow-rs": "PegaFlow 0.25.1, PegaKVConnector + pegaflow-server",
          "pegaflow": "pegaflow (this repository), PegaKVConnector + its engine"}
KNOWN_ISSUES = {"lmcache": "LMCache#4463"}  # upstream reports of a configuration's wrong outputs
LMCACHE_CHUNK_TOKENS = 256
LMCACHE_EVICTION = "LRU"  # `lmcache server` requires a policy; its quick start names LRU
CHECK_TIMEOUT_S = 600.0   # one import check: torch and vLLM imported cold
START_TIMEOUT_S = 300.0   # a server pins its whole pool before it answers
STOP_TIMEOUT_S = 120.0

# What each configuration's processes must be able to load, in their order: torch before
# LMCache's compiled extensions, each loaded from its file (``lmcache.c_ops`` is a shim that
# hides a failed load behind a warning), then the connector vLLM will load.
_LMCACHE_EXTENSIONS = (
    "import glob, importlib.util, os, torch, lmcache\n"
    "for path in sorted(glob.glob(os.path.join(os.path.dirname(lmcache.__file__), '*.so'))):\n"
    "    name = 'lmcache.' + os.path.basename(path).split('.')[0]\n"
    "    importlib.util.module_from_spec(importlib.util.spec_from_file_location(name, path))\n")
_CHECKS = {
    "lmcache": _LMCACHE_EXTENSIONS + "import lmcache.integration.vllm.vllm_v1_adapter\n",
    # the server's and the connector's modules, then every import they make only once running
    # (the metrics exporter at the server's startup): tools/lib/peer_imports.py
    "lmcache-mp": _LMCACHE_EXTENSIONS + (
        "import sys\nfrom tools.lib import peer_imports\nsys.exit(peer_imports.main(['lmcache']))\n"),
    "pegaflow-rs": (
        "import os, subprocess, sys, torch, pegaflow\n"
        "if not os.path.realpath(pegaflow.__file__).startswith(os.path.realpath(sys.argv[1])):\n"
        "    sys.exit(f'pegaflow is {pegaflow.__file__}, not PegaFlow under {sys.argv[1]}')\n"
        "import pegaflow.pegaflow, pegaflow.connector\n"
        "from pegaflow._bin_utils import binary_env, find_binary\n"
        "ldd = subprocess.run(['ldd', find_binary('pegaflow-server-py')], env=binary_env(),\n"
        "                     capture_output=True, text=True)\n"
        "lost = [line.split()[0] for line in ldd.stdout.splitlines() if 'not found' in line]\n"
        "if ldd.returncode or lost:\n"
        "    sys.exit(f'pegaflow-server-py cannot load {lost or ldd.stderr.strip()}')\n"),
}


@dataclass(frozen=True, slots=True)
class Plan:
    """One configuration's vLLM settings and the server it needs (``server_argv`` empty: none)."""

    config: str
    kv_transfer_config: dict
    env: dict[str, str]
    cwd: Path | None
    server_argv: tuple[str, ...] = ()
    health_url: str = ""
    server_env: dict[str, str] = field(default_factory=dict)
    clear_url: str = ""  # POST: the server drops every block it holds (tools/lib/cache_reset.py)

    def serve_args(self) -> list[str]:
        return ["--kv-transfer-config", json.dumps(self.kv_transfer_config)]


def peers_dir() -> Path:
    return Path(os.environ.get("PEGAFLOW_PEERS_DIR") or Path.home() / "vb" / "peers")


def site_of(config: str) -> Path:
    return peers_dir() / PEER_PACKAGE[config] / "site"


def skip_line(config: str, reason: str) -> str:
    return f"skipping {config}: {reason}"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def process_env(config: str) -> dict[str, str]:
    """The environment entries every process of ``config`` needs: its package first on the path
    (then this repo, for ``tools``), LMCache's usage reports off (the GPU machine has no network)."""
    path = [str(site_of(config)), str(ROOT), os.environ.get("PYTHONPATH", "")]
    env = {"PYTHONPATH": os.pathsep.join(p for p in path if p)}
    if config.startswith("lmcache"):
        env["LMCACHE_TRACK_USAGE"] = "false"
    return env


def process_cwd(config: str) -> Path | None:
    """PegaFlow's processes run outside this repo: the working directory comes first on
    ``sys.path`` and would put this repo's ``pegaflow`` ahead of PegaFlow's."""
    if config != "pegaflow-rs":
        return None
    cwd = Path(tempfile.gettempdir()) / "pegaflow-rs-cwd"
    cwd.mkdir(exist_ok=True)
    return cwd


def unavailable(config: str) -> str | None:
    """None when ``config``'s processes can import what they need here; else the reason, one
    line: the folder that is missing, or the last line of the import's error."""
    if config not in PEERS:
        raise _unknown(config)
    site = site_of(config)
    if config == "pegaflow-rs" and not (site / "pegaflow").is_dir():
        return f"no PegaFlow package under {site} (tools/peers_bundle.sh carries it)"
    env = dict(os.environ, **process_env(config))
    try:
        done = subprocess.run([sys.executable, "-c", _CHECKS[config], str(site)], env=env,
                              cwd=process_cwd(config) or ROOT, capture_output=True, text=True,
                              timeout=CHECK_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return f"its import check did not finish in {CHECK_TIMEOUT_S:.0f} s"
    if done.returncode == 0:
        return None
    lines = [line.strip() for line in done.stderr.splitlines() if line.strip()]
    reason = lines[-1] if lines else f"its import check exited with status {done.returncode}"
    return reason if site.is_dir() else f"{reason} (no {site}: tools/peers_bundle.sh carries it)"


def plan(config: str, pool_bytes: int, num_vllms: int = 1) -> Plan:
    """The settings of one run of ``config`` whose host cache holds ``pool_bytes``, shared by
    ``num_vllms`` vLLM processes (a server's peers only; ``lmcache``'s cache is per process)."""
    if config not in PEERS:
        raise _unknown(config)
    env, cwd, gib = process_env(config), process_cwd(config), pool_bytes / (1 << 30)
    if config == "lmcache":
        env |= {"LMCACHE_LOCAL_CPU": "True", "LMCACHE_MAX_LOCAL_CPU_SIZE": f"{gib:g}",
                "LMCACHE_CHUNK_SIZE": str(LMCACHE_CHUNK_TOKENS)}
        return Plan(config, {"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_both"}, env, cwd)
    port, http_port = free_port(), free_port()
    if config == "lmcache-mp":  # docs/peers.md says why each setting is what it is
        server = (sys.executable, "-m", "lmcache.cli.main", "server", "--l1-size-gb", f"{gib:g}",
                  "--eviction-policy", LMCACHE_EVICTION, "--chunk-size", str(LMCACHE_CHUNK_TOKENS),
                  "--max-workers", str(num_vllms), "--host", "127.0.0.1", "--port", str(port),
                  "--http-host", "127.0.0.1", "--http-port", str(http_port))
        extra = {"lmcache.mp.host": "tcp://127.0.0.1", "lmcache.mp.port": port}
        return Plan(config, {"kv_connector": "LMCacheMPConnector", "kv_role": "kv_both",
                             "kv_connector_extra_config": extra}, env, cwd, server,
                    f"http://127.0.0.1:{http_port}/healthcheck", process_env(config),
                    f"http://127.0.0.1:{http_port}/cache/clear")
    if config == "pegaflow-rs":
        # its pool size in bytes: its "gb" is a GiB, a plain number is bytes
        server = (sys.executable, "-m", "pegaflow._server", "--addr", f"127.0.0.1:{port}",
                  "--http-addr", f"127.0.0.1:{http_port}", "--pool-size", str(pool_bytes))
        env |= {"PEGAFLOW_HOST": "http://127.0.0.1", "PEGAFLOW_PORT": str(port)}
        extra = {"pegaflow.host": "http://127.0.0.1", "pegaflow.port": port}
        return Plan(config, {"kv_connector": "PegaKVConnector", "kv_connector_module_path": "pegaflow.connector",
                             "kv_role": "kv_both", "kv_connector_extra_config": extra}, env, cwd, server,
                    f"http://127.0.0.1:{http_port}/health", process_env(config),
                    f"http://127.0.0.1:{http_port}/cache/memory/cleanup")
    raise AssertionError(f"a configuration of PEERS without a plan: {config}")


def _unknown(config: str) -> Exception:
    from pegaflow.platform.errors import ConfigError  # here, not at the top: see the module's docstring
    return ConfigError(f"unknown peer configuration {config!r}; expected one of {PEERS}")


@contextlib.contextmanager
def side_process(run: Plan, log_path: Path, start_timeout_s: float = START_TIMEOUT_S) -> Iterator[None]:
    """The server ``run`` needs, up (its health check answered) for the ``with`` block."""
    if not run.server_argv:
        yield
        return
    with open(log_path, "w") as log:
        # its own group (SIGINT reaches the binary its wrapper runs too), stopped however the
        # bench ends; the segments it made, which it cannot remove when killed, removed after it
        proc = processes.start(run.server_argv, label=f"{run.config} server", stop_signal=signal.SIGINT,
                               stop_timeout_s=STOP_TIMEOUT_S,
                               leftovers=processes.new_segments_since(processes.shm_snapshot()),
                               env=dict(os.environ, PYTHONUNBUFFERED="1", **run.server_env),
                               cwd=run.cwd or ROOT, stdout=log, stderr=subprocess.STDOUT)
        try:
            _wait_healthy(proc, run, log_path, start_timeout_s)
            yield
        finally:
            processes.stop(proc)


def _wait_healthy(proc: subprocess.Popen, run: Plan, log_path: Path, timeout_s: float) -> None:
    from pegaflow.platform.errors import PeerError  # here, not at the top: see the module's docstring
    deadline = time.monotonic() + timeout_s
    while True:
        if proc.poll() is not None:
            raise PeerError(f"{run.config}'s server exited ({proc.returncode}); see {log_path}; "
                            f"its last lines: {_tail(log_path)}")
        try:
            with urllib.request.urlopen(run.health_url, timeout=5):
                return
        except OSError:
            if time.monotonic() > deadline:
                raise PeerError(f"{run.config}'s server did not answer {run.health_url} in "
                                f"{timeout_s:.0f} s; see {log_path}; its last lines: {_tail(log_path)}") from None
            time.sleep(0.5)


def _tail(log_path: Path, num_lines: int = 3) -> str:
    lines = [line.strip() for line in log_path.read_text(errors="replace").splitlines() if line.strip()]
    return " | ".join(lines[-num_lines:]) or "(empty)"
