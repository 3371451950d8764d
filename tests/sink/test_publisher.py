"""Appending exactly once against a real Redis: the transaction path and the append script."""

from __future__ import annotations

import random

import hiredis
import pytest
import redis
from hypothesis import given, settings
from hypothesis import strategies as st

from cdc.errors import TransientError
from cdc.sink.publisher import Publisher, StreamBatch, position, split_position
from cdc.sink import lane
from cdc.sink.lane import xadd_command
from cdc.sink.node import coalesce

MODES = ["transaction", "script"]


def batch(stream: str, positions: list[tuple[int, int]], packed: bool = False) -> StreamBatch:
    """A batch of the positions; `packed`: its entries packed as the compiled loop queues them."""
    b = StreamBatch(stream, lane.packer if packed else None)
    for lsn, seq in positions:
        fields = [b"op", b"c", b"lsn", str(lsn), b"seq", seq]
        if packed:
            b.packed.append([*fields, position(lsn, seq)])
        else:
            b.add(position(lsn, seq), fields)
    return b


needs_packer = pytest.mark.skipif(lane.packer is None, reason="the compiled packer is not built")


def positions_in(client: redis.Redis, stream: str) -> list[tuple[int, int]]:
    return [(int(f[b"lsn"]), int(f[b"seq"])) for _, f in client.xrange(stream)]


@pytest.fixture
def client(redis_server):
    c = redis.Redis.from_url(redis_server.url)
    c.flushall()
    yield c
    c.close()


@pytest.mark.integration
@pytest.mark.parametrize("mode", MODES)
def test_a_replayed_batch_appends_only_what_is_past_the_mark(redis_server, client, mode):
    pub = Publisher(redis_server.url, append=mode)
    try:
        assert pub.publish([batch("s", [(100, 0), (100, 1)]), batch("t", [(100, 2)])]) == 3
        # a crash replays the transaction and the next one: only new positions are appended
        assert pub.publish([batch("s", [(100, 0), (100, 1), (200, 0)]), batch("t", [(100, 2)])]) == 1
        assert [f[b"lsn"] for _, f in client.xrange("s")] == [b"100", b"100", b"200"]
        assert client.xlen("t") == 1
        assert pub.marks(["s", "t", "u"]) == {"s": (200, 0), "t": (100, 2), "u": None}
        assert pub.entries_skipped == 3
        # positions compare as numbers, beyond what a Lua double could hold
        big = 2**63 + 5
        assert pub.publish([batch("s", [(big, 0), (big, 10)])]) == 2
        assert pub.publish([batch("s", [(big, 9)])]) == 0
        assert split_position(client.get("{s}:hwm")) == (big, 10)
        # the script cache is gone after a restart or flush: it is reloaded transparently
        client.script_flush()
        assert pub.publish([batch("s", [(big + 1, 0)])]) == 1
    finally:
        pub.close()


@needs_packer
@pytest.mark.integration
def test_packed_batches_append_what_entry_lists_append(redis_server, client):
    """The same batches, replays over the marks included (filtered entry by entry, or sent whole when past
    them), appended from entry lists and from packed entries: the same streams, marks and counts."""
    rounds = [[("s", [(100, 0), (100, 1)]), ("t", [(100, 2)])],
              [("s", [(100, 0), (100, 1), (200, 0)]), ("t", [(100, 2)])],  # a replay: the mark is inside
              [("s", [(300, 0), (300, 1)]), ("t", [(300, 2), (400, 0)])],  # past every mark: sent as packed
              [("s", [(300, 1), (250, 0), (500, 0)])]]  # positions not ascending: each judged
    outcomes = []
    for packed in (False, True):
        client.flushall()
        pub = Publisher(redis_server.url)
        try:
            counts = [pub.publish([batch(stream, ps, packed) for stream, ps in r]) for r in rounds]
            streams = {k: [f for _, f in client.xrange(k)] for k in ("s", "t")}
            outcomes.append((counts, pub.entries_skipped, streams, pub.marks(["s", "t"])))
        finally:
            pub.close()
    assert outcomes[0] == outcomes[1]
    assert outcomes[1][0] == [3, 1, 4, 1] and outcomes[1][3] == {"s": (500, 0), "t": (400, 0)}


