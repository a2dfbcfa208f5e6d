"""Two "hosts" on one machine for the remote tier's tests and benchmark, and a Mooncake
master on the first.

    with two_hosts() as hosts:           # two network namespaces over a veth pair
        master = MasterProcess(hosts)    # (or two loopback addresses where they cannot be made)
        master.start()
        ... engines with prefix=hosts.first.prefix, *master.engine_flags(hosts.first) ...
        master.kill()

Namespaces need root and ``ip`` (iproute2); ``hosts.note`` says which stand-in was used.
"""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

MASTER_START_S = 15.0


class HostsError(RuntimeError):
    """The master did not start (its log says why)."""


@dataclass(frozen=True)
class Host:
    address: str
    prefix: tuple[str, ...]  # runs a command on this host (``ip netns exec NS``), or nothing


@dataclass(frozen=True)
class TwoHosts:
    first: Host
    second: Host
    is_netns: bool
    note: str


def mooncake_master_binary() -> str | None:
    """The ``mooncake_master`` beside this Python (the package's script), or on PATH."""
    beside = Path(sys.executable).parent / "mooncake_master"
    return str(beside) if os.access(beside, os.X_OK) else shutil.which("mooncake_master")


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=10)


def _make_netns(tag: str, subnet: str) -> list[str]:
    """Two namespaces joined by a veth pair, each with lo up; their names."""
    names, made = [f"pf{tag}a", f"pf{tag}b"], []
    try:
        for name in names:
            _ip("netns", "add", name)
            made.append(name)
        _ip("link", "add", f"pfv{tag}a", "type", "veth", "peer", "name", f"pfv{tag}b")
        for side, name in zip("ab", names):
            _ip("link", "set", f"pfv{tag}{side}", "netns", name)
            _ip("-n", name, "addr", "add", f"{subnet}.{1 if side == 'a' else 2}/24", "dev", f"pfv{tag}{side}")
            _ip("-n", name, "link", "set", f"pfv{tag}{side}", "up")
            _ip("-n", name, "link", "set", "lo", "up")
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired, OSError):
        _remove_netns(made)
        raise
    return names


def _remove_netns(names: list[str]) -> None:
    for name in names:  # (the veth pair goes with its namespaces)
        subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=10)


@contextlib.contextmanager
def two_hosts():
    tag = f"{os.getpid() % 100000}{random.randrange(10)}"
    subnet = f"10.{random.randrange(200, 250)}.{random.randrange(1, 250)}"
    reason = "not root" if os.geteuid() != 0 else "no ip command" if shutil.which("ip") is None else ""
    names = []
    if not reason:
        try:
            names = _make_netns(tag, subnet)
        except (subprocess.CalledProcessError, subprocess.TimeoutExpired, OSError) as exc:
            reason = f"ip netns failed: {(getattr(exc, 'stderr', b'') or b'').decode(errors='replace') or exc}"
    if not names:
        yield TwoHosts(Host("127.0.0.2", ()), Host("127.0.0.3", ()), False,
                       f"network namespaces cannot be made ({reason}): two loopback addresses "
                       f"(127.0.0.2, 127.0.0.3) stand in for the two hosts")
        return
    try:
        yield TwoHosts(Host(f"{subnet}.1", ("ip", "netns", "exec", names[0])),
                       Host(f"{subnet}.2", ("ip", "netns", "exec", names[1])), True,
                       f"two network namespaces {names[0]}, {names[1]} ({subnet}.1, .2) over a veth pair")
    finally:
        _remove_netns(names)


def free_port(hosts: TwoHosts) -> int:
    if hosts.is_netns:  # a fresh namespace has every port free
        return random.randrange(20000, 30000)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class MasterProcess:
    """A ``mooncake_master`` with its HTTP metadata server, on the first host's address."""

    def __init__(self, hosts: TwoHosts, log_dir: Path, binary: str | None = None):
        self.binary = binary or mooncake_master_binary()
        self.host, self.log_dir = hosts.first, log_dir
        self.rpc_port, self.http_port, self.metrics_port = (free_port(hosts) for _ in range(3))
        self.proc: subprocess.Popen | None = None
        self.num_starts = 0

    @property
    def address(self) -> str:
        return f"{self.host.address}:{self.rpc_port}"

    @property
    def metadata(self) -> str:
        return f"http://{self.host.address}:{self.http_port}/metadata"

    def engine_flags(self, host: Host, segment: str = "64MiB", *more: str) -> tuple[str, ...]:
        return ("--remote", "mooncake", "--remote-master", self.address, "--remote-metadata", self.metadata,
                "--remote-host", host.address, "--remote-segment-size", segment, *more)

    def start(self) -> None:
        self.num_starts += 1
        log = self.log_dir / f"mooncake-master-{self.num_starts}.log"
        with open(log, "wb") as out:
            self.proc = subprocess.Popen(
                [*self.host.prefix, self.binary, f"--rpc_address={self.host.address}", f"--rpc_port={self.rpc_port}",
                 "--enable_http_metadata_server=true", f"--http_metadata_server_host={self.host.address}",
                 f"--http_metadata_server_port={self.http_port}", f"--metrics_port={self.metrics_port}"],
                stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + MASTER_START_S
        while b"Master admin server started" not in log.read_bytes():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.kill()
                raise HostsError(f"mooncake_master did not start:\n{log.read_text(errors='replace')}")
            time.sleep(0.02)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)
