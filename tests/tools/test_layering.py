"""tools/ is a library (tools/lib/ and the modules beside the benches) and one thin entry point per
bench: no module of tools/ imports a bench (``tools/bench_*.py``)."""

from __future__ import annotations

import ast
from pathlib import Path

TOOLS = Path(__file__).resolve().parents[2] / "tools"


def _imported(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names |= {f"{node.module}.{alias.name}" for alias in node.names}
    return names


def test_layering_no_tools_module_imports_a_bench():
    benches = {f"tools.{p.stem}" for p in TOOLS.glob("bench_*.py")}
    assert "tools.bench_serving" in benches  # (the walk found them)
    found = {f"{p.relative_to(TOOLS.parent)} imports {name}" for p in TOOLS.rglob("*.py")
             for name in _imported(p) if name in benches and name != f"tools.{p.stem}"}
    assert found == set()
