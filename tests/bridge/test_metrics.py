"""The /metrics exposition, without servers: names, labels and histograms as documented."""

from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families

from cdc.metrics import Histogram, Registry

pytestmark = pytest.mark.one_path


def test_families_render_in_the_prometheus_text_format(caplog):
    registry, latency = Registry(), Histogram([0.001, 0.5, 5])
    for value in (0.0005, 0.3, 2, 60):
        latency.observe(value)
    published = {"cdc:ride": 25, 'odd"name\\': 1}
    registry.counter("cdc_entries_published_total", "entries", lambda: {(("stream", s),): n for s, n in published.items()})
    registry.counter("cdc_sessions_total", "sessions", lambda: 2)
    registry.gauge("cdc_redis_memory_ratio", "no limit: left out", lambda: None)
    registry.gauge("cdc_broken", "a failing reader", lambda: 1 / 0)
    registry.histogram("cdc_publish_seconds", "latency", latency)

    text = registry.render()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    assert set(families) == {"cdc_entries_published", "cdc_sessions", "cdc_publish_seconds"}
    assert {(s.name, s.labels["stream"], s.value) for s in families["cdc_entries_published"].samples} == {
        ("cdc_entries_published_total", "cdc:ride", 25), ("cdc_entries_published_total", 'odd"name\\', 1)}
    assert "# TYPE cdc_sessions_total counter" in text and "cdc_sessions_total 2.0" in text
    buckets = {s.labels["le"]: s.value for s in families["cdc_publish_seconds"].samples if s.name.endswith("_bucket")}
    assert buckets == {"0.001": 1, "0.5": 2, "5": 3, "+Inf": 4}
    assert "cdc_publish_seconds_count 4.0" in text and "cdc_publish_seconds_sum 62.3005" in text
    assert "metric cdc_broken unavailable" in caplog.text

    published["cdc:rider"] = 3  # read at scrape time, not at registration
    assert 'cdc_entries_published_total{stream="cdc:rider"} 3.0' in registry.render()
