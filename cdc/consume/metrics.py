"""A consumer's metrics and probes: what it handled, failed and dead-lettered, and its group's backlog.

`Consumer` counts on itself as it goes (`ConsumerMetrics`: plain counters and a
histogram, per batch). The gauges that need Redis (pending entries, lag in entries and
seconds, a data loss the bridge recorded) and the state database (resets applied by the
reconciliation) are read by a thread of their own every `REFRESH_S`, never per entry, and
kept for the scrapes. `serve_metrics` starts that thread and the HTTP server of
`cdc.metrics` (``/metrics``, ``/healthz``, ``/readyz``), the bridge's.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import redis

from .. import keys
from ..metrics import Histogram, Registry, serve
from ..sink.entry import parse_stream_id, reply_text

__all__ = ["ConsumerMetrics", "GroupView", "MetricsServer", "group_view", "serve_metrics"]

log = logging.getLogger("cdc.consumer.metrics")

#: how often the gauges that read Redis and the state database are refreshed (s)
REFRESH_S = 5.0
#: /healthz fails once the consumer's loop has not come round for this long (s)
STALL_S = 60.0
#: when Redis cannot tell a group's lag (XINFO GROUPS lag is nil: entries were deleted or trimmed
#: since the group's last delivery), the entries after it are counted, up to this many (pages of 1000)
LAG_COUNT_LIMIT = 10_000
HANDLER_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)


@dataclass(frozen=True)
class GroupView:
    """A group's backlog on one stream, as Redis reports it."""

    pending: int
    oldest_pending_idle_s: float
    lag_entries: int | None  # None: unknown (Redis cannot tell, and more than LAG_COUNT_LIMIT entries to count)
    lag_seconds: float  # now - commit time (ts_ms) of the oldest entry not delivered to the group yet


def group_view(client: redis.Redis, stream: str, group: str, now: float) -> GroupView | None:
    """`group`'s view of `stream` (None: no such stream or group yet)."""
    try:
        groups = client.xinfo_groups(stream)
    except redis.ResponseError as exc:
        if "no such key" in str(exc).lower():
            return None
        raise
    for g in groups:
        if reply_text(g["name"]) != group:
            continue
        idle = 0.0
        if g["pending"]:
            first = client.xpending_range(stream, group, "-", "+", 1)
            idle = first[0]["time_since_delivered"] / 1000 if first else 0.0
        last = reply_text(g["last-delivered-id"])
        after = client.xrange(stream, min="(" + last, count=1)
        waiting = 0.0
        if after:
            entry_id, fields = after[0]
            ts_ms = int(fields.get(b"ts_ms") or parse_stream_id(entry_id)[0])  # a marker has no ts_ms: its ID's time
            waiting = max(0.0, now - ts_ms / 1000)
        lag = g.get("lag")
        if lag is None:
            lag = undelivered(client, stream, last) if after else 0
        return GroupView(int(g["pending"]), idle, None if lag is None else int(lag), waiting)
    return None


def undelivered(client: redis.Redis, stream: str, last: str) -> int | None:
    """How many entries of `stream` come after `last`, counted where Redis cannot tell (XINFO GROUPS
    lag nil): the whole stream when `last` is before its first entry, else up to `LAG_COUNT_LIMIT`
    (None past it: unknown)."""
    first = client.xrange(stream, count=1)
    if first and parse_stream_id(first[0][0]) > parse_stream_id(last):
        return int(client.xlen(stream))
    counted, start = 0, "(" + last
    while counted < LAG_COUNT_LIMIT:
        page = client.xrange(stream, min=start, count=1000)
        counted += len(page)
        if len(page) < 1000:
            return counted
        start = "(" + reply_text(page[-1][0])
    return None


