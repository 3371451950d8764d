"""The loop of one session, without servers: XLogData bytes in; entries sent and positions acknowledged out."""

from __future__ import annotations

import struct

import orjson
import pytest

from cdc.bridge.loop import Bridge
from cdc.bridge.session import LINGER_S, Session
from cdc.config import Settings
from cdc.mapping.model import parse_mapping
from cdc.source import pgoutput as po
from cdc.source.lsn import Lsn
from cdc.yamlsrc import load_yaml_documents
from pgoutput_encoder import encode

RIDE = "entity: ride\ntable: public.rides\nkey: [id]\nfields: {id: id, distance: distance_m}\n"
RIDES = po.Relation(16400, "public", "rides", "d", (po.Column(True, "id", 20, -1), po.Column(False, "distance_m", 1700, -1)))


def xlog(message: po.PgOutputMessage) -> bytes:
    return b"w" + struct.pack(">QQq", 0, 0, 0) + encode(message)


def keepalive(wal_end: int, reply: bool = False) -> bytes:
    return b"k" + struct.pack(">QqB", wal_end, 0, reply)


def transaction(final: int, ids: range) -> list[bytes]:
    return ([xlog(po.Begin(Lsn(final), 0, 9))] + [xlog(po.Insert(16400, (str(i), "1.5"))) for i in ids]
            + [xlog(po.Commit(0, Lsn(final), Lsn(final + 8), 0))])


class Stream:
    """Replays messages (None: nothing to read now), then stops the bridge; records what the slot is told."""

    backend_pid = 0

    def __init__(self, bridge: Bridge, messages: list[bytes | None], publisher: Publisher) -> None:
        self.bridge, self.messages, self.publisher = bridge, list(messages), publisher
        self.statuses: list[tuple[int, frozenset]] = []  # (flush LSN told, the entries Redis had confirmed then)
        self.told: list[tuple[int, int]] = []  # (flush LSN told, messages still to read then)

    def read(self, timeout: float) -> bytes | None:
        if self.messages:
            return self.messages.pop(0)
        self.bridge.stopping = True
        return None

    def get_copy_data(self, async_: int) -> tuple[int, bytes]:
        """libpq's view, for the compiled loop: a message already received, or (0, b"") at a gap or the end."""
        if self.messages and self.messages[0] is not None:
            raw = self.messages.pop(0)
            return len(raw), raw
        return 0, b""

    def send_status(self, write: int, flush: int, apply: int, reply: bool = False) -> None:
        self.statuses.append((flush, frozenset(self.publisher.confirmed)))
        self.told.append((flush, len(self.messages)))


class Publisher:
    def __init__(self) -> None:
        self.batches: list[list[int]] = []  # the seqs of each batch sent
        self.unconfirmed: list[tuple[int, int]] = []
        self.confirmed: set[tuple[int, int]] = set()  # (commit LSN, seq) of every entry Redis confirmed
        self.recorded: list[tuple[int, frozenset]] = []
        self.keys: list[int] = []  # the ride id of every entry sent, in order

    def send(self, batches, flushed=None) -> None:
        assert not self.unconfirmed, "one batch in flight at most"
        entries = [e for b in batches for e in b.queued()]
        self.batches.append([int(e[e.index(b"seq") + 1]) for e in entries])
        self.keys += [orjson.loads(e[e.index(b"key") + 1])["id"] for e in entries]
        self.unconfirmed = [(int(e[e.index(b"lsn") + 1]), int(e[e.index(b"seq") + 1])) for e in entries]

    def confirm(self) -> int:
        self.confirmed.update(self.unconfirmed)
        self.unconfirmed = []
        return 0

    def record_flushed(self, lsn: int) -> None:
        self.recorded.append((lsn, frozenset(self.confirmed)))


def held(transactions: dict[int, int], lsn: int, confirmed: frozenset) -> bool:
    """Redis holds every entry of every transaction (commit LSN: its changes) ending at or before `lsn`."""
    return all((final, seq) in confirmed for final, n in transactions.items() if final + 8 <= lsn for seq in range(n))


class Catalog:  # the catalog connection: no backfill table, no type look-ups needed, no partitions
    query = ""

    def execute(self, *args):
        self.query = str(args[0]) if args else ""
        return self

    def fetchone(self):
        return None if "pg_partition_root" in self.query else (False,)

    def fetchall(self):
        return []


class Gate:  # the ack gate, with a catalog that always vouches for the mapped tables
    resyncing: dict = {}  # and nothing resyncing

    def verify(self, conn) -> None:
        pass

    def relation(self, *args) -> None:
        pass


