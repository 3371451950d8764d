"""Transaction END records in the loop of one session, without servers: both hot paths, the same bytes."""

from __future__ import annotations

import struct

import orjson
import pytest

from cdc import speedups
from cdc.bridge import changes, session as session_module
from cdc.bridge.loop import Bridge
from cdc.config import Settings
from cdc.mapping.model import parse_mapping
from cdc.sink.lane import xadd_command
from cdc.source import pgoutput as po
from cdc.source.lsn import Lsn
from cdc.yamlsrc import load_yaml_documents
from pgoutput_encoder import encode
from test_session import Catalog, Gate, Stream, VouchedSession

RIDE = "entity: ride\ntable: public.rides\nkey: [id]\nfields: {id: id}\n"
NOTE = "entity: note\ntable: public.notes\nkey: [id]\nfields: {id: id}\npartitions: {count: 2}\nstream: 'cdc:note:{partition}'\n"
MESSAGE = "entity: msg\nmessage_prefix: 'app:'\n"
RIDES = po.Relation(16400, "public", "rides", "d", (po.Column(True, "id", 20, -1),))
NOTES = po.Relation(16401, "public", "notes", "d", (po.Column(True, "id", 20, -1),))
OTHER = po.Relation(16402, "public", "other", "d", (po.Column(True, "id", 20, -1),))
TX_STREAM = "cdc:transactions"


def xlog(message: po.PgOutputMessage) -> bytes:
    return b"w" + struct.pack(">QQq", 0, 0, 0) + encode(message)


def transaction(final: int, xid: int, changes_: list[tuple[int, int]]) -> list[bytes]:
    """A committed transaction of inserts, each (relid, id)."""
    return ([xlog(po.Begin(Lsn(final), 800_000_000_000_000 + final, xid))]
            + [xlog(po.Insert(relid, (str(i),))) for relid, i in changes_]
            + [xlog(po.Commit(0, Lsn(final), Lsn(final + 8), 800_000_000_000_000 + final))])


class Publisher:
    """Records every entry sent, per batch, as (stream, fields)."""

    def __init__(self, mark: tuple[int, int] | None = None) -> None:
        self.batches: list[list[tuple[str, list]]] = []
        self.confirmed: set = set()  # what the replaying stream records beside each status
        self.mark = mark  # the transactions stream's high-water mark

    def marks(self, streams):
        return {s: self.mark for s in streams}

    def send(self, batches, flushed=None) -> None:
        self.batches.append([(b.stream, list(e)) for b in batches for e in b.queued()])

    def confirm(self) -> int:
        return 0

    def record_flushed(self, lsn: int) -> None:
        pass


def run(messages: list[bytes], max_entries: int, stream: str = TX_STREAM, per_end: int = 1,
        mark: tuple[int, int] | None = None) -> Publisher:
    settings = Settings.from_dict({"http": {"port": 0}, "batch": {"max_entries": max_entries},
                                   "transactions": {"stream": stream, "max_per_end": per_end}})
    mappings = [parse_mapping(load_yaml_documents(text, "m.yaml")[0], {}) for text in (RIDE, NOTE, MESSAGE)]
    bridge = Bridge(settings, mappings)
    bridge.gate = Gate()
    publisher = Publisher(mark)
    bridge._stream(VouchedSession(bridge, Stream(bridge, messages, publisher), publisher, Catalog(), Lsn(0)))
    return publisher


def as_dict(fields: list) -> dict:
    """An entry's fields by name, each value as the text Redis receives (an entry the compiled loop packed
    reads back as bytes, one the batch kept as a list holds str and int values)."""
    *pairs, pos = fields
    it = iter(pairs)
    return {k.decode(): v.decode() if type(v) is bytes else str(v) for k, v in zip(it, it)} | {"pos": pos}


def workload() -> list[bytes]:
    lone = po.Message(False, Lsn(1500), "app:lone", b"hello")
    streamed = ([xlog(po.StreamStart(77, True)), xlog(po.Insert(16400, ("900",), xid=77)),
                 xlog(po.Insert(16401, ("901",), xid=77)), xlog(po.StreamStop())])
    return (
        [xlog(RIDES), xlog(NOTES), xlog(OTHER)]
        + transaction(1000, 501, [(16400, 1), (16401, 2), (16401, 3), (16402, 4)])  # two tables, then an unmapped one
        + transaction(2000, 502, [(16402, 5), (16402, 6)])  # touches no mapped table: no END
        + [xlog(lone)]  # a message of no transaction: counted by no END
        + streamed
        + transaction(3000, 503, [(16400, i) for i in range(10, 17)])  # spans several batches
        + [xlog(po.StreamCommit(77, 0, Lsn(4000), Lsn(4008), 800_000_000_000_004))]
    )