class ConsumerMetrics:
    """The counters a `Consumer` keeps, the gauges refreshed for it, and their registry."""

    def __init__(self, group: str, transactions: bool = False) -> None:
        self.group = group
        self.transactions = transactions  # transaction mode: the wait for END records is exported
        self.handled: dict[str, int] = defaultdict(int)
        self.failures: dict[str, int] = defaultdict(int)
        self.dead_letters: dict[str, int] = defaultdict(int)
        self.handler_seconds = Histogram(HANDLER_BUCKETS, (("group", group),))
        #: as of the last refresh
        self.views: dict[str, GroupView] = {}
        self.resets: int | None = None
        self.data_loss: dict[str, int] = {}
        self.refreshed_at = 0.0  # monotonic; 0: never
        self.refresh_error = ""
        #: where the consumer's loop is: starting, reading, retrying, stopped (set by Consumer.run, cdc consume)
        self.state = "starting"
        self.loop_at = time.monotonic()  # when the loop last came round
        #: transaction mode: since when (monotonic) entries wait for an END record the bridge has not written yet
        self.end_wait_since: float | None = None
        self.registry = self._registry()

    def tick(self) -> None:
        self.loop_at = time.monotonic()

    def _by_stream(self, counts: dict[str, int]) -> dict:
        return {(("stream", s), ("group", self.group)): n for s, n in counts.items()}

    def _gauge(self, read: Callable[[GroupView], float | None]) -> Callable[[], dict]:
        def values() -> dict:
            out = {}
            for stream, view in self.views.items():
                value = read(view)
                if value is not None:
                    out[(("stream", stream), ("group", self.group))] = value
            return out
        return values

    def _registry(self) -> Registry:
        r = Registry()
        r.counter("cdc_consumer_entries_total", "entries the handler finished (acknowledged), by stream",
                  lambda: self._by_stream(self.handled))
        r.histogram("cdc_consumer_handler_seconds", "time the handler took per batch", self.handler_seconds)
        r.counter("cdc_consumer_failures_total", "the handler's failures on an entry (counted towards max_deliveries)",
                  lambda: self._by_stream(self.failures))
        r.counter("cdc_consumer_dead_letters_total", "entries this consumer moved to the dead-letter stream",
                  lambda: self._by_stream(self.dead_letters))
        r.gauge("cdc_consumer_pending_entries", "entries delivered to the group and not acknowledged yet",
                self._gauge(lambda v: v.pending))
        r.gauge("cdc_consumer_oldest_pending_idle_seconds", "time since the group's oldest pending entry was delivered",
                self._gauge(lambda v: v.oldest_pending_idle_s))
        r.gauge("cdc_consumer_lag_entries", "entries not delivered to the group yet (XINFO GROUPS lag, "
                "counted when Redis cannot tell)", self._gauge(lambda v: v.lag_entries))
        r.gauge("cdc_consumer_lag_unknown", "1 while cdc_consumer_lag_entries is left out: Redis cannot tell the "
                "group's lag and more than 10000 entries wait", self._gauge(lambda v: int(v.lag_entries is None)))
        r.gauge("cdc_consumer_lag_seconds", "now minus the commit time of the oldest entry not delivered to the group yet",
                self._gauge(lambda v: v.lag_seconds))
        r.counter("cdc_consumer_resets_total", "reconciliation resets that repaired this consumer's state (cdc_reconcile_runs)",
                  lambda: None if self.resets is None else {(("group", self.group),): self.resets})
        r.gauge("cdc_redis_data_loss", "1 while the bridge has a Redis data loss recorded (cdc status shows it; cdc recover repairs it)",
                lambda: {(("slot", s),): v for s, v in self.data_loss.items()} or None)
        r.gauge("cdc_consumer_up", "1 while the consumer's loop is reading", lambda: int(self.state == "reading"))
        r.gauge("cdc_consumer_end_wait_seconds", "transaction mode: how long the oldest entries read have waited for "
                "their END record, which the bridge has not written yet (0: none waits)",
                lambda: {(("group", self.group),): self.end_wait_s()} if self.transactions else None)
        return r

    def end_wait_s(self) -> float:
        """How long entries have waited for an END record the bridge has not written yet (0: none waits)."""
        since = self.end_wait_since
        return 0.0 if since is None else max(0.0, time.monotonic() - since)

    def refresh(self, client: redis.Redis, streams: Sequence[str], slot: str | None = None,
                resets: Callable[[], int | None] | None = None) -> None:
        """Read the gauges now; a failure of the group views is kept for /readyz and raised."""
        now = time.time()
        try:
            views = {}
            for stream in streams:
                view = group_view(client, stream, self.group, now)
                if view is not None:
                    views[stream] = view
        except Exception as exc:
            self.refresh_error = " ".join(str(exc).split()) or type(exc).__name__
            raise
        self.views, self.refresh_error, self.refreshed_at = views, "", time.monotonic()
        if slot is not None:
            self._extra("the bridge's data loss record", lambda: self._read_data_loss(client, slot))
        if resets is not None:
            self._extra("the resets applied", lambda: setattr(self, "resets", resets()))

    def _read_data_loss(self, client: redis.Redis, slot: str) -> None:
        [at] = client.hmget(keys.bridge_state_key(slot), "data_loss_at_ms")
        self.data_loss = {slot: int(bool(at))}

    @staticmethod
    def _extra(what: str, read: Callable[[], None]) -> None:
        try:
            read()
        except Exception as exc:  # a side reading must not make the consumer look unready
            log.warning("metrics: cannot read %s: %s", what, " ".join(str(exc).split()))


