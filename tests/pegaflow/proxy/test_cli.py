"""``pegaflow-proxy``'s command line: bad arguments are refused with a clear message."""

from __future__ import annotations

import pytest

from pegaflow.platform.values import parse_size
from pegaflow.proxy.cli import build_parser, main
from pegaflow.proxy.config import ProxyConfig


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


def test_cli_version_names_the_proxy(capsys):
    with pytest.raises(SystemExit) as exited:
        main(["--version"])
    assert exited.value.code == 0
    assert capsys.readouterr().out.startswith("pegaflow-proxy ")


@pytest.mark.parametrize("flags,why", [
    (["--max-body-size", "12"], "has no unit"),
    (["--max-body-size", "2GiB"], "must not exceed max_body_bytes_in_flight"),
    (["--max-in-flight", "0"], "max_in_flight must be a positive whole number"),
    (["--idle-timeout-s", "0"], "idle_timeout_s=0.0"),
    (["--body-timeout-s", "nan"], "body_timeout_s=nan"),
])
def test_cli_bad_bound_is_refused_with_message(capsys, flags, why):
    assert main(["--prefill", "http://a:1", "--decode", "http://b:2", *flags]) == 2
    assert why in capsys.readouterr().err


def test_cli_defaults_are_the_configs():
    args = build_parser().parse_args(["--prefill", "http://a:1", "--decode", "http://b:1"])
    config = ProxyConfig(("http://a:1",), ("http://b:1",))
    assert (args.prefill_timeout_s, args.idle_timeout_s, args.body_timeout_s, args.max_in_flight) == (
        config.prefill_timeout_s, config.idle_timeout_s, config.body_timeout_s, config.max_in_flight)
    assert parse_size(args.max_body_size) == config.max_body_bytes == 128 << 20
    assert parse_size(args.max_body_bytes_in_flight) == config.max_body_bytes_in_flight