class VouchedSession(Session):
    """The ack gate's rule is tested in test_stages.py: here the catalog vouches for everything at once."""

    def verify(self) -> None:
        self.ack.vouched(Lsn(2**62))


class Late:
    """A message that arrives `after` seconds after the loop starts waiting for the next one."""

    def __init__(self, after: float, raw: bytes) -> None:
        self.after, self.raw = after, raw


class LateStream(Stream):
    """`Stream`, where a `Late` message is received only by a read that waits long enough for it (a shorter
    one finds nothing: the message comes in later); the timeouts the loop waited with, at a `Late`."""

    def __init__(self, *args) -> None:
        super().__init__(*args)
        self.waits: list[float] = []

    def read(self, timeout: float) -> bytes | None:
        if self.messages and isinstance(self.messages[0], Late):
            self.waits.append(timeout)
            if timeout < self.messages[0].after:
                self.messages[0].after -= timeout
                return None
            return self.messages.pop(0).raw
        return super().read(timeout)

    def get_copy_data(self, async_: int) -> tuple[int, bytes]:
        if self.messages and isinstance(self.messages[0], Late):
            return 0, b""  # not received yet
        return super().get_copy_data(async_)


def run(messages: list, max_entries: int, max_delay_ms: int = 20, stream_type: type[Stream] = Stream,
        ) -> tuple[Bridge, Stream, Publisher]:
    settings = Settings.from_dict({"http": {"port": 0}, "batch": {"max_entries": max_entries, "max_delay_ms": max_delay_ms}})
    bridge = Bridge(settings, [parse_mapping(load_yaml_documents(RIDE, "m.yaml")[0], {})])
    bridge.gate = Gate()
    publisher = Publisher()
    stream = stream_type(bridge, messages, publisher)
    bridge._stream(VouchedSession(bridge, stream, publisher, Catalog(), Lsn(0)))
    return bridge, stream, publisher


def test_every_change_is_sent_once_and_the_slot_never_runs_ahead_of_redis():
    messages = [xlog(RIDES)] + transaction(1000, range(0, 7)) + transaction(2000, range(7, 12))
    bridge, stream, publisher = run(messages, max_entries=3)
    assert [seq for batch in publisher.batches for seq in batch] == list(range(7)) + list(range(5))
    assert max(map(len, publisher.batches)) <= 3, "a large transaction goes out in pieces"
    for lsn, confirmed in stream.statuses + publisher.recorded:
        assert held({1000: 7, 2000: 5}, lsn, confirmed), f"{lsn} told or recorded before Redis held it"
    assert any(0 < lsn < 2008 for lsn, _ in stream.statuses), "acknowledged along the way, not only at the end"
    assert stream.statuses[-1][0] == 2008 and bridge.durable_lsn == 2008
    assert bridge.counters.changes_read == 12 and bridge.counters.transactions == 2 and bridge.counters.entries_published == 12


def test_a_keepalive_past_everything_sent_moves_the_slot_on():
    pending = [xlog(RIDES)] + transaction(1000, range(2)) + [keepalive(5000)]
    bridge, stream, _ = run(pending, max_entries=100)
    assert bridge.durable_lsn == 1008, "entries were pending: the keepalive's position is not ours to take"
    bridge, stream, _ = run(pending[:-1] + [None] + pending[-1:], max_entries=100)
    assert bridge.durable_lsn == 5000 and stream.statuses[-1][0] == 5000


def test_keepalives_in_a_row_do_not_hold_back_the_batch_in_flight():
    """The server sends keepalives, not silence, while other databases write: the loop must not wait for
    silence to confirm the last batch and tell the slot."""
    messages = [xlog(RIDES)] + transaction(1000, range(3)) + [keepalive(900)] * 5
    bridge, stream, publisher = run(messages, max_entries=3)  # the batch is due, and sent, at the last insert
    assert publisher.batches == [[0, 1, 2]]
    told_early = [lsn for lsn, left in stream.told if left > 0]
    assert told_early and max(told_early) == 1008, stream.told


