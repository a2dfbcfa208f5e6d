"""Two hosts and a Mooncake master for the remote tier's tests (``tools/remote_hosts.py``).

``two_hosts``: two network namespaces joined by a veth pair, made here and removed after;
where namespaces cannot be made (not root, no ``ip``), two loopback addresses instead,
which the test output says.  ``mooncake_master``: a master (with its HTTP metadata server)
on the first host, on ports of its own; ``kill()`` and ``start()`` take it down and bring
it back.  Each test that needs the package skips without it, saying how to install it.
"""

from __future__ import annotations

import warnings

import pytest

from tools.remote_hosts import HostsError, MasterProcess, mooncake_master_binary
from tools.remote_hosts import two_hosts as make_two_hosts


def _require_mooncake() -> str:
    try:
        import mooncake.store  # noqa: F401
    except ImportError as exc:
        pytest.skip(f"mooncake-transfer-engine is not installed ({exc}): pip install -e '.[remote]' (make test)")
    binary = mooncake_master_binary()
    if binary is None:
        pytest.skip("mooncake_master not found beside the mooncake package")
    return binary


@pytest.fixture(scope="module")
def two_hosts():
    _require_mooncake()
    with make_two_hosts() as hosts:
        print(f"\nremote tier tests: {hosts.note}")
        if not hosts.is_netns:  # (in the summary even under -q)
            warnings.warn(f"remote tier tests: {hosts.note}", stacklevel=1)
        yield hosts


@pytest.fixture
def mooncake_master(two_hosts, tmp_path):
    master = MasterProcess(two_hosts, tmp_path, _require_mooncake())
    try:
        master.start()
    except HostsError as exc:
        pytest.fail(str(exc))
    yield master
    master.kill()
