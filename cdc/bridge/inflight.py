"""The in-flight handshake with Redis: one batch is appended while the next is decoded.

At most one batch is sent and not yet confirmed. `send` hands the pending batches
to the publisher without waiting; `settle` waits for Redis to confirm them and
returns what was confirmed (the acknowledger then may move the slot to it).
"""

from __future__ import annotations

from typing import Protocol

from ..source.lsn import Lsn
from .batcher import Batcher

__all__ = ["InFlight", "Sent"]


class _Publisher(Protocol):  # what `cdc.sink.publisher.Publisher` offers this stage
    def send(self, batches, flushed: int | None = None) -> None: ...

    def confirm(self) -> int: ...


class Sent:
    """A batch sent to Redis: the end LSN it completes, its entries, and when it left."""

    __slots__ = ("ack", "count", "counts", "sent_at", "ts_ms")

    def __init__(self, ack: Lsn, count: int, counts: dict[str, int], sent_at: float, ts_ms: int) -> None:
        self.ack, self.count, self.counts, self.sent_at, self.ts_ms = ack, count, counts, sent_at, ts_ms


class InFlight:
    """The batch sent and not yet confirmed, if any."""

    __slots__ = ("publisher", "sent")

    def __init__(self, publisher: _Publisher) -> None:
        self.publisher = publisher
        self.sent: Sent | None = None

    @property
    def busy(self) -> bool:
        return self.sent is not None

    def send(self, batcher: Batcher, ack: Lsn, ts_ms: int, now: float) -> None:
        """Send every pending entry, with `ack` (the last whole transaction in them) as the flushed mark.

        The batcher is emptied; `settle()` must come before the next send.
        """
        if self.sent is not None:
            raise RuntimeError("settle() the batch in flight first")
        counts = batcher.counts()
        self.publisher.send(batcher.batches.values(), flushed=ack)
        self.sent = Sent(ack, batcher.pending, counts, now, ts_ms)
        batcher.clear()

    def settle(self) -> Sent | None:
        """Wait for Redis to confirm the batch in flight; it, or None if nothing was in flight."""
        if self.sent is None:
            return None
        self.publisher.confirm()
        sent, self.sent = self.sent, None
        return sent
