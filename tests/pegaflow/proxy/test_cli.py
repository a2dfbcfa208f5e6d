"""``pegaflow-proxy``'s command line: bad arguments are refused with a clear message."""

from __future__ import annotations

import pytest

from pegaflow.proxy.cli import build_parser, main


def test_cli_bad_url_or_timeout_is_refused_with_message(capsys):
    assert main(["--prefill", "localhost:8100", "--decode", "http://127.0.0.1:8200"]) == 2
    assert "expected http://host:port" in capsys.readouterr().err
    assert main(["--prefill", "http://a:1", "--decode", "http://b:2", "--prefill-timeout-s", "0"]) == 2
    assert "timeouts must be positive" in capsys.readouterr().err


def test_cli_needs_both_kinds_of_server():
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--prefill", "http://a:1"])
    args = build_parser().parse_args(["--prefill", "http://a:1", "http://a:2", "--decode", "http://b:1"])
    assert args.prefill == ["http://a:1", "http://a:2"] and args.port == 8000


@pytest.mark.parametrize("value", ["nan", "inf", "-1"])
def test_cli_timeout_that_is_no_duration_is_refused(capsys, value):
    assert main(["--prefill", "http://a:1", "--decode", "http://b:2", "--decode-timeout-s", value]) == 2
    assert f"decode_timeout_s={float(value)}" in capsys.readouterr().err