@needs_packer
@pytest.mark.integration
def test_a_double_send_of_packed_entries_sends_each_twice_and_the_lane_reads_on(redis_server, client):
    """The test-only fault sends a batch again past the marks, one `XADD` per entry: the lane reads one reply
    per command it sent, so the next batch goes on as before."""
    pub = Publisher(redis_server.url, double_send=1.0)
    try:
        assert pub.publish([batch("s", [(100, 0), (100, 1), (100, 2)], packed=True)]) == 3
        assert pub.publish([batch("s", [(200, 0)], packed=True), batch("t", [(200, 1)])]) == 2
        assert positions_in(client, "s") == [(100, 0), (100, 1), (100, 2)] * 2 + [(200, 0)] * 2
        assert positions_in(client, "t") == [(200, 1)] * 2
    finally:
        pub.close()


@pytest.mark.integration
def test_both_paths_write_the_same_entries_and_marks(redis_server, client):
    """The transaction path against the append script, its reference: same fields, same marks."""
    rng = random.Random(7)
    streams = ["cdc:a", "cdc:{b}:0", "cdc:{b}:1"]
    rounds = []
    lsn = 1000
    for _ in range(30):
        lsn += rng.randint(1, 50)
        round_ = {}
        for s in rng.sample(streams, rng.randint(1, 3)):
            start = rng.randint(0, 3)
            round_[s] = [(lsn - rng.randint(0, 40), seq) for seq in range(start, start + rng.randint(1, 6))]
        rounds.append(round_)
    seen = {}
    for mode in MODES:
        client.flushall()
        pub = Publisher(redis_server.url, append=mode)
        try:
            for round_ in rounds:
                pub.publish([batch(s, sorted(p)) for s, p in round_.items()])
            seen[mode] = ({s: [f for _, f in client.xrange(s)] for s in streams},
                          {s: client.get(f"{{{s}}}:hwm" if "{" not in s else s.split("}")[0] + "}:hwm") for s in streams},
                          pub.entries_written, pub.entries_skipped)
        finally:
            pub.close()
    assert seen["transaction"] == seen["script"]
    assert seen["transaction"][2] > 30


@pytest.mark.integration
@pytest.mark.parametrize("mode", MODES)
def test_two_writers_on_the_same_streams_never_duplicate(redis_server, client, mode):
    """A second bridge started by mistake: both send the same changes, interleaved; each stream is exact."""
    first, second = Publisher(redis_server.url, append=mode), Publisher(redis_server.url, append=mode)
    rng = random.Random(11)
    try:
        changes = [(lsn, seq) for lsn in range(100, 400) for seq in range(3)]
        cursor = {id(first): 0, id(second): 0}
        while min(cursor.values()) < len(changes):
            pub = rng.choice([first, second])
            at = cursor[id(pub)]
            if at >= len(changes):
                continue
            # each writer re-sends a little of what it sent before, as after a reconnect
            lo = max(0, at - rng.randint(0, 5))
            hi = min(len(changes), at + rng.randint(1, 40))
            pub.send([batch("cdc:x", changes[lo:hi]), batch("cdc:y", changes[lo:hi])])
            other = second if pub is first else first
            if other._inflight is None and rng.random() < 0.5:
                # the other writer sends while this one's transaction is queued or in flight
                o_at = cursor[id(other)]
                o_hi = min(len(changes), o_at + rng.randint(1, 40))
                other.send([batch("cdc:x", changes[o_at:o_hi]), batch("cdc:y", changes[o_at:o_hi])])
                other.confirm()
                cursor[id(other)] = o_hi
            pub.confirm()
            cursor[id(pub)] = hi
        for stream in ("cdc:x", "cdc:y"):
            assert positions_in(client, stream) == changes
        assert first.entries_written + second.entries_written == 2 * len(changes)
    finally:
        first.close()
        second.close()


