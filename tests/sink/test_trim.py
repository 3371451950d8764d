"""Consumer-aware trimming: never drops what a group still needs; a hard cap is loud."""

from __future__ import annotations

import logging
import random

import pytest
import redis

from cdc.sink.trim import TrimPolicy, accept_removed, removed_by_others, removed_unconsumed, trim_stream

pytestmark = [pytest.mark.integration, pytest.mark.one_path]


@pytest.fixture
def client(redis_server):
    c = redis.Redis.from_url(redis_server.url)
    c.flushall()
    yield c
    c.close()


def add(client, n: int) -> list[bytes]:
    return [client.xadd("s", {"n": i}) for i in range(n)]


def test_trims_only_what_every_group_consumed(client):
    ids = add(client, 10)
    assert trim_stream(client, "s").trimmed == 0, "without groups nothing is known to be consumed"
    client.xgroup_create("s", "fast", id="0")
    client.xgroup_create("s", "slow", id="0")
    # fast reads and acks everything; slow reads 6, acks 4 (entries 2 and 5 stay pending)
    for entry_id, _ in client.xreadgroup("fast", "f1", {"s": ">"})[0][1]:
        client.xack("s", "fast", entry_id)
    slow = client.xreadgroup("slow", "s1", {"s": ">"}, count=6)[0][1]
    client.xack("s", "slow", *[i for n, (i, _) in enumerate(slow) if n not in (2, 5)])
    result = trim_stream(client, "s")
    assert result.trimmed == 2 and result.forced == 0
    assert client.xrange("s")[0][0] == ids[2], "the oldest pending entry of the slow group stays"
    client.xack("s", "slow", ids[2], ids[5])
    result = trim_stream(client, "s")
    assert client.xrange("s")[0][0] == ids[6], "entries delivered to nobody in 'slow' stay"
    assert client.xlen("s") == 4


def test_a_dead_group_holds_the_stream_until_the_hard_cap_drops_loudly(client, caplog):
    add(client, 5)
    client.xgroup_create("s", "dead", id="0")  # never reads
    client.xgroup_create("s", "live", id="0")
    for entry_id, _ in client.xreadgroup("live", "l1", {"s": ">"})[0][1]:
        client.xack("s", "live", entry_id)
    ids = add(client, 5)
    assert trim_stream(client, "s").trimmed == 0
    with caplog.at_level(logging.ERROR, logger="cdc.sink.trim"):
        result = trim_stream(client, "s", TrimPolicy(max_len=3))
    assert result.forced == 7 and client.xlen("s") == 3
    assert [i for i, _ in client.xrange("s")] == ids[2:]
    assert "dropped 7 entries a consumer group had not consumed" in caplog.text
    assert client.hget("cdc:stats:trim", "s:forced") == b"7"


def test_a_hold_keeps_acknowledged_entries_until_released_or_expired(client):
    import time

    from cdc.keys import holds_key

    ids = add(client, 3)
    client.xgroup_create("s", "g", id="0")
    client.hset(holds_key("s"), "reconcile:x", f"{ids[0].decode()} {int(time.time() * 1000) + 60_000}")
    ids += add(client, 4)
    for entry_id, _ in client.xreadgroup("g", "c", {"s": ">"})[0][1]:
        client.xack("s", "g", entry_id)
    result = trim_stream(client, "s")
    assert [i for i, _ in client.xrange("s")] == ids[1:], "everything after the held entry stays"
    assert result.groups["hold:reconcile:x"] == ids[0].decode()
    client.hset(holds_key("s"), "reconcile:x", f"{ids[3].decode()} {int(time.time() * 1000) - 1}")  # expired
    trim_stream(client, "s")
    assert client.xlen("s") == 0, "an expired hold holds nothing"


class AckingBetweenReads:
    """A client whose group's consumer acknowledges everything pending right after XINFO GROUPS answered,
    as a live consumer can between that read and the XPENDING that follows it."""

    def __init__(self, client, group: str) -> None:
        self.client, self.group = client, group

    def __getattr__(self, name):
        return getattr(self.client, name)

    def xinfo_groups(self, stream):
        groups = self.client.xinfo_groups(stream)
        for p in self.client.xpending_range(stream, self.group, "-", "+", 1000):
            self.client.xack(stream, self.group, p["message_id"])
        return groups


def test_entries_acknowledged_between_the_reads_are_no_loss_and_no_crash_nor_block_a_trim(client):
    ids = add(client, 10)
    client.xgroup_create("s", "g", id="0")
    client.xreadgroup("g", "c", {"s": ">"}, count=3)  # 3 pending
    client.xtrim("s", minid=ids[1], approximate=False)  # the first entry removed by hand, below where the group reads
    assert [r.pending for r in removed_unconsumed(client, "s")] == [True], "a pending entry removed is a loss"
    client.xgroup_destroy("s", "g")
    client.xgroup_create("s", "g", id=ids[1])
    client.xreadgroup("g", "c", {"s": ">"}, count=3)
    assert removed_unconsumed(AckingBetweenReads(client, "g"), "s") == []
    assert client.xpending("s", "g")["pending"] == 0
    client.xreadgroup("g", "c", {"s": ">"}, count=3)  # 3 more pending, acknowledged while the trim looks
    result = trim_stream(AckingBetweenReads(client, "g"), "s")
    assert result.trimmed == 7 and client.xrange("s")[0][0] == ids[8], "trimmed up to what the group has not read"


