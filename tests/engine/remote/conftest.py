"""Two hosts and a Mooncake master for the remote tier's tests.

``two_hosts``: two network namespaces joined by a veth pair (10.<a>.<b>.1 and .2), made
here and removed after; where namespaces cannot be made (not root, no ``ip``), two
loopback addresses instead, which the test output says.  ``mooncake_master``: a master
(with its HTTP metadata server) on the first host, on ports of its own; ``kill()`` and
``start()`` take it down and bring it back.  Each test that needs the package skips
without it, saying how to install it.
"""

from __future__ import annotations

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

import pytest

MASTER_START_S = 15.0


@dataclass(frozen=True)
class Host:
    address: str
    prefix: tuple[str, ...]  # runs a command on this host (``ip netns exec NS``), or nothing


@dataclass(frozen=True)
class TwoHosts:
    first: Host
    second: Host
    is_netns: bool


def _mooncake_master() -> str:
    try:
        import mooncake.store  # noqa: F401
    except ImportError as exc:
        pytest.skip(f"mooncake-transfer-engine is not installed ({exc}): pip install -e '.[remote]' (make install)")
    found = shutil.which("mooncake_master") or str(Path(sys.executable).parent / "mooncake_master")
    if not os.access(found, os.X_OK):
        pytest.skip("mooncake_master not found beside the mooncake package")
    return found


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=10)


def _make_netns(tag: str, subnet: str) -> list[str]:
    """Two namespaces joined by a veth pair, each with lo up; their names."""
    names = [f"pf{tag}a", f"pf{tag}b"]
    made = []
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
        for name in made:
            subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=10)
        raise
    return names


@pytest.fixture(scope="module")
def two_hosts():
    _mooncake_master()
    tag = f"{os.getpid() % 100000}{random.randrange(10)}"
    subnet = f"10.{random.randrange(200, 250)}.{random.randrange(1, 250)}"
    reason = "not root" if os.geteuid() != 0 else "no ip command" if shutil.which("ip") is None else ""
    names = []
    if not reason:
        try:
            names = _make_netns(tag, subnet)
        except (subprocess.CalledProcessError, subprocess.TimeoutExpired, OSError) as exc:
            reason = f"ip netns failed: {getattr(exc, 'stderr', b'') or exc}"
    if names:
        print(f"\nremote tier tests: two network namespaces {names[0]}, {names[1]} ({subnet}.1, .2) over a veth pair")
        yield TwoHosts(Host(f"{subnet}.1", ("ip", "netns", "exec", names[0])),
                       Host(f"{subnet}.2", ("ip", "netns", "exec", names[1])), True)
        for name in names:
            subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=10)
        return
    print(f"\nremote tier tests: network namespaces cannot be made ({reason}); two loopback "
          f"addresses (127.0.0.2, 127.0.0.3) stand in for the two hosts")
    yield TwoHosts(Host("127.0.0.2", ()), Host("127.0.0.3", ()), False)


def _free_port(host: TwoHosts) -> int:
    if host.is_netns:  # a fresh namespace has every port free
        return random.randrange(20000, 30000)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class MooncakeMaster:
    def __init__(self, binary: str, hosts: TwoHosts, log_dir: Path):
        self.binary, self.host, self.log_dir = binary, hosts.first, log_dir
        self.rpc_port, self.http_port, self.metrics_port = (_free_port(hosts) for _ in range(3))
        self.proc: subprocess.Popen | None = None
        self.num_starts = 0

    @property
    def address(self) -> str:
        return f"{self.host.address}:{self.rpc_port}"

    @property
    def metadata(self) -> str:
        return f"http://{self.host.address}:{self.http_port}/metadata"

    def engine_flags(self, host: Host, *more: str) -> tuple[str, ...]:
        return ("--remote", "mooncake", "--remote-master", self.address, "--remote-metadata", self.metadata,
                "--remote-host", host.address, "--remote-segment-size", "64MiB", *more)

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
                pytest.fail(f"mooncake_master did not start:\n{log.read_text(errors='replace')}")
            time.sleep(0.02)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)


@pytest.fixture
def mooncake_master(two_hosts, tmp_path):
    master = MooncakeMaster(_mooncake_master(), two_hosts, tmp_path)
    master.start()
    yield master
    master.kill()
