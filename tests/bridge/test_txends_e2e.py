"""Transaction END records against real PostgreSQL and Redis: one per transaction with entries, counts that
match the streams, exactly once across kill -9."""

from __future__ import annotations

import random
from collections import Counter, defaultdict

import pytest

from conftest import read_stream
from test_crash_recovery import RIDER_MAPPING, assert_streams_exact, kill_bridge_at_random
from workload import MixedWorkload

pytestmark = pytest.mark.integration

TX_STREAM = "cdc:transactions"
NOTE_MAPPING = """
entity: note
table: public.notes
key: [id]
fields: {id: id, body: body}
stream: "cdc:note:{partition}"
partitions: {count: 2}
"""
NOTES_SQL = """
CREATE TABLE public.notes (id bigint PRIMARY KEY, body text);
CREATE TABLE public.audit (id bigint PRIMARY KEY);
"""


def assert_ends_match(client, streams: list[str]) -> list[dict]:
    """Every transaction with entries in `streams` is covered by exactly one END, after them, whose counts are
    what the streams hold for the transactions it covers (format 1: one; format 2: those it lists); every END
    covers such transactions only. Returns the ENDs (and rebuild markers)."""
    held: dict[tuple[str, str], Counter] = defaultdict(Counter)
    last: dict[tuple[str, str], int] = defaultdict(int)
    for stream in streams:
        for e in read_stream(client, stream):
            if e["op"] in ("r", "x") or e["xid"] == "0":
                continue
            held[e["lsn"], e["xid"]][stream] += 1
            last[e["lsn"], e["xid"]] = max(last[e["lsn"], e["xid"]], int(e["seq"]))
    everything = read_stream(client, TX_STREAM)
    ends = [e for e in everything if e["op"] == "e"]
    assert all(e["op"] == "x" for e in everything if e["op"] != "e"), "only ENDs and rebuild markers"
    by_tx: Counter = Counter()
    for e in ends:
        listed = [(str(lsn), str(xid)) for xid, lsn, _ in e["data"]["transactions"]] if e["v"] == "2" else [
            (e["lsn"], e["xid"])]
        by_tx.update(listed)
        assert e["key"] == {} and e["v"] in ("1", "2")
        totals: Counter = Counter()
        for tx in listed:
            totals.update(held[tx])
        assert {k: v for k, v in e["data"].items() if k != "transactions"} == {
            "count": sum(totals.values()), "streams": dict(totals)}, listed
        assert (e["lsn"], e["xid"]) == listed[-1] and int(e["seq"]) == last[listed[-1]] + 1
        assert [int(lsn) for lsn, _ in listed] == sorted(int(lsn) for lsn, _ in listed)
    assert not [tx for tx, n in by_tx.items() if n > 1], "a transaction covered twice"
    assert set(by_tx) == set(held), "a transaction without its END, or an END of no transaction"
    lsns = [int(e["lsn"]) for e in everything]
    assert lsns == sorted(lsns), "ENDs in commit order"
    return everything


@pytest.mark.one_path
@pytest.mark.parametrize("append, pure", [("transaction", ""), ("script", "1")])
def test_transactions_get_one_end_each_with_their_counts(env, append, pure):
    env.apply_sql("10_rocket_rides.sql")
    env.execute(NOTES_SQL)
    env.copy_mappings("ride.yaml")
    env.write_mapping("rider.yaml", RIDER_MAPPING)
    env.write_mapping("note.yaml", NOTE_MAPPING)
    env.write_config(f"batch: {{max_entries: 40}}\ntransactions: {{stream: '{TX_STREAM}'}}\n", redis=f", append: {append}")
    env.cdc("init", check=True)
    with env.connect() as conn:
        with conn.transaction():  # two mapped tables
            conn.execute("INSERT INTO riders (id, name, email) VALUES (1, 'Ann', 'a@x')")
            conn.execute("INSERT INTO rides (id, rider_id, distance_m) VALUES (100000, 1, 10)")
        with conn.transaction():  # three, one of them partitioned
            conn.execute("INSERT INTO riders (id, name, email) VALUES (2, 'Bo', 'b@x')")
            conn.execute("UPDATE rides SET distance_m = 11 WHERE id = 100000")
            conn.execute("INSERT INTO notes SELECT g, 'n' || g FROM generate_series(1, 5) g")
        conn.execute("INSERT INTO audit VALUES (1)")  # no mapped table: no END
        conn.execute("INSERT INTO rides (rider_id, distance_m) SELECT 1, g FROM generate_series(1, 130) g")  # 4 batches
    env.cdc("run", "--until-caught-up", check=True, env={"CDC_PURE_PYTHON": pure})
    streams = ["cdc:ride", "cdc:rider", "cdc:note:0", "cdc:note:1"]
    ends = assert_ends_match(env.redis, streams)
    assert [e["data"]["count"] for e in ends] == [2, 7, 130]
    assert set(ends[1]["data"]["streams"]) == {"cdc:rider", "cdc:ride", "cdc:note:0", "cdc:note:1"}
    rides = read_stream(env.redis, "cdc:ride")
    assert ends[0]["ts_ms"] == rides[0]["ts_ms"] and ends[0]["xid"] == rides[0]["xid"]
    env.execute("INSERT INTO notes VALUES (6, 'n6')")
    env.cdc("run", "--until-caught-up", check=True, env={"CDC_PURE_PYTHON": "" if pure else "1"})
    ends = assert_ends_match(env.redis, streams)
    assert len(ends) == 4 and ends[3]["data"]["count"] == 1, "the other path goes on after it, nothing twice"


