"""The bridge loop's stages, one by one, without servers: wire bytes in, decisions out."""

from __future__ import annotations

import orjson
import pytest

from cdc.bridge.ack import Acknowledger
from cdc.bridge.backfill import TRUNCATED, Windows
from cdc.bridge.batcher import Batcher
from cdc.bridge.changes import bind, route_message, route_row, route_truncate
from cdc.bridge.inflight import InFlight
from cdc.bridge.snapshot import queue_chunk
from cdc.bridge.positions import Transaction
from cdc.mapping.model import parse_mapping
from cdc.source import pgoutput as po
from cdc.source.framing import pg_ts_to_unix_ms
from cdc.source.lsn import Lsn
from cdc.source.values import TypeCatalog
from cdc.yamlsrc import load_yaml_documents
from pgoutput_encoder import encode

RIDE = "entity: ride\ntable: public.rides\nkey: [id]\nfields: {id: id, distance: distance_m}\n"
NOTE = "entity: note\nmessage_prefix: 'note:'\n"
RIDES = po.Relation(16400, "public", "rides", "d", (
    po.Column(True, "id", 20, -1), po.Column(False, "distance_m", 1700, -1), po.Column(False, "note", 25, -1),
))
BEGIN = po.Begin(Lsn(0x1_0000_0200), 800_000_000_000_000, 731)
COMMIT = po.Commit(0, Lsn(0x1_0000_0200), Lsn(0x1_0000_0230), 800_000_000_000_000)


def wire(message: po.PgOutputMessage) -> po.PgOutputMessage:
    """The message as the loop sees it: encoded to pgoutput bytes and decoded again."""
    return po.PgOutputDecoder().decode(encode(message))


def mapping(text: str):
    return parse_mapping(load_yaml_documents(text, "m.yaml")[0], {})


def entry(fields: list) -> dict:
    *pairs, pos = fields
    it = iter(pairs)
    return {k.decode(): v for k, v in zip(it, it)} | {"pos": pos}


def entries(batcher: Batcher, stream: str = "cdc:ride") -> list[dict]:
    return [entry(e) for e in batcher.batch(stream).entries]


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def bound():
    batcher = Batcher(max_entries=1000, max_delay_s=0.05)
    read = {"ride": [0]}
    targets = bind(wire(RIDES), [mapping(RIDE)], TypeCatalog(), batcher, read)
    return targets, batcher, read


# -- the transaction assembler ---------------------------------------------------------------


def test_transaction_gives_each_change_its_commit_position():
    tx = Transaction()
    tx.begin(wire(BEGIN))
    assert tx.open and tx.lsn == str(0x1_0000_0200) and tx.xid == "731" and tx.seq == 0
    assert tx.ts == str(pg_ts_to_unix_ms(BEGIN.commit_ts))
    assert tx.position() == f"{0x1_0000_0200:020d}{0:010d}"
    tx.seq += 2
    assert tx.position().endswith("0000000002")
    assert tx.commit(wire(COMMIT)) == 0x1_0000_0230 and not tx.open
    tx.begin(wire(BEGIN))
    assert tx.seq == 0, "a new transaction counts from 0 again"


def test_a_lone_message_has_its_own_position():
    lone = Transaction.lone(wire(po.Message(False, Lsn(4242), "note:x", b"{}")), now_us=0)
    assert (lone.lsn, lone.xid, lone.seq, lone.position()) == ("4242", "0", 0, f"{4242:020d}{0:010d}")
    assert lone.ts == str(pg_ts_to_unix_ms(0))


# -- projecting and packing changes -------------------------------------------------------------


def test_changes_are_projected_and_packed_with_their_positions(bound):
    targets, batcher, read = bound
    tx, windows = Transaction(), Windows()
    tx.begin(wire(BEGIN))
    for message in (po.Insert(16400, ("7", "1.500", "private")),
                    po.Update(16400, None, None, ("7", "2.500", "private")),
                    po.Delete(16400, "K", ("7", None, None))):
        msg = wire(message)
        route_row(encode(message)[0], msg, targets, tx, batcher, windows)
        tx.seq += 1
    got = entries(batcher)
    assert [e["op"] for e in got] == [b"c", b"u", b"d"]
    assert [e["seq"] for e in got] == [0, 1, 2] and [e["pos"][-1:] for e in got] == ["0", "1", "2"]
    assert {(e["lsn"], e["xid"], e["v"]) for e in got} == {(str(0x1_0000_0200), "731", 1)}
    assert orjson.loads(got[0]["data"]) == {"id": 7, "distance": "1.500"}
    assert all(b"private" not in b"".join(v for v in e.values() if isinstance(v, bytes)) for e in got)
    assert batcher.pending == 3 and read == {"ride": [3]}


def test_changes_inside_an_open_window_are_noted_by_key(bound):
    targets, batcher, _ = bound
    tx, windows = Transaction(), Windows()
    windows.low("c1", ("public", "rides"))
    route_row(ord("U"), wire(po.Update(16400, "K", ("8", None, None), ("9", "1", None))),
              targets, tx, batcher, windows)
    assert windows.close("c1") == {("9",), ("8",)}


