"""Every process a bench starts, gone when the bench ends, however it ends: a return, an error,
SIGINT, SIGTERM or SIGHUP (``timeout`` sends SIGTERM), with what each left in /dev/shm.

- ``start(argv, label=..., stop_signal=..., stop_timeout_s=..., leftovers=...)``: a child in a
  session of its own, so that one signal reaches everything it started in turn (vLLM's engine
  core, a server's workers), with SIGTERM as its parent-death signal (the bench killed with
  SIGKILL: the child still stops); registered until ``stop``.
- ``stop(proc)``: its stop signal to its whole group, SIGKILL to the group past its timeout (and
  to any straggler of the group once its leader is gone), then the CUDA driver's files of the
  group's processes (``cuda.shm.<n>.<hex pid>.<n>``: a killed process cannot remove its own)
  once they are gone, and ``leftovers()``: what it made in /dev/shm removed.
- ``register(proc, label, stop)`` / ``forget(proc)``: a process some other class starts and
  stops (``tools/engine_process.py``'s engine), stopped here only if the bench ends with it
  still registered.
- ``handle_signals()``: in a bench's parent, SIGTERM, SIGINT and SIGHUP stop every registered
  child, latest first (a thread waiting on one, e.g. a request to a vLLM, then ends), and raise
  ``SystemExit(128 + signal)`` (SIGINT: ``KeyboardInterrupt``) in the main thread: each ``with``
  block and ``finally`` then finds its processes stopped; a second signal is ignored meanwhile.
  At exit every child still registered is stopped too.
- ``new_segments_since(before)`` (with ``shm_snapshot()``): a ``leftovers`` for a process whose
  segment names are not known beforehand (a peer's server): the /dev/shm entries made since
  ``before`` that its own group held when stopped, ours, and that no live process holds then
  (``SegmentsMade``); what other processes made meanwhile is never touched.
- ``phase(bench, name)``: one time-stamped line on stderr when a phase starts and one when it
  ends (how long it took, or the error that ended it), so a run cut short says where it was.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import datetime
import logging
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)
SHM_DIR = Path("/dev/shm")
_PR_SET_PDEATHSIG = 1
_STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
_LIBC = ctypes.CDLL(None, use_errno=True)  # loaded here: nothing is loaded between fork and exec
_CUDA_SHM = re.compile(r"cuda\.shm\.\d+\.([0-9a-fA-F]+)\.\d+")  # the CUDA driver's, per process
GONE_WAIT_S = 15.0  # after SIGKILL, for the group's processes to be gone (a GPU's may take seconds)


@dataclass(slots=True)
class _Child:
    proc: subprocess.Popen
    label: str
    stop: Callable[[], object]


_children: list[_Child] = []
_lock = threading.RLock()  # (a signal's stop_all may come while it is held)
_handling = False


def _die_with_parent() -> None:
    """In the child, before exec: SIGTERM when the bench that started it dies."""
    _LIBC.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


def start(argv: list[str] | tuple[str, ...], *, label: str, stop_signal: int = signal.SIGTERM,
          stop_timeout_s: float = 60.0, leftovers: Callable[[], None] | None = None,
          **popen_kwargs) -> subprocess.Popen:
    """``argv`` started in a session of its own and registered; ``popen_kwargs`` go to Popen."""
    proc = subprocess.Popen(list(argv), start_new_session=True, preexec_fn=_die_with_parent, **popen_kwargs)
    register(proc, label, lambda: _stop_group(proc, stop_signal, stop_timeout_s, leftovers))
    return proc


def register(proc: subprocess.Popen, label: str, stop_fn: Callable[[], object]) -> None:
    with _lock:
        _children.append(_Child(proc, label, stop_fn))


def forget(proc: subprocess.Popen) -> None:
    """``proc`` is stopped by its owner: not ours to stop at exit any more."""
    with _lock:
        _children[:] = [c for c in _children if c.proc is not proc]


def stop(proc: subprocess.Popen) -> int | None:
    """Stop a child of ``start`` (its group, then its leftovers); its exit status."""
    with _lock:
        child = next((c for c in _children if c.proc is proc), None)
    if child is not None:
        child.stop()  # (forgotten only once stopped: a signal that cuts this short leaves it for exit)
        forget(proc)
    return proc.returncode


def running() -> list[str]:
    """The labels of the children registered now, oldest first."""
    with _lock:
        return [c.label for c in _children]


def stop_all() -> None:
    """Every registered child, latest first; one that cannot be stopped is logged, the rest go on."""
    while True:
        with _lock:
            if not _children:
                return
            child = _children[-1]
        try:
            child.stop()
        except (OSError, subprocess.SubprocessError) as exc:
            logger.error("could not stop %s (pid %d): %s", child.label, child.proc.pid, exc)
        forget(child.proc)


def _stop_group(proc: subprocess.Popen, sig: int, timeout_s: float,
                leftovers: Callable[[], None] | None) -> None:
    members = _group_pids(proc.pid)
    if proc.poll() is None:
        if isinstance(leftovers, SegmentsMade):
            leftovers.note_group(proc.pid)
        _signal_group(proc.pid, sig)
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            _signal_group(proc.pid, signal.SIGKILL)
            proc.wait()
    _signal_group(proc.pid, signal.SIGKILL)  # what the leader started and left running
    remove_cuda_shm_of(members)
    if leftovers is not None:
        leftovers()


def _signal_group(pgid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError):  # the group is empty: nothing to signal
        os.killpg(pgid, sig)


def handle_signals() -> None:
    """For a bench's parent process (call from the main thread, once is enough)."""
    global _handling
    if _handling:
        return
    _handling = True
    for sig in _STOP_SIGNALS:
        signal.signal(sig, _exit_on_signal)
    atexit.register(stop_all)