@pytest.mark.parametrize("seed", range(5))
def test_the_bridges_own_trims_among_appends_and_reads_never_look_like_a_hole(client, seed):
    """A seeded random workload: appends, groups reading and acknowledging, the bridge's trims with and without
    caps. Whatever the bridge removed itself is never a hole; an entry deleted by hand that a group had not read
    is one, whatever came before."""
    rng = random.Random(seed)
    groups = ["g1", "g2"]
    add(client, 3)
    for g in groups:
        client.xgroup_create("s", g, id="0")
    for step in range(150):
        action = rng.random()
        if action < 0.45:
            add(client, rng.randint(1, 8))
        elif action < 0.75:
            g = rng.choice(groups)
            read = client.xreadgroup(g, "c", {"s": ">"}, count=rng.randint(1, 6))
            got = [i for i, _ in read[0][1]] if read else []
            acked = [i for i in got if rng.random() < 0.8]
            if acked:
                client.xack("s", g, *acked)
        else:
            cap = TrimPolicy(max_len=rng.choice([0, 0, 3, 10]), max_age_s=rng.choice([0, 0, 0, 0.02]))
            trim_stream(client, "s", cap)
        assert removed_by_others(client, "s", client.xinfo_stream("s"))[0] == 0, f"seed {seed} step {step}"
        assert removed_unconsumed(client, "s") == [], f"seed {seed} step {step}: the bridge's own trim seen as a loss"
    # a hand deletion of an entry a group has not been delivered: found
    newest = add(client, 3)[1]
    client.xdel("s", newest)
    found = removed_unconsumed(client, "s")
    assert {f.group for f in found} == set(groups) and {f.through for f in found} == {newest.decode()}
    assert removed_by_others(client, "s", client.xinfo_stream("s")) == (1, newest.decode())


def test_a_hand_trim_at_the_head_before_any_delivery_is_found_though_redis_reports_the_lag_after_it(client):
    add(client, 10)
    client.xgroup_create("s", "g", id="0")  # never read: Redis estimates its lag from what is left
    client.xtrim("s", maxlen=6, approximate=False)
    assert client.xinfo_groups("s")[0]["lag"] == 6
    [found] = removed_unconsumed(client, "s")
    assert (found.group, found.after, found.count, found.through) == ("g", "0-0", 4, None)
    accept_removed(client, "s")  # what cdc recover records after rebuilding the stream
    assert removed_unconsumed(client, "s") == []
    client.xdel("s", client.xrange("s")[-1][0])  # a later removal is found again
    assert len(removed_unconsumed(client, "s")) == 1


def test_a_hand_deletion_of_entries_every_group_consumed_is_no_loss(client):
    ids = add(client, 10)
    client.xgroup_create("s", "g", id="0")
    read = client.xreadgroup("g", "c", {"s": ">"}, count=6)[0][1]
    client.xack("s", "g", *[i for i, _ in read])
    client.xdel("s", ids[2], ids[4])
    client.xtrim("s", minid=ids[1], approximate=False)
    assert removed_by_others(client, "s", client.xinfo_stream("s"))[0] == 3
    assert removed_unconsumed(client, "s") == []


def test_a_stream_an_older_bridge_trimmed_is_no_hole_before_or_after_the_first_counted_trim(client):
    add(client, 10)
    client.xgroup_create("s", "g", id="0")
    read = client.xreadgroup("g", "c", {"s": ">"}, count=4)[0][1]
    client.xack("s", "g", *[i for i, _ in read])
    client.xtrim("s", minid=read[-1][0], approximate=False)  # what an older bridge did: no count beside the trim
    client.hincrby("cdc:stats:trim", "s:trimmed", 3)
    assert removed_by_others(client, "s", client.xinfo_stream("s"))[0] == 0
    client.xack("s", "g", read[-1][0])
    assert trim_stream(client, "s").trimmed == 1
    assert client.hget("{s}:removed", "count") == b"4"
    assert removed_by_others(client, "s", client.xinfo_stream("s"))[0] == 0 and removed_unconsumed(client, "s") == []


def test_after_the_cap_dropped_what_a_group_needed_only_a_later_hole_is_reported(client):
    add(client, 10)
    client.xgroup_create("s", "g", id="0")
    client.xreadgroup("g", "c", {"s": ">"}, count=2)
    trim_stream(client, "s", TrimPolicy(max_len=5))  # knowingly: counted as forced
    client.xdel("s", client.xrange("s")[0][0])  # by hand, at the head the cap left
    client.xtrim("s", maxlen=3, approximate=False)  # and by hand past it
    assert removed_unconsumed(client, "s") != []
    accept_removed(client, "s")
    assert removed_unconsumed(client, "s") == []
    kept = client.xrange("s")
    client.xdel("s", kept[1][0])  # a hole in the middle
    [found] = removed_unconsumed(client, "s")
    assert found.through == kept[1][0].decode()
