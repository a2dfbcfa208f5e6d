"""``python -m tools.peers``: each peer configuration's one line on this machine: it runs here,
or why not (the exact import or loader error).  How the peers are run: ``tools/lib/peers.py``."""

from __future__ import annotations

import sys

from tools.lib.peers import PEERS, site_of, skip_line, unavailable


def main(argv: list[str] | None = None) -> int:
    """``python -m tools.peers``: each configuration's one line: runnable here, or why not."""
    import argparse
    p = argparse.ArgumentParser(description=main.__doc__)
    p.add_argument("configs", nargs="*", help=f"some of {', '.join(PEERS)} (default: every one)")
    args = p.parse_args(argv)
    if unknown := sorted(set(args.configs) - set(PEERS)):
        p.error(f"unknown {unknown}; choose from {list(PEERS)}")
    for config in args.configs or PEERS:
        reason = unavailable(config)
        print(f"{config}: runs here ({site_of(config)})" if reason is None else skip_line(config, reason))
    return 0


if __name__ == "__main__":
    sys.exit(main())
