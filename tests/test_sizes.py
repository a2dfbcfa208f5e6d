"""The size rule for every product and tool file (pegaflow/, engine/, tools/): no file over 400
lines, no function over 60.  Size is a smell, not a law (docs/contributing.md): past these, look
for the seam a newcomer would name."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
COVERED = ("pegaflow", "engine", "tools")
MAX_FILE_LINES = 400
MAX_FUNCTION_LINES = 60


def _covered_files() -> list[Path]:
    return sorted(p for part in COVERED for p in (ROOT / part).rglob("*.py"))


def test_sizes_no_file_is_over_400_lines():
    files = _covered_files()
    assert {p.relative_to(ROOT).parts[0] for p in files} == set(COVERED)  # (the walk found the tree)
    long = [f"{p.relative_to(ROOT)}: {n}" for p in files if (n := len(p.read_text().splitlines())) > MAX_FILE_LINES]
    assert long == []


def test_sizes_no_function_is_over_60_lines():
    long = []
    for path in _covered_files():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                if (n := node.end_lineno - node.lineno + 1) > MAX_FUNCTION_LINES:
                    long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name}: {n}")
    assert long == []
