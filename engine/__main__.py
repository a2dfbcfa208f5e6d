"""``pegaflow-engine`` (``python -m engine`` in a checkout, ``make run-engine``): configure logging,
start, stop on a signal."""

from __future__ import annotations

import signal

# Every thread inherits this mask (numpy's BLAS pool, started while imports run, too), so
# SIGTERM and SIGINT stay pending until the stop watch's thread takes them (a start waiting
# for the name sees them pending: name_lock.py).
signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM, signal.SIGINT})

import ctypes  # noqa: E402
import logging  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402

from pegaflow.platform.cli import EXIT_FAILED, EXIT_OK, EXIT_USAGE, say  # noqa: E402
from pegaflow.platform.errors import PegaflowError, ShmError, StartInterruptedError  # noqa: E402

from .process.options import build_parser, config_from_parsed, warn_unknown_env  # noqa: E402
from .process.server import EngineServer  # noqa: E402
from .process.stop_watch import StopWatch  # noqa: E402

logger = logging.getLogger("engine")

PROG = "pegaflow-engine"  # every line it prints of a problem starts with it

_PR_SET_TIMERSLACK = 29
TIMER_SLACK_NS = 1000


def clean_command(name: str) -> int:
    """``--clean NAME``: 0 when nothing of a dead engine is left, 1 when refused (it runs)."""
    from .process.cleanup import clean, describe
    try:  # (a bad name: clean's ConfigError, exit 2 in main, as for any bad flag)
        cleaned = clean(name)
    except ShmError as exc:
        say(PROG, str(exc))
        return EXIT_FAILED
    print(f"{PROG}: {describe(name, cleaned)}")
    return EXIT_FAILED if cleaned.not_removed else EXIT_OK


def tighten_timer_slack() -> None:
    """Let the loop's short naps while copies run (20 us) end on time instead of up to
    50 us late (Linux's default timer slack), so finished copies are answered sooner."""
    if not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_TIMERSLACK, TIMER_SLACK_NS, 0, 0, 0) != 0:
        logger.warning("timer slack left at the default: %s", os.strerror(ctypes.get_errno()))


def main(argv: list[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)  # the one parse: --clean, or the engine's config
        if args.clean is not None:
            return clean_command(args.clean)
        config = config_from_parsed(args)
    except PegaflowError as exc:
        say(PROG, str(exc))
        return EXIT_USAGE
    logging.basicConfig(level=config.log_level,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    warn_unknown_env()
    try:
        server = EngineServer(config)
    except StartInterruptedError as exc:
        logger.info("stopped before serving: %s", exc)
        return EXIT_OK
    except PegaflowError as exc:
        say(PROG, f"cannot start: {exc}")
        return EXIT_FAILED
    tighten_timer_slack()
    watch = StopWatch(server)  # a stop signal stops the loop, and the process within a bound
    watch.start()
    try:
        server.serve_forever()
    finally:
        watch.done()
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
