"""What deploy/'s dashboard and alert rules ask Prometheus for, against what the exporter emits;
and promtool, found on PATH or beside this Python (``make test`` puts it in .venv/bin)."""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
from pathlib import Path

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from tests.deploy.promql import parse

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "deploy" / "grafana" / "pegaflow.json"
RULES = ROOT / "deploy" / "prometheus" / "alerts.yaml"
RULES_TEST = ROOT / "deploy" / "prometheus" / "alerts_test.yaml"
SCRAPE_LABELS = {"instance", "job"}  # added by Prometheus to every series it scrapes
_LABEL_VALUES = re.compile(r"^label_values\((.*),\s*([A-Za-z_][A-Za-z0-9_]*)\)$")


def dashboard_expressions(dashboard: dict) -> list[str]:
    """Every PromQL expression of a Grafana dashboard: its panels' targets and the queries of
    its variables (``label_values(EXPR, LABEL)`` as ``EXPR``)."""
    exprs = [t["expr"] for panel in dashboard["panels"] for t in panel.get("targets", [])]
    for variable in dashboard["templating"]["list"]:
        if variable["type"] == "query":
            query = variable["query"]["query"] if isinstance(variable["query"], dict) else variable["query"]
            match = _LABEL_VALUES.match(query)
            exprs.append(match.group(1) if match else query)
    return exprs


def rule_expressions(rules: dict) -> dict[str, str]:
    """Alert (or recording rule) name -> its expression."""
    return {rule.get("alert") or rule["record"]: rule["expr"] for group in rules["groups"] for rule in group["rules"]}


def emitted_series(exposition: str) -> dict[str, dict[str, set[str]]]:
    """Sample name -> label -> the values it takes, in a scrape of the exporter."""
    series: dict[str, dict[str, set[str]]] = {}
    for family in text_string_to_metric_families(exposition):
        for sample in family.samples:
            labels = series.setdefault(sample.name, {})
            for label, value in sample.labels.items():
                labels.setdefault(label, set()).add(value)
    return series


def unknown_series(exprs: list[str], emitted: dict[str, dict[str, set[str]]]) -> list[str]:
    """What ``exprs`` name that the exporter does not emit: metrics, labels, and the values of
    ``=`` matchers."""
    problems = []
    for expr in exprs:
        parsed = parse(expr)
        known_labels = set(SCRAPE_LABELS)
        for selector in parsed.selectors:
            if selector.name not in emitted:
                problems.append(f"no metric {selector.name!r} (in {expr!r})")
                continue
            labels = emitted[selector.name]
            known_labels |= set(labels)
            for label, operator, value in selector.matchers:
                if label not in labels and label not in SCRAPE_LABELS:
                    problems.append(f"{selector.name} has no label {label!r}")
                elif operator == "=" and label in labels and value not in labels[label]:
                    problems.append(f"{selector.name}{{{label}={value!r}}} is never emitted "
                                    f"(its values: {sorted(labels[label])})")
        problems += [f"no label {label!r} on any series of {expr!r}"
                     for label in sorted(parsed.grouping_labels - known_labels)]
    return problems


def load_dashboard(path: Path = DASHBOARD) -> dict:
    return json.loads(path.read_text())


def load_rules(path: Path = RULES) -> dict:
    return yaml.safe_load(path.read_text())


def promtool() -> str:
    found = shutil.which("promtool") or shutil.which("promtool", path=str(Path(sys.executable).parent))
    if found is None:
        message = "promtool not found (on PATH or beside this Python): `make test` puts it in .venv/bin"
        if os.environ.get("CI"):
            pytest.fail(message)  # CI must run the rules' checks, not skip them
        pytest.skip(message)
    return found