def test_a_batch_not_yet_due_waits_a_moment_for_the_next_message_before_it_goes():
    """The server sent everything so far: the loop waits up to `LINGER_S` for its next message before it
    sends a batch that is not due, so that a flow of changes pausing for less fills its batches; never
    past the batch's `max_delay` (0: no wait, each pause sends what is pending)."""
    first, second = transaction(1000, range(3)), transaction(2000, range(3, 6))
    messages = [xlog(RIDES), *first, Late(LINGER_S / 2, second[0]), *second[1:]]
    bridge, stream, publisher = run(messages, max_entries=100, stream_type=LateStream)
    assert publisher.batches == [[0, 1, 2, 0, 1, 2]], "one batch: the next transaction came within the wait"
    assert stream.waits[0] == pytest.approx(LINGER_S, rel=0.5)
    messages = [xlog(RIDES), *first, Late(LINGER_S * 3, second[0]), *second[1:]]
    bridge, stream, publisher = run(messages, max_entries=100, stream_type=LateStream)
    assert publisher.batches == [[0, 1, 2], [0, 1, 2]], "a longer pause: what was pending went"
    messages = [xlog(RIDES), *first, Late(LINGER_S / 2, second[0]), *second[1:]]
    bridge, stream, publisher = run(messages, max_entries=100, max_delay_ms=0, stream_type=LateStream)
    assert publisher.batches == [[0, 1, 2], [0, 1, 2]], "max_delay 0: due at once, never waiting"


def test_an_unmapped_table_publishes_nothing_but_its_commit_is_acknowledged():
    other = po.Relation(16500, "public", "other", "d", (po.Column(True, "id", 20, -1),))
    messages = [xlog(other), xlog(po.Begin(Lsn(3000), 0, 1)), xlog(po.Insert(16500, ("1",))),
                xlog(po.Commit(0, Lsn(3000), Lsn(3008), 0))]
    bridge, stream, publisher = run(messages, max_entries=100)
    assert publisher.batches == [] and bridge.counters.changes_read == 1 and stream.statuses[-1][0] == 3008
    assert publisher.recorded[-1][0] == 3008, "Redis records how far it holds the source before the slot is told"


def streamed_block(xid: int, changes: list[tuple[int, int]], first: bool) -> list[bytes]:
    """A Stream Start/Stop block of inserts, each (subtransaction xid, ride id)."""
    return ([xlog(po.StreamStart(xid, first))] + [xlog(po.Insert(16400, (str(i), "2.5"), xid=sub)) for sub, i in changes]
            + [xlog(po.StreamStop())])


def test_a_streamed_transaction_is_sent_after_its_commit_with_the_positions_of_an_unstreamed_one():
    """Blocks of a running transaction arrive between other transactions; a subtransaction aborts;
    keepalives come while it runs. Nothing of it is sent before its Stream Commit, and its entries
    take seqs 0.. at its commit LSN, its aborted subtransaction's left out. A transaction aborted
    whole leaves nothing. The slot is told positions as without streaming (the server sends again
    every transaction that commits past them)."""
    messages = (
        [xlog(RIDES)]
        + streamed_block(50, [(50, 100), (51, 101), (50, 102)], first=True)
        + transaction(1000, range(0, 3))
        + [keepalive(1500)]
        + streamed_block(60, [(60, 200), (60, 201)], first=True)
        + streamed_block(50, [(51, 103), (52, 104), (50, 105)], first=False)
        + [xlog(po.StreamAbort(50, 51)), keepalive(1600), xlog(po.StreamAbort(60, 60))]
        + transaction(2000, range(3, 5))
        + [keepalive(2900), keepalive(2950, reply=True)]  # all sent and confirmed, a streamed one open
        + [xlog(po.StreamCommit(50, 0, Lsn(3000), Lsn(3008), 0))]
        + transaction(4000, range(5, 6))
    )
    # max_delay 0: a batch goes at each pause (with a delay, transactions coming this fast keep a young batch
    # waiting across keepalives, and a keepalive's position is the slot's only once nothing is pending)
    bridge, stream, publisher = run(messages, max_entries=2, max_delay_ms=0)
    sent = [e for batch in publisher.batches for e in batch]
    assert len(sent) == 6 + 4  # the plain transactions' 6, the streamed one's 4 (100, 102, 104, 105)
    assert sorted(publisher.confirmed) == sorted(
        [(1000, s) for s in range(3)] + [(2000, s) for s in range(2)] + [(3000, s) for s in range(4)] + [(4000, 0)])
    # nothing of the streamed transaction went out before its commit was read
    commit_at = len(messages) - messages.index(xlog(po.StreamCommit(50, 0, Lsn(3000), Lsn(3008), 0))) - 1
    before = [confirmed for (_, confirmed), (_, left) in zip(stream.statuses, stream.told) if left > commit_at]
    assert before and all(lsn != 3000 for confirmed in before for lsn, _ in confirmed)
    assert (2950, 4) in stream.told  # the quiet keepalive's position, told while it ran
    assert bridge.durable_lsn == 4008 and stream.told[-1][0] == 4008
    assert bridge.streams.committed == 1 and bridge.streams.aborted == 1 and not bridge.streams.held
    assert publisher.keys == [*range(3), *range(3, 5), 100, 102, 104, 105, 5]