def ends(publisher: Publisher) -> list[dict]:
    return [as_dict(f) for batch in publisher.batches for s, f in batch if s == TX_STREAM]


@pytest.fixture(params=["compiled", "pure"])
def path(request, monkeypatch):
    if request.param == "compiled" and changes.burst_changes is changes.burst:
        pytest.skip(f"the compiled hot path does not run: {speedups.describe()}")
    if request.param == "pure":
        monkeypatch.setattr(session_module, "burst_changes", changes.burst)
        monkeypatch.setattr(session_module, "route_change", changes.route_raw)
    return request.param


def test_each_transaction_with_entries_gets_one_end_after_them(path):
    publisher = run(workload(), max_entries=3)
    got = ends(publisher)
    assert [(e["lsn"], e["xid"], e["seq"]) for e in got] == [("1000", "501", "3"), ("3000", "503", "7"), ("4000", "77", "2")]
    data = [orjson.loads(e["data"]) for e in got]
    notes = {s for s, _ in (p for b in publisher.batches for p in b) if s.startswith("cdc:note:")}
    assert data[0]["count"] == 3 and data[0]["streams"]["cdc:ride"] == 1
    assert sum(n for s, n in data[0]["streams"].items() if s in notes) == 2
    assert data[1] == {"count": 7, "streams": {"cdc:ride": 7}}, "counted across the batches it spans"
    assert data[2]["count"] == 2
    assert all(e["op"] == "e" and e["key"] == "{}" and e["v"] == "1" for e in got)
    assert got[0]["ts_ms"] == str((800_000_000_000_000 + 1000) // 1000 + 946_684_800_000)
    assert got[0]["pos"] == f"{1000:020d}{3:010d}"
    # every END comes after every entry it counts
    order = [(s, as_dict(f)) for b in publisher.batches for s, f in b]
    for i, (s, e) in enumerate(order):
        if s == TX_STREAM:
            counted = [x for t, x in order if t != TX_STREAM and x["lsn"] == e["lsn"] and x["xid"] == e["xid"]]
            before = [x for t, x in order[:i] if t != TX_STREAM and x["lsn"] == e["lsn"] and x["xid"] == e["xid"]]
            assert len(counted) == len(before) == orjson.loads(e["data"])["count"]


def test_both_paths_write_the_same_bytes(monkeypatch):
    if changes.burst_changes is changes.burst:
        pytest.skip(f"the compiled hot path does not run: {speedups.describe()}")
    compiled = run(workload(), max_entries=3).batches
    monkeypatch.setattr(session_module, "burst_changes", changes.burst)
    monkeypatch.setattr(session_module, "route_change", changes.route_raw)
    pure = run(workload(), max_entries=3).batches

    def flat(batches):  # each entry as its XADD and position; a lone message is stamped when read: no ts_ms
        return [(s, xadd_command(s.encode(), f if as_dict(f)["xid"] != "0" else [*f[:-5], *f[-3:]]), f[-1])
                for b in batches for s, f in b]

    assert flat(compiled) == flat(pure)
    assert any(s == TX_STREAM for s, _, _ in flat(compiled))


def test_without_a_transactions_stream_nothing_else_changes(path):
    publisher = run(workload(), max_entries=3, stream="")
    assert not ends(publisher) and all(s != TX_STREAM for b in publisher.batches for s, _ in b)


def small_transactions(n: int, seed: int, start: int = 0) -> list[bytes]:
    """`n` transactions of 0 to 3 inserts into the mapped tables (and the unmapped one), commit LSNs 1000 apart
    (from 1000 * (start + 1)); the Relations first unless `start`."""
    import random

    rng = random.Random(seed)
    out = [] if start else [xlog(RIDES), xlog(NOTES), xlog(OTHER)]
    for i in range(start, start + n):
        out += transaction(1000 * (i + 1), 600 + i, [(rng.choice((16400, 16401, 16402)), 10 * i + j)
                                                     for j in range(rng.randint(0, 3))])
    return out


def covered(publisher: Publisher) -> list[tuple[int, dict]]:
    """Each END in order with its fields, checked against the entries before it: it comes after every entry
    of the transactions it covers, and counts exactly those."""
    order = [(n, s, as_dict(f)) for n, b in enumerate(publisher.batches) for s, f in b]  # n: the batch (atomic)
    out = []
    for i, s, e in order:
        if s != TX_STREAM:
            continue
        data = orjson.loads(e["data"])
        txs = {(str(lsn), str(xid)) for xid, lsn, _ in data["transactions"]}
        mine = [(t, x) for _, t, x in order if t != TX_STREAM and (x["lsn"], x["xid"]) in txs]
        assert mine == [(t, x) for n, t, x in order if n <= i and t != TX_STREAM and (x["lsn"], x["xid"]) in txs]
        assert data["count"] == len(mine) == sum(data["streams"].values())
        assert all(data["streams"][t] == sum(1 for u, _ in mine if u == t) for t in data["streams"])
        last = data["transactions"][-1]
        assert (e["v"], e["op"], e["lsn"], e["xid"], e["ts_ms"]) == ("2", "e", str(last[1]), str(last[0]), str(last[2]))
        assert e["pos"] == f"{last[1]:020d}{int(e['seq']):010d}" and int(e["seq"]) == 1 + max(
            int(x["seq"]) for _, x in mine if x["lsn"] == str(last[1]))
        out.append((len(data["transactions"]), data))
    return out


@pytest.mark.parametrize("per_end,max_entries", [(2, 4), (5, 7), (1000, 6), (1000, 1)])
def test_grouped_ends_cover_each_transaction_of_a_batch_once(path, per_end, max_entries):
    publisher = run(small_transactions(60, seed=per_end + max_entries), max_entries, per_end=per_end)
    got = covered(publisher)
    txs = [tuple(t) for _, data in got for t in data["transactions"]]
    with_entries = sorted({(int(x["xid"]), int(x["lsn"])) for b in publisher.batches for s, f in b
                           if s != TX_STREAM for x in [as_dict(f)] if x["xid"] != "0"}, key=lambda t: t[1])
    assert [t[:2] for t in txs] == with_entries, "every transaction with entries once, in commit order"
    assert max(n for n, _ in got) <= per_end
    if per_end > 1 and max_entries > 1:
        assert max(n for n, _ in got) > 1, "transactions of one batch share an END"
    for batch in publisher.batches:  # an END covers transactions of its own batch only
        assert sum(1 for s, _ in batch if s == TX_STREAM) <= max(1, len(batch))


def test_a_grouped_end_never_straddles_the_mark_a_replay_starts_under(path):
    # the mark of an END written before a crash: transactions up to commit LSN 20000 are covered already
    publisher = run(small_transactions(40, seed=3), max_entries=1000, per_end=1000, mark=(20000, 5))
    got = covered(publisher)
    for _, data in got:
        lsns = [lsn for _, lsn, _ in data["transactions"]]
        assert max(lsns) <= 20000 or min(lsns) > 20000, lsns
    assert len(got) >= 2


def test_grouped_ends_are_the_same_bytes_on_both_paths(monkeypatch):
    if changes.burst_changes is changes.burst:
        pytest.skip(f"the compiled hot path does not run: {speedups.describe()}")
    messages = small_transactions(50, seed=11)
    compiled = run(messages, max_entries=5, per_end=4).batches
    monkeypatch.setattr(session_module, "burst_changes", changes.burst)
    monkeypatch.setattr(session_module, "route_change", changes.route_raw)
    pure = run(messages, max_entries=5, per_end=4).batches
    flat = [[(s, as_dict(f)) for s, f in b] for b in compiled]
    assert flat == [[(s, as_dict(f)) for s, f in b] for b in pure]


def test_no_grouped_end_spans_an_entry_no_end_counts(path):
    """A message of no transaction between two transactions of one batch: the END before it is closed (a
    consumer hands the message over between the two)."""
    lone = xlog(po.Message(False, Lsn(10500), "app:lone", b"between"))
    publisher = run(small_transactions(10, seed=5) + [lone] + small_transactions(10, seed=6, start=10),
                    max_entries=1000, per_end=1000)
    assert any(as_dict(f)["op"] == "m" for b in publisher.batches for _, f in b)
    got = covered(publisher)
    for _, data in got:
        lsns = [lsn for _, lsn, _ in data["transactions"]]
        assert max(lsns) < 10500 or min(lsns) > 10500, lsns
    assert len(got) == 2
