"""pegaflow.smoke (``pegaflow-smoke``) against a real engine, and what ``pegaflow-stat --json``
then reports; the console script an install makes, and ``python -m tools.smoke`` as before."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
SMOKE = ("-m", "pegaflow.smoke")
NUM_SAVED = 64
ENTRY_BYTES = 4 * 4096  # smoke's 4 layers of 4 KiB pages


def run_tool(*argv: str) -> subprocess.CompletedProcess:
    """Run a tool to completion; ``.pid`` is the process id it had."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")]))
    with subprocess.Popen([sys.executable, *argv], cwd=REPO_ROOT, env=env, text=True,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE) as proc:
        stdout, stderr = proc.communicate(timeout=120)
    done = subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)
    done.pid = proc.pid
    return done


def buffers_left_by(pid: int) -> list[str]:
    """Host KV buffers (``pegaflow.<uid>.smoke.<pid>.*``) the process ``pid`` did not unlink."""
    prefix = f"pegaflow.{os.getuid()}.smoke.{pid}."
    return [e for e in os.listdir("/dev/shm") if e.startswith(prefix)]


def test_smoke_against_running_engine_prints_smoke_ok(engine):
    # 1. The smoke client saves, looks up and loads 64 blocks, and checks every byte.
    done = run_tool(*SMOKE, "--name", engine.name)
    assert (done.returncode, done.stdout.strip()) == (0, "smoke ok"), done.stderr
    assert buffers_left_by(done.pid) == []
    # 2. pegaflow-stat sees exactly what it did.
    stat = run_tool("-m", "pegaflow.stats.cli", "--once", "--json", "--name", engine.name)
    assert stat.returncode == 0, stat.stderr
    snapshot = json.loads(stat.stdout)
    assert snapshot["blocks_saved"] == NUM_SAVED
    assert snapshot["blocks_loaded"] == NUM_SAVED
    assert snapshot["lookup_hit_blocks"] == NUM_SAVED
    assert snapshot["pool_bytes_used"] == NUM_SAVED * ENTRY_BYTES
    assert snapshot["pool_bytes_capacity"] == 64 << 20


def test_smoke_twice_dedups_nothing_and_still_passes(engine):
    # 1. A second run uses fresh random hashes: it stores another 64 blocks, all byte-exact.
    for _ in range(2):
        done = run_tool(*SMOKE, "--name", engine.name)
        assert done.returncode == 0, done.stderr
    assert engine.wait_stats(lambda s: s["blocks_saved"] == 2 * NUM_SAVED)["save_dedup_blocks"] == 0


def test_smoke_without_engine_exits_1_with_one_line_saying_so():
    # 1. No engine under that name: exit 1 and one line that says so, without the segment's
    #    path or an exception's name.
    name = f"t{os.getpid()}_absent"
    done = run_tool(*SMOKE, "--name", name)
    assert done.returncode == 1
    assert done.stderr.strip() == (f"pegaflow-smoke: no engine named {name!r} is running on this "
                                   f"host (start one with `pegaflow-engine --name {name}`)")
    # 2. It unlinked the KV buffer it created, even though it never got to use it.
    left = buffers_left_by(done.pid)
    for entry in left:  # keep the host clean, then fail
        os.unlink("/dev/shm/" + entry)
    assert left == []


def test_smoke_bad_name_is_a_usage_error_exit_2():
    done = run_tool(*SMOKE, "--name", "a/b")
    assert done.returncode == 2 and done.stderr.startswith("pegaflow-smoke: engine name 'a/b'"), done.stderr


def test_smoke_is_a_console_script_of_the_package():
    # 1. An install makes `pegaflow-smoke`, pointing at pegaflow.smoke:main.
    scripts = (REPO_ROOT / "pyproject.toml").read_text().split("[project.scripts]", 1)[1].split("\n[", 1)[0]
    assert 'pegaflow-smoke = "pegaflow.smoke:main"' in scripts.splitlines()
    # 2. It needs nothing a wheel leaves out: no tools, no tests, no engine module imported.
    probe = run_tool("-c", "import sys, pegaflow.smoke; print(sorted({m.split('.')[0] for m in sys.modules} "
                     "& {'tools', 'tests', 'engine'}))")
    assert (probe.returncode, probe.stdout.strip()) == (0, "[]"), probe.stderr


def test_smoke_old_command_and_help_still_work(engine):
    # 1. `python -m tools.smoke` (what make smoke ran) is the same check.
    done = run_tool("-m", "tools.smoke", "--name", engine.name)
    assert (done.returncode, done.stdout.strip()) == (0, "smoke ok"), done.stderr
    # 2. Its help names the flag, its default, and no RST markup.
    helped = run_tool(*SMOKE, "--help")
    assert helped.returncode == 0 and "default pegaflow" in helped.stdout and "``" not in helped.stdout