def _exit_on_signal(signum: int, frame) -> None:
    for sig in _STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)  # the clean-up below must not be cut short by a second one
    print(f"{_now()} {Path(sys.argv[0]).stem}: {signal.Signals(signum).name}: stopping "
          f"{', '.join(running()) or 'nothing'}", file=sys.stderr, flush=True)
    # First every child: a thread waiting on one (a request to a vLLM) then ends, and the exit
    # below is not held up by it.  The blocks that started them find them stopped.
    stop_all()
    if signum == signal.SIGINT:
        raise KeyboardInterrupt
    raise SystemExit(128 + signum)


def shm_snapshot() -> frozenset[str]:
    return frozenset(os.listdir(SHM_DIR)) if SHM_DIR.is_dir() else frozenset()


class SegmentsMade:
    """A ``leftovers`` for a process whose segment names are not known beforehand (a peer's
    server, a peer's vLLM): the /dev/shm entries made since ``before`` that its own process group
    held (open or mapped) when it was stopped, ours, and that no live process holds once it is
    gone.  An entry someone else made meanwhile (another bench, a test's engine, a crashed
    engine's kept pool) is never a candidate, held or not.  A group that exited before its stop
    leaves nothing known to be its: whatever it made is logged, not removed."""

    def __init__(self, before: frozenset[str]) -> None:
        self.before = before
        self.group_held: set[str] | None = None

    def note_group(self, pgid: int) -> None:
        """What ``pgid``'s processes hold now: called just before they are signalled."""
        self.group_held = _held_shm_names(pgid)

    def __call__(self) -> None:
        made = {name for name in shm_snapshot() - self.before if _is_ours(SHM_DIR / name)}
        if not made:
            return
        if self.group_held is None:
            logger.warning("left in /dev/shm since the process started, not known to be its (it had exited): %s",
                           ", ".join(sorted(made)))
            return
        held = _held_shm_names()
        for name in sorted(made & self.group_held - held):
            with contextlib.suppress(FileNotFoundError):
                (SHM_DIR / name).unlink()
            logger.info("removed /dev/shm/%s, left by a stopped process", name)


