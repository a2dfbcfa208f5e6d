"""pegaflow-stat shows the KV caches an engine's CPU workers moved into shared memory: those of
running workers, and those killed workers left, with what removes them."""

from __future__ import annotations

import os

from pegaflow.stats.cli import main
from tests.cpu_workers import killed_worker_cache, running_worker_cache


def test_in_place_caches_no_engine_running_shows_a_killed_workers_and_a_running_ones(capsys):
    # 1. No engine of the name runs; one CPU worker of it was killed, this one runs.
    with running_worker_cache() as (name, _):
        left = killed_worker_cache(name)
        try:
            # 2. pegaflow-stat says no engine runs, and what each worker's cache holds.
            assert main(["--name", name, "--once"]) == 1
            said = capsys.readouterr().err
        finally:
            os.unlink("/dev/shm" + left)
    assert f"no engine named {name!r} is running" in said
    assert f"cpu kv  1 KV cache in /dev/shm (1.0 MiB, pids {os.getpid()}) of CPU workers running" in said
    pid = left.split(".")[-2]
    assert f"cpu kv  1 KV cache in /dev/shm (1.0 MiB, pids {pid}) left by CPU workers that are gone" in said
    assert f"`pegaflow-engine --clean {name}`" in said


def test_in_place_caches_running_engine_shows_a_worker_killed_since(engine_factory, capsys):
    # 1. An engine runs; a CPU worker of it is killed (its cache outlives it).
    with running_worker_cache() as (name, _):
        engine_factory(name)
        left = killed_worker_cache(name)
        try:
            # 2. The snapshot lists both caches after the engine's own lines.
            assert main(["--name", name, "--once"]) == 0
            said = capsys.readouterr().out
        finally:
            os.unlink("/dev/shm" + left)
    assert said.startswith(f"engine {name!r} pid")
    assert "of CPU workers running" in said and "left by CPU workers that are gone" in said
