"""Transaction mode: the entries of one source transaction handed over together, in commit order.

The bridge appends one END record (``op e``) to the transactions stream for each source
transaction, after all of that transaction's entries; its ``data`` counts them per stream
(the format: docs/concepts/stream-entry-contract.md; transaction mode: docs/how-to/consuming.md).
`TransactionAssembler` takes the entries a consumer read, from its streams and from the
transactions stream, and gives back `Unit`s:

- a transaction: its END and all of its entries in the subscribed streams (streams the
  consumer does not read are ignored), only once every counted entry has arrived;
- an entry no END record covers (a snapshot read ``r``, a rebuild marker ``x``, a
  non-transactional message ``xid 0``), alone;
- an entry whose END is already behind (its transaction was handed over, or ended before the
  group started on the transactions stream), alone: it is a redelivery the checkpoint skips;
- an entry older than every END read while the transactions stream's high-water mark says no
  END is missing (`ends_written`: entries written before transactions were turned on, or whose
  END this group acknowledged already), alone;
- a duplicate (a double send of an entry or an END), to acknowledge, never to hand over;
- the marker `cdc recover` appends to the transactions stream (``op x``), to acknowledge: an END
  before it that stays incomplete counts entries the rebuild replaced, and is acknowledged too
  (the handler gets each rebuilt stream's own marker and resets there).

An END record of format 2 (``v`` 2, the bridge's ``transactions.max_per_end`` above 1) covers
several consecutive transactions (``data.transactions``, each ``[xid, commit LSN, ts_ms]``), its
position the last one's: they make one unit, their entries in commit order.

Units come out in commit order (the transactions stream's order), and every stream's
entries in that stream's order. A transaction whose END was read and that stays incomplete
past `wait_s` raises `IncompleteTransaction`: the bridge writes an END after every entry it
counts, so an entry still missing then was removed (or is lost), and the consumer stops
rather than hand over part of a transaction. Entries with no END read are not a loss while
the bridge has not written past them (its END can come in the bridge's next batch, after a
restart): they wait, as `unended`, for as long as it takes; the consumer compares the
transactions stream's high-water mark with them (`ends_written`). Pure: entries in, units
out, the clock given.
"""

from __future__ import annotations

from collections import deque
from operator import attrgetter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from ..errors import ConfigError, DataLossError
from ..sink.entry import Entry

__all__ = ["END_OP", "IncompleteTransaction", "TransactionAssembler", "Unit", "covered", "first_lsn", "transactions_in"]

#: the op of an END record in the transactions stream
END_OP = "e"
#: ops no END record covers
STANDALONE_OPS = ("r", "x")
#: the position below every entry's: nothing handed over yet
_NOWHERE = (-1, -1)
_seq = attrgetter("seq")
_position = attrgetter("lsn", "seq")


class IncompleteTransaction(DataLossError):
    """A transaction's END record was read and the entries it counts did not all arrive in time
    (or an entry was deleted while pending)."""


def covered(e: Entry) -> bool:
    """True when an END record covers `e` (a change of a source transaction)."""
    return e.op not in STANDALONE_OPS and e.xid != 0


def _covers(end: Entry) -> list | None:
    """The transactions a format 2 END covers, each [xid, commit LSN, ts_ms]; None for format 1."""
    if end.v < 2:
        return None
    listed = (end.data or {}).get("transactions")
    return listed if listed else None


def first_lsn(end: Entry) -> int:
    """The commit LSN of the first transaction an END record covers."""
    listed = _covers(end)
    return int(listed[0][1]) if listed else end.lsn


def transactions_in(end: Entry) -> int:
    """How many source transactions an END record covers."""
    listed = _covers(end)
    return len(listed) if listed else 1


