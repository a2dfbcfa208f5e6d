"""README's "Why pegaflow" table against the raw results: each figure of a row is the value of
the key its source line names in docs/benchmarks/ (``a/b``: a ratio of two keys), rounded as
the table shows it; a peer's "wrong" stands where that run's outputs differed and nowhere else."""

from __future__ import annotations

import json
import re
from decimal import ROUND_HALF_UP, Decimal
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
RESULTS = ROOT / "docs" / "benchmarks"
# Numbers in a cell that are no figure: a version, an issue number, a flag's value, "top-5".
_NOT_FIGURES = re.compile(r"`[^`]*`|\[[^\]]*\]\([^)]*\)|vLLM \d+\.\d+|LMCache#\d+")
_FIGURE = re.compile(r"(?<![\w.#-])(\d+(?:\.\d+)?)(?:x\b|(?![\w.-]))")
_SOURCE = re.compile(r"^- (?P<row>[^:]+): (?P<spec>.+)$")


def why_section(text: str) -> str:
    return text.split("## Why pegaflow", 1)[1].split("\n## ", 1)[0]


def table_rows(section: str) -> tuple[list[str], list[list[str]]]:
    """The header's cells and every row's cells (the separator left out)."""
    lines = [line for line in section.splitlines() if line.startswith("|")]
    cells = [[c.strip() for c in line.strip().strip("|").split("|")] for line in lines]
    return cells[0], [row for row in cells[1:] if not set(row[0]) <= set("-")]


def sources(section: str) -> dict[str, list[tuple[str, str]]]:
    """Row label fragment -> (file, key) per figure, in order, from the source lines."""
    found = {}
    for line in section.splitlines():
        match = _SOURCE.match(line)
        if match is None or "`" not in match["spec"]:
            continue
        keys, current = [], None
        for token in re.findall(r"`([^`]+)`", match["spec"]):
            if token.endswith(".json"):
                current = token
            else:
                keys.append((current, token))
        found[match["row"]] = keys
    return found


def figures(cell: str) -> list[str]:
    return _FIGURE.findall(_NOT_FIGURES.sub(" ", cell))


def _lookup(result, path: str) -> Decimal:
    value = result
    for part in path.split("."):
        value = value[int(part)] if isinstance(value, list) else value[part]
    return Decimal(str(value))


def key_value(file: str, key: str) -> Decimal:
    result = json.loads((RESULTS / file).read_text())
    numerator, _, denominator = key.partition("/")
    value = _lookup(result, numerator)
    return value / _lookup(result, denominator) if denominator else value


def _rounded_as(value: Decimal, shown: str) -> str:
    places = len(shown.partition(".")[2])
    return str(value.quantize(Decimal(1).scaleb(-places), rounding=ROUND_HALF_UP))


def figure_mismatches(text: str) -> list[str]:
    """Every figure of the table that its source key does not give, and every row whose figures
    and keys differ in number or that has no source line."""
    section = why_section(text)
    _, rows = table_rows(section)
    keyed, problems = sources(section), []
    for row in rows:
        shown = [f for cell in row[1:] for f in figures(cell)]
        if not shown:
            continue
        matching = [label for label in keyed if label in row[0]]
        if len(matching) != 1:
            problems.append(f"row {row[0]!r}: {len(matching)} source lines")
            continue
        keys = keyed[matching[0]]
        if len(keys) != len(shown):
            problems.append(f"row {row[0]!r}: {len(shown)} figures {shown}, {len(keys)} keys")
            continue
        for figure, (file, key) in zip(shown, keys):
            if _rounded_as(key_value(file, key), figure) != figure:
                problems.append(f"row {row[0]!r}: {figure} where {file} {key} is {key_value(file, key)}")
    return problems


def test_readme_why_table_every_figure_is_its_source_key():
    assert figure_mismatches(README.read_text()) == []


def test_readme_why_table_has_sources_for_the_figure_rows():
    section = why_section(README.read_text())
    assert len(sources(section)) == 11
    assert sum(len(keys) for keys in sources(section).values()) >= 50


def test_figure_mismatches_finds_one_figure_changed():
    # The test above can fail: one figure changed, one missing, one key misnamed.
    text = README.read_text()
    assert "**42.4** (cold 281.3" in text and "| 9.57 |" in text
    changed = figure_mismatches(text.replace("**42.4** (cold 281.3", "**42.4** (cold 265.1"))
    assert len(changed) == 1 and "265.1" in changed[0]
    assert any("figures" in p for p in figure_mismatches(text.replace("| 9.57 |", "| fast |")))
    renamed = text.replace("`native.restart_time_to_ready_s`", "`native.time_to_ready_s`")
    assert any("109.125" in p for p in figure_mismatches(renamed))


def test_readme_why_table_marks_lmcache_wrong_only_where_its_outputs_differed():
    # A workload column of LMCache says "wrong" exactly where peers.json's run of it had
    # outputs_identical false; a mode never run says "not run".
    header, rows = table_rows(why_section(README.read_text()))
    in_process = next(i for i, h in enumerate(header) if "LMCacheConnectorV1" in h)
    multi_process = next(i for i, h in enumerate(header) if "LMCacheMPConnector" in h)
    peers = json.loads((RESULTS / "peers.json").read_text())["configs"]
    keyed = sources(why_section(README.read_text()))
    for row in rows:
        label = next((label for label in keyed if label in row[0]), None)
        workloads = {key.split(".")[2] for file, key in keyed.get(label, [])
                     if file == "peers.json" and key.startswith("configs.lmcache.")}
        for workload in workloads:
            assert ("wrong" in row[in_process]) == (not peers["lmcache"][workload]["outputs_identical"]), row[0]
        if label is not None:
            assert row[multi_process] == "not run" or "lmcache-mp" in peers, row[0]
    assert not any("wrong" in row[multi_process] for row in rows)