@pytest.mark.integration
def test_a_mark_moved_by_someone_else_is_seen_before_the_next_append(redis_server, client):
    pub = Publisher(redis_server.url)
    try:
        assert pub.publish([batch("s", [(100, 0), (100, 1)])]) == 2
        # a recovery (or another writer) moves the mark on while this publisher holds its watch
        client.set("{s}:hwm", position(300, 0))
        assert pub.publish([batch("s", [(200, 0), (300, 0), (300, 1)])]) == 1
        assert positions_in(client, "s") == [(100, 0), (100, 1), (300, 1)]
        assert pub.marks(["s"]) == {"s": (300, 1)}
    finally:
        pub.close()


@pytest.mark.integration
def test_a_mark_moved_back_under_an_append_has_the_batch_read_again(redis_server, client):
    """The lane lets a batch's entries go once packed, keeping those past the mark. When the mark then
    moves back under it (a recovery rewinding a stream), what it left out may be due: it appends none of
    the batch and asks for it again (a new session reads it from the slot), where it once appended only
    the rest. With nothing left out, it filters again and appends."""
    pub = Publisher(redis_server.url)
    try:
        assert pub.publish([batch("s", [(100, 0), (100, 1)])]) == 2
        client.set("{s}:hwm", position(50, 0))  # after the lane read the mark: its EXEC aborts
        pub.send([batch("s", [(100, 1), (200, 0)])])  # (100, 1) left out against the mark the lane read
        with pytest.raises(TransientError, match="moved back") as caught:
            pub.confirm()
        assert "read again from the slot" in str(caught.value)
        assert positions_in(client, "s") == [(100, 0), (100, 1)]
        assert client.get("{s}:hwm") == position(50, 0).encode()
        # the batch read again: filtered against the mark Redis holds now
        assert pub.publish([batch("s", [(100, 1), (200, 0)])]) == 2
        assert positions_in(client, "s") == [(100, 0), (100, 1), (100, 1), (200, 0)]
        client.set("{s}:hwm", position(250, 0))
        client.set("{s}:hwm", position(150, 0))  # moved back, but the batch left nothing out
        assert pub.publish([batch("s", [(300, 0)])]) == 1
        assert positions_in(client, "s")[-1] == (300, 0)
    finally:
        pub.close()


@pytest.mark.integration
@pytest.mark.parametrize("mode", MODES)
def test_a_connection_cut_mid_batch_appends_all_or_nothing(redis_server, client, mode):
    """The connection dies after the batch was sent and before its reply: a new publisher replays it."""
    cut = 0
    for attempt in range(20):
        client.flushall()
        pub = Publisher(redis_server.url, append=mode)
        try:
            pub.publish([batch("s", [(10, 0)])])
            changes = [(lsn, 0) for lsn in range(11, 2011)]
            paused = attempt % 2 == 0  # writes held: the cut surely lands before the batch is applied
            if paused:
                client.client_pause(5000, all=False)
            pub.send([batch("s", changes), batch("t", changes)])
            client.client_kill_filter(_type="normal", skipme=True)
            if paused:
                client.client_unpause()
            try:
                pub.confirm()
            except TransientError:
                cut += 1
        finally:
            pub.close()
        held = positions_in(client, "s")
        assert held in ([(10, 0)], [(10, 0), *changes])  # never a part of the transaction
        assert len(positions_in(client, "t")) in (0, len(changes))
        again = Publisher(redis_server.url, append=mode)
        try:
            again.publish([batch("s", changes), batch("t", changes)])
        finally:
            again.close()
        assert positions_in(client, "s") == [(10, 0), *changes]
        assert positions_in(client, "t") == changes
    assert cut >= 10, "the kill never landed before the replies were read"


values = st.one_of(st.binary(max_size=40), st.text(max_size=20), st.integers(-2**63, 2**63))