@pytest.mark.one_path
def test_a_clashing_transactions_stream_is_a_config_error(env):
    env.apply_sql("10_rocket_rides.sql")
    env.copy_mappings("ride.yaml")
    for key, why in (("cdc:ride", "it is the stream of entity ride"), ("{cdc:ride}:x", "named like a key kept beside"),
                     ("cdc:bridge:x", "names starting cdc:bridge:")):
        env.write_config(f"transactions:\n  stream: '{key}'\n")
        result = env.cdc("check")
        assert result.returncode == 2, result.stderr
        line = result.stderr.strip().splitlines()[-1]
        assert line.startswith(f"cdc: error: {env.config_path}:5: transactions.stream") and why in line, line


@pytest.mark.slow
@pytest.mark.parametrize("per_end", [1, 50])
def test_kill_9_mid_stream_leaves_every_end_once_with_its_counts(env, per_end):
    env.apply_sql("10_rocket_rides.sql")
    env.copy_mappings("ride.yaml")
    env.write_mapping("rider.yaml", RIDER_MAPPING)
    env.write_config(f"batch: {{max_entries: 40, max_delay_ms: 5}}\n"
                     f"transactions: {{stream: '{TX_STREAM}', max_per_end: {per_end}}}\n")
    env.cdc("init", check=True)
    workload = MixedWorkload(env.dsn, transactions=600, seed=7, big_every=40, big_size=300, rate=120)
    workload.start()
    rng = random.Random(99)
    written = []
    for _ in range(8):
        before = env.redis.xlen(TX_STREAM)
        kill_bridge_at_random(env, rng, 0.05, 0.6)
        written.append(env.redis.xlen(TX_STREAM) - before)
    workload.done.wait(300)
    assert workload.error is None, workload.error
    assert sum(1 for n in written if n > 0) >= 3, written
    env.cdc("run", "--until-caught-up", check=True, timeout=300)
    assert_streams_exact(env, workload)
    ends = assert_ends_match(env.redis, ["cdc:ride", "cdc:rider"])
    assert any(e["data"]["count"] > 40 for e in ends), "a transaction spanning batches was counted whole"
    if per_end > 1:
        assert all(e["v"] == "2" for e in ends if e["op"] == "e")
        assert any(len(e["data"]["transactions"]) > 1 for e in ends if e["op"] == "e"), "transactions shared ENDs"


@pytest.mark.one_path
def test_status_trim_and_recover_treat_the_transactions_stream_like_the_others(env):
    import orjson

    env.apply_sql("10_rocket_rides.sql")
    env.copy_mappings("ride.yaml")
    env.write_mapping("rider.yaml", RIDER_MAPPING)
    env.write_config(f"transactions: {{stream: '{TX_STREAM}'}}\n")
    env.cdc("init", check=True)
    env.execute("INSERT INTO riders (id, name, email) VALUES (1, 'Ann', 'a@x')")
    env.cdc("run", "--until-caught-up", check=True)
    status = orjson.loads(env.cdc("status", "--json", check=True).stdout)
    shown = {s["stream"]: s for s in status["streams"]}
    assert shown[TX_STREAM]["length"] == 1 and shown[TX_STREAM]["entity"] == "transactions (END records)"
    assert shown[TX_STREAM]["last_lsn"] is not None
    assert f"{TX_STREAM}: trimmed 0" in env.cdc("trim", check=True).stdout
    out = env.cdc("recover", check=True, timeout=120).stdout
    assert f"{TX_STREAM}: the marker (x)" in out, out
    ends = read_stream(env.redis, TX_STREAM)
    assert [e["op"] for e in ends] == ["e", "x"] and ends[1]["xid"] == "0"
    env.execute("INSERT INTO riders (id, name, email) VALUES (2, 'Bo', 'b@x')")
    env.cdc("run", "--until-caught-up", check=True)
    ends = assert_ends_match(env.redis, ["cdc:ride", "cdc:rider"])
    assert [e["op"] for e in ends] == ["e", "x", "e"] and ends[2]["data"] == {"count": 1, "streams": {"cdc:rider": 1}}