def test_a_truncate_empties_the_windows_of_its_table(bound):
    targets, batcher, _ = bound
    windows = Windows()
    windows.low("c1", ("public", "rides"))
    route_truncate(wire(po.Truncate(False, False, (16400, 99))), {16400: targets}, Transaction(), batcher, windows)
    assert TRUNCATED in windows.close("c1")
    assert [e["op"] for e in entries(batcher)] == [b"t"]


def test_a_resume_closes_every_window_left_open_and_requests_name_their_slot():
    from cdc.bridge.backfill import parse_request, request_slot

    windows = Windows()
    windows.low("1:0:aa", ("public", "rides"))
    windows.low("2:3:aa", ("public", "riders"))
    assert sorted(windows.close_all()) == ["1:0:aa", "2:3:aa"]
    assert not windows.open and not windows.tables, "nothing holds the acknowledgements any more"
    assert windows.close("1:0:aa") is None, "a late high of a closed window finds none"
    assert request_slot(b"cdc_a:17") == "cdc_a" and request_slot("17") is None
    assert parse_request(b"cdc_a:17") == ("cdc_a", 17) and parse_request("17") == (None, 17)
    assert parse_request(b"a:b:x") == ("a:b", None), "an unreadable id is no request to look for"


def test_messages_go_to_the_first_matching_prefix_and_take_a_seq():
    batcher = Batcher(1000, 1.0)
    note = mapping(NOTE)
    targets = [(note.message_prefix, note.version, batcher.batch(note.stream_key()))]
    tx = Transaction()
    tx.begin(wire(BEGIN))
    route_message(wire(po.Message(True, Lsn(1), "note:a", b'{"n": 1}')), targets, tx, batcher)
    route_message(wire(po.Message(True, Lsn(1), "other", b"{}")), targets, tx, batcher)
    route_message(wire(po.Message(False, Lsn(4242), "note:b", b"{}")), targets, tx, batcher)
    got = entries(batcher, note.stream_key())
    assert tx.seq == 2, "every transactional message takes a seq, mapped or not"
    assert [(e["seq"], e["lsn"], e["xid"]) for e in got] == [(0, str(0x1_0000_0200), "731"), (0, "4242", "0")]


def test_a_snapshot_chunk_leaves_out_rows_the_stream_changed():
    batcher, tx = Batcher(1000, 1.0), Transaction()
    targets = bind(wire(RIDES), [mapping(RIDE)], TypeCatalog(), batcher, {"ride": [0]})
    info = {"columns": ["distance_m", "id"], "rows": [["1.0", "1"], ["2.0", "2"], ["3.0", "3"]]}
    assert queue_chunk(info, targets[0].projector, {("2",)}, batcher, tx) == (2, 1)
    got = entries(batcher)
    assert [orjson.loads(e["key"]) for e in got] == [{"id": 1}, {"id": 3}] and [e["seq"] for e in got] == [0, 1]
    assert {e["op"] for e in got} == {b"r"}
    assert queue_chunk(info, targets[0].projector, {TRUNCATED}, batcher, tx) == (0, 3)


# -- the batcher ---------------------------------------------------------------------------------


def test_a_batch_is_due_when_full_or_old():
    clock = Clock()
    batcher = Batcher(max_entries=3, max_delay_s=0.05, clock=clock)
    tx = Transaction()
    assert not batcher.due(clock.now), "nothing pending is never due"
    batcher.add(batcher.batch("s"), [b"f", 1], 1, tx)
    clock.now += 0.01
    batcher.add(batcher.batch("t"), [b"f", 2], 1, tx)
    assert not batcher.due(clock.now)
    assert batcher.due(clock.now + 0.04), "the oldest entry's age counts, not the newest's"
    batcher.add(batcher.batch("s"), [b"f", 3], 1, tx)
    assert batcher.due(clock.now) and batcher.counts() == {"s": 2, "t": 1}
    batcher.clear()
    assert batcher.pending == 0 and batcher.counts() == {} and not batcher.due(clock.now + 10)


# -- the in-flight handshake ----------------------------------------------------------------------


class FakePublisher:
    def __init__(self) -> None:
        self.sent: list[tuple[dict[str, list], int | None]] = []
        self.confirms = 0
        self.fail = False

    def send(self, batches, flushed=None) -> None:
        self.sent.append(({b.stream: list(b.entries) for b in batches if b.count}, flushed))

    def confirm(self) -> int:
        if self.fail:
            raise ConnectionError("redis went away")
        self.confirms += 1
        return 0