@given(stream=st.binary(min_size=1, max_size=20), fields=st.lists(st.tuples(st.binary(max_size=8), values), max_size=8))
@settings(max_examples=300)
def test_xadd_command_packs_what_hiredis_packs(stream, fields):
    entry = [x for pair in fields for x in pair] + ["0" * 30]
    assert xadd_command(stream, entry) == hiredis.pack_command((b"XADD", stream, b"*", *entry[:-1]))


def test_names_that_are_equal_keys_but_not_equal_bytes_each_pack_as_themselves():
    packed = [xadd_command(b"s", [name, b"v", "0" * 30]) for name in (1, True, 1.0, "1", b"1")]
    assert [p.split(b"\r\n")[8] for p in packed] == [b"1", b"True", b"1.0", b"1", b"1"]
    assert xadd_command(b"s", [bytearray(b"ab"), b"v", "p"]).split(b"\r\n")[8] == str(bytearray(b"ab")).encode()


@pytest.mark.integration
@pytest.mark.parametrize("mode", MODES)
def test_the_flushed_record_only_moves_forward(redis_server, client, mode):
    """A stale writer (or a late heartbeat) never sets back how far Redis holds the source."""
    ahead = Publisher(redis_server.url, append=mode, flushed_key="cdc:bridge:s:flushed")
    stale = Publisher(redis_server.url, append=mode, flushed_key="cdc:bridge:s:flushed")
    try:
        stale.publish([batch("s", [(100, 0)])])  # the stale writer has watched the record already
        ahead.send([batch("s", [(100, 0), (200, 0)])], flushed=250)
        ahead.confirm()
        stale.send([batch("s", [(100, 0), (150, 0)])], flushed=180)
        assert stale.confirm() == 0
        assert client.get("cdc:bridge:s:flushed") == b"250"
        stale.record_flushed(190)
        assert client.get("cdc:bridge:s:flushed") == b"250"
        ahead.record_flushed(300)
        assert client.get("cdc:bridge:s:flushed") == b"300"
        assert positions_in(client, "s") == [(100, 0), (200, 0)]
    finally:
        ahead.close()
        stale.close()


def state_of(client: redis.Redis, streams: list[str], flushed: str) -> tuple:
    """What a refused batch must leave as it was: every stream's entries and mark, and the flushed record."""
    from cdc.keys import mark_key

    return ({s: positions_in(client, s) if client.type(s) == b"stream" else client.type(s) for s in streams},
            {s: client.get(mark_key(s)) for s in streams}, client.get(flushed))


@pytest.mark.integration
@pytest.mark.parametrize("mode", MODES)
def test_a_key_of_another_type_refuses_the_whole_batch_and_names_the_key(redis_server, client, mode):
    """Defect: WRONGTYPE failed one XADD inside EXEC while the SETs of the marks and the record ran."""
    from cdc.errors import PublishError

    flushed = "cdc:bridge:s:flushed"
    streams = ["cdc:a", "cdc:b", "cdc:c"]
    pub = Publisher(redis_server.url, append=mode, flushed_key=flushed, entities={"cdc:c": "ride"})
    try:
        pub.send([batch("cdc:a", [(100, 0)]), batch("cdc:b", [(100, 1)])], flushed=150)
        pub.confirm()
        client.set("cdc:c", "not a stream")  # between batches: the lane last read cdc:c as missing
        before = state_of(client, streams, flushed)
        with pytest.raises(PublishError) as caught:
            pub.send([batch("cdc:a", [(200, 0)]), batch("cdc:b", [(200, 1)]), batch("cdc:c", [(200, 2)])], flushed=250)
            pub.confirm()
        assert type(caught.value) is PublishError and caught.value.exit_code == 5
        assert str(caught.value) == ("redis key cdc:c holds a string, not a stream, stream of entity ride; the bridge "
                                     "appended nothing; rename or delete that key (redis-cli TYPE/DEL cdc:c) and run "
                                     "cdc run again")
        assert state_of(client, streams, flushed) == before  # no entry, no mark, no record moved
        # refused again before anything is sent while the key stays
        with pytest.raises(PublishError, match="redis key cdc:c holds a string"):
            pub.send([batch("cdc:a", [(200, 0)]), batch("cdc:c", [(200, 2)])], flushed=250)
            pub.confirm()
        assert state_of(client, streams, flushed) == before
    finally:
        pub.close()
    client.delete("cdc:c")  # the fix; a replay appends each entry once
    again = Publisher(redis_server.url, append=mode, flushed_key=flushed)
    try:
        again.send([batch("cdc:a", [(100, 0), (200, 0)]), batch("cdc:b", [(100, 1), (200, 1)]),
                    batch("cdc:c", [(200, 2)])], flushed=250)
        assert again.confirm() == 3
    finally:
        again.close()
    assert [positions_in(client, s) for s in streams] == [[(100, 0), (200, 0)], [(100, 1), (200, 1)], [(200, 2)]]
    assert client.get(flushed) == b"250"


