"""tools/lib/peers.py without a GPU: each peer's vLLM settings and server command, the one-line
reason a peer cannot run, the path that keeps PegaFlow's ``pegaflow`` ahead of this repo's,
and the side process's start, health wait and stop."""

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from pegaflow.platform.errors import ConfigError, PeerError
from tools.lib import peers

GIB = 1 << 30


@pytest.fixture
def peers_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("PEGAFLOW_PEERS_DIR", str(tmp_path))
    return tmp_path


def _write(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(textwrap.dedent(text))


def _arg(argv, flag: str) -> str:
    return argv[list(argv).index(flag) + 1]


def test_peers_plan_lmcache_sizes_its_cpu_backend_like_the_pool(peers_dir):
    # 1. In vLLM's process: LMCacheConnectorV1, its CPU backend in GiB of the pool, no server.
    run = peers.plan("lmcache", 48 * GIB)
    assert run.kv_transfer_config == {"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_both"}
    assert run.env["LMCACHE_MAX_LOCAL_CPU_SIZE"] == "48" and run.env["LMCACHE_LOCAL_CPU"] == "True"
    assert run.env["LMCACHE_CHUNK_SIZE"] == "256" and run.server_argv == ()
    # 2. Its package first on the path; the vLLM arguments carry the same config.
    assert run.env["PYTHONPATH"].split(os.pathsep)[0] == str(peers_dir / "lmcache" / "site")
    assert json.loads(_arg(run.serve_args(), "--kv-transfer-config")) == run.kv_transfer_config
    # 3. A pool that is not a whole number of GiB keeps its fraction.
    assert peers.plan("lmcache", 3 * GIB // 2).env["LMCACHE_MAX_LOCAL_CPU_SIZE"] == "1.5"


def test_peers_plan_lmcache_mp_points_vllm_at_its_server(peers_dir):
    # 1. One lmcache server of the pool's size, with the eviction policy it requires (0.5.3
    #    exits with a usage error without one), its default 256-token chunks and a worker
    #    thread per vLLM it serves; vLLM's MP connector at its address.
    run = peers.plan("lmcache-mp", 32 * GIB, num_vllms=2)
    assert run.server_argv[1:5] == ("-m", "lmcache.cli.main", "server", "--l1-size-gb")
    assert _arg(run.server_argv, "--l1-size-gb") == "32" and _arg(run.server_argv, "--eviction-policy") == "LRU"
    assert _arg(run.server_argv, "--chunk-size") == "256" and _arg(run.server_argv, "--max-workers") == "2"
    extra = run.kv_transfer_config["kv_connector_extra_config"]
    assert run.kv_transfer_config["kv_connector"] == "LMCacheMPConnector"
    assert extra == {"lmcache.mp.host": "tcp://" + _arg(run.server_argv, "--host"),
                     "lmcache.mp.port": int(_arg(run.server_argv, "--port"))}
    # 2. Its health check is on its HTTP port, not the ZMQ one.
    assert run.health_url == f"http://127.0.0.1:{_arg(run.server_argv, '--http-port')}/healthcheck"
    assert _arg(run.server_argv, "--http-port") != _arg(run.server_argv, "--port")
    # 3. One vLLM (bench_ttft, bench_serving): one worker.
    assert _arg(peers.plan("lmcache-mp", 32 * GIB).server_argv, "--max-workers") == "1"


_PARSE_SERVER_ARGS = """
import argparse, json, sys
from lmcache.cli.commands.server import ServerCommand
parser = argparse.ArgumentParser(prog="lmcache server")
ServerCommand().add_arguments(parser)
args = parser.parse_args(json.loads(sys.argv[1]))
print(json.dumps([args.l1_size_gb, args.eviction_policy, args.max_workers, args.http_port]))
"""


def test_peers_plan_lmcache_mp_server_argv_is_what_lmcache_server_accepts():
    # Where the bundle's LMCache is (the GPU machine): its own parser takes our arguments.
    if peers.unavailable("lmcache-mp") is not None:
        pytest.skip("LMCache's package is not here (tools/peers_bundle.sh carries it)")
    run = peers.plan("lmcache-mp", 48 * GIB, num_vllms=2)
    done = subprocess.run([sys.executable, "-c", _PARSE_SERVER_ARGS, json.dumps(list(run.server_argv[4:]))],
                          env=dict(os.environ, **run.server_env), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads(done.stdout.splitlines()[-1]) == [48.0, "LRU", 2, int(_arg(run.server_argv, "--http-port"))]


def test_peers_plan_pegaflow_rs_runs_its_package_outside_this_repo(peers_dir):
    # 1. pegaflow-server with the pool in bytes (its "gb" means GiB; bytes leave no doubt).
    run = peers.plan("pegaflow-rs", 48 * GIB)
    assert _arg(run.server_argv, "--pool-size") == str(48 * GIB)
    port = int(_arg(run.server_argv, "--addr").rsplit(":", 1)[1])
    # 2. The connector reaches that port, by its extra config and by the variables it reads first.
    assert run.kv_transfer_config["kv_connector_module_path"] == "pegaflow.connector"
    assert run.kv_transfer_config["kv_connector_extra_config"]["pegaflow.port"] == port
    assert run.env["PEGAFLOW_PORT"] == str(port)
    assert run.health_url.endswith(_arg(run.server_argv, "--http-addr") + "/health")
    # 3. Its folder ahead of this repo on the path, and a working directory with no pegaflow in it.
    path = run.env["PYTHONPATH"].split(os.pathsep)
    assert path[0] == str(peers_dir / "pegaflow-rs" / "site") and path[1] == str(peers.ROOT)
    assert run.cwd is not None and run.cwd != peers.ROOT and not (run.cwd / "pegaflow").exists()
    assert run.server_env["PYTHONPATH"] == run.env["PYTHONPATH"]


def test_peers_unavailable_without_the_bundle_says_where_in_one_line(peers_dir):
    reason = peers.unavailable("pegaflow-rs")
    assert "peers_bundle.sh" in reason and "\n" not in reason
    assert peers.skip_line("pegaflow-rs", reason).startswith("skipping pegaflow-rs: no PegaFlow package")
    with pytest.raises(ConfigError, match="lmcache-v9"):
        peers.unavailable("lmcache-v9")
    with pytest.raises(ConfigError, match="lmcache-v9"):
        peers.plan("lmcache-v9", GIB)


def test_peers_unavailable_lmcache_not_carried_names_the_import_error_and_the_bundle(peers_dir):
    reason = peers.unavailable("lmcache")  # this test environment has no lmcache installed
    assert reason.startswith("ModuleNotFoundError: No module named 'lmcache'") and "peers_bundle.sh" in reason


def test_peers_unavailable_gives_the_extension_load_error(peers_dir):
    # 1. A stand-in LMCache whose compiled extension cannot be loaded (not an ELF file at all).
    site = peers_dir / "lmcache" / "site"
    _write(site, {"lmcache/__init__.py": "", "lmcache/integration/vllm/vllm_v1_adapter.py": ""})
    extension = site / "lmcache" / "c_ops.cpython-312-x86_64-linux-gnu.so"
    extension.write_bytes(b"not a shared object, and long enough for the loader to read its header" * 4)
    # 2. The reason is the loader's own line, word for word.
    assert peers.unavailable("lmcache") == f"ImportError: {extension}: invalid ELF header"
    # 3. Extensions fine, the vLLM side not: that error instead.
    extension.unlink()
    _write(site, {"lmcache/integration/vllm/vllm_v1_adapter.py": "raise ImportError('needs vLLM 0.99')\n"})
    assert peers.unavailable("lmcache") == "ImportError: needs vLLM 0.99"
    # 4. Both fine: it runs.
    _write(site, {"lmcache/integration/vllm/vllm_v1_adapter.py": ""})
    assert peers.unavailable("lmcache") is None


def test_peers_unavailable_pegaflow_rs_finds_its_package_not_this_repos(peers_dir):
    # 1. A stand-in PegaFlow: its Rust module, its connector, a server binary that loads.
    _write(peers_dir / "pegaflow-rs" / "site", {
        "pegaflow/__init__.py": "", "pegaflow/pegaflow.py": "", "pegaflow/connector.py": "",
        "pegaflow/_bin_utils.py": f"""
            import os
            def find_binary(name):
                return {os.path.realpath(sys.executable)!r}
            def binary_env():
                return dict(os.environ)
            """})
    # 2. It runs: this repo's pegaflow (no pegaflow.pegaflow) did not shadow it.
    assert peers.unavailable("pegaflow-rs") is None
    # 3. Its server binary unloadable: the check says which library is missing.
    _write(peers_dir / "pegaflow-rs" / "site", {"pegaflow/_bin_utils.py": """
            import os
            def find_binary(name):
                return "/nonexistent/pegaflow-server-py"
            def binary_env():
                return dict(os.environ)
            """})
    assert peers.unavailable("pegaflow-rs").startswith("pegaflow-server-py cannot load")


_SERVER = """
import http.server, os, sys, time
open(sys.argv[1], "w").write(str(os.getpid()))
time.sleep(0.5)  # not up at once: the caller must wait for the health check
class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()
    def log_message(self, *args):
        pass
http.server.HTTPServer(("127.0.0.1", int(sys.argv[2])), Health).serve_forever()
"""


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_peers_side_process_waits_for_health_and_stops_the_server(tmp_path):
    # 1. A server that answers /health half a second after it starts.
    port, pid_file = peers.free_port(), tmp_path / "pid"
    run = peers.Plan("stand-in", {}, {}, None, (sys.executable, "-c", _SERVER, str(pid_file), str(port)),
                     f"http://127.0.0.1:{port}/health")
    # 2. Inside the block it is up; after it, its process is gone.
    import urllib.request
    with peers.side_process(run, tmp_path / "server.log"):
        with urllib.request.urlopen(run.health_url, timeout=30) as answer:
            assert answer.status == 200
        pid = int(pid_file.read_text())
    deadline = time.monotonic() + 60
    while _pid_alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _pid_alive(pid)


def test_peers_side_process_server_that_exits_raises_peer_error(tmp_path):
    run = peers.Plan("stand-in", {}, {}, None, (sys.executable, "-c", "import sys; print('no GPU'); sys.exit(3)"),
                     f"http://127.0.0.1:{peers.free_port()}/health")
    with pytest.raises(PeerError, match=r"exited \(3\)"):
        with peers.side_process(run, tmp_path / "server.log"):
            pytest.fail("the block must not run")
    assert "no GPU" in (tmp_path / "server.log").read_text()


def test_peers_side_process_without_a_server_starts_nothing(tmp_path):
    with peers.side_process(peers.plan("lmcache", GIB), tmp_path / "server.log"):
        pass
    assert not (tmp_path / "server.log").exists()
