"""The monitoring files of deploy/: the Prometheus alert rules pass `promtool check rules` and their unit
tests (`promtool test rules`, every alert both firing and not), and every metric the rules and the Grafana
dashboard use is one the code exports."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
RULES = ROOT / "deploy" / "prometheus" / "cdc-rules.yaml"
RULE_TESTS = ROOT / "deploy" / "prometheus" / "cdc-rules.test.yaml"
DASHBOARD = ROOT / "deploy" / "grafana" / "cdc.json"

#: a metric-like identifier of ours (label values such as cdc:ride or cdc-bridge do not match)
METRIC = re.compile(r"\bcdc_[a-z0-9_]+\b")
#: a family the code registers: Registry.counter/gauge/histogram("cdc_...", ...)
REGISTERED = re.compile(r"\.(?:counter|gauge|histogram)\(\s*\"(cdc_[a-z0-9_]+)\"")
HISTOGRAM = re.compile(r"\.histogram\(\s*\"(cdc_[a-z0-9_]+)\"")


def promtool() -> str:
    path = shutil.which("promtool")
    if path is None:
        pytest.fail("promtool is needed: apt-get install prometheus (make test-deps)")
    return path


def exported() -> set[str]:
    """Every series name the code exports: the families registered, plus a histogram's _bucket/_sum/_count."""
    names: set[str] = set()
    for source in (ROOT / "cdc").rglob("*.py"):
        text = source.read_text()
        names.update(REGISTERED.findall(text))
        for histogram in HISTOGRAM.findall(text):
            names.update(histogram + suffix for suffix in ("_bucket", "_sum", "_count"))
    return names


def rule_expressions() -> list[str]:
    return [r["expr"] for group in yaml.safe_load(RULES.read_text())["groups"] for r in group["rules"]]


def dashboard_expressions() -> list[str]:
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    exprs += [v["definition"] for v in dashboard["templating"]["list"] if v.get("type") == "query"]
    return exprs


def test_promtool_checks_the_rules_and_runs_their_tests():
    tool = promtool()
    check = subprocess.run([tool, "check", "rules", str(RULES)], capture_output=True, text=True, timeout=60)
    assert check.returncode == 0, check.stdout + check.stderr
    tests = subprocess.run([tool, "test", "rules", RULE_TESTS.name], cwd=RULE_TESTS.parent, capture_output=True, text=True,
                           timeout=120)
    assert tests.returncode == 0, tests.stdout + tests.stderr
    assert "SUCCESS" in tests.stdout


def test_every_alert_is_tested_firing_and_not_firing():
    alerts = {r["alert"] for group in yaml.safe_load(RULES.read_text())["groups"] for r in group["rules"]}
    fired, quiet = set(), set()
    for case in yaml.safe_load(RULE_TESTS.read_text())["tests"]:
        for t in case.get("alert_rule_test", []):
            (fired if t.get("exp_alerts") else quiet).add(t["alertname"])
    assert alerts - fired == set(), "alerts never tested firing"
    assert alerts - quiet == set(), "alerts never tested staying quiet"
    assert fired | quiet <= alerts, "tests of alerts the rules do not have"


def test_every_metric_the_rules_and_the_dashboard_use_is_exported_by_the_code():
    names = exported()
    # the families of the bridge, the consumers and the reconciliation's metrics file are all found
    assert {"cdc_entries_published_total", "cdc_consumer_lag_seconds", "cdc_reconcile_last_run_timestamp_seconds",
            "cdc_commit_to_publish_seconds_bucket"} <= names
    for where, exprs in (("cdc-rules.yaml", rule_expressions()), ("cdc.json", dashboard_expressions())):
        used = {name for expr in exprs for name in METRIC.findall(expr)}
        assert used, where
        assert used - names == set(), f"{where} uses metrics the code does not export"
    # the dashboard shows every family the code exports
    shown = {name for expr in dashboard_expressions() for name in METRIC.findall(expr)}
    families = {n for n in names if not n.endswith(("_bucket", "_sum", "_count"))}
    histograms = {n[: -len("_bucket")] for n in names if n.endswith("_bucket")}
    hidden = {f for f in families if f not in shown and not (f in histograms and {f + "_bucket", f + "_sum"} & shown)}
    assert hidden == set(), "exported but not on the dashboard"
