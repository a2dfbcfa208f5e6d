"""Speed tricks live in the ring and the codec only (docs/contributing.md): nowhere else in
pegaflow/ or engine/ a ``tuple.__new__`` partial, or a comment that reads a name "once" or
saves "a call" for speed."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HOMES = {"pegaflow/platform/ring.py", "pegaflow/platform/protocol/codec.py"}
TRICKS = re.compile(r"tuple\.__new__|read once|less a call|a call less|hot loop compares")


def test_speed_tricks_only_in_the_ring_and_the_codec():
    found = [f"{path.relative_to(ROOT)}:{n}: {line.strip()}"
             for part in ("pegaflow", "engine") for path in sorted((ROOT / part).rglob("*.py"))
             if str(path.relative_to(ROOT)) not in HOMES
             for n, line in enumerate(path.read_text().splitlines(), 1) if TRICKS.search(line)]
    assert found == []


def test_speed_tricks_homes_say_what_they_measured():
    # 1. Each home has its one comment, naming where it was timed.
    for home in HOMES:
        text = (ROOT / home).read_text()
        assert text.count("# Speed") == 1 and "timeit" in text, home
