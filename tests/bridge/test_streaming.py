"""Streamed in-progress transactions: the same entries as unstreamed ones, nothing aborted, bounded memory."""

from __future__ import annotations

import random
import re
import subprocess
import sys

import orjson
import psycopg
import pytest
import redis

from cdc.demo.local import wait_for
from conftest import read_stream
from test_crash_recovery import RIDER_MAPPING, assert_streams_exact, kill_bridge_at_random
from workload import MixedWorkload

pytestmark = pytest.mark.integration

MAPPING = """
entity: ride
table: public.rides
key: [id]
fields: {id: id, rider: rider_id, distance_m: distance_m}
"""


def _stream_small(env) -> None:
    """Make the server stream any transaction past 64kB of changes (its minimum), in this test's database."""
    env.execute(f'ALTER DATABASE "{env.dbname}" SET logical_decoding_work_mem = \'64kB\'')


def _workload(env) -> list[int]:
    """Large transactions with rolled-back savepoints, an aborted one, and small ones committed while a
    large one runs. Returns the ride ids that must be published, in commit order."""
    expected: list[int] = []
    with psycopg.connect(env.dsn, autocommit=True) as a, psycopg.connect(env.dsn, autocommit=True) as b:
        a.execute("INSERT INTO riders (id, name, email) VALUES (1, 'r', 'e')")
        ins = "INSERT INTO rides (id, rider_id, distance_m) SELECT g, 1, g FROM generate_series(%s::int, %s::int) g"
        # 1: one large insert, past the 1 MiB the streaming bridge holds in memory
        a.execute(ins, (100001, 125000))
        expected += range(100001, 125001)
        # 2: savepoints: one rolled back (with a nested one inside), one released
        with a.transaction():
            a.execute(ins, (3001, 4000))
            a.execute("SAVEPOINT s1")
            a.execute(ins, (4001, 5000))
            a.execute("SAVEPOINT s2")
            a.execute(ins, (5001, 5500))
            a.execute("ROLLBACK TO SAVEPOINT s1")
            a.execute(ins, (5501, 6000))
            a.execute("SAVEPOINT s3")
            a.execute(ins, (6001, 6500))
            a.execute("RELEASE SAVEPOINT s3")
            a.execute("SAVEPOINT s4")
            a.execute(ins, (6501, 9000))
            a.execute("ROLLBACK TO SAVEPOINT s4")
        expected += [*range(3001, 4001), *range(5501, 6501)]
        # 3: a large transaction rolled back
        a.execute("BEGIN")
        a.execute(ins, (9001, 12000))
        a.execute("ROLLBACK")
        # 4: small transactions commit while a large one is open; the large one commits last
        a.execute("BEGIN")
        a.execute(ins, (12001, 14000))
        for i in range(14001, 14011):
            b.execute(ins, (i, i))
            expected.append(i)
        a.execute(ins, (14011, 16000))
        a.execute("UPDATE rides SET distance_m = distance_m + 1 WHERE id BETWEEN 12001 AND 12500")
        a.execute("COMMIT")
        expected += [*range(12001, 14001), *range(14011, 16001), *range(12001, 12501)]
        # 5: a large transaction aborted after it streamed, then the same ids committed
        a.execute("BEGIN")
        a.execute(ins, (16001, 19000))
        a.execute("ROLLBACK")
        a.execute(ins, (16001, 16100))
        expected += range(16001, 16101)
    return expected


def _second_config(env, slot: str, db: int, extra: str) -> str:
    path = env.tmp / f"{slot}.yaml"
    url = env.redis_server.url.rsplit("/", 1)[0] + f"/{db}"
    path.write_text(
        f"postgres: {{dsn: '{env.dsn}', slot: {slot}, publication: {env.publication}, streaming: false}}\n"
        f"redis: {{url: '{url}'}}\nmappings: mappings/\nhttp: {{port: 0}}\n{extra}"
    )
    return str(path)


