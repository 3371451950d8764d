"""What a bridge counts across its sessions: the figures its metrics and its last log line report.

A session moves them (`cdc.bridge.session`); the bridge that runs it keeps them for
its whole life and serves them (`cdc.bridge.loop`). Pure: numbers only.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable

from ..metrics import Histogram
from .inflight import Sent

__all__ = ["Counters"]


class Counters:
    """Changes read, transactions, entries Redis confirmed, batches, and the rows of backfills."""

    __slots__ = ("changes_read", "transactions", "entries_published", "read_by_entity", "published_by_stream",
                 "batch_sizes", "publish_seconds", "commit_lag_seconds", "backfill_rows", "backfill_skipped")

    def __init__(self, entities: Iterable[str]) -> None:
        self.changes_read = 0
        self.transactions = 0
        self.entries_published = 0
        #: entity -> [changes of its table read], one list shared by every target bound to it
        self.read_by_entity: dict[str, list[int]] = {e: [0] for e in entities}
        self.published_by_stream: dict[str, int] = defaultdict(int)
        self.batch_sizes = Histogram([1, 10, 50, 100, 500, 1000, 2000, 5000])
        self.publish_seconds = Histogram([0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1, 5])
        self.commit_lag_seconds = Histogram([0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 5, 30])
        self.backfill_rows: dict[str, int] = defaultdict(int)
        self.backfill_skipped = 0

    def confirmed(self, sent: Sent, monotonic: float, wall: float) -> None:
        """Redis confirmed `sent` at `monotonic` (s, the clock of `Sent.sent_at`), `wall` (s since the epoch)."""
        self.publish_seconds.observe(monotonic - sent.sent_at)
        self.commit_lag_seconds.observe(max(0.0, wall - sent.ts_ms / 1000))
        for name, n in sent.counts.items():
            self.published_by_stream[name] += n
        self.entries_published += sent.count