def test_one_batch_in_flight_while_the_next_fills():
    publisher, batcher = FakePublisher(), Batcher(1000, 1.0)
    inflight = InFlight(publisher)
    assert inflight.settle() is None and publisher.confirms == 0, "nothing in flight: nothing to wait for"
    tx = Transaction()
    batcher.add(batcher.batch("s"), [b"f", 1], 1, tx)
    batcher.add(batcher.batch("s"), [b"f", 2], 1, tx)
    inflight.send(batcher, Lsn(500), 1234, now=7.0)
    [(streams, flushed)] = publisher.sent
    assert flushed == 500 and [entry(e)["f"] for e in streams["s"]] == [1, 2]
    assert inflight.busy and batcher.pending == 0 and batcher.batch("s").count == 0
    batcher.add(batcher.batch("s"), [b"f", 3], 1, tx)
    with pytest.raises(RuntimeError):
        inflight.send(batcher, Lsn(600), 0, now=8.0)
    sent = inflight.settle()
    assert (sent.ack, sent.count, sent.counts, sent.sent_at, sent.ts_ms) == (500, 2, {"s": 2}, 7.0, 1234)
    assert not inflight.busy and publisher.confirms == 1


def test_a_failed_confirmation_leaves_the_batch_in_flight():
    publisher, batcher = FakePublisher(), Batcher(1000, 1.0)
    inflight = InFlight(publisher)
    batcher.add(batcher.batch("s"), [b"f", 1], 1, Transaction())
    inflight.send(batcher, Lsn(500), 0, now=0.0)
    publisher.fail = True
    with pytest.raises(ConnectionError):
        inflight.settle()
    assert inflight.busy, "unconfirmed: the slot must not move to it"


# -- the acknowledger -----------------------------------------------------------------------------


def test_the_slot_never_moves_past_what_redis_confirmed():
    ack = Acknowledger(Lsn(100))
    ack.vouched(Lsn(10**9))  # the gate vouches for everything here
    ack.committed(Lsn(200), window_open=False, nothing_unsent=False)
    assert ack.ackable == 200 and ack.durable == 100 and ack.acked == 100
    ack.confirmed(Lsn(200))
    assert ack.durable == 200 and ack.acked == 200
    ack.committed(Lsn(300), window_open=False, nothing_unsent=True)
    assert ack.durable == 300, "a transaction with nothing mapped is done at once"
    assert ack.to_record(in_flight=True) is None, "the connection is busy with a batch's replies"
    assert ack.to_record(in_flight=False) == 300 and ack.acked == 200, "told only once Redis records it"
    ack.record(Lsn(300))
    assert ack.acked == 300 and ack.to_record(in_flight=False) is None


def test_the_slot_never_moves_inside_an_open_backfill_window():
    ack = Acknowledger(Lsn(100))
    ack.committed(Lsn(200), window_open=True, nothing_unsent=True)
    ack.drained()
    assert ack.ackable == 100 and ack.durable == 100
    ack.keepalive(900, quiet=False)
    assert ack.ackable == 100
    ack.committed(Lsn(300), window_open=False, nothing_unsent=False)
    ack.drained()
    assert ack.durable == 300


def test_a_keepalive_moves_the_slot_only_when_nothing_of_ours_is_before_it():
    ack = Acknowledger(Lsn(100))
    ack.vouched(Lsn(10**9))  # the gate vouches for everything here
    ack.keepalive(50, quiet=True)
    assert ack.durable == 100, "never backwards"
    ack.keepalive(900, quiet=True)
    assert ack.ackable == ack.durable == 900
    ack.confirmed(Lsn(500))
    assert ack.durable == 900 and ack.recorded == 500, "a late confirmation moves nothing back"
    assert ack.acked == 500, "durable by a keepalive, but not recorded yet: not told"


def test_the_slot_never_moves_past_what_the_gate_vouched_for():
    ack = Acknowledger(Lsn(100))
    ack.resume(Lsn(400), confirmed=Lsn(300))  # Redis records 400, the slot is at 300
    assert ack.acked == 300, "what Redis recorded past the slot is not vouched for yet"
    ack.committed(Lsn(500), window_open=False, nothing_unsent=True)
    received = ack.received()  # a catalog reading starts
    ack.committed(Lsn(600), window_open=False, nothing_unsent=True)
    ack.record(Lsn(600))
    assert ack.durable == 600 and ack.acked == 300, "durable and recorded, but no reading passed yet"
    ack.vouched(received)
    assert ack.acked == 500, "only what was received before the reading started"
    ack.vouched(Lsn(200))
    assert ack.acked == 500, "never backwards"


def test_a_new_session_starts_from_what_redis_records_not_from_memory():
    ack = Acknowledger(Lsn(100))
    ack.keepalive(900, quiet=True)  # durable, and the session ends before it is recorded
    ack.resume(Lsn(500))  # the next session: Redis records 500
    assert (ack.ackable, ack.durable, ack.recorded, ack.acked) == (500, 500, 500, 500)
    assert ack.to_record(in_flight=False) is None, "the slot is told no more than Redis holds"
    ack.resume(Lsn(300))  # a Redis restored from an older state
    assert ack.acked == 300 and ack.to_record(in_flight=False) is None
