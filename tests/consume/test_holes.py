"""A plain consumer (without transaction mode) never reads past entries its group had not been delivered that
someone other than the bridge removed (XDEL anywhere, XTRIM by hand): it stops before the read, the group where
it was. The bridge's own trimming is no hole."""

from __future__ import annotations

import pytest
import redis

from cdc.consume import Consumer
from cdc.errors import DataLossError
from cdc.sink.entry import parse_stream_id
from cdc.sink.trim import TrimPolicy, accept_removed, trim_stream
from redis_cluster import three_node_cluster

pytestmark = pytest.mark.integration
A, B = "cdc:a", "cdc:b"


@pytest.fixture
def single(redis_server):
    client = redis.Redis.from_url(redis_server.url)
    client.flushall()
    yield client
    client.close()


@pytest.fixture
def cluster(servers_root):
    from redis.cluster import RedisCluster

    with three_node_cluster(servers_root, "holes") as nodes:
        client = RedisCluster(host="127.0.0.1", port=nodes[0].port)
        assert client.get_node_from_key(A).name != client.get_node_from_key(B).name, "the streams on different nodes"
        yield client
        client.close()


def add(client, stream: str, n: int) -> list[str]:
    return [client.xadd(stream, {"op": "c", "ts_ms": 1, "lsn": 1, "seq": i, "key": "{}", "data": "{}"}).decode()
            for i in range(n)]


def read_all(consumer: Consumer) -> list[str]:
    got = []
    while True:
        entries = consumer.read()
        if not entries:
            return got
        consumer.ack(entries)
        got += [(e.stream, e.id) for e in entries]


@pytest.mark.parametrize("where", ["single", "cluster"])
def test_a_plain_consumer_stops_before_a_hole_and_reads_on_once_it_is_accepted(request, where):
    client = request.getfixturevalue(where)
    a, b = add(client, A, 10), add(client, B, 10)
    consumer = Consumer(client, [A, B], "g", "c1", exclusive=False, count=3, block_ms=10)
    consumer.create_group("0")
    assert len(read_all(consumer)) == 20
    trim_stream(client, A, TrimPolicy(max_len=2))  # the bridge's own trim: no hole
    trim_stream(client, B)
    a, b = add(client, A, 10), add(client, B, 10)
    client.xdel(B, b[4], b[5])  # not delivered to g yet
    got = []
    with pytest.raises(DataLossError) as caught:
        for _ in range(20):
            entries = consumer.read()
            consumer.ack(entries)
            got += [e.id for e in entries]
    [group] = client.xinfo_groups(B)
    delivered = group["last-delivered-id"].decode()
    assert (f"stream {B} (read by consumer group g) lost entries consumer group g had not consumed: IDs after ID "
            f"{delivered} up to ID {b[5]} (deleted, XDEL) (2 entries removed from the stream other than by the "
            "bridge)") in caught.value.message
    assert parse_stream_id(delivered) < parse_stream_id(b[4]) and (B, b[6]) not in got, "nothing read past the hole"
    with pytest.raises(DataLossError):  # the group stayed where it was: the same again
        consumer.read()
    accept_removed(client, B)  # what cdc recover records, after rebuilding the stream
    expected = {(A, i) for i in a} | {(B, i) for i in b[:4] + b[6:]}
    assert sorted(got + read_all(consumer)) == sorted(expected), "each entry left once"


def test_a_hand_trim_before_the_first_read_stops_a_new_consumer(single):
    add(single, A, 10)
    consumer = Consumer(single, [A], "g", "c1", block_ms=10)
    consumer.create_group("0")
    single.xtrim(A, maxlen=4, approximate=False)
    with pytest.raises(DataLossError) as caught:
        consumer.read()
    assert "IDs after ID 0-0 up to before" in caught.value.message and "(6 entries)" in caught.value.message
    assert single.xinfo_groups(A)[0]["last-delivered-id"] == b"0-0"