@dataclass(slots=True)
class Unit:
    """What the handler gets in one piece, and what is acknowledged with it."""

    entries: list[Entry]  # the handler's: a transaction's entries in the subscribed streams, in source order
    end: Entry | None = None  # the END record, None for a unit no END covers
    extra: list[Entry] = field(default_factory=list)  # duplicates: acknowledged with the unit, never handed over

    @property
    def records(self) -> list[Entry]:
        """Everything acknowledged (or dead-lettered) together once the unit is done."""
        return self.entries + self.extra + ([self.end] if self.end is not None else [])

    @property
    def head(self) -> Entry | None:
        """The record a unit's failures are counted on: its END, else its entry."""
        return self.end if self.end is not None else (self.entries[0] if self.entries else None)


class TransactionAssembler:
    """Collects the entries read from `streams` and the END records of `transactions` into units."""

    def __init__(self, streams: Sequence[str], transactions: str, wait_s: float) -> None:
        self.transactions = transactions
        self.wait_s = wait_s
        self.buffers: dict[str, deque[Entry]] = {s: deque() for s in streams}
        self.ends: deque[Entry] = deque()
        self._markers = 0  # how many of `ends` are cdc recover's markers
        self.handed: dict[str, tuple[int, int]] = {}  # stream -> the highest position handed over
        self.last_end = (0, 0)  # the position of the last END handed over
        self.redelivered: set[str] = set()  # IDs read again from the pending list (their failures are cleared when done)
        self.waiting = ""  # what the assembler waits for, for the error
        self.short = ""  # the stream the first END waits for entries of
        self.ends_written = 0  # every END up to this commit LSN was read (none buffered): older entries have none
        self.superseded = 0  # incomplete END records acknowledged because cdc recover rebuilt the streams after them
        self.unended: Entry | None = None  # the first entry waiting for an END record not read yet (none buffered)
        self.since: float | None = None  # when the wait for what holds the head up (`stalled_on`) began
        self._stalled_on = ""  # the END record, or the entry, the head waits on
        self.ready: deque[Unit] = deque()  # units taken, not yet handled: the consumer's queue
        self.cursor: dict[str, str] = {}  # stream -> the last ID read again from the pending list

    def add(self, entries: Iterable[Entry], redelivered: bool = False) -> None:
        """Buffer what was read; `redelivered`: read again from the pending list, where an entry still
        buffered is not taken twice (entries read as new, with ``>``, never are: Redis delivers each once)."""
        buffered: dict[str, set[str]] = {}  # stream -> the IDs buffered: built for entries read again only
        transactions = self.transactions
        for e in entries:
            if redelivered:
                ids = buffered.get(e.stream)
                if ids is None:
                    ids = buffered[e.stream] = {x.id for x in (self.ends if e.stream == transactions
                                                               else self.buffers[e.stream])}
                if e.id in ids:
                    continue
                ids.add(e.id)
                self.redelivered.add(e.id)
            if e.stream == transactions:
                if e.op not in (END_OP, "x"):
                    raise ConfigError(f"entry {e.id} of the transactions stream {e.stream} is no END record (op {e.op!r})",
                                      hint="give --transactions the bridge's transactions.stream, not an entity's stream")
                self.ends.append(e)
                self._markers += e.op == "x"
            else:
                self.buffers[e.stream].append(e)

    def wanted(self, limit: int) -> list[str]:
        """The streams worth reading next, so that no stream's buffer runs far ahead of the others:
        a stream with fewer than `limit` entries buffered, one the first END still waits for, and the
        transactions stream while fewer than `limit` END records are buffered."""
        streams = [s for s, buf in self.buffers.items() if len(buf) < limit or s == self.short]
        if len(self.ends) < limit:
            streams.append(self.transactions)
        return streams

    def waiting_for_end(self, now: float, after_s: float) -> bool:
        """True when entries have waited more than `after_s` for an END and none is buffered."""
        return self.unended is not None and self.since is not None and now - self.since > after_s

    def pending(self) -> bool:
        """True while anything read is not yet handed over."""
        return bool(self.ends) or any(self.buffers.values())

    def take(self, now: float) -> list[Unit]:
        """Every unit ready now, in order; `IncompleteTransaction` once a transaction whose END was read
        waited past `wait_s` for the entries it counts (entries waiting for their END wait on)."""
        units = []
        while (unit := self._next()) is not None:
            units.append(unit)
        if not self.pending():
            self.since, self._stalled_on = None, ""
            return units
        head = self.ends[0] if self.ends else self.unended
        stalled_on = f"{head.stream} {head.id}" if head is not None else ""
        if units or self.since is None or stalled_on != self._stalled_on:  # progress, or a wait on something else
            self.since, self._stalled_on = now, stalled_on
        elif self.ends and now - self.since > self.wait_s:
            raise IncompleteTransaction(f"{self.waiting} after waiting {self.wait_s:g}s", hint=(
                "the missing entries were removed from their stream (trimmed or deleted by hand) or never written; "
                "no part of the transaction is handed over: restore them, or skip the whole transaction knowingly "
                "by acknowledging its END record and its entries for this group (XACK)"))
        return units

    def _next(self) -> Unit | None:
        ends = self.ends
        # an entry at or below this commit LSN has its END behind (or none to come): it goes alone
        bound = first_lsn(ends[0]) - 1 if ends else self.ends_written
        if self.last_end[0] > bound:
            bound = self.last_end[0]
        handed = self.handed
        for stream, buf in self.buffers.items():
            if not buf:
                continue
            e = buf[0]
            if e.xid == 0 or e.op in STANDALONE_OPS:  # no END covers it
                buf.popleft()
                return Unit([e])
            lsn, seq = handed.get(stream, _NOWHERE)
            if e.lsn <= lsn and (e.lsn < lsn or e.seq <= seq):  # a duplicate of what was handed over
                buf.popleft()
                return Unit([], extra=[e])
            if e.lsn <= bound:  # its END is behind
                return self._alone(stream, buf, e)
        self.unended = None
        if ends:
            return self._transaction(ends[0])
        self.unended = min((b[0] for b in self.buffers.values() if b), key=lambda e: e.position, default=None)
        return None

    def _alone(self, stream: str, buf: deque[Entry], e: Entry) -> Unit:
        """The entries of `e`'s transaction at the head of `stream`, whose END is behind: a unit of their own."""
        entries = []
        while buf and covered(buf[0]) and buf[0].lsn == e.lsn and buf[0].xid == e.xid:
            entries.append(buf.popleft())
        self._handed(entries)
        return Unit(entries)

    def _transaction(self, end: Entry) -> Unit | None:
        if end.op == "x" or end.position <= self.last_end:  # cdc recover's marker, or the END sent twice
            self.ends.popleft()
            self._markers -= end.op == "x"
            return Unit([], extra=[end])
        data = end.data or {}
        counts = data.get("streams", {})
        listed = _covers(end)
        if listed is not None:
            return self._several(end, counts, {(int(t[1]), int(t[0])) for t in listed})
        lsn, xid = end.lsn, end.xid
        taken: list[tuple[str, deque[Entry], list[Entry], list[Entry], tuple[int, int]]] = []
        ordered = True  # the entries taken are in source order as they are (no sort needed)
        for stream, count in counts.items():
            buf = self.buffers.get(stream)
            if buf is None:
                continue
            count = int(count)
            entries: list[Entry] = []
            twice: list[Entry] = []
            top = -1  # the highest seq taken while the seqs rise: none of them is there twice
            seen: set[int] | None = None  # the seqs taken, once they stopped rising
            for e in buf if xid != 0 else ():  # (an END of xid 0 covers nothing)
                if e.lsn != lsn or e.xid != xid or e.op in STANDALONE_OPS:
                    break
                if seen is None:
                    if e.seq > top or not entries:
                        entries.append(e)
                        top = e.seq
                        continue
                    seen = {x.seq for x in entries}  # every entry shares the END's commit LSN: the seq tells them apart
                    ordered = False
                if e.seq in seen:
                    twice.append(e)
                else:
                    entries.append(e)
                    seen.add(e.seq)
                    top = max(top, e.seq)
            if len(entries) < count:
                return self._short(end, stream, count, len(entries))
            taken.append((stream, buf, entries, twice, (lsn, top)))
        return self._taken(end, taken, ordered, _seq)

    def _several(self, end: Entry, counts: dict, covered_: set[tuple[int, int]]) -> Unit | None:
        """`_transaction` for an END covering several transactions ((commit LSN, xid) in `covered_`): their
        entries are told apart by their whole position."""
        lsn = end.lsn
        taken: list[tuple[str, deque[Entry], list[Entry], list[Entry], tuple[int, int]]] = []
        ordered = True
        for stream, count in counts.items():
            buf = self.buffers.get(stream)
            if buf is None:
                continue
            count = int(count)
            entries: list[Entry] = []
            twice: list[Entry] = []
            top = (-1, -1)  # the highest position taken while the positions rise
            seen: set[tuple[int, int]] | None = None  # the positions taken, once they stopped rising
            for e in buf:
                if e.lsn > lsn or e.op in STANDALONE_OPS or (e.lsn, e.xid) not in covered_:
                    break
                pos = (e.lsn, e.seq)
                if seen is None:
                    if pos > top or not entries:
                        entries.append(e)
                        top = pos
                        continue
                    seen = {x.position for x in entries}
                    ordered = False
                if pos in seen:
                    twice.append(e)
                else:
                    entries.append(e)
                    seen.add(pos)
                    top = max(top, pos)
            if len(entries) < count:
                return self._short(end, stream, count, len(entries))
            taken.append((stream, buf, entries, twice, top))
        return self._taken(end, taken, ordered, _position)

    def _short(self, end: Entry, stream: str, count: int, arrived: int) -> Unit | None:
        """The END's entries in `stream` are not all there: wait for them (or, before a cdc recover marker,
        acknowledge the END: the rebuild replaced them)."""
        if self._markers:  # a cdc recover marker after it
            return self._superseded(end)
        self.short = stream
        listed = _covers(end)
        what = (f"transaction {end.xid} (commit LSN {end.lsn})" if listed is None else
                f"one of the {len(listed)} transactions of commit LSNs {listed[0][1]} to {end.lsn}")
        self.waiting = (f"{what} is incomplete: its END record {self.transactions} {end.id} counts {count} "
                        f"entries in {stream}, {arrived} arrived")
        return None

    def _taken(self, end: Entry, taken: list[tuple[str, deque[Entry], list[Entry], list[Entry], tuple[int, int]]],
               ordered: bool, order: attrgetter) -> Unit:
        self.ends.popleft()
        self.short = ""
        handed = self.handed
        out: list[Entry] = []
        extra: list[Entry] = []
        for stream, buf, mine, twice, top in taken:
            for _ in range(len(mine) + len(twice)):
                buf.popleft()
            if mine:
                if out:
                    ordered = False
                out += mine
                if top > handed.get(stream, _NOWHERE):
                    handed[stream] = top
            extra += twice
        self.last_end = end.position
        if not ordered:
            out.sort(key=order)  # by position (one END's transaction: every entry has its commit LSN, by seq)
        return Unit(out, end, extra)

    def _superseded(self, end: Entry) -> Unit:
        """An incomplete END before a `cdc recover` marker: the rebuild replaced entries it counts (the
        consumer resets at each rebuilt stream's own marker). Acknowledged; its entries that are left
        are handed over alone, before the marker that supersedes them."""
        self.ends.popleft()
        self.last_end = end.position
        self.short = ""
        self.superseded += 1
        return Unit([], extra=[end])

    def _handed(self, entries: Sequence[Entry]) -> None:
        for e in entries:
            if e.position > self.handed.get(e.stream, (-1, -1)):
                self.handed[e.stream] = e.position
