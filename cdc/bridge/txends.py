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

With ``transactions.max_per_end`` above 1, the transactions of one batch share END records
(format 2): an END covers up to that many consecutive transactions, its position and
``lsn``/``xid``/``ts_ms`` those of the last, ``data.streams`` their counts together and
``data.transactions`` each one's ``[xid, commit LSN, ts_ms]`` in commit order. A consumer
then reads one END per batch instead of one per transaction. An END never straddles the
transactions stream's high-water mark as it stood when the session started (`floor`):
a replay after a crash groups transactions differently, and an END covering some
transactions an END already written covers would count entries the streams' marks drop.

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

__all__ = ["END_OP", "END_VERSION", "GROUPED_VERSION", "TransactionEnds", "end_record"]

END_OP = b"e"
#: the format version of the END record, its ``v`` field
END_VERSION = 1
#: the format of an END record covering several transactions (``transactions.max_per_end`` above 1)
GROUPED_VERSION = 2
#: where the fields of an END record sit in its list (`end_record`)
_DATA, _LSN, _SEQ, _XID, _TS, _POS = 5, 7, 9, 11, 13, 16


def end_record(tx: Transaction, seq: int, streams: dict[str, int]) -> list:
    """The END record's fields (with its position last, as `Batcher.add` leaves an entry)."""
    data = orjson.dumps({"count": sum(streams.values()), "streams": streams})
    return [b"op", END_OP, b"key", b"{}", b"data", data, b"lsn", tx.lsn, b"seq", seq, b"xid", tx.xid,
            b"ts_ms", tx.ts, b"v", END_VERSION, tx.prefix + f"{seq:010d}"]


def grouped_data(transactions: list[list], streams: dict[str, int]) -> bytes:
    """The ``data`` of a format 2 END record: its transactions ([xid, commit LSN, ts_ms] each) and their counts."""
    return orjson.dumps({"count": sum(streams.values()), "streams": streams, "transactions": transactions})


class _Open:
    """A format 2 END record still in the batch, which later transactions of the batch may join."""

    __slots__ = ("record", "transactions", "streams")

    def __init__(self, record: list, transactions: list[list], streams: dict[str, int]) -> None:
        self.record, self.transactions, self.streams = record, transactions, streams


def _queued(batch: StreamBatch) -> int:
    return batch.sent + batch.count


class TransactionEnds:
    """Counts each transaction's entries per stream from the batches and queues its END at the commit."""

    __slots__ = ("batcher", "batch", "base", "ends", "max_per_end", "floor", "open")

    def __init__(self, batcher: Batcher, stream: str, max_per_end: int = 1, floor: str = "") -> None:
        self.batcher = batcher
        self.batch = batcher.batch(stream)
        self.base = 0  # entries queued in all batches before the transaction being read
        self.ends = 0  # END records queued
        self.max_per_end = max_per_end
        #: the transactions stream's high-water mark when the session started ('' if never written)
        self.floor = floor
        self.open: _Open | None = None  # the format 2 END the batch's next transactions may join
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
        """Entries queued inside belong to no transaction's count (and no END held open covers transactions on
        both sides of them: a consumer hands them over between)."""
        self.seal()
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
        self.base = total + 1
        if self.max_per_end > 1:
            return self._grouped(tx, seq, streams)
        self._queue(end_record(tx, seq, streams))
        return True

    def _queue(self, record: list) -> None:
        batcher = self.batcher
        self.batch.entries.append(record)
        self.batch.base += 1
        if not batcher.pending:
            batcher.first_at = batcher.clock()
        batcher.pending += 1
        self.ends += 1

    def _grouped(self, tx: Transaction, seq: int, streams: dict[str, int]) -> bool:
        """Format 2: the transaction joins the END still open in the batch, else opens one."""
        pos = tx.prefix + f"{seq:010d}"
        entries = self.batch.entries
        o = self.open
        if (o is not None and entries and entries[-1] is o.record and len(o.transactions) < self.max_per_end
                and (o.record[_POS] > self.floor or pos <= self.floor)):  # never across the mark (see the module)
            o.transactions.append([int(tx.xid), int(tx.lsn), int(tx.ts)])
            totals = o.streams
            for stream, n in streams.items():
                totals[stream] = totals.get(stream, 0) + n
            record = o.record
            record[_LSN], record[_SEQ], record[_XID], record[_TS], record[_POS] = tx.lsn, seq, tx.xid, tx.ts, pos
            self.base -= 1  # no entry queued for it
            return True
        self.seal()
        record = end_record(tx, seq, streams)
        transactions = [[int(tx.xid), int(tx.lsn), int(tx.ts)]]
        record[_DATA] = grouped_data(transactions, streams)
        record[15] = GROUPED_VERSION
        self.open = _Open(record, transactions, streams)
        self._queue(record)
        return True

    def seal(self) -> None:
        """The END held open takes its final data, and no transaction joins it (the batch goes to Redis, or
        the next transaction opens another)."""
        o = self.open
        if o is not None:
            if len(o.transactions) > 1:
                o.record[_DATA] = grouped_data(o.transactions, o.streams)
            self.open = None
