"""Transaction END records: one per source transaction that produced entries, in the transactions stream.

With ``transactions: {stream: ...}`` set, each source transaction that queued at least
one entry gets an END record (``op`` ``e``) naming its xid, commit LSN and time, and
how many entries it produced in all and in each stream. It is queued at the commit,
after every entry of the transaction, so it goes to Redis in the same batch as the
transaction's last entries (or, when that batch filled up exactly at its last change,
in the next one): one MULTI/EXEC or script call on a single server, after every other
stream's lane confirmed on a cluster (`cdc.sink.publisher`). It has a position like any
entry, ``(commit LSN, one past the largest seq of its entries)``, and the stream a
high-water mark, so a replay after a crash appends no END twice.

Counting costs nothing per change: each `StreamBatch` knows how many entries it ever
queued (``sent + count``), and the counts of a transaction are the differences from
the last commit, taken once per transaction. Entries that belong to no transaction
(non-transactional logical messages, the ``r`` rows of a backfill chunk) are left out
with `uncounted`. Pure: no I/O.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import orjson

from ..sink.publisher import StreamBatch
from .batcher import Batcher
from .positions import Transaction

__all__ = ["END_OP", "END_VERSION", "TransactionEnds", "end_record"]

END_OP = b"e"
#: the format version of the END record, its ``v`` field
END_VERSION = 1


def end_record(tx: Transaction, seq: int, streams: dict[str, int]) -> list:
    """The END record's fields (with its position last, as `Batcher.add` leaves an entry)."""
    data = orjson.dumps({"count": sum(streams.values()), "streams": streams})
    return [b"op", END_OP, b"key", b"{}", b"data", data, b"lsn", tx.lsn, b"seq", seq, b"xid", tx.xid,
            b"ts_ms", tx.ts, b"v", END_VERSION, tx.prefix + f"{seq:010d}"]


def _queued(batch: StreamBatch) -> int:
    return batch.sent + batch.count


class TransactionEnds:
    """Counts each transaction's entries per stream from the batches and queues its END at the commit."""

    __slots__ = ("batcher", "batch", "base", "ends")

    def __init__(self, batcher: Batcher, stream: str) -> None:
        self.batcher = batcher
        self.batch = batcher.batch(stream)
        self.base = 0  # entries queued in all batches before the transaction being read
        self.ends = 0  # END records queued
        self.reset()

    def _total(self) -> int:
        batcher = self.batcher
        return batcher.sent + batcher.pending

    def reset(self) -> None:
        """Start counting afresh (a new session, whose first transaction starts from its Begin)."""
        for b in self.batcher.batches.values():
            b.base = _queued(b)
        self.base = self._total()

    @contextmanager
    def uncounted(self) -> Iterator[None]:
        """Entries queued inside belong to no transaction's count."""
        before = {b.stream: _queued(b) for b in self.batcher.batches.values()}
        yield
        for b in self.batcher.batches.values():
            b.base += _queued(b) - before.get(b.stream, 0)
        self.base = self.base + self._total() - sum(before.values())

    def commit(self, tx: Transaction) -> bool:
        """The transaction being read committed: queue its END if it produced entries; True if it did."""
        batcher = self.batcher
        total = self._total()
        if total == self.base:
            return False
        streams: dict[str, int] = {}
        last = ""
        for b in batcher.batches.values():
            queued = _queued(b)
            n = queued - b.base
            if n:
                b.base = queued
                streams[b.stream] = n
                pos = b.last_position
                if pos > last:
                    last = pos
        seq = int(last[20:]) + 1
        self.batch.entries.append(end_record(tx, seq, streams))
        self.batch.base += 1
        if not batcher.pending:
            batcher.first_at = batcher.clock()
        batcher.pending += 1
        self.base = total + 1
        self.ends += 1
        return True
