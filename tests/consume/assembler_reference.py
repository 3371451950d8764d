"""The transaction assembler as it was written first (cdc 0.2.0), kept as the model the faster one
(`cdc.consume.transactions.TransactionAssembler`) is checked against: tests/consume/test_assembler_model.py."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Sequence

from cdc.consume.transactions import END_OP, IncompleteTransaction, Unit, covered, first_lsn
from cdc.errors import ConfigError
from cdc.sink.entry import Entry


class ReferenceAssembler:
    """Collects the entries read from `streams` and the END records of `transactions` into units: the
    algorithm as it was before `cdc.consume.transactions.TransactionAssembler` was made faster."""

    def __init__(self, streams: Sequence[str], transactions: str, wait_s: float) -> None:
        self.transactions = transactions
        self.wait_s = wait_s
        self.buffers: dict[str, deque[Entry]] = {s: deque() for s in streams}
        self.ends: deque[Entry] = deque()
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
        self._ids: set[str] = set()  # (stream, ID) of what is buffered: a re-read entry is not taken twice
        self.ready: deque[Unit] = deque()  # units taken, not yet handled: the consumer's queue
        self.cursor: dict[str, str] = {}  # stream -> the last ID read again from the pending list

    def add(self, entries: Iterable[Entry], redelivered: bool = False) -> None:
        for e in entries:
            token = f"{e.stream} {e.id}"
            if token in self._ids:
                continue
            if e.stream == self.transactions:
                if e.op not in (END_OP, "x"):
                    raise ConfigError(f"entry {e.id} of the transactions stream {e.stream} is no END record (op {e.op!r})",
                                      hint="give --transactions the bridge's transactions.stream, not an entity's stream")
                self.ends.append(e)
            else:
                self.buffers[e.stream].append(e)
            self._ids.add(token)
            if redelivered:
                self.redelivered.add(e.id)

    def wanted(self, limit: int) -> list[str]:
        """The streams worth reading next, so that no stream's buffer runs far ahead of the others:
        a stream with nothing buffered, one the first END still waits for, and the transactions
        stream while fewer than `limit` END records are buffered."""
        streams = [s for s, buf in self.buffers.items() if not buf or s == self.short]
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
            for e in unit.records:
                self._ids.discard(f"{e.stream} {e.id}")
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
        for stream, buf in self.buffers.items():
            unit = self._alone(stream, buf)
            if unit is not None:
                return unit
        self.unended = None
        if self.ends:
            return self._transaction(self.ends[0])
        self.unended = min((b[0] for b in self.buffers.values() if b), key=lambda e: e.position, default=None)
        return None

    def _alone(self, stream: str, buf: deque[Entry]) -> Unit | None:
        """The head of `stream` when it is a unit of its own: a duplicate, an entry no END covers,
        or an entry whose END is behind."""
        if not buf:
            return None
        e = buf[0]
        if not covered(e):
            buf.popleft()
            return Unit([e])
        if e.position <= self.handed.get(stream, (-1, -1)):
            buf.popleft()
            return Unit([], extra=[e])
        if not (e.lsn <= self.last_end[0] or (self.ends and e.lsn < first_lsn(self.ends[0]))
                or (not self.ends and e.lsn <= self.ends_written)):
            return None  # its END is still to come
        entries = []
        while buf and covered(buf[0]) and (buf[0].lsn, buf[0].xid) == (e.lsn, e.xid):
            entries.append(buf.popleft())
        self._handed(entries)
        return Unit(entries)

    def _transaction(self, end: Entry) -> Unit | None:
        if end.op == "x" or end.position <= self.last_end:  # cdc recover's marker, or the END sent twice
            self.ends.popleft()
            return Unit([], extra=[end])
        counts = (end.data or {}).get("streams", {})
        listed = (end.data or {}).get("transactions") if end.v >= 2 else None  # format 2: several transactions
        mine_ = {(int(lsn), int(xid)) for xid, lsn, _ in listed} if listed else {(end.lsn, end.xid)}
        taken: dict[str, tuple[list[Entry], list[Entry]]] = {}
        for stream, count in counts.items():
            if stream not in self.buffers:
                continue
            entries: list[Entry] = []
            twice: list[Entry] = []
            seen: set = set()
            for e in self.buffers[stream]:
                if not covered(e) or (e.lsn, e.xid) not in mine_:
                    break
                (twice if e.position in seen else entries).append(e)
                seen.add(e.position)
            if len(entries) < int(count) and any(later.op == "x" for later in self.ends):
                return self._superseded(end)
            if len(entries) < int(count):
                self.short = stream
                what = (f"one of the {len(listed)} transactions of commit LSNs {listed[0][1]} to {end.lsn}" if listed
                        else f"transaction {end.xid} (commit LSN {end.lsn})")
                self.waiting = (f"{what} is incomplete: its END record "
                                f"{self.transactions} {end.id} counts {count} entries in {stream}, {len(entries)} arrived")
                return None
            taken[stream] = (entries, twice)
        self.ends.popleft()
        self.short = ""
        entries, extra = [], []
        for stream, (mine, twice) in taken.items():
            for _ in range(len(mine) + len(twice)):
                self.buffers[stream].popleft()
            entries += mine
            extra += twice
            self._handed(mine)
        self.last_end = end.position
        entries.sort(key=lambda e: e.position)
        return Unit(entries, end, extra)

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
