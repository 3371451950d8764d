"""The record of whose history Redis' positions belong to (`check_source_history`), against a real Redis."""

from __future__ import annotations

import pytest
import redis

from cdc import keys
from cdc.bridge.guards import check_source_history, clear_data_loss
from cdc.errors import DataLossError
from cdc.source.history import ServerHistory, divergence, read_history
from cdc.source.lsn import Lsn

pytestmark = [pytest.mark.integration, pytest.mark.one_path]

SLOT = "hist"


@pytest.fixture
def client(redis_server):
    c = redis.Redis.from_url(redis_server.url)
    c.flushall()
    c.set(keys.flushed_key(SLOT), int(Lsn.parse("0/3000200")))
    yield c
    c.close()


def source(client) -> dict:
    return {k.decode(): v.decode() for k, v in client.hgetall(keys.source_key(SLOT)).items()}


def test_a_record_without_a_history_is_accepted_and_recorded(client):
    check_source_history(client, SLOT, ServerHistory("7", 1, {}, Lsn.parse("0/3000300")), reread=None)
    assert source(client) == {"system_id": "7", "timeline": "1"}


def test_a_check_that_only_reads_records_nothing(client):
    check_source_history(client, SLOT, ServerHistory("7", 1, {}, Lsn.parse("0/3000300")), record=False, reread=None)
    assert source(client) == {}


def test_a_newer_timeline_branching_at_or_above_the_record_is_recorded_and_goes_on(client):
    check_source_history(client, SLOT, ServerHistory("7", 1, {}, None), reread=None)
    check_source_history(client, SLOT, ServerHistory("7", 2, {1: Lsn.parse("0/3000200")}, Lsn.parse("0/3000400")), reread=None)
    assert source(client) == {"system_id": "7", "timeline": "2"}
    assert not client.hgetall(keys.bridge_state_key(SLOT))


def test_a_timeline_branching_below_the_record_stops_records_the_loss_and_holds_until_cleared(client):
    check_source_history(client, SLOT, ServerHistory("7", 1, {}, None), reread=None)
    server = ServerHistory("7", 2, {1: Lsn.parse("0/3000100")}, Lsn.parse("0/3000400"))
    with pytest.raises(DataLossError, match=r"positions in \(0/3000100, 0/3000200\]") as caught:
        check_source_history(client, SLOT, server, reread=None)
    assert caught.value.exit_code == 6
    state = client.hgetall(keys.bridge_state_key(SLOT))
    assert (state[b"data_loss_from"], state[b"data_loss_to"]) == (b"0/3000100", b"0/3000200")
    assert source(client)["timeline"] == "1"  # the record stays the old history's
    # recorded: even an identity that would pass (the record was moved below) does not clear it
    client.set(keys.flushed_key(SLOT), int(Lsn.parse("0/3000050")))
    with pytest.raises(DataLossError, match="0/3000200"):
        check_source_history(client, SLOT, server, reread=None)
    clear_data_loss(client, SLOT)  # cdc recover
    check_source_history(client, SLOT, server, reread=None)
    assert source(client)["timeline"] == "2"


def test_another_system_stops(client):
    check_source_history(client, SLOT, ServerHistory("7", 1, {}, None), reread=None)
    with pytest.raises(DataLossError, match=r"positions in \(the start, 0/3000200\].*system 7.*system 8"):
        check_source_history(client, SLOT, ServerHistory("8", 1, {}, Lsn.parse("0/9000000")), reread=None)


def test_a_record_moved_past_the_wal_read_before_it_is_judged_on_a_reading_after_it(env):
    """`cdc check`, `cdc init` or a restarted bridge read the server, then Redis' record: a bridge streaming the
    slot meanwhile moves the record past the WAL position read first. That is no divergence: the check reads the
    server again after the record before it stops anything."""
    client = env.redis
    server = read_history(env.dsn)
    env.execute("CREATE TABLE moved (id int); INSERT INTO moved VALUES (1)")
    streamed = Lsn(env.current_wal())  # the bridge streamed that transaction and recorded its end
    assert server.wal is not None and server.wal < streamed
    client.set(keys.flushed_key(SLOT), int(streamed))
    check_source_history(client, SLOT, server, reread=lambda: read_history(env.dsn))
    assert not client.hgetall(keys.bridge_state_key(SLOT))
    assert source(client) == {"system_id": server.system_id, "timeline": "1"}
    # the first reading alone would have stopped the bridge with a data loss that never happened
    assert divergence(server.system_id, 1, streamed, server) is not None


def test_a_record_past_the_wal_read_after_it_still_stops(env):
    """The second reading spares only a record another bridge moved: one the server's WAL never reached (a
    promoted standby or a restored backup lacked it) still stops, on the second reading's position."""
    client = env.redis
    server = read_history(env.dsn)
    beyond = Lsn(int(server.wal) + 0x100000)
    client.set(keys.flushed_key(SLOT), int(beyond))
    readings = []
    with pytest.raises(DataLossError, match=rf"positions in \(.*, {beyond}\].*WAL is at") as caught:
        check_source_history(client, SLOT, server, reread=lambda: readings.append(read_history(env.dsn)) or readings[-1])
    assert caught.value.exit_code == 6
    assert len(readings) == 1 and f"WAL is at {readings[0].wal} only" in str(caught.value)
    assert client.hget(keys.bridge_state_key(SLOT), "data_loss_to") == str(beyond).encode()