def new_segments_since(before: frozenset[str]) -> SegmentsMade:
    return SegmentsMade(before)


def _is_ours(path: Path) -> bool:
    try:
        return path.stat().st_uid == os.getuid()
    except FileNotFoundError:
        return False


def _held_shm_names(pgid: int | None = None) -> set[str]:
    """Names under /dev/shm that some live process (of group ``pgid``, if given) has open or
    mapped (those it can read)."""
    held: set[str] = set()
    prefix = str(SHM_DIR) + "/"
    for pid in filter(str.isdigit, os.listdir("/proc")):
        if pgid is not None and not _in_group(int(pid), pgid):
            continue
        with contextlib.suppress(OSError):  # gone meanwhile, or not ours to read
            for fd in os.listdir(f"/proc/{pid}/fd"):
                with contextlib.suppress(OSError):
                    if (target := os.readlink(f"/proc/{pid}/fd/{fd}")).startswith(prefix):
                        held.add(target[len(prefix):].removesuffix(" (deleted)"))
        with contextlib.suppress(OSError):
            with open(f"/proc/{pid}/maps") as maps:
                for line in maps:
                    if (at := line.find(prefix)) >= 0:
                        held.add(line[at + len(prefix):].strip().removesuffix(" (deleted)"))
    return held


def remove_cuda_shm_of(pids: set[int], wait_s: float = GONE_WAIT_S) -> list[str]:
    """The CUDA driver's /dev/shm files of ``pids`` (``cuda.shm.<n>.<hex pid>.<n>``, one set per
    process that used a GPU; a process killed with SIGKILL leaves its own), removed once no
    live process has that pid: those of a pid still alive after ``wait_s``, or another
    process's by now, are kept (logged).  Returns the names removed."""
    deadline = time.monotonic() + wait_s
    while (alive := {pid for pid in pids if _is_live(pid)}) and time.monotonic() < deadline:
        time.sleep(0.05)
    removed = []
    for name in sorted(os.listdir(SHM_DIR)) if pids else ():
        match = _CUDA_SHM.fullmatch(name)
        if match is None or int(match[1], 16) not in pids or not _is_ours(SHM_DIR / name):
            continue
        if int(match[1], 16) in alive or _is_live(int(match[1], 16)):
            logger.warning("kept /dev/shm/%s: its process (or one that has its pid now) is alive", name)
            continue
        with contextlib.suppress(FileNotFoundError):
            (SHM_DIR / name).unlink()
            removed.append(name)
    if removed:
        logger.info("removed the CUDA driver's files of stopped processes: %s", ", ".join(removed))
    return removed


def _group_pids(pgid: int) -> set[int]:
    """The pids of group ``pgid``'s processes now (zombies too: their files are left as well)."""
    return {int(pid) for pid in filter(str.isdigit, os.listdir("/proc")) if _in_group(int(pid), pgid)}


def _is_live(pid: int) -> bool:
    """Whether a process that is not a zombie has ``pid`` (a zombie has let go of everything)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            text = stat.read()
    except OSError:
        return False
    return text[text.rindex(")") + 2] not in "ZX"


def _in_group(pid: int, pgid: int) -> bool:
    try:
        return os.getpgid(pid) == pgid
    except ProcessLookupError:
        return False


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


@contextlib.contextmanager
def phase(bench: str | None, name: str) -> Iterator[None]:
    """``<time> <bench>: phase <name> started`` and ``... ended after N s`` (or ``failed``);
    ``bench`` None: the running script's name."""
    bench = bench or Path(sys.argv[0]).stem
    print(f"{_now()} {bench}: phase {name} started", file=sys.stderr, flush=True)
    started = time.monotonic()
    try:
        yield
    except BaseException as exc:
        print(f"{_now()} {bench}: phase {name} failed after {time.monotonic() - started:.1f} s: "
              f"{type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
        raise
    print(f"{_now()} {bench}: phase {name} ended after {time.monotonic() - started:.1f} s",
          file=sys.stderr, flush=True)
