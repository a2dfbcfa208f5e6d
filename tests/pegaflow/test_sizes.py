"""The size rule for pegaflow's own parts (connector, stats, proxy; the platform and the
client have theirs): no file over 300 lines, no function over 50."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2] / "pegaflow"
MAX_FILE_LINES = 300
MAX_FUNCTION_LINES = 50


def _product_files() -> list[Path]:
    return sorted(p for p in ROOT.rglob("*.py") if p.relative_to(ROOT).parts[0] not in ("platform", "client"))


def test_sizes_no_file_of_the_connector_stats_or_proxy_is_over_300_lines():
    files = _product_files()
    assert any(p.parent.name == "connector" for p in files)  # (the walk found the tree)
    long = [f"{p.relative_to(ROOT)}: {n}" for p in files if (n := len(p.read_text().splitlines())) > MAX_FILE_LINES]
    assert long == []


def test_sizes_no_function_of_the_connector_stats_or_proxy_is_over_50_lines():
    long = []
    for path in _product_files():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                if (n := node.end_lineno - node.lineno + 1) > MAX_FUNCTION_LINES:
                    long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name}: {n}")
    assert long == []
