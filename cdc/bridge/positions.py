"""The transaction assembler: the source position of every change as it arrives.

pgoutput without streaming sends only committed transactions, and Begin carries
the commit LSN, so each change's position ``(commit LSN, seq)`` is known the
moment it is read: ``seq`` counts the transaction's changes (and the messages and
snapshot rows it carries) from 0. Pure: messages in, positions out.
"""

from __future__ import annotations

from ..source.framing import pg_now_us, pg_ts_to_unix_ms
from ..source.lsn import Lsn
from ..source.pgoutput import Begin, Commit, Message

__all__ = ["Transaction"]


class Transaction:
    """The transaction being read: its position fields as entries carry them, and its next seq.

    ``lsn``, ``xid`` and ``ts`` are the text forms written into entries;
    ``prefix`` is the 20-digit commit LSN that starts every position.
    """

    __slots__ = ("open", "lsn", "xid", "ts", "prefix", "seq")

    def __init__(self) -> None:
        self.open = False
        self.lsn = self.xid = self.ts = self.prefix = ""
        self.seq = 0

    def begin(self, msg: Begin) -> None:
        self.begin_at(int(msg.final_lsn), msg.commit_ts, msg.xid)

    def begin_at(self, final: int, commit_ts: int, xid: int) -> None:
        """A Begin's fields as they are on the wire: its commit LSN, commit time (PostgreSQL's) and xid."""
        self.open = True
        self.seq = 0
        self.lsn = str(final)
        self.prefix = f"{final:020d}"
        self.xid = str(xid)
        self.ts = str(pg_ts_to_unix_ms(commit_ts))

    def commit(self, msg: Commit) -> Lsn:
        """Close the transaction; the LSN a replay would resume from after it."""
        return self.commit_at(msg.end_lsn)

    def commit_at(self, end_lsn: int) -> Lsn:
        """`commit` from the Commit's end LSN as it is on the wire."""
        self.open = False
        return Lsn(end_lsn)

    def position(self) -> str:
        """The comparable position of the current change (see `cdc.sink.publisher.position`)."""
        return self.prefix + f"{self.seq:010d}"

    @classmethod
    def lone(cls, msg: Message, now_us: int | None = None) -> Transaction:
        """The position of a non-transactional message: its own LSN, seq 0, no xid, stamped now."""
        tx = cls()
        lsn = int(msg.lsn)
        tx.lsn, tx.prefix, tx.xid = str(lsn), f"{lsn:020d}", "0"
        tx.ts = str(pg_ts_to_unix_ms(pg_now_us() if now_us is None else now_us))
        return tx
