"""The parent's side of a bench whose phases each run in a vLLM process of their own
(``bench_decode``, ``profile_decode``, ``bench_ttft``), against one pegaflow engine.

- ``spawn_phase(module, phase, flags, ...)``: ``python -m <module> --phase <phase> --phase-out
  <file> <flags>``; the phase writes its figures to the file as JSON and they are returned.  Its
  stdout goes to our stderr (our stdout carries only our JSON), a phase that exits non-zero
  raises ``CalledProcessError`` and one that hangs past ``timeout_s`` ``TimeoutExpired``; its
  whole process group is stopped when it returns, raises or the bench is stopped by a signal;
- the phase's side: ``add_phase_args(parser, phases)`` declares the two flags ``spawn_phase``
  passes (hidden from ``--help``) and ``write_phase(args, figures)`` writes the figures back;
- ``engine_unless_named(engine_name, prefix, pool_size)``: the engine the phases attach to: the
  one ``engine_name`` names, or else one started here (named ``<prefix><pid>``) and stopped
  after the ``with`` block.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

from tools.lib import processes

ROOT = Path(__file__).resolve().parents[2]
PHASE_TIMEOUT_S = 900.0  # one vLLM phase: model init (~50 s) and its timed passes
PHASE_STOP_TIMEOUT_S = 30.0  # a phase stopped early: vLLM's engine core given this long to go
ENGINE_START_TIMEOUT_S = 300.0


def spawn_phase(module: str, phase: str, flags: list[str], timeout_s: float = PHASE_TIMEOUT_S,
                env: dict[str, str] | None = None, cwd: Path | None = None,
                leftovers: Callable[[], None] | None = None) -> dict:
    """One phase in its own process (``env``: its whole environment, None: ours; ``cwd``:
    where it runs, None: the repository); the figures it wrote.  Its process group (vLLM's
    engine core with it) is stopped however this returns, and ``leftovers()`` then run
    (``tools/lib/processes.py``).  Unbuffered, so its log reaches our stderr as it is written."""
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        out = f.name
    cmd = [sys.executable, "-m", module, "--phase", phase, "--phase-out", out, *flags]
    env = dict(os.environ if env is None else env, PYTHONUNBUFFERED="1")
    proc = processes.start(cmd, label=f"{module} phase {phase}", stop_timeout_s=PHASE_STOP_TIMEOUT_S,
                           leftovers=leftovers, cwd=cwd or ROOT, stdout=sys.stderr, env=env)
    try:
        try:
            returncode = proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            raise subprocess.TimeoutExpired(cmd, timeout_s) from None
        if returncode:
            raise subprocess.CalledProcessError(returncode, cmd)
        return json.loads(Path(out).read_text())
    finally:
        processes.stop(proc)
        Path(out).unlink(missing_ok=True)


def add_phase_args(parser: argparse.ArgumentParser, phases: list[str] | tuple[str, ...]) -> None:
    """``--phase`` (one of ``phases``; absent: the parent's run) and ``--phase-out``."""
    parser.add_argument("--phase", choices=phases, help=argparse.SUPPRESS)
    parser.add_argument("--phase-out", help=argparse.SUPPRESS)


def write_phase(args: argparse.Namespace, figures: dict) -> None:
    """A phase's figures, where ``spawn_phase`` reads them."""
    Path(args.phase_out).write_text(json.dumps(figures))


@contextlib.contextmanager
def engine_unless_named(engine_name: str, prefix: str, pool_size: str) -> Iterator[str]:
    """The name of the engine the phases attach to: ``engine_name``, or else a fresh CUDA
    engine's with a ``pool_size`` pool, up for the ``with`` block."""
    if engine_name:
        yield engine_name
        return
    from tools.engine_process import EngineProcess  # here, not at the top: it imports this repo's pegaflow
    with EngineProcess(f"{prefix}{os.getpid()}", backend="cuda", pool_size=pool_size,
                       start_timeout_s=ENGINE_START_TIMEOUT_S) as engine:
        yield engine.name
