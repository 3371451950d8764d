"""The per-stream batcher: entries waiting to be sent, and when to send them.

Entries gather in one `StreamBatch` per stream. The batch is due when it holds
``max_entries`` entries or its oldest entry is ``max_delay`` seconds old; the loop
also sends it once the server has had nothing more to say for a moment
(`cdc.bridge.session.Session.linger`: `LINGER_S`, or a few gaps between transactions while
they keep coming, never past ``max_delay``). Pure: no I/O.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from ..sink.lane import Packed
from ..sink.publisher import StreamBatch
from .positions import Transaction

__all__ = ["Batcher"]


class Batcher:
    """One batch per stream, the count of entries pending across them, and the size and age rules."""

    __slots__ = ("batches", "pending", "sent", "first_at", "max_entries", "max_delay", "clock", "packer")

    def __init__(self, max_entries: int, max_delay_s: float, clock: Callable[[], float] = time.monotonic,
                 packer: Callable[[bytes], Packed] | None = None) -> None:
        self.batches: dict[str, StreamBatch] = {}
        self.pending = 0  # entries added since the last `clear`
        self.sent = 0  # entries cleared away over the batcher's lifetime (`sent + pending`: ever added)
        self.first_at = 0.0  # when the oldest of them was added
        self.max_entries = max_entries
        self.max_delay = max_delay_s
        self.clock = clock
        #: each batch's `StreamBatch.packed` (None: batches keep entry lists until sent)
        self.packer = packer

    def batch(self, stream: str) -> StreamBatch:
        """The batch of `stream` (the same object for the bridge's lifetime)."""
        batch = self.batches.get(stream)
        if batch is None:
            batch = self.batches[stream] = StreamBatch(stream, self.packer)
        return batch

    def add(self, batch: StreamBatch, fields: list, version: int, tx: Transaction) -> None:
        """Complete an entry with its source position fields and queue it in `batch` (fields taken over)."""
        seq = tx.seq
        fields += (b"lsn", tx.lsn, b"seq", seq, b"xid", tx.xid, b"ts_ms", tx.ts, b"v", version,
                   tx.prefix + f"{seq:010d}")
        batch.entries.append(fields)  # `StreamBatch.add`, inline: this runs once per entry
        if not self.pending:
            self.first_at = self.clock()
        self.pending += 1

    def due(self, now: float) -> bool:
        """Full or old enough to send."""
        return self.pending > 0 and (self.pending >= self.max_entries or now - self.first_at >= self.max_delay)

    def counts(self) -> dict[str, int]:
        """Entries pending per stream (streams with none left out)."""
        return {b.stream: b.count for b in self.batches.values() if b.count}

    def clear(self) -> None:
        for b in self.batches.values():
            b.clear()
        self.sent += self.pending
        self.pending = 0
