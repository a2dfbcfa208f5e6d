"""The size rule for every product file (pegaflow/ and engine/): no file over 300 lines, no
function over 50."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PRODUCT = ("pegaflow", "engine")
MAX_FILE_LINES = 300
MAX_FUNCTION_LINES = 50


def _product_files() -> list[Path]:
    return sorted(p for part in PRODUCT for p in (ROOT / part).rglob("*.py"))


def test_sizes_no_product_file_is_over_300_lines():
    files = _product_files()
    assert {p.relative_to(ROOT).parts[0] for p in files} == set(PRODUCT)  # (the walk found the tree)
    long = [f"{p.relative_to(ROOT)}: {n}" for p in files if (n := len(p.read_text().splitlines())) > MAX_FILE_LINES]
    assert long == []


def test_sizes_no_product_function_is_over_50_lines():
    long = []
    for path in _product_files():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                if (n := node.end_lineno - node.lineno + 1) > MAX_FUNCTION_LINES:
                    long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name}: {n}")
    assert long == []
