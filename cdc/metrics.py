"""Prometheus metrics and health endpoints.

Values are read when scraped: the bridge and the consumers keep plain counters on
themselves (cheap on the hot path) and register functions that report them; `Registry` is a
`prometheus_client` custom collector that turns them into metric families at
scrape time, and the library writes the exposition format. `serve()` runs a
small HTTP server in a daemon thread with ``/metrics``, ``/healthz`` and ``/readyz``.

`prometheus_client` and the HTTP server are imported at the first scrape or `serve()`: a bridge
with ``http.port: 0`` counts without ever loading them.
"""

from __future__ import annotations

import bisect
import logging
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import TYPE_CHECKING

from .redact import redact

if TYPE_CHECKING:
    from http.server import ThreadingHTTPServer

    from prometheus_client import CollectorRegistry
    from prometheus_client.core import HistogramMetricFamily, Metric

__all__ = ["Histogram", "Registry", "serve"]

log = logging.getLogger("cdc.metrics")

Labels = tuple[tuple[str, str], ...]


class Histogram:
    """A histogram observed from one thread without locks, read by the collector from another."""

    def __init__(self, buckets: Iterable[float], labels: Labels = ()) -> None:
        self.labels = labels
        self.bounds = sorted(buckets)
        self.counts = [0] * (len(self.bounds) + 1)
        self.total = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.total += value
        self.count += 1

    def family(self, name: str, help: str) -> HistogramMetricFamily:
        from prometheus_client.core import HistogramMetricFamily

        buckets, running = [], 0
        for bound, n in zip(self.bounds, self.counts):
            running += n
            buckets.append((_le(bound), running))
        buckets.append(("+Inf", self.count))
        family = HistogramMetricFamily(name, help, labels=[k for k, _ in self.labels])
        family.add_metric([v for _, v in self.labels], buckets, sum_value=self.total)
        return family


def _le(bound: float) -> str:
    return str(int(bound)) if bound == int(bound) else repr(float(bound))


class Registry:
    """Metric families, each a function returning {labels: value}, a value, None (left out) or a Histogram."""

    def __init__(self) -> None:
        self._families: list[tuple[str, str, str, Callable[[], object]]] = []
        self._collectors: CollectorRegistry | None = None

    @property
    def collectors(self) -> CollectorRegistry:
        """The `prometheus_client` registry holding this collector (made at the first scrape)."""
        if self._collectors is None:
            from prometheus_client import CollectorRegistry

            self._collectors = CollectorRegistry(auto_describe=False)
            self._collectors.register(self)
        return self._collectors

    def add(self, name: str, kind: str, help: str, read: Callable[[], object]) -> None:
        self._families.append((name, kind, help, read))

    def counter(self, name: str, help: str, read: Callable[[], Mapping[Labels, float] | float]) -> None:
        self.add(name, "counter", help, read)

    def gauge(self, name: str, help: str, read: Callable[[], Mapping[Labels, float] | float | None]) -> None:
        self.add(name, "gauge", help, read)

    def histogram(self, name: str, help: str, histogram: Histogram) -> None:
        self.add(name, "histogram", help, lambda: histogram)

    def collect(self) -> Iterator[Metric]:
        """The `prometheus_client` collector protocol: every family, read now."""
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        families = {"counter": CounterMetricFamily, "gauge": GaugeMetricFamily}
        for name, kind, help, read in self._families:
            try:
                value = read()
            except Exception as exc:  # a broken reader must not break the endpoint
                log.warning("metric %s unavailable: %s", name, exc)
                continue
            if value is None:
                continue
            if isinstance(value, Histogram):
                yield value.family(name, help)
                continue
            items = sorted(value.items()) if isinstance(value, Mapping) else [((), value)]
            label_names = [k for k, _ in items[0][0]] if items else []
            family = families[kind](name, help, labels=label_names)
            for labels, v in items:
                family.add_metric([redact(str(v)) for _, v in labels], v)
            yield family

    def render(self) -> str:
        from prometheus_client import generate_latest

        return generate_latest(self.collectors).decode()


def _answers() -> tuple[bool, str]:
    return True, "ok"


def serve(
    registry: Registry,
    ready: Callable[[], tuple[bool, str]],
    host: str = "0.0.0.0",
    port: int = 9187,
    alive: Callable[[], tuple[bool, str]] = _answers,
) -> ThreadingHTTPServer:
    """Serve /metrics, /healthz (`alive`: by default, the process answers) and /readyz (`ready`)."""
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from prometheus_client import CONTENT_TYPE_LATEST

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (the stdlib's name)
            if self.path == "/metrics":
                self._reply(200, registry.render(), CONTENT_TYPE_LATEST)
            elif self.path in ("/healthz", "/readyz"):
                ok, why = (alive if self.path == "/healthz" else ready)()
                self._reply(200 if ok else 503, redact(why) + "\n")
            else:
                self._reply(404, "not found\n")

        def _reply(self, status: int, body: str, kind: str = "text/plain") -> None:
            data = body.encode()
            self.send_response(status)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, format: str, *args: object) -> None:  # noqa: A002
            pass  # scrapes are not events worth a log line

    server = ThreadingHTTPServer((host, port), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, name="cdc-http", daemon=True).start()
    log.info("serving /metrics, /healthz, /readyz on %s:%d", host, server.server_address[1])
    return server