@pytest.mark.integration
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("how", ["deleted", "replaced"])
def test_a_stream_whose_history_vanished_is_never_re_created(redis_server, client, mode, how):
    from cdc.errors import DataLossError

    flushed = "cdc:bridge:s:flushed"
    streams = ["cdc:a", "cdc:b"]
    pub = Publisher(redis_server.url, append=mode, flushed_key=flushed, entities={"cdc:b": "ride"})
    try:
        pub.send([batch("cdc:a", [(100, 0)]), batch("cdc:b", [(100, 1), (100, 2)])], flushed=150)
        pub.confirm()
        client.delete("cdc:b")
        if how == "replaced":
            client.hset("cdc:b", "f", "v")
        before = state_of(client, streams, flushed)
        # the lane last read cdc:b as a stream: the change aborts the transaction, which is judged again
        pub.send([batch("cdc:a", [(200, 0)]), batch("cdc:b", [(200, 1)])], flushed=250)
        with pytest.raises(DataLossError) as caught:
            pub.confirm()
        assert caught.value.exit_code == 6
        text = str(caught.value)
        if how == "deleted":
            assert text.startswith("stream cdc:b (stream of entity ride) is gone from redis, but its mark "
                                   "{cdc:b}:hwm says it held entries up to 0/64 (seq 2)")
            assert "it never re-creates a vanished stream" in text and "run cdc recover" in text
        else:
            assert text.startswith("redis key cdc:b holds a hash, not a stream, stream of entity ride, and its mark")
            assert "redis-cli RENAME cdc:b <new name>" in text and "DEL" not in text
        assert state_of(client, streams, flushed) == before
    finally:
        pub.close()


@pytest.mark.integration
def test_a_redis_emptied_under_the_transaction_lane_is_a_data_loss(redis_server, client):
    """FLUSHALL takes the marks with the streams: nothing then says a stream held entries, but the lane
    watched the marks and the record it had set, and refuses to write into the empty keyspace."""
    from cdc.errors import DataLossError

    pub = Publisher(redis_server.url, flushed_key="cdc:bridge:s:flushed")
    try:
        pub.send([batch("cdc:a", [(100, 0)]), batch("cdc:b", [(100, 1)])], flushed=150)
        pub.confirm()
        client.flushall()
        pub.send([batch("cdc:a", [(200, 0)])], flushed=250)
        with pytest.raises(DataLossError, match="vanished while the bridge was writing"):
            pub.confirm()
        assert client.keys("*") == []
    finally:
        pub.close()


@given(st.lists(st.sampled_from([b"", b"*1\r\n$4\r\nPING\r\n", b"x" * 70_000, b"y" * 65_535, b"z" * 65_536]), max_size=8))
def test_coalesce_sends_the_same_bytes_in_order_and_never_copies_a_large_command(commands):
    writes = coalesce(commands)
    assert b"".join(writes) == b"".join(commands)
    large = [c for c in commands if len(c) >= 65_536]
    assert [w for w in writes if any(w is c for c in large)] == large, "each large command written as it is"
    assert len(writes) <= 2 * len(large) + 1