def _cdc(config: str, *args: str) -> subprocess.CompletedProcess:
    result = subprocess.run([sys.executable, "-m", "cdc", "--log-format", "text", args[0], "--config", config, *args[1:]],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    return result


def _streamed(env) -> tuple[int, int]:
    """The server's own count of the transactions it streamed on the slot, and of bytes it spilled."""
    row = env.execute("SELECT stream_txns, spill_bytes FROM pg_stat_replication_slots WHERE slot_name = %s", (env.slot,))
    return (row[0][0], row[0][1]) if row else (0, 0)


def test_streamed_transactions_publish_the_same_entries_as_unstreamed_ones(env):
    """One workload, two slots: a bridge with streaming (and a 1 MiB buffer that spills) and one
    without write identical entries, positions included; rolled-back work leaves nothing."""
    env.apply_sql("10_rocket_rides.sql")
    env.write_mapping("ride.yaml", MAPPING)
    env.write_config("batch: {stream_buffer_mb: 1}\n", postgres=", streaming: true")
    _stream_small(env)
    env.cdc("init", check=True)
    plain = _second_config(env, "plain_" + env.slot, 1, "")
    _cdc(plain, "init")
    expected = _workload(env)

    streamed_run = env.cdc("run", "--until-caught-up", check=True, timeout=300)
    _cdc(plain, "run", "--until-caught-up")
    log = streamed_run.stdout + streamed_run.stderr
    counts = re.search(r"streamed transactions since start: (\d+) committed, (\d+) aborted, \d+ left open; (\d+) bytes spilled", log)
    assert counts, log[-3000:]
    committed, aborted, spilled = map(int, counts.groups())
    # PostgreSQL 18 does not stream a transaction it already knows aborted (here: all of them, as the bridge
    # reads after the workload ended); earlier versions stream them and send Stream Abort
    server = env.execute("SHOW server_version_num")[0][0]
    assert committed >= 3 and aborted >= (0 if int(server) >= 180000 else 2) and spilled > 0, counts.group(0)

    streamed = read_stream(env.redis, "cdc:ride")
    unstreamed = read_stream(redis.Redis.from_url(env.redis_server.url.rsplit("/", 1)[0] + "/1"), "cdc:ride")
    assert [e["key"]["id"] for e in streamed] == expected
    for e in streamed + unstreamed:
        del e["_id"]  # Redis' own ids: when each entry was appended
    assert streamed == unstreamed  # every field, source positions included

    # cdc status shows what the server streamed for one slot and spilled to its disk for the other
    on = orjson.loads(env.cdc("status", "--json", check=True).stdout)["slot"]["decoding"]
    off = orjson.loads(_cdc(plain, "status", "--json").stdout)["slot"]["decoding"]
    assert on["streaming"] is True and on["streamed_transactions"] >= committed + aborted and on["streamed_bytes"] > 0
    assert off["streaming"] is False and off["streamed_transactions"] == 0
    assert off["spilled_transactions"] >= 1 and off["spilled_bytes"] > 0


class SavepointWorkload(MixedWorkload):
    """The mixed workload whose large transactions also roll back a savepoint of 300 inserts."""

    def _extra(self, conn: psycopg.Connection, n: int) -> None:
        if self.big_every and n % self.big_every == self.big_every - 1:
            conn.execute("SAVEPOINT undone")
            conn.execute("INSERT INTO rides (id, rider_id, distance_m) SELECT -g - %s, 1, 1 "
                         "FROM generate_series(1, 300) g", (n * 1000,))
            conn.execute("ROLLBACK TO SAVEPOINT undone")


@pytest.mark.slow
def test_kill_9_while_transactions_stream_loses_and_duplicates_nothing(env):
    """The bridge is killed at random moments while large transactions stream (held in memory and
    spilled, some with a rolled-back savepoint, some rolled back whole); the streams end exact."""
    env.apply_sql("10_rocket_rides.sql")
    env.copy_mappings("ride.yaml")
    env.write_mapping("rider.yaml", RIDER_MAPPING)
    env.write_config("batch: {max_entries: 40, max_delay_ms: 5, stream_buffer_mb: 1}\n", postgres=", streaming: true")
    _stream_small(env)
    env.cdc("init", check=True)
    workload = SavepointWorkload(env.dsn, transactions=700, seed=7, big_every=10, big_size=1500, rate=60)
    workload.start()
    rng = random.Random(99)
    kills = 0
    while not workload.done.is_set() and kills < 12:
        kill_bridge_at_random(env, rng, 0.2, 1.5)
        kills += 1
    workload.done.wait(300)
    assert workload.error is None, workload.error
    assert kills >= 8
    env.cdc("run", "--until-caught-up", check=True, timeout=300)
    assert_streams_exact(env, workload)
    assert all(e["key"]["id"] > 0 for e in read_stream(env.redis, "cdc:ride"))  # nothing of a rolled-back savepoint
    wait_for(lambda: _streamed(env)[0] > 0, 30, "the server's statistics to count streamed transactions")
    print(f"{kills} kills; the server streamed {_streamed(env)[0]} transactions")


def test_a_reconnection_while_a_transaction_streams_receives_it_again_whole(env):
    """The replication connection drops while a large transaction is half streamed, after the slot was
    told a position past its start (a small transaction committed meanwhile): the new session drops
    what was held, the server streams the transaction again from its start; nothing lost or doubled."""
    env.apply_sql("10_rocket_rides.sql")
    env.write_mapping("ride.yaml", MAPPING)
    env.write_config("batch: {stream_buffer_mb: 1}\n", postgres=", streaming: true")
    _stream_small(env)
    env.cdc("init", check=True)
    env.execute("INSERT INTO riders (id, name, email) VALUES (1, 'r', 'e')")
    proc = env.start_bridge()
    wait_for(env.slot_active, 30, "the bridge to attach to the slot")
    ins = "INSERT INTO rides (id, rider_id, distance_m) SELECT g, 1, g FROM generate_series(%s::int, %s::int) g"
    with psycopg.connect(env.dsn, autocommit=True) as conn:
        started = env.current_wal()
        conn.execute("BEGIN")
        conn.execute(ins, (1, 20000))
        wait_for(lambda: _streamed(env)[0] > 0, 30, "the server to stream the open transaction")
        env.execute(ins, (50001, 50001))
        wait_for(lambda: env.confirmed_flush() > started, 30, "the slot to move past the open transaction's start")
        env.execute("SELECT pg_terminate_backend(active_pid) FROM pg_replication_slots WHERE slot_name = %s", (env.slot,))
        wait_for(lambda: "transient failure, retrying" in proc.log_path.read_text(), 30, "the bridge to reconnect")
        conn.execute(ins, (20001, 30000))
        conn.execute("COMMIT")
    wait_for(lambda: env.redis.xlen("cdc:ride") >= 30001, 60, "the transaction's entries")
    proc.terminate()
    assert proc.wait(30) == 0
    entries = read_stream(env.redis, "cdc:ride")
    assert [e["key"]["id"] for e in entries] == [50001, *range(1, 30001)]
    assert [int(e["seq"]) for e in entries[1:]] == list(range(30000))
