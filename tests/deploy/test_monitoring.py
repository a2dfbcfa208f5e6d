"""deploy/grafana/pegaflow.json and deploy/prometheus/alerts.yaml: every series they ask for is
one ``pegaflow-stat --serve-metrics`` emits (scraped from a running engine), the rules pass
``promtool check rules``, and each alert fires on its synthetic series and stays quiet on a
healthy one (``promtool test rules``).  Each check is also shown to fail on a broken copy."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import urllib.request

import pytest
import yaml

from tests.conftest import readline_within
from tests.deploy.monitoring import (
    DASHBOARD,
    ROOT,
    RULES,
    RULES_TEST,
    dashboard_expressions,
    emitted_series,
    load_dashboard,
    load_rules,
    promtool,
    rule_expressions,
    unknown_series,
)


@pytest.fixture(scope="module")
def emitted(shared_engine) -> dict:
    # 1. The exporter as deployed (a second process), on an ephemeral port, scraped once.
    proc = subprocess.Popen([sys.executable, "-m", "pegaflow.stats.cli", "--name", shared_engine.name,
                             "--serve-metrics", "127.0.0.1:0"], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        line = readline_within(proc)
        assert "/metrics" in line, proc.stderr.read() if proc.poll() is not None else line
        with urllib.request.urlopen(line.split(" at ", 1)[1].strip(), timeout=10) as response:
            body = response.read().decode()
    finally:
        proc.terminate()
        proc.wait(10)
    # 2. The engine was up: every family is there, not only pegaflow_up.
    assert f'pegaflow_up{{engine="{shared_engine.name}"}} 1.0' in body
    return emitted_series(body)


def test_dashboard_names_only_emitted_series(emitted):
    exprs = dashboard_expressions(load_dashboard())
    assert len(exprs) >= 12
    assert unknown_series(exprs, emitted) == []


def test_alert_rules_name_only_emitted_series(emitted):
    exprs = list(rule_expressions(load_rules()).values())
    assert unknown_series(exprs, emitted) == []


def test_unknown_series_finds_a_misspelt_metric_a_label_and_a_value_never_emitted(emitted):
    # The two checks above can fail: a broken copy of the dashboard is caught, each mistake once.
    text = DASHBOARD.read_text()
    assert "pegaflow_blocks_saved_total" in text and 'sum by (le, opcode)' in text
    broken = json.loads(text.replace("pegaflow_blocks_saved_total", "pegaflow_block_saved_total")
                            .replace("sum by (le, opcode)", "sum by (le, op)"))
    problems = unknown_series(dashboard_expressions(broken), emitted)
    assert any("pegaflow_block_saved_total" in p for p in problems)
    assert any("'op'" in p for p in problems)
    # A value of an `=` matcher the exporter never writes (its buckets are 0.025 and 0.25, not 0.3).
    rules = RULES.read_text().replace('le="0.25"', 'le="0.3"')
    problems = unknown_series(list(rule_expressions(yaml.safe_load(rules)).values()), emitted)
    assert any("le='0.3'" in p for p in problems)


def test_dashboard_panels_have_unique_ids_a_position_and_the_datasource_variable():
    dashboard = load_dashboard()
    ids = [panel["id"] for panel in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    assert {v["name"] for v in dashboard["templating"]["list"]} == {"datasource", "engine", "instance"}
    for panel in dashboard["panels"]:
        assert set(panel["gridPos"]) == {"h", "w", "x", "y"} and panel["gridPos"]["x"] + panel["gridPos"]["w"] <= 24
        assert panel["datasource"]["uid"] == "${datasource}" and panel["targets"], panel["title"]


def test_alert_rules_cover_the_five_conditions_each_with_a_firing_and_a_quiet_unit_test():
    alerts = set(rule_expressions(load_rules()))
    assert alerts == {"PegaflowEngineDown", "PegaflowPoolFull", "PegaflowHitRateCollapsed",
                      "PegaflowLookupsTimingOut", "PegaflowSlowCommands"}
    cases = [case for test in yaml.safe_load(RULES_TEST.read_text())["tests"] for case in test["alert_rule_test"]]
    for alert in alerts:
        expected = [case["exp_alerts"] for case in cases if case["alertname"] == alert]
        assert [] in expected and any(expected), alert  # quiet at one time, firing at another
        firing = [a["exp_labels"]["instance"] for e in expected for a in e]
        assert "node-b:9464" not in firing, alert  # the healthy series never fires


def test_alert_rules_pass_promtool_check():
    check = subprocess.run([promtool(), "check", "rules", str(RULES)], capture_output=True, text=True, timeout=60)
    assert check.returncode == 0, check.stdout + check.stderr


def test_alert_rules_unit_tests_pass_promtool_test():
    run = subprocess.run([promtool(), "test", "rules", str(RULES_TEST)], capture_output=True, text=True,
                         timeout=120, cwd=RULES_TEST.parent)
    assert run.returncode == 0, run.stdout + run.stderr


@pytest.mark.parametrize("old, new", [
    ("> 0.05", "> 0.5"),  # PegaflowSlowCommands would miss node-a's 20% of slow SAVEs
    ("pegaflow_up == 0", "pegaflow_up == 1"),  # PegaflowEngineDown on the healthy node
])
def test_alert_rules_unit_tests_fail_on_a_broken_rule(tmp_path, old, new):
    # The unit tests can fail: a copy of the rules with one threshold changed does not pass them.
    text = RULES.read_text()
    assert text.count(old) == 1
    (tmp_path / RULES.name).write_text(text.replace(old, new))
    shutil.copy(RULES_TEST, tmp_path / RULES_TEST.name)
    run = subprocess.run([promtool(), "test", "rules", RULES_TEST.name], capture_output=True, text=True,
                         timeout=120, cwd=tmp_path)
    assert run.returncode != 0 and "FAILED" in run.stdout + run.stderr


def test_alert_rules_promtool_check_fails_on_an_invalid_expression(tmp_path):
    broken = tmp_path / "alerts.yaml"
    broken.write_text(RULES.read_text().replace("expr: pegaflow_up == 0", "expr: pegaflow_up == == 0"))
    check = subprocess.run([promtool(), "check", "rules", str(broken)], capture_output=True, text=True, timeout=60)
    assert check.returncode != 0