class MetricsServer:
    """The HTTP server and the refreshing thread of one consumer; `close()` stops both."""

    def __init__(self, consumer, host: str, port: int, *, refresh_s: float, stall_s: float, slot: str | None,
                 resets: Callable[[], int | None] | None) -> None:
        self.consumer, self.metrics = consumer, consumer.metrics
        self.refresh_s, self.stall_s = refresh_s, stall_s
        self._stop = threading.Event()
        self._refresh = lambda: self.metrics.refresh(consumer.client, consumer.streams, slot, resets)
        self._resets = resets
        self.http = serve(self.metrics.registry, self.readiness, host, port, alive=self.liveness)
        self.port = self.http.server_address[1]
        self._thread = threading.Thread(target=self._run, name="cdc-consumer-metrics", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self._refresh()
            except Exception as exc:
                log.warning("metrics: cannot read the group's backlog: %s", self.metrics.refresh_error or exc)
            self._stop.wait(self.refresh_s)

    def liveness(self) -> tuple[bool, str]:
        m = self.metrics
        if m.state == "stopped":
            return True, "ok: stopped"
        quiet = time.monotonic() - m.loop_at
        if quiet > self.stall_s:
            return False, f"not alive: the consumer's loop has not come round for {quiet:.0f}s (its handler is stuck?)"
        return True, "ok"

    def readiness(self) -> tuple[bool, str]:
        """Ready: reading, Redis answered the last refresh, and (exclusive) holding at least one stream."""
        m, c = self.metrics, self.consumer
        if m.state != "reading":
            return False, f"not ready: {m.state}"
        if m.refresh_error:
            return False, f"not ready: redis: {m.refresh_error}"
        if not m.refreshed_at or time.monotonic() - m.refreshed_at > 3 * self.refresh_s + 5:
            return False, "not ready: redis has not answered the backlog reading yet"
        held = [s for s in c.active_streams if s in c.streams]  # transaction mode: the transactions stream apart
        if not held:
            return False, f"not ready: holding none of its {len(c.streams)} stream(s) (another consumer of group {c.group} holds them)"
        text = f"ready: reading {len(held)} of {len(c.streams)} stream(s)"
        if not c.transactions:
            return True, f"{text} for group {c.group}"
        text += f" and the transactions stream {c.transactions} for group {c.group}"
        waited = m.end_wait_s()
        if waited > c.transaction_wait_ms / 1000:  # as the log says once: no loss, the bridge is behind
            text += f"; waiting {waited:.0f}s for an END record the bridge has not written yet"
        return True, text

    def close(self) -> None:
        self._stop.set()
        self.http.shutdown()
        self.http.server_close()
        self._thread.join(timeout=10)
        close = getattr(self._resets, "close", None)
        if close is not None:
            close()


def serve_metrics(consumer, port: int, host: str = "0.0.0.0", *, refresh_s: float = REFRESH_S, stall_s: float = STALL_S,
                  slot: str | None = None, resets: Callable[[], int | None] | None = None) -> MetricsServer:
    """Serve `consumer`'s /metrics, /healthz and /readyz on host:port (0: a free port, see `.port`).

    `slot`: also export whether the bridge of that slot recorded a Redis data loss. `resets`: a
    reader of the resets applied to the consumer's state (`cdc.consume.checkpoint.ResetCount`)."""
    return MetricsServer(consumer, host, port, refresh_s=refresh_s, stall_s=stall_s, slot=slot, resets=resets)
