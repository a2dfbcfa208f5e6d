"""engine.remote.probe: the master's port tried, the store's setup tried in a child process
and given up on a stop signal, the client's last log line quoted without its prefix."""

from __future__ import annotations

import signal
import socket
import threading

import pytest

from engine.remote.probe import check_master, last_line, probe_setup
from pegaflow.platform.errors import RemoteTierError, StartInterruptedError


def test_probe_check_master_refused_port_is_a_remote_tier_error():
    with socket.socket() as freed:
        freed.bind(("127.0.0.1", 0))
        port = freed.getsockname()[1]
    refused = rf"--remote-master 127.0.0.1:{port}: cannot connect \(Connection refused\)"
    with pytest.raises(RemoteTierError, match=refused):
        check_master(f"127.0.0.1:{port}", 5.0)


def test_probe_check_master_listening_port_passes():
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        check_master(f"127.0.0.1:{listener.getsockname()[1]}", 5.0)


def test_probe_last_line_drops_the_glog_prefix():
    text = ("W1206 05:20:51.789240 21072 real_client.cpp:858] Failed to create client on port 13067, retry 1/20\n"
            "E1206 05:22:17.447229 21072 real_client.cpp:865] Failed to create client after 20 retries\n\n")
    assert last_line(text) == "Failed to create client after 20 retries"
    assert last_line("") == "" and last_line("plain words\n") == "plain words"


def test_probe_setup_with_a_stop_signal_waiting_is_interrupted():
    # 1. SIGTERM blocked, as the starting engine has it, and one waiting.
    old_mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    try:
        signal.pthread_kill(threading.get_ident(), signal.SIGTERM)  # (this thread's: others may not block it)
        # 2. The trial is given up (its child killed) and the start interrupted, not failed.
        with pytest.raises(StartInterruptedError):
            probe_setup(["127.0.0.1", "P2PHANDSHAKE", 0, 16 << 20, "tcp", "", "127.0.0.1:1"], 600.0)
    finally:
        signal.sigtimedwait({signal.SIGTERM}, 0)  # taken, so that unblocking does not deliver it
        signal.pthread_sigmask(signal.SIG_SETMASK, old_mask)
