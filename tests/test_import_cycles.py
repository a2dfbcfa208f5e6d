"""No two modules of pegaflow/ or engine/ import each other, directly or round a loop, at
module level: a reader follows the imports downward only (``driver.py`` once re-imported
``batch_copy`` at its bottom, which imported ``driver``)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _module_of(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, modules: set[str]) -> set[str]:
    """The modules of the tree that ``path`` imports at module level."""
    name = _module_of(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[:len(package.split(".")) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)
    return {m.removeprefix("pegaflow.") if m.startswith("pegaflow.engine") else m for m in found} & modules


def _graph() -> dict[str, set[str]]:
    paths = [p for package in ("pegaflow", "engine") for p in (ROOT / package).rglob("*.py")]
    modules = {_module_of(p) for p in paths}
    return {_module_of(p): _imports(p, modules) - {_module_of(p)} for p in paths}


def _cycle_from(graph: dict[str, set[str]]) -> list[str]:
    state: dict[str, int] = {}  # 1: on the path, 2: done

    def visit(node: str, path: list[str]) -> list[str]:
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [node, nxt] if nxt in path else [node, nxt]
            if nxt not in state and (loop := visit(nxt, path + [node])):
                return loop
        state[node] = 2
        return []

    for node in sorted(graph):
        if node not in state and (loop := visit(node, [])):
            return loop
    return []


def test_import_cycles_none_at_module_level():
    assert _cycle_from(_graph()) == []


def test_import_cycles_check_finds_a_loop():
    assert _cycle_from({"a": {"b"}, "b": {"c"}, "c": {"a"}}) != []
    assert _cycle_from({"a": {"b"}, "b": set()}) == []
