"""The installed distribution: its packages claim no top-level name but ``pegaflow`` (the engine
installs as ``pegaflow.engine``), and a plain install runs the engine, the smoke check and
pegaflow-stat without this checkout."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = pytest.importorskip("tomllib").loads((ROOT / "pyproject.toml").read_text())  # Python 3.11+


def _packages_in_tree() -> set[str]:
    found = {".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "pegaflow").rglob("__init__.py")}
    found |= {"pegaflow." + ".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "engine").rglob("__init__.py")}
    return found


def test_packaging_lists_every_package_of_the_tree_and_nothing_else():
    # A package added under pegaflow/ or engine/ without its line would be missing from the wheel.
    assert set(PYPROJECT["tool"]["setuptools"]["packages"]) == _packages_in_tree()
    assert PYPROJECT["tool"]["setuptools"]["package-dir"] == {"pegaflow.engine": "engine"}


def test_packaging_engine_imports_itself_only_relatively():
    # Installed as pegaflow.engine, an ``from engine.x import`` would find nothing (or another
    # project's ``engine``).
    absolute = re.compile(r"^\s*(from engine[. ]|import engine\b)", re.M)
    offenders = [str(p.relative_to(ROOT)) for p in (ROOT / "engine").rglob("*.py") if absolute.search(p.read_text())]
    assert offenders == []


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    target = tmp_path_factory.mktemp("site")
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                    "--target", str(target), str(ROOT)], check=True, capture_output=True, timeout=300,
                   cwd=target)
    return target


def test_packaging_install_claims_no_top_level_name_but_pegaflow(installed):
    tops = {p.name for p in installed.iterdir() if not p.name.endswith(".dist-info") and p.name != "bin"}
    assert tops == {"pegaflow"}
    assert (installed / "pegaflow" / "engine" / "__main__.py").is_file()


def test_packaging_installed_engine_smoke_and_stat_run_outside_the_checkout(installed, tmp_path):
    # 1. The installed console scripts, run where this checkout is not on the path.
    env = dict(os.environ, PYTHONPATH=str(installed))
    env.pop("PEGAFLOW_NAME", None)
    name = f"pkg{os.getpid()}"
    bin_dir = installed / "bin"
    log_path = tmp_path / "engine.log"  # a file, not a pipe nobody reads while it runs
    with open(log_path, "w") as log:
        engine = subprocess.Popen([str(bin_dir / "pegaflow-engine"), "--backend", "host", "--pool-size", "64MiB",
                                   "--name", name], cwd=tmp_path, env=env, stderr=log)
    try:
        # 2. pegaflow-stat finds it once it serves; the smoke check saves, looks up and loads.
        deadline = time.monotonic() + 60.0
        while True:
            stat = subprocess.run([str(bin_dir / "pegaflow-stat"), "--name", name, "--once"], cwd=tmp_path, env=env,
                                  capture_output=True, text=True, timeout=60)
            if stat.returncode == 0 or engine.poll() is not None or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert stat.returncode == 0 and f"engine '{name}'" in stat.stdout, stat.stdout + stat.stderr
        smoke = subprocess.run([str(bin_dir / "pegaflow-smoke"), "--name", name], cwd=tmp_path, env=env,
                               capture_output=True, text=True, timeout=120)
        assert smoke.returncode == 0 and "smoke ok" in smoke.stdout, smoke.stdout + smoke.stderr
    finally:
        engine.terminate()
        engine.wait(timeout=60)
    err = log_path.read_text()
    # 3. The engine that ran was the installed one.
    assert engine.returncode == 0, err
    assert " pegaflow.engine." in err  # (its loggers are named for the installed package)


def _make_dry_run(target: str, tmp_path: Path) -> str:
    """What ``make TARGET`` would run on a fresh machine (no venvs yet), printed, not run."""
    run = subprocess.run(["make", "-n", "-C", str(ROOT), target, f"VENV={tmp_path}/venv",
                          f"VENV_CPU={tmp_path}/venv-cpu"], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    return run.stdout


def test_packaging_make_install_builds_no_test_environment(tmp_path):
    # make install: the package and its own dependencies only; no vLLM, test tools, vLLM's CPU
    # build, promtool or apt-get.
    commands = _make_dry_run("install", tmp_path)
    assert "pip install -e .\n" in commands
    for test_only in ("venv-cpu", "promtool", "apt-get", "vllm", "[test", "[remote", "[cpu"):
        assert test_only not in commands, test_only


def test_packaging_make_test_builds_the_test_environments_on_first_use(tmp_path):
    commands = _make_dry_run("test", tmp_path)
    for needed in ("pip install -e .\n", "'.[test,remote,proxy]'", "'vllm==", "promtool", "venv-cpu", "'.[cpu]'",
                   "ruff check", "-m pytest -q\n", "pytest -q tests/e2e_cpu"):
        assert needed in commands, needed


def test_packaging_ci_runs_readmes_two_commands():
    script = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()
              if line.strip() and not line.startswith(("#", "set ", "cd "))]
    assert script == ["make install", "make test"]
    readme = (ROOT / "README.md").read_text().split("## Install and test", 1)[1]
    assert "    make install " in readme and "    make test " in readme
