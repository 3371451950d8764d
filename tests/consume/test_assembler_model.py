"""The transaction assembler against the model of it as it was first written (tests/consume/assembler_reference.py):
on seeded random deliveries (streams read in chunks of any size and any interleaving, entries and END records
sent twice, entries read again from the pending list, snapshot reads, messages, rebuild markers, lost
entries, transactions over streams the consumer does not read, the transactions stream's high-water mark),
both give the same units (the same entries, duplicates and END, in the same order), raise the same
`IncompleteTransaction`, and are left in the same state after every step."""

from __future__ import annotations

import random

import orjson
import pytest

from cdc.consume.transactions import IncompleteTransaction, TransactionAssembler
from cdc.sink.entry import Entry, parse_entry

from assembler_reference import ReferenceAssembler

TX = "cdc:transactions"
READ = ["cdc:s0", "cdc:s1", "cdc:s2"]
OTHER = "cdc:other"  # counted by END records, not read by the consumer


class Source:
    """The streams as the bridge writes them, with faults."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.streams: dict[str, list[Entry]] = {s: [] for s in [*READ, OTHER, TX]}
        self.lsn = 1000
        self.xid = 1
        self.loss = 0.02 if rng.random() < 0.25 else 0.0  # a change lost now and then, in a quarter of the runs
        #: the most transactions an END covers (transactions.max_per_end; above 1: format 2 END records)
        self.per_end = rng.choice([1, 1, 2, 4, 50])
        self.open: list[tuple[int, int, int, dict[str, int]]] = []  # (lsn, xid, size, counts) no END covers yet
        self.written: dict[tuple[int, int], list[Entry]] = {}  # (lsn, xid) -> its entries as first written

    def write(self, stream: str, op: str, lsn: int, seq: int, xid: int, data: dict | None = None, v: int = 1) -> Entry:
        fields = {b"op": op.encode(), b"key": b'{"id":1}', b"data": orjson.dumps(data or {"id": 1}),
                  b"lsn": str(lsn).encode(), b"seq": str(seq).encode(), b"xid": str(xid).encode(),
                  b"ts_ms": b"1", b"v": str(v).encode()}
        e = parse_entry(stream, f"{len(self.streams[stream]) + 1}-0", fields)
        self.streams[stream].append(e)
        return e

    def again(self, e: Entry) -> None:
        """A double send: the same change under a new ID."""
        self.write(e.stream, e.op, e.lsn, e.seq, e.xid, e.data, e.v)

    def end(self) -> None:
        """The END of the transactions written since the last (format 2: one for them all, as a batch's)."""
        if not self.open:
            return
        lsn, xid, size, _ = self.open[-1]
        totals: dict[str, int] = {}
        for *_, counts in self.open:
            for stream, n in counts.items():
                totals[stream] = totals.get(stream, 0) + n
        data = {"count": sum(totals.values()), "streams": totals,
                "transactions": [[x, lsn_, 1] for lsn_, x, _, _ in self.open]}
        end = self.write(TX, "e", lsn, size, xid, data, v=2)
        self.open = []
        if self.rng.random() < 0.03:
            self.again(end)

    def transaction(self) -> None:
        rng = self.rng
        self.lsn += rng.randint(1, 3)
        self.xid += 1
        size = rng.choice([1, 1, 2, 3, 5, 12])
        counts: dict[str, int] = {}
        written = []
        for seq in range(size):
            stream = rng.choice([*READ, *READ, OTHER])
            counts[stream] = counts.get(stream, 0) + 1
            if rng.random() < self.loss:  # lost: never written (or trimmed before it was read)
                continue
            written.append(self.write(stream, rng.choice("cud"), self.lsn, seq, self.xid))
            if rng.random() < 0.04:  # sent twice, right after
                self.again(written[-1])
        self.written[(self.lsn, self.xid)] = [e for e in written if e.stream in READ]
        if self.per_end > 1:  # the batch goes when full, or now and then
            self.open.append((self.lsn, self.xid, size, counts))
            if len(self.open) >= self.per_end or rng.random() < 0.3:
                self.end()
        else:
            end = self.write(TX, "e", self.lsn, size, self.xid, {"count": size, "streams": counts})
            if rng.random() < 0.03:
                self.again(end)
        if written and rng.random() < 0.04:  # a whole batch sent twice, later
            for e in written:
                self.again(e)

    def alone(self, markers: bool = True) -> None:
        self.end()  # the bridge writes no END covering transactions on both sides of an entry no END covers
        rng = self.rng
        stream = rng.choice(READ)
        kind = rng.random() * (1.0 if markers else 0.8)
        if kind < 0.5:
            self.write(stream, "r", self.lsn, rng.randint(0, 3), 0)  # a snapshot read
        elif kind < 0.8:
            self.write(stream, "m", self.lsn + 1, 0, 0)  # a non-transactional message
        else:  # cdc recover: a marker in the transactions stream and in each stream it rebuilt
            self.lsn += 1
            self.write(TX, "x", self.lsn, 0, 0)
            for s in READ:
                self.write(s, "x", self.lsn, 0, 0)


def units_of(units) -> list[tuple]:
    return [([(e.stream, e.id) for e in u.entries], [(e.stream, e.id) for e in u.extra],
             (u.end.stream, u.end.id) if u.end is not None else None) for u in units]


def state(a) -> tuple:
    return ({s: [e.id for e in b] for s, b in a.buffers.items()}, [e.id for e in a.ends], dict(a.handed),
            a.last_end, set(a.redelivered), a.waiting, a.short, a.superseded,
            (a.unended.stream, a.unended.id) if a.unended is not None else None, a.since, a.pending(),
            a.waiting_for_end(a.since or 0.0, 0.0))


def step(new, old, now: float) -> list[tuple]:
    got = expected = None
    try:
        expected = units_of(old.take(now))
    except IncompleteTransaction as exc:
        expected = ("incomplete", str(exc))
    try:
        got = units_of(new.take(now))
    except IncompleteTransaction as exc:
        got = ("incomplete", str(exc))
    assert got == expected
    assert state(new) == state(old)
    return got


@pytest.mark.parametrize("seed", range(300))
def test_the_same_units_as_the_first_algorithm(seed):
    rng = random.Random(seed)
    source = Source(rng)
    for _ in range(rng.randint(5, 60)):
        if rng.random() < 0.15:
            source.alone()
        else:
            source.transaction()
    source.end()
    wait_s = rng.choice([0.5, 5.0, 1000.0])
    new = TransactionAssembler(READ, TX, wait_s)
    old = ReferenceAssembler(READ, TX, wait_s)
    read = {s: 0 for s in [*READ, TX]}  # how far each stream was read
    now = 0.0
    for _ in range(400):
        batch: list[Entry] = []
        redelivered = rng.random() < 0.1
        for stream in rng.sample(list(read), rng.randint(1, len(read))):
            if redelivered:  # read again from the pending list: some of what was read already (only that:
                start = rng.randint(0, read[stream])  # Redis delivers each entry once as new)
                batch += source.streams[stream][start:min(start + rng.randint(0, 4), read[stream])]
                continue
            n = rng.choice([0, 1, 2, 3, 8, 50])
            batch += source.streams[stream][read[stream]:read[stream] + n]
            read[stream] = min(read[stream] + n, len(source.streams[stream]))
        new.add(batch, redelivered)
        old.add(batch, redelivered)
        if rng.random() < 0.05:  # the consumer read the transactions stream's high-water mark
            new.ends_written = old.ends_written = source.lsn if rng.random() < 0.5 else source.lsn - 3
        now += rng.choice([0.0, 0.1, 0.3, 1.0])
        got = step(new, old, now)
        if got and got[0] == "incomplete":
            break
        if all(read[s] >= len(source.streams[s]) for s in read) and not old.pending():
            break


def test_the_model_test_meets_every_case():
    """The random deliveries above reach each of the assembler's cases (else they would prove little)."""
    seen = {"transaction": 0, "alone": 0, "duplicate": 0, "incomplete": 0, "superseded": 0, "marker or END twice": 0,
            "several transactions": 0}
    for seed in range(300):
        rng = random.Random(seed)
        source = Source(rng)
        for _ in range(rng.randint(5, 60)):
            source.alone() if rng.random() < 0.15 else source.transaction()
        source.end()
        a = TransactionAssembler(READ, TX, 2.0)
        read = {s: 0 for s in [*READ, TX]}
        now = 0.0
        for _ in range(400):
            for stream in rng.sample(list(read), rng.randint(1, len(read))):
                n = rng.choice([0, 1, 2, 3, 8, 50])
                a.add(source.streams[stream][read[stream]:read[stream] + n])
                read[stream] += n
            now += 0.3
            try:
                units = a.take(now)
            except IncompleteTransaction:
                seen["incomplete"] += 1
                break
            for u in units:
                if u.end is not None:
                    seen["transaction"] += 1
                    seen["several transactions"] += len({(e.lsn, e.xid) for e in u.entries}) > 1
                elif any(e.stream == TX for e in u.extra):
                    seen["marker or END twice"] += 1
                elif u.entries:
                    seen["alone"] += 1
                else:
                    seen["duplicate"] += 1
            if all(read[s] >= len(source.streams[s]) for s in read) and not a.pending():
                break
        seen["superseded"] += a.superseded
    assert all(seen.values()), seen


@pytest.mark.parametrize("seed", range(200))
def test_each_transaction_comes_whole_once_in_commit_order(seed):
    """Without losses and rebuilds (END records and entries sent twice, entries read again, snapshot reads and
    messages between, in any interleaving): the units with an END hand over exactly the entries of the
    transactions it covers, as first written, in commit order."""
    rng = random.Random(seed)
    source = Source(rng)
    source.loss = 0.0
    for _ in range(rng.randint(5, 60)):
        source.alone(markers=False) if rng.random() < 0.1 else source.transaction()
    source.end()
    a = TransactionAssembler(READ, TX, 1000.0)
    read = {s: 0 for s in [*READ, TX]}
    handed: list[tuple[int, int]] = []  # the transactions handed over, in order
    for _ in range(2000):
        batch: list[Entry] = []
        redelivered = rng.random() < 0.1
        for stream in rng.sample(list(read), rng.randint(1, len(read))):
            if redelivered:
                start = rng.randint(0, read[stream])
                batch += source.streams[stream][start:min(start + rng.randint(0, 4), read[stream])]
                continue
            n = rng.choice([0, 1, 2, 3, 8, 50])
            batch += source.streams[stream][read[stream]:read[stream] + n]
            read[stream] = min(read[stream] + n, len(source.streams[stream]))
        if redelivered:  # Redis delivers again only what is pending: read, and not yet handed over (acknowledged)
            batch = [e for e in batch if any(x is e for x in (a.ends if e.stream == TX else a.buffers[e.stream]))]
        a.add(batch, redelivered)
        for u in a.take(0.0):
            if u.end is None or u.end.op != "e":
                continue
            listed = u.end.data.get("transactions") or [[u.end.xid, u.end.lsn, 1]]
            txs = [(int(lsn), int(xid)) for xid, lsn, _ in listed]
            assert [(e.stream, e.id) for e in u.entries] == [
                (e.stream, e.id) for t in txs for e in sorted(source.written[t], key=lambda e: e.seq)]
            handed += txs
        if all(read[s] >= len(source.streams[s]) for s in read) and not a.pending():
            break
    assert not a.pending()
    assert handed == sorted(source.written), "every transaction once, in commit order"
