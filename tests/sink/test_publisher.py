"""The exactly-once append script against a real Redis."""

from __future__ import annotations

import pytest
import redis

from cdc.sink.publisher import Publisher, StreamBatch, position, split_position

pytestmark = pytest.mark.integration


def batch(stream: str, positions: list[tuple[int, int]]) -> StreamBatch:
    b = StreamBatch(stream)
    for lsn, seq in positions:
        b.add(position(lsn, seq), [b"op", b"c", b"lsn", str(lsn), b"seq", seq])
    return b


def test_a_replayed_batch_appends_only_what_is_past_the_mark(redis_server):
    client = redis.Redis.from_url(redis_server.url)
    client.flushall()
    pub = Publisher(redis_server.url)
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
        client.close()
