"""Prometheus metrics and health endpoints, with no dependency beyond the standard library.

Values are read when scraped: the bridge keeps plain counters on itself (cheap on
the hot path) and registers functions that report them. `serve()` runs a small
HTTP server in a daemon thread with ``/metrics``, ``/healthz`` and ``/readyz``.
"""

from __future__ import annotations

import bisect
import logging
import threading
from collections.abc import Callable, Iterable, Mapping
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

__all__ = ["Histogram", "Registry", "serve"]

log = logging.getLogger("cdc.metrics")

Labels = tuple[tuple[str, str], ...]


def _labels(labels: Labels) -> str:
    if not labels:
        return ""
    inner = ",".join(f'{k}="{str(v).replace(chr(92), chr(92) * 2).replace(chr(34), chr(92) + chr(34))}"' for k, v in labels)
    return "{" + inner + "}"


def _number(value: float) -> str:
    if value == int(value) and abs(value) < 1e15:
        return str(int(value))
    return repr(float(value))


class Histogram:
    """A cumulative histogram; `observe` is called from one thread, `render` from another."""

    def __init__(self, buckets: Iterable[float]) -> None:
        self.bounds = sorted(buckets)
        self.counts = [0] * (len(self.bounds) + 1)
        self.total = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.total += value
        self.count += 1

    def lines(self, name: str) -> list[str]:
        out, running = [], 0
        for bound, n in zip(self.bounds, self.counts):
            running += n
            out.append(f'{name}_bucket{{le="{_number(bound)}"}} {running}')
        out.append(f'{name}_bucket{{le="+Inf"}} {self.count}')
        out.append(f"{name}_sum {repr(self.total)}")
        out.append(f"{name}_count {self.count}")
        return out


class Registry:
    """Metric families, each a function returning {labels: value} (or a Histogram)."""

    def __init__(self) -> None:
        self._families: list[tuple[str, str, str, Callable[[], object]]] = []

    def add(self, name: str, kind: str, help: str, read: Callable[[], object]) -> None:
        self._families.append((name, kind, help, read))

    def counter(self, name: str, help: str, read: Callable[[], Mapping[Labels, float] | float]) -> None:
        self.add(name, "counter", help, read)

    def gauge(self, name: str, help: str, read: Callable[[], Mapping[Labels, float] | float | None]) -> None:
        self.add(name, "gauge", help, read)

    def histogram(self, name: str, help: str, histogram: Histogram) -> None:
        self.add(name, "histogram", help, lambda: histogram)

    def render(self) -> str:
        lines = []
        for name, kind, help, read in self._families:
            try:
                value = read()
            except Exception as exc:  # a broken reader must not break the endpoint
                log.warning("metric %s unavailable: %s", name, exc)
                continue
            if value is None:
                continue
            lines.append(f"# HELP {name} {help}")
            lines.append(f"# TYPE {name} {kind}")
            if isinstance(value, Histogram):
                lines.extend(value.lines(name))
            elif isinstance(value, Mapping):
                for labels, v in sorted(value.items()):
                    lines.append(f"{name}{_labels(labels)} {_number(v)}")
            else:
                lines.append(f"{name} {_number(value)}")
        return "\n".join(lines) + "\n"


def serve(
    registry: Registry,
    ready: Callable[[], tuple[bool, str]],
    host: str = "0.0.0.0",
    port: int = 9187,
) -> ThreadingHTTPServer:
    """Serve /metrics, /healthz (the process answers) and /readyz (connected and not stalled)."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (the stdlib's name)
            if self.path == "/metrics":
                self._reply(200, registry.render(), "text/plain; version=0.0.4")
            elif self.path == "/healthz":
                self._reply(200, "ok\n")
            elif self.path == "/readyz":
                ok, why = ready()
                self._reply(200 if ok else 503, why + "\n")
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
