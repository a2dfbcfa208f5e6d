"""docs/contributing.md: its layout names every module of pegaflow/, engine/ and tools/, and no
module that is gone."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _listed() -> set[str]:
    text = (ROOT / "docs" / "contributing.md").read_text()
    return set(re.findall(r"^    ((?:pegaflow|engine|tools)/\S+\.py)\s", text, re.M))


def _modules() -> set[str]:
    return {str(p.relative_to(ROOT)) for package in ("pegaflow", "engine", "tools")
            for p in (ROOT / package).rglob("*.py") if p.name != "__init__.py"}


def test_contributing_layout_lists_every_module():
    assert sorted(_modules() - _listed()) == []


def test_contributing_layout_lists_no_module_that_is_gone():
    assert sorted(_listed() - _modules()) == []
