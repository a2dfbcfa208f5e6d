"""``pegaflow-proxy --prefill URL... --decode URL...``: serve the proxy until stopped."""

from __future__ import annotations

import argparse
import logging
import sys

from pegaflow.platform.errors import ConfigError


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="pegaflow-proxy",
        description="OpenAI-compatible front for prefill/decode disaggregation through pegaflow: "
                    "each request goes to a prefill vLLM (kv_producer) with max_tokens=1, then to a "
                    "decode vLLM (kv_consumer), round-robin among several of each "
                    "(docs/disaggregation.md).")
    p.add_argument("--prefill", nargs="+", required=True, metavar="URL",
                   help="prefill servers, e.g. http://127.0.0.1:8100")
    p.add_argument("--decode", nargs="+", required=True, metavar="URL",
                   help="decode servers, e.g. http://127.0.0.1:8200")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port to listen on (default 8000)")
    p.add_argument("--prefill-timeout-s", type=float, default=600.0,
                   help="a prefill answer later than this is given up: the decode server computes "
                        "the prompt (default 600)")
    p.add_argument("--decode-timeout-s", type=float, default=3600.0,
                   help="the longest a whole decode answer may take (default 3600)")
    p.add_argument("--log-level", default="INFO", choices=("DEBUG", "INFO", "WARNING", "ERROR"))
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        from aiohttp import web

        from pegaflow.proxy.app import Proxy, ProxyConfig
    except ImportError as exc:
        print(f"pegaflow-proxy: needs aiohttp (pip install 'vllm-kv-offload-engine[proxy]'): {exc}", file=sys.stderr)
        return 2
    try:
        proxy = Proxy(ProxyConfig(tuple(args.prefill), tuple(args.decode), args.prefill_timeout_s,
                                  args.decode_timeout_s))
    except ConfigError as exc:
        print(f"pegaflow-proxy: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger(__name__).info("prefill %s, decode %s", " ".join(proxy.prefill.urls),
                                     " ".join(proxy.decode.urls))
    access_log = logging.getLogger("aiohttp.access") if args.log_level == "DEBUG" else None  # one line a request
    web.run_app(proxy.app(), host=args.host, port=args.port, print=None, access_log=access_log)
    return 0
