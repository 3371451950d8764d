"""The acknowledger: the one place that decides what LSN the slot may be told.

Three rules: never past what Redis confirmed (the slot would forget changes Redis
does not hold), never inside an open backfill window (a replay must start
before the window's low watermark to see the changes that filter its chunk),
and never past what the ack gate vouched for (`cdc.bridge.gate`: a change the
publication did not send leaves no trace in the stream, only in the catalog).
And the slot is told a position only once Redis itself records that it holds the
source up to there (the flushed key `cdc check` and a restart compare against).

So the slot's confirmed position never passes the record without a real loss:
the slot is told only what this session saw Redis record, and a session starts
from the record Redis holds, never from what an earlier session remembered (a
position made durable by a keepalive but not recorded before the session ended,
or one a Redis restored from an older state no longer holds).

Four positions:

- ``ackable``: end LSN of the last complete transaction the slot may move to
  once Redis holds everything before it;
- ``durable``: what Redis confirmed holding (every entry up to there appended);
- ``recorded``: what Redis records in the flushed key;
- ``verified``: the last position received before the last catalog reading that
  vouched for every mapped table started.

Pure: decisions only; the loop does the writing and the telling.
"""

from __future__ import annotations

from ..source.lsn import Lsn

__all__ = ["Acknowledger"]


class Acknowledger:
    __slots__ = ("ackable", "durable", "recorded", "verified")

    def __init__(self, durable: Lsn = Lsn(0)) -> None:
        self.ackable = self.durable = self.recorded = self.verified = durable

    def resume(self, held: Lsn, confirmed: Lsn | None = None) -> None:
        """A new session starts from `held`, the record Redis holds now (read after the loss check), with
        the slot at `confirmed`: nothing past that is vouched for until the gate's first reading."""
        self.ackable = self.durable = self.recorded = held
        self.verified = held if confirmed is None else min(held, confirmed)

    def received(self) -> Lsn:
        """The position the gate vouches for if the catalog reading it starts now passes."""
        return self.ackable

    def vouched(self, lsn: Lsn) -> None:
        """A catalog reading that started after `lsn` was received passed."""
        if lsn > self.verified:
            self.verified = lsn

    def committed(self, end_lsn: Lsn, window_open: bool, nothing_unsent: bool) -> None:
        """A transaction ended at `end_lsn`; `nothing_unsent`: no entry pending nor in flight."""
        if not window_open:
            self.ackable = end_lsn
        if nothing_unsent and self.ackable > self.durable:
            self.durable = self.ackable

    def keepalive(self, wal_end: int, quiet: bool) -> None:
        """The server has sent everything before `wal_end`; `quiet`: outside any transaction and
        window, nothing pending nor in flight, so nothing of ours lies before it."""
        if quiet and wal_end > self.ackable:
            self.ackable = self.durable = Lsn(wal_end)

    def confirmed(self, lsn: Lsn) -> None:
        """Redis confirmed a batch sent with `lsn` as its mark (recorded by the same pipeline)."""
        if lsn > self.recorded:
            self.recorded = lsn
        if lsn > self.durable:
            self.durable = lsn

    def drained(self) -> None:
        """Nothing pending nor in flight: Redis holds everything up to the ackable position."""
        if self.ackable > self.durable:
            self.durable = self.ackable

    def to_record(self, in_flight: bool) -> Lsn | None:
        """The position to record in Redis before telling the slot, if any.

        While a batch is in flight its connection is busy with its replies: nothing then.
        """
        if self.durable > self.recorded and not in_flight:
            return self.durable
        return None

    def record(self, lsn: Lsn) -> None:
        self.recorded = lsn

    @property
    def acked(self) -> Lsn:
        """What the slot may be told: durable, recorded, and vouched for by the gate."""
        return min(self.durable, self.recorded, self.verified)
