"""engine.__main__ (``python -m engine``): a mistake is one line and exit 2; --version."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _engine(*argv: str, env: dict | None = None) -> subprocess.CompletedProcess:
    environ = {k: v for k, v in os.environ.items() if not k.startswith("PEGAFLOW_")}
    return subprocess.run([sys.executable, "-m", "engine", *argv], cwd=ROOT, capture_output=True,
                          text=True, timeout=60, env={**environ, **(env or {})})


@pytest.mark.parametrize("argv, env, says", [
    (["--pool-size", "lots"], {}, "--pool-size: size 'lots'"),
    (["--pool-size", "4XB"], {}, "size '4XB'"),
    (["--backend", "gpu"], {}, "--backend 'gpu': choose auto, cuda, host"),
    (["--backend", "host", "--copy-backend", "staged"], {}, "is a GPU copy path"),
    (["--max-clients", "many"], {}, "--max-clients='many': expected a number"),
    (["--lease-ttl", "0"], {}, "--lease-ttl"),
    (["--name", "a/b"], {}, "engine name"),
    (["--frobnicate"], {}, "unrecognized arguments: --frobnicate"),
    ([], {"PEGAFLOW_POOL_SIZE": "lots"}, "PEGAFLOW_POOL_SIZE: size 'lots'"),
    ([], {"PEGAFLOW_KEEP_POOL": "maybe"}, "PEGAFLOW_KEEP_POOL"),
    (["--pool-size", "512"], {}, "--pool-size: size '512' has no unit: write 512MiB or 512GiB"),
    ([], {"PEGAFLOW_POOL_SIZE": "64"}, "PEGAFLOW_POOL_SIZE: size '64' has no unit"),
    (["--pool-size", "-5GiB"], {}, "--pool-size: size '-5GiB' is negative"),
    (["--pool-size=-5GiB"], {}, "--pool-size: size '-5GiB' is negative"),
    (["--slab-size", "-1"], {}, "--slab-size: size '-1' is negative"),
    (["--clean", "a/b"], {}, "engine name 'a/b'"),
])
def test_main_mistake_is_one_line_and_exit_2(argv, env, says):
    # 1. Each mistake: exit 2 before anything is made, one line on stderr that names it.
    done = _engine(*argv, env=env)
    assert done.returncode == 2, done.stderr
    assert says in done.stderr and "Traceback" not in done.stderr, done.stderr
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr


def test_main_version_names_the_release_and_the_wire_protocol():
    import pegaflow
    from pegaflow.platform.wire import WIRE_VERSION
    done = _engine("--version")
    assert done.returncode == 0
    assert done.stdout.strip() == f"pegaflow-engine {pegaflow.__version__} (wire protocol v{WIRE_VERSION})"


def test_main_help_names_every_env_var():
    from engine.options import OPTIONS
    done = _engine("--help")
    text = " ".join(done.stdout.split())
    assert done.returncode == 0 and all(o.env in text for o in OPTIONS)


@pytest.mark.parametrize("argv, code, says", [
    (["--pool-size", "lots"], 2, "pegaflow-engine: --pool-size: size 'lots'"),
    (["--frobnicate"], 2, "pegaflow-engine: unrecognized arguments: --frobnicate"),
    (["--clean", "a/b"], 2, "pegaflow-engine: engine name 'a/b'"),
    (["--backend", "host", "--pool-size", "64TiB"], 1, "pegaflow-engine: cannot start: "),
])
def test_main_every_problem_is_one_line_prefixed_with_the_program_name(argv, code, says):
    # 1. A bad value, an unknown flag (exit 2) and a start refused (exit 1: a pool larger
    #    than the host) each end with one line in the same form: `pegaflow-engine: ...`.
    done = _engine("--name", f"t{os.getpid()}_prefix", *argv)
    assert done.returncode == code, done.stderr
    assert done.stderr.strip().splitlines()[-1].startswith(says), done.stderr
    assert "ERROR" not in done.stderr and "Traceback" not in done.stderr, done.stderr


@pytest.mark.skipif(__import__("engine.copy").copy.cuda_unusable_reason() is None,
                    reason="a GPU is usable here")
def test_main_backend_cuda_without_a_gpu_exits_1_saying_so():
    done = _engine("--name", f"t{os.getpid()}_nogpu", "--backend", "cuda", "--pool-size", "4MiB")
    assert done.returncode == 1, done.stderr
    assert done.stderr.strip().splitlines()[-1].startswith(
        "pegaflow-engine: cannot start: --backend cuda, but no GPU is usable here"), done.stderr
