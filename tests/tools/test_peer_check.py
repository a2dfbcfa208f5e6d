"""tools/peer_check.py without a GPU: its verdict on a phase's figures, and a peer whose server
cannot start reported within seconds with the server's own words."""

from __future__ import annotations

import time

from tools import peer_check
from tools.lib import peers


def _result(cached, warm, cold, cacheable):
    return {"warm_cached_tokens": cached, "warm_tokens": warm, "cold_tokens": cold, "cacheable_tokens": cacheable}


def test_peer_check_verdict_needs_every_request_served_in_full_with_equal_tokens():
    # 1. Two prompts of 2 032 cacheable tokens each, both served in full, tokens equal: passed.
    ok, lines = peer_check.verdict(_result([2032, 2032], [[1], [2]], [[1], [2]], 4064))
    assert ok and lines[0] == "warm request 0: 2032 prompt tokens served by the peer, tokens equal: True"
    # 2. One served in part: failed.
    assert not peer_check.verdict(_result([2032, 256], [[1], [2]], [[1], [2]], 4064))[0]
    # 3. Served in full, one token differs: failed, and the line says which.
    ok, lines = peer_check.verdict(_result([2032, 2032], [[1], [3]], [[1], [2]], 4064))
    assert not ok and lines[1].endswith("tokens equal: False")


def test_peer_check_server_that_exits_at_start_fails_fast_with_its_log(tmp_path, monkeypatch, capsys):
    # 1. A stand-in LMCache whose `lmcache server` refuses its arguments, as 0.5.3's did
    #    without --eviction-policy.
    monkeypatch.setenv("PEGAFLOW_PEERS_DIR", str(tmp_path))
    cli = tmp_path / "lmcache" / "site" / "lmcache" / "cli"
    cli.mkdir(parents=True)
    (cli.parent / "__init__.py").write_text("")
    (cli / "__init__.py").write_text("")
    (cli / "main.py").write_text("import sys\nprint('lmcache server: error: the following arguments are required: "
                                 "--eviction-policy', file=sys.stderr)\nsys.exit(2)\n")
    monkeypatch.setattr(peers, "unavailable", lambda config: None)
    # 2. peer_check says so within seconds, with the server's words, and exits 1.
    started = time.monotonic()
    assert peer_check.main(["lmcache-mp", "--timeout", "60"]) == 1
    assert time.monotonic() - started < 30
    out = capsys.readouterr().out
    assert "peer_check: lmcache-mp failed: lmcache-mp's server exited (2)" in out
    assert out.count("required: --eviction-policy") == 2  # in the error, and in the log's last lines
