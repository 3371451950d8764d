"""The documentation's generated reference pages are the code's: `python -m cdc.cli.docgen` writes them,
and a committed page that differs from what it writes fails here, with the command to run."""

from __future__ import annotations

import dataclasses

from pathlib import Path

from cdc.bridge.loop import Bridge
from cdc.config import Settings
from cdc.cli import docgen
from conftest import ROOT


def test_the_generated_reference_pages_are_up_to_date():
    stale = docgen.stale_pages(ROOT)
    assert not stale, f"out of date: {', '.join(stale)}; regenerate them: {docgen.REGENERATE}"


def test_every_metric_the_bridge_serves_is_found_in_the_source():
    served = {name for name, *_ in Bridge(Settings(), [])._metrics()._families}
    found = {m.name for m in docgen.metric_definitions()}
    assert served and served <= found, served - found


def test_a_metric_defined_anywhere_is_found_with_its_labels(tmp_path):
    """As a new module would define them: on a registry, or with prometheus_client directly."""
    package = tmp_path / "cdc"
    (package / "consume").mkdir(parents=True)
    (package / "consume" / "stats.py").write_text(
        "from prometheus_client import Counter\n"
        "def register(r, groups):\n"
        "    r.counter('cdc_consumer_entries_total', 'entries handled, by group',\n"
        "              lambda: {(('group', g), ('outcome', 'acked')): n for g, n in groups.items()})\n"
        "    r.gauge('cdc_consumer_lag', 'entries not yet delivered', lambda: 0)\n"
        "LATE = Counter('cdc_consumer_late_total', 'entries late', ['group'])\n")
    found = {m.name: m for m in docgen.metric_definitions(package)}
    assert set(found) == {"cdc_consumer_entries_total", "cdc_consumer_lag", "cdc_consumer_late_total"}
    assert found["cdc_consumer_entries_total"].labels == ("group", "outcome (acked)")
    assert found["cdc_consumer_entries_total"].module == "cdc.consume.stats"
    assert (found["cdc_consumer_lag"].kind, found["cdc_consumer_late_total"].labels) == ("gauge", ("group",))


def test_labels_written_by_a_helper_are_found():
    """The consumers' labels come from helper methods and attributes, the alarm levels from a method:
    the table names them as /metrics does."""
    found = {m.name: m.labels for m in docgen.metric_definitions()}
    assert found["cdc_consumer_entries_total"] == found["cdc_consumer_lag_seconds"] == ("stream", "group")
    assert found["cdc_consumer_handler_seconds"] == ("group",)
    assert found["cdc_retained_wal_alarm_bytes"] == ("level (warning, critical)",)
    assert found["cdc_reconcile_status"] == ("spec", "consumer", "status")


def test_a_default_of_zero_is_shown():
    assert "| `--metrics-port METRICS_PORT` | `0` |" in docgen.cli_block()


def test_a_stale_page_is_named_with_the_command_that_regenerates_it(tmp_path, monkeypatch, capsys):
    for page in docgen.PAGES:
        (tmp_path / page).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / page).write_text((ROOT / page).read_text())
    page = tmp_path / "docs" / "reference" / "metrics.md"
    page.write_text(page.read_text().replace("| `cdc_up` |", "| `cdc_down` |"))
    assert docgen.stale_pages(tmp_path) == ["docs/reference/metrics.md"]
    monkeypatch.setattr(docgen, "ROOT", tmp_path)
    assert docgen.main(["--check"]) == 1
    assert capsys.readouterr().err == (f"out of date: docs/reference/metrics.md; regenerate them: {docgen.REGENERATE}\n")
    assert docgen.main([]) == 0 and docgen.stale_pages(tmp_path) == []


def test_every_setting_says_what_it_is():
    """A setting without a #: comment in cdc/config.py would leave its item empty: the generator refuses it. The
    settings are a list, no wide table: the page reads at any window width."""
    import re

    from cdc import config

    text = docgen.settings_block()
    items = [line for line in text.splitlines() if line.startswith("- ")]
    described = [re.fullmatch(r"- \*\*`([a-z_.]+)`\*\* \((?:[^()]|\([^()]*\))*\): (\S.*)", line) for line in items]
    assert all(described), [line for line, match in zip(items, described) if not match]
    sections = sum(len(dataclasses.fields(cls)) for cls in config._SECTIONS.values())
    assert len(items) > sections and not any(line.startswith("|") for line in text.splitlines())
    page = Path(ROOT / "docs" / "reference" / "configuration.md").read_text()
    assert page.count("- **`trim.max_len`** (") == 1
