"""``python -m engine`` / ``make run-engine``: configure logging, start, stop on a signal."""

from __future__ import annotations

import signal

# Threads started while imports run (numpy's BLAS pool) inherit this mask, so SIGTERM and
# SIGINT always reach the main thread, whose handler stops the loop at once.
signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM, signal.SIGINT})

import logging  # noqa: E402
import sys  # noqa: E402

from engine.config import config_from_args  # noqa: E402
from engine.server import EngineServer  # noqa: E402
from pegaflow.errors import PegaflowError  # noqa: E402

logger = logging.getLogger("engine")


def main(argv: list[str] | None = None) -> int:
    try:
        config = config_from_args(argv)
    except PegaflowError as exc:
        print(f"pegaflow engine: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(level=config.log_level,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        server = EngineServer(config)
    except PegaflowError as exc:
        logger.error("cannot start: %s", exc)
        return 1
    signal.signal(signal.SIGTERM, lambda *_: server.request_stop())
    signal.signal(signal.SIGINT, lambda *_: server.request_stop())
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM, signal.SIGINT})
    server.serve_forever()
    return 0


if __name__ == "__main__":
    sys.exit(main())
