"""``pegaflow-proxy --prefill URL... --decode URL...``: serve the proxy until stopped."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys

from pegaflow.platform.errors import ConfigError
from pegaflow.platform.values import parse_size, version_line
from pegaflow.proxy.config import DEFAULT_MAX_BODY_BYTES, ProxyConfig


class _Defaults:
    """ProxyConfig's defaults by name: each stated once, there."""

    def __getattr__(self, name: str):
        return next(f.default for f in dataclasses.fields(ProxyConfig) if f.name == name)


def build_parser() -> argparse.ArgumentParser:
    d = _Defaults()
    p = argparse.ArgumentParser(
        prog="pegaflow-proxy",
        description="OpenAI-compatible front for prefill/decode disaggregation through pegaflow: "
                    "each request goes to a prefill vLLM (kv_producer) with max_tokens=1, then to a "
                    "decode vLLM (kv_consumer), round-robin among several of each "
                    "(docs/disaggregation.md).")
    p.add_argument("--version", action="version", version=version_line("pegaflow-proxy"))
    p.add_argument("--prefill", nargs="+", required=True, metavar="URL",
                   help="prefill servers, e.g. http://127.0.0.1:8100")
    p.add_argument("--decode", nargs="+", required=True, metavar="URL",
                   help="decode servers, e.g. http://127.0.0.1:8200")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port to listen on (default 8000)")
    p.add_argument("--prefill-timeout-s", type=float, default=d.prefill_timeout_s,
                   help="a prefill answer later than this is given up: the decode server computes "
                        f"the prompt (default {d.prefill_timeout_s:g})")
    p.add_argument("--prefill-retry-s", type=float, default=d.prefill_retry_s,
                   help="a prefill server whose last 3 requests failed gets one request per this many "
                        f"seconds until one succeeds; meanwhile others serve (default {d.prefill_retry_s:g})")
    p.add_argument("--decode-timeout-s", type=float, default=d.decode_timeout_s,
                   help=f"the longest a whole decode answer may take (default {d.decode_timeout_s:g})")
    p.add_argument("--idle-timeout-s", type=float, default=d.idle_timeout_s,
                   help="a connection that has not sent a whole request head this long after it opened "
                        f"or after its last answer is closed (default {d.idle_timeout_s:g})")
    p.add_argument("--body-timeout-s", type=float, default=d.body_timeout_s,
                   help=f"a request body not whole this long after its head is answered 408 "
                        f"(default {d.body_timeout_s:g})")
    p.add_argument("--max-body-size", default=f"{DEFAULT_MAX_BODY_BYTES >> 20}MiB",
                   help="a longer request body is answered 413 (default 128MiB)")
    p.add_argument("--max-body-bytes-in-flight", default=f"{d.max_body_bytes_in_flight >> 20}MiB",
                   help="request bodies held at once, being read or served; a body that would go past it "
                        f"is answered 503 (default {d.max_body_bytes_in_flight >> 30}GiB)")
    p.add_argument("--max-in-flight", type=int, default=d.max_in_flight,
                   help="requests served at once (their body read, upstream requests open); past it a "
                        f"request is answered 503 (default {d.max_in_flight})")
    p.add_argument("--log-level", default="INFO", choices=("DEBUG", "INFO", "WARNING", "ERROR"))
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        from pegaflow.proxy.app import Proxy
        from pegaflow.proxy.serve import serve
    except ImportError as exc:
        print(f"pegaflow-proxy: needs aiohttp (pip install 'vllm-kv-offload-engine[proxy]'): {exc}", file=sys.stderr)
        return 2
    try:
        proxy = Proxy(ProxyConfig(
            tuple(args.prefill), tuple(args.decode), prefill_timeout_s=args.prefill_timeout_s,
            decode_timeout_s=args.decode_timeout_s, prefill_retry_s=args.prefill_retry_s,
            idle_timeout_s=args.idle_timeout_s, body_timeout_s=args.body_timeout_s,
            max_body_bytes=parse_size(args.max_body_size),
            max_body_bytes_in_flight=parse_size(args.max_body_bytes_in_flight), max_in_flight=args.max_in_flight))
    except ConfigError as exc:
        print(f"pegaflow-proxy: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger(__name__).info("prefill %s, decode %s", " ".join(proxy.prefill.urls),
                                     " ".join(proxy.decode.urls))
    access_log = logging.getLogger("aiohttp.access") if args.log_level == "DEBUG" else None  # one line a request
    serve(proxy, args.host, args.port, access_log)
    return 0
