"""``python -m tools.peers_table``: every system on every workload in one table, from the JSON
that bench_ttft, bench_serving and bench_replicas write (``tools/lib/tables.py`` builds it).

    python -m tools.peers_table --ttft ttft.json --serving serving.json --replicas replicas.json \\
        --out docs/benchmarks/peers.json --date 2026-12-06
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path

from tools.lib.tables import build, markdown


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ttft", help="bench_ttft --json output (its stdout, saved)")
    p.add_argument("--serving", help="bench_serving --json file")
    p.add_argument("--replicas", help="bench_replicas --json file")
    p.add_argument("--out", help="write the table's JSON here (e.g. docs/benchmarks/peers.json)")
    p.add_argument("--date", default=datetime.date.today().isoformat())
    args = p.parse_args(argv)
    inputs = {bench: json.loads(Path(path).read_text()) for bench, path in
              (("ttft", args.ttft), ("serving", args.serving), ("replicas", args.replicas)) if path}
    if not inputs:
        p.error("give at least one of --ttft, --serving, --replicas")
    table = build(inputs, args.date)
    if args.out:
        Path(args.out).write_text(json.dumps(table, indent=1) + "\n")
    print(markdown(table))
    return 0


if __name__ == "__main__":
    sys.exit(main())
