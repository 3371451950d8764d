"""Consumers across a resync (`on_unaccountable: resync`): seeded random transactions write two mapped tables,
rides (resync) and trips (stop), often both in one transaction, while rides is broken at a random moment (dropped
and re-created with rows, under a `FOR TABLE` publication or, in a transaction writing trips too, `FOR ALL
TABLES`; dropped and created again later; taken out of the publication and back) and `cdc init` puts it back.
Meanwhile four consumers run: a plain group keeping a key->row read model of both streams, a plain group keeping
the rocket-rides totals of the rides, a transaction-mode group keeping the same read model, and a `TableSink`
mirroring the rides. Once the resync is done, all of them equal the tables (the totals, which fold each change's
before-image, because after the marker the stream brings every row once, before any change of it); every
transaction reached the transaction-mode handler whole, in one call, and those committed while the rides changes
were left out came with their trips entries only (no END record counts what was left out). A reconciliation run
during a resync is refused and changes nothing; one after it finds the totals exact."""

from __future__ import annotations

import json
import random
import threading
import uuid
from decimal import Decimal
from pathlib import Path

import orjson
import psycopg
import pytest

from cdc.consume import Consumer, TableSink, TransactionalHandler
from cdc.demo.local import wait_for
from cdc.demo.rocketrides import ride_totals
from conftest import read_stream
from replay import brought_in_order

pytestmark = pytest.mark.integration

TX = "cdc:tx"
RIDES = ("CREATE TABLE public.rides (id bigint PRIMARY KEY, rider_id bigint NOT NULL, distance_m numeric(12, 3) NOT NULL);"
         "ALTER TABLE public.rides REPLICA IDENTITY FULL;")
TRIPS = "CREATE TABLE public.trips (id bigint PRIMARY KEY, km int NOT NULL);"
RIDE = """entity: ride
table: public.rides
key: [id]
on_unaccountable: resync
fields: {id: id, distance: distance_m, rider: rider_id}
"""
TRIP = """entity: trip
table: public.trips
key: [id]
fields: {id: id, km: km}
"""
STATE = """
CREATE TABLE rm (grp text, stream text, k bigint, data jsonb, PRIMARY KEY (grp, stream, k));
CREATE TABLE calls (grp text, call text, stream text, entry_id text, xid bigint, op text);
"""
SPEC = """name: totals
source: {table: public.rides, partition_column: id, partitions: 2, fetch_size: 500}
truth:
  group_by: [rider_id]
  overall: {rider_id: 0}
  values: {total_distance: sum(distance_m)}
consumers:
  - name: totals
    entity: ride
    handler: cdc.demo.rocketrides:ride_totals
    state: {table: consumer_states, scope: {consumer: totals}}
"""
JAR = "/usr/share/java/postgresql.jar"


def rides_now(env) -> dict[int, dict]:
    return {i: {"id": i, "distance": d, "rider": r}
            for i, d, r in env.execute("SELECT id, distance_m::text, rider_id FROM rides")}


def trips_now(env) -> dict[int, dict]:
    return {i: {"id": i, "km": k} for i, k in env.execute("SELECT id, km FROM trips")}


def totals_now(env) -> dict[int, Decimal]:
    totals: dict[int, Decimal] = {}
    for rider, total in env.execute("SELECT rider_id, sum(distance_m) FROM rides GROUP BY rider_id"):
        totals[rider] = total
    totals[0] = sum(totals.values(), Decimal(0))
    return {r: t for r, t in totals.items() if t != 0}


def totals_state(env, consumer: str = "totals") -> dict[int, Decimal]:
    return {r: t for r, t in env.execute("SELECT rider_id, total_distance FROM consumer_states "
                                         "WHERE consumer = %s AND total_distance <> 0", (consumer,))}


def read_model(env, group: str, stream: str) -> dict[int, dict]:
    return {k: d for k, d in env.execute("SELECT k, data FROM rm WHERE grp = %s AND stream = %s", (group, stream))}


def mirror(env) -> dict[int, dict]:
    return {k["id"]: d for k, d in env.execute("SELECT key, data FROM ride_mirror WHERE NOT deleted")}


def resync_record(env) -> dict:
    return {k.decode(): json.loads(v) for k, v in env.redis.hgetall(f"cdc:bridge:{env.slot}:resync").items()}


def key_rows(group: str, calls: bool = False):
    """An apply function keeping one row per stream and key in `rm`: a truncate or a rebuild marker (x) empties
    the stream's rows, what follows brings them back. `calls`: every entry is also logged with its call."""

    def apply(conn, entries, consumer: str) -> None:
        call = str(uuid.uuid4())
        for e in entries:
            if e.op in ("t", "x"):
                conn.execute("DELETE FROM rm WHERE grp = %s AND stream = %s", (group, e.stream))
            elif e.op in ("c", "u", "r"):
                old = (e.before or {}).get("id")
                if e.op == "u" and old is not None and old != e.key["id"]:
                    conn.execute("DELETE FROM rm WHERE grp = %s AND stream = %s AND k = %s", (group, e.stream, old))
                conn.execute("INSERT INTO rm VALUES (%s, %s, %s, %s) ON CONFLICT (grp, stream, k) DO UPDATE "
                             "SET data = excluded.data", (group, e.stream, e.key["id"], orjson.dumps(e.data).decode()))
            elif e.op == "d":
                conn.execute("DELETE FROM rm WHERE grp = %s AND stream = %s AND k = %s", (group, e.stream, e.key["id"]))
            else:
                raise AssertionError(f"unexpected entry {e}")
        if calls:
            conn.cursor().executemany("INSERT INTO calls VALUES (%s, %s, %s, %s, %s, %s)",
                                      [(group, call, e.stream, e.id, e.xid, e.op) for e in entries])

    return apply


class Running:
    """Consumers, each in a thread until `stop`; a consumer's failure is kept for the test to report."""

    def __init__(self) -> None:
        self.halt = threading.Event()
        self.threads: list[threading.Thread] = []
        self.failures: list[BaseException] = []
        self.closers: list = []

    def start(self, consumer: Consumer, handler) -> None:
        consumer.create_group("0")
        self.closers.append(handler)

        def run() -> None:
            try:
                consumer.run(handler, self.halt)
            except BaseException as exc:  # reported by the test
                self.failures.append(exc)

        thread = threading.Thread(target=run, daemon=True, name=f"consumer-{consumer.group}")
        thread.start()
        self.threads.append(thread)

    def stop(self) -> None:
        self.halt.set()
        for thread in self.threads:
            thread.join(30)
        for handler in self.closers:
            handler.close()


class Writes(threading.Thread):
    """Seeded random transactions until stopped: rides alone, trips alone, or both in one transaction, each
    with 1-4 inserts, updates (a ride may move to another rider) and deletes. A transaction the rides table
    cannot take right now (dropped, being re-created) fails and is skipped."""

    def __init__(self, env, seed: int, ride_ids: range = range(1, 80)) -> None:
        super().__init__(daemon=True, name="writes")
        self.env, self.rng, self.ride_ids = env, random.Random(seed), ride_ids
        self.halt = threading.Event()
        self.done = 0
        self.error: BaseException | None = None

    def statements(self, table: str) -> list[tuple[str, tuple]]:
        rng = self.rng
        out = []
        for _ in range(rng.randint(1, 4)):
            i, roll = rng.randrange(1, 80), rng.random()
            if table == "rides":
                i = rng.choice(self.ride_ids)
                distance = Decimal(rng.randrange(1, 10**6)) / 1000
                if roll < 0.45:
                    out.append(("INSERT INTO rides VALUES (%s, %s, %s) ON CONFLICT (id) DO UPDATE "
                                "SET distance_m = excluded.distance_m", (i, rng.randrange(1, 6), distance)))
                elif roll < 0.8:
                    out.append(("UPDATE rides SET distance_m = %s, rider_id = %s WHERE id = %s",
                                (distance, rng.randrange(1, 6), i)))
                else:
                    out.append(("DELETE FROM rides WHERE id = %s", (i,)))
            elif roll < 0.45:
                out.append(("INSERT INTO trips VALUES (%s, %s) ON CONFLICT (id) DO UPDATE SET km = excluded.km",
                            (i, rng.randrange(1000))))
            elif roll < 0.8:
                out.append(("UPDATE trips SET km = %s WHERE id = %s", (rng.randrange(1000), i)))
            else:
                out.append(("DELETE FROM trips WHERE id = %s", (i,)))
        return out

    def transaction(self, conn: psycopg.Connection) -> None:
        roll = self.rng.random()
        tables = ["rides"] if roll < 0.35 else ["trips"] if roll < 0.55 else ["rides", "trips"]
        statements = [s for t in tables for s in self.statements(t)]
        self.rng.shuffle(statements)
        try:
            with conn.transaction():
                for stmt, params in statements:
                    conn.execute(stmt, params)
            self.done += 1
        except psycopg.Error:
            pass

    def run(self) -> None:
        try:
            with psycopg.connect(self.env.dsn, autocommit=True) as conn:
                while not self.halt.is_set():
                    self.transaction(conn)
                    self.halt.wait(0.002)
        except BaseException as exc:  # reported by the test
            self.error = exc

    def stop(self) -> None:
        self.halt.set()
        self.join(30)
        assert self.error is None, self.error


def spanning(env, rng: random.Random, n: int) -> list[int]:
    """`n` transactions over both tables, committed while rides is out of the stream: their xids."""
    xids = []
    with env.connect() as conn:
        for _ in range(n):
            with conn.transaction():
                i = rng.randrange(200, 300)
                conn.execute("INSERT INTO trips VALUES (%s, %s) ON CONFLICT (id) DO UPDATE SET km = excluded.km",
                             (i, rng.randrange(1000)))
                conn.execute("INSERT INTO rides VALUES (%s, 7, %s) ON CONFLICT (id) DO UPDATE "
                             "SET distance_m = excluded.distance_m", (i, Decimal(rng.randrange(1, 10**6)) / 1000))
                conn.execute("UPDATE trips SET km = km + 1 WHERE id = %s", (i,))
                xids.append(conn.execute("SELECT txid_current()").fetchone()[0])
    return xids


def groups_caught_up(env) -> bool:
    """Every group on every stream has read and acknowledged everything."""
    for stream in ("cdc:ride", "cdc:trip", TX):
        if not env.redis.exists(stream):
            return False
        for g in env.redis.xinfo_groups(stream):
            if g["pending"] or g["lag"]:
                return False
    return True


def start_consumers(env, running: Running) -> None:
    client = env.redis
    plain = Consumer(client, ["cdc:ride", "cdc:trip"], "plain", "p1", block_ms=100, lease_ttl_ms=2000)
    running.start(plain, TransactionalHandler(env.dsn, "plain", key_rows("plain"), epoch_of=plain.epoch))
    totals = Consumer(client, ["cdc:ride"], "totals", "t1", block_ms=100, lease_ttl_ms=2000)
    running.start(totals, TransactionalHandler(env.dsn, "totals", ride_totals, epoch_of=totals.epoch))
    tx = Consumer(client, ["cdc:ride", "cdc:trip"], "tx", "x1", transactions=TX, block_ms=100, lease_ttl_ms=2000)
    running.start(tx, TransactionalHandler(env.dsn, "tx", key_rows("tx", calls=True), epoch_of=tx.epoch))
    mirror_ = Consumer(client, ["cdc:ride"], "mirror", "m1", block_ms=100, lease_ttl_ms=2000)
    running.start(mirror_, TableSink(env.dsn, "public.ride_mirror"))


def setup(env, reconcile: bool, all_tables: bool = False) -> None:
    env.execute(RIDES + TRIPS)
    if all_tables:  # a re-created table is published at once: its changes before the marker are decoded, left out
        env.execute(f"CREATE PUBLICATION {env.publication} FOR ALL TABLES")
    env.apply_sql("20_consumer_state.sql")
    env.execute(STATE)
    env.write_mapping("ride.yaml", RIDE)
    env.write_mapping("trip.yaml", TRIP)
    extra = ""
    if reconcile:
        (env.tmp / "reconcile").mkdir()
        (env.tmp / "reconcile" / "totals.yaml").write_text(SPEC)
        extra = f"reconcile: {{specs: reconcile/, jdbc_jar: {JAR}, wait_for_bridge_s: 60, lock_timeout_s: 30}}\n"
    # small chunks: the resync's backfill takes several, consumers read between them
    env.write_config("batch: {status_interval_s: 0.2, backfill_chunk_rows: 25, max_entries: 50}\n"
                     f"transactions: {{stream: '{TX}'}}\n" + extra)
    env.cdc("init", check=True)
    # rows 500-520 the writes never touch: after the break only the marker can take them out of a consumer's state
    env.execute("INSERT INTO rides SELECT g, g % 5 + 1, g * 1.5 FROM generate_series(1, 60) g; "
                "INSERT INTO rides SELECT g, 2, 1 FROM generate_series(500, 520) g; "
                "INSERT INTO trips SELECT g, g FROM generate_series(1, 60) g")


def break_rides(env, kind: str, rng: random.Random, before_init=lambda: None) -> tuple[list[int], list[int]]:
    """Break the rides table as `kind` says, with transactions over both tables while it is out of the stream;
    `before_init()`, then `cdc init` puts it back. The xids of the transactions over both tables whose rides
    changes are left out, and of those whose rides changes may be (published FOR ALL TABLES: those decoded
    after the marker are streamed)."""
    left_out = []
    if kind == "recreate, all tables":  # the transaction re-creating it writes trips too
        with env.connect() as conn, conn.transaction():
            conn.execute("DROP TABLE rides")
            conn.execute(RIDES)
            conn.execute("INSERT INTO rides SELECT g, g %% 3 + 1, g * 2.25 FROM generate_series(%s::int, %s::int) g",
                         (rng.randrange(1, 40), rng.randrange(60, 120)))
            conn.execute("INSERT INTO trips VALUES (901, 1) ON CONFLICT (id) DO UPDATE SET km = trips.km + 1")
            left_out.append(conn.execute("SELECT txid_current()").fetchone()[0])
    elif kind == "recreate":
        env.execute("BEGIN; DROP TABLE rides; " + RIDES + "INSERT INTO rides SELECT g, g % 3 + 1, g * 2.25 "
                    f"FROM generate_series({rng.randrange(1, 40)}, {rng.randrange(60, 120)}) g; COMMIT;")
    elif kind == "drop then create":
        env.execute("DROP TABLE rides")
        wait_for(lambda: resync_record(env).get("public.rides"), 30, "the resync record")
        env.execute(RIDES + f"INSERT INTO rides SELECT g, 4, g FROM generate_series(1, {rng.randrange(5, 90)}) g")
    else:
        env.execute(f"ALTER PUBLICATION {env.publication} DROP TABLE rides")
    wait_for(lambda: resync_record(env).get("public.rides"), 30, "the resync record")
    # no stream says so (taken out of the publication, rows 500-520 stay, these go)
    with env.connect() as conn, conn.transaction():  # the lock first: rows in another order than the writer's deadlock
        conn.execute("LOCK TABLE rides IN SHARE ROW EXCLUSIVE MODE")
        conn.execute("DELETE FROM rides WHERE id %% %s = 0 OR id >= 510", (rng.randrange(3, 6),))
    xids = spanning(env, rng, 3)
    before_init()
    env.cdc("init", check=True)
    return (left_out, xids) if kind.endswith("all tables") else (left_out + xids, [])


def wait_resynced(env, bridge, running: Running, writes: Writes) -> None:
    wait_for(lambda: bridge.poll() is not None or not resync_record(env), 90, "the resync to finish")
    assert bridge.poll() is None, bridge.log_path.read_text()
    writes.stop()
    env.execute("INSERT INTO trips VALUES (1000, 1); INSERT INTO rides VALUES (1000, 1, 1)")  # the last of each
    wait_for(lambda: bool(running.failures) or (
        all(any(e["key"] == {"id": 1000} for e in read_stream(env.redis, s)) for s in ("cdc:ride", "cdc:trip"))
        and groups_caught_up(env)), 60, "the consumers to catch up")
    assert not running.failures, running.failures


def check_states(env) -> None:
    """Every keyed consumer's state equals the tables' projections."""
    rides, trips = rides_now(env), trips_now(env)
    for group in ("plain", "tx"):
        assert read_model(env, group, "cdc:ride") == rides, group
        assert read_model(env, group, "cdc:trip") == trips, group
    assert mirror(env) == rides
    # the totals fold before- and after-images: exact because the stream brings each row before changing it
    assert totals_state(env) == totals_now(env)
    assert brought_in_order(read_stream(env.redis, "cdc:ride")) == rides


def check_transactions(env, left_out: list[int], maybe: list[int]) -> None:
    """Each transaction reached the transaction-mode handler whole, in one call; those over both tables
    committed while rides was out of the stream came with their trips entries only, as their END records say
    (`maybe`: rides changes decoded after the marker, streamed)."""
    streams = {s: read_stream(env.redis, s) for s in ("cdc:ride", "cdc:trip")}
    ends = {e["xid"]: e for e in read_stream(env.redis, TX) if e["op"] == "e"}
    written: dict[str, set[tuple[str, str]]] = {}
    for stream, entries in streams.items():
        for e in entries:
            if e["op"] in ("c", "u", "d", "t"):
                written.setdefault(e["xid"], set()).add((stream, e["_id"]))
    handed: dict[str, dict[str, set[tuple[str, str]]]] = {}  # xid -> call -> entries
    for call, stream, entry_id, xid, op in env.execute(
            "SELECT call, stream, entry_id, xid, op FROM calls WHERE grp = 'tx' AND op IN ('c', 'u', 'd', 't')"):
        handed.setdefault(str(xid), {}).setdefault(call, set()).add((stream, entry_id))
    assert set(handed) == set(written), "every transaction handed over, none twice"
    for xid, entries in written.items():
        assert len(handed[xid]) == 1, f"transaction {xid} split over {len(handed[xid])} calls"
        assert next(iter(handed[xid].values())) == entries, f"transaction {xid} handed over in part"
        counts = {s: int(n) for s, n in ends[xid]["data"]["streams"].items() if int(n)}
        assert counts == {s: sum(1 for st, _ in entries if st == s) for s in {st for st, _ in entries}}, (xid, counts)
    both = [x for x, entries in written.items() if {s for s, _ in entries} == {"cdc:ride", "cdc:trip"}]
    assert both, "transactions over both tables"
    markers = [e for e in streams["cdc:ride"] if e["op"] == "x"]
    for xid in map(str, left_out + maybe):
        assert "cdc:trip" in {s for s, _ in written[xid]}, xid
        rides = [e for e in streams["cdc:ride"] if e["xid"] == xid]
        if xid in map(str, left_out) or not rides:
            assert not rides, f"transaction {xid}: its rides changes were given up"
            assert not int(ends[xid]["data"]["streams"].get("cdc:ride", 0)), ends[xid]
        else:
            assert int(rides[0]["lsn"]) > int(markers[0]["lsn"]), f"transaction {xid}: streamed after the marker"
    # the marker: one, standalone (no END counts it), handed to each group's handler
    assert markers and all(m["data"]["resync"] is True for m in markers), markers
    assert not {m["xid"] for m in markers} & set(ends)
    for group in ("tx",):
        got = {i for (i,) in env.execute("SELECT entry_id FROM calls WHERE grp = %s AND op = 'x'", (group,))}
        assert got == {m["_id"] for m in markers}, group


CASES = [(1, "recreate"), (2, "unpublish"), (3, "drop then create"), (4, "recreate, all tables")]


@pytest.mark.parametrize("seed, kind", CASES, ids=[f"{seed}-{kind.replace(', ', '-').replace(' ', '-')}" for seed, kind in CASES])
def test_consumers_across_a_resync_end_equal_to_the_tables(env, seed, kind):
    rng = random.Random(seed)
    setup(env, reconcile=False, all_tables=kind.endswith("all tables"))
    running = Running()
    bridge = env.start_bridge()
    writes = Writes(env, seed)
    try:
        start_consumers(env, running)
        wait_for(lambda: env.redis.xlen("cdc:ride") >= 81 and env.redis.xlen("cdc:trip") >= 60, 30, "the bridge to stream")
        writes.start()
        before, after = rng.randrange(20, 120), rng.randrange(80, 200)
        wait_for(lambda: writes.done >= before, 60, "writes before the break")
        left_out, maybe = break_rides(env, kind, rng)
        after += writes.done
        wait_for(lambda: writes.done >= after, 60, "writes after the break")
        wait_resynced(env, bridge, running, writes)
        check_states(env)
    finally:
        writes.halt.set()
        running.stop()
    check_transactions(env, left_out, maybe)
    assert "Traceback" not in bridge.log_path.read_text()


@pytest.mark.parametrize("seed", [5, 6])
def test_a_bridge_killed_while_the_resync_backfills_still_brings_every_row_once(env, seed):
    """kill -9 twice while the re-created table's backfill runs under writes: each new session reads back from the
    stream what it brought since the marker, and the totals and every other consumer end equal to the table."""
    rng = random.Random(seed)
    setup(env, reconcile=False)
    running = Running()
    bridge = env.start_bridge()
    writes = Writes(env, seed, ride_ids=range(1, 4000))  # rows the backfill has not read yet change too
    try:
        start_consumers(env, running)
        wait_for(lambda: env.redis.xlen("cdc:ride") >= 81 and env.redis.xlen("cdc:trip") >= 60, 30, "the bridge to stream")
        writes.start()
        wait_for(lambda: writes.done >= rng.randrange(20, 60), 60, "writes before the break")
        env.execute("BEGIN; DROP TABLE rides; " + RIDES + "INSERT INTO rides SELECT g, g % 5 + 1, g * 1.25 "
                    "FROM generate_series(1, 4000) g WHERE g <> 1000; COMMIT;")
        wait_for(lambda: resync_record(env).get("public.rides", {}).get("marked_at"), 30, "the marker")
        base = env.redis.xlen("cdc:ride")
        env.cdc("init", check=True)  # the new table into the publication: its backfill starts
        for brought in (rng.randrange(30, 200), rng.randrange(800, 2000)):
            wait_for(lambda: bridge.poll() is not None or env.redis.xlen("cdc:ride") >= base + brought, 60,
                     "the backfill to bring rows")
            assert bridge.poll() is None, bridge.log_path.read_text()
            assert resync_record(env), "killed before the resync ends"
            bridge.kill()
            bridge.wait(30)
            bridge = env.start_bridge()
        wait_resynced(env, bridge, running, writes)
        check_states(env)
    finally:
        writes.halt.set()
        running.stop()
    assert "resuming its resync with" in bridge.log_path.read_text()


@pytest.fixture
def spark():
    from cdc.reconcile.truth import start_spark

    session = start_spark("local[2]", JAR, "1g")
    yield session
    session.stop()


def reconcile(env, spark):
    from cdc.config import Settings
    from cdc.mapping.model import load_mappings
    from cdc.reconcile.job import preflight, reconcile_spec
    from cdc.reconcile.spec import load_specs

    settings = Settings.from_file(env.config_path)
    [spec] = load_specs(Path(env.tmp / "reconcile"))
    return reconcile_spec(settings, spec, preflight(settings, load_mappings(settings.mappings), spec), spark)


@pytest.mark.slow
def test_a_reconciliation_after_a_resync_resets_the_totals_exactly(env, spark):
    """The rocket-rides totals fold each change's before-image into sums. A reconciliation while the table is
    resyncing is refused, changing nothing (the rows its snapshot holds come again in the stream); once the
    resync is done the totals are exact by themselves, and a run repairs a drift added by hand while the consumer
    runs on; after more writes they stay exact."""
    rng = random.Random(4)
    setup(env, reconcile=True)
    running = Running()
    bridge = env.start_bridge()
    writes = Writes(env, 4)
    try:
        start_consumers(env, running)
        wait_for(lambda: env.redis.xlen("cdc:ride") >= 81 and env.redis.xlen("cdc:trip") >= 60, 30, "the bridge to stream")
        writes.start()
        wait_for(lambda: writes.done >= 50, 60, "writes before the break")
        during: list = []

        def reconcile_during_the_resync() -> None:
            wait_for(lambda: any(e["op"] == "x" for e in read_stream(env.redis, "cdc:ride")), 30, "the marker")
            wait_for(lambda: groups_caught_up(env), 30, "the consumers to read the marker")
            during.append((totals_state(env), reconcile(env, spark)))
            assert resync_record(env).get("public.rides"), "still resyncing after the reconciliation"

        break_rides(env, "recreate", rng, reconcile_during_the_resync)
        # refused while resyncing: the snapshot holds the new table, whose rows come later (a reset would count
        # them twice); nothing changed, and the run is recorded as not repaired
        [(totals_before, result)] = during
        [outcome] = result.outcomes
        assert outcome.status == "failed" and not result.exact, (outcome.status, outcome.reason)
        assert "public.rides was being resynced at the snapshot" in outcome.reason, outcome.reason
        assert totals_before == {}, "the consumer emptied its totals at the marker"
        assert env.execute("SELECT status FROM cdc_reconcile_runs") == [("failed",)]
        after = writes.done + 150
        wait_for(lambda: writes.done >= after, 60, "writes after the break")
        wait_resynced(env, bridge, running, writes)
        check_states(env)
        # and a drift of its own, so that the reset has something to repair
        env.execute("INSERT INTO consumer_states (consumer, rider_id, total_distance) VALUES ('totals', 99, 5)")
        result = reconcile(env, spark)
        [outcome] = result.outcomes
        assert outcome.status == "repaired" and result.exact, (outcome.status, outcome.reason)
        assert ((99,), "total_distance") in {(d.key, d.column) for d in outcome.drift.drifted}, outcome.drift.drifted
        assert totals_state(env) == totals_now(env)
        env.execute("UPDATE rides SET distance_m = distance_m + 1, rider_id = 2 WHERE id % 3 = 0; "
                    "DELETE FROM rides WHERE id % 7 = 0; INSERT INTO rides VALUES (2000, 3, 12.5)")
        wait_for(lambda: bool(running.failures) or totals_state(env) == totals_now(env), 60,
                 "the totals to stay exact after the reset")
        assert not running.failures, running.failures
    finally:
        writes.halt.set()
        running.stop()


def test_a_resync_marker_between_the_hold_and_the_snapshot_refuses_the_reset(env):
    """The reconciliation's check of its snapshot against a resync: the bridge's record before or after the
    snapshot names the table, or the stream holds a resync marker after the hold and below the snapshot's
    position (a whole resync between the two readings of the record). A marker before the hold (a resync
    over before the snapshot, the record cleared) or at or after the position (the stream resets after the
    snapshot, as the consumer does) leaves the reset to go on."""
    from cdc.reconcile.job import _resync_refusal

    client = env.redis

    def add(op: str, lsn: int, data: dict | None = None) -> str:
        fields = {"op": op, "key": "{}" if op == "x" else '{"id": 1}', "lsn": str(lsn), "seq": "0", "xid": "9",
                  "ts_ms": "0", "v": "1", "data": orjson.dumps(data or {"id": 1}).decode()}
        return client.xadd("cdc:ride", fields).decode()

    marker = {"resync": True, "cause": "table public.rides dropped", "vouched": "0/10"}
    early = add("x", 100, marker)
    hold = add("c", 110)
    holds = {"cdc:ride": hold}
    assert _resync_refusal(client, "public.rides", ["cdc:ride"], holds, 200, {}) == ""
    assert "public.rides was being resynced" in _resync_refusal(client, "public.rides", ["cdc:ride"], holds, 200,
                                                                 {"public.rides": "dropped"})
    assert _resync_refusal(client, "public.rides", ["cdc:ride"], holds, 200, {"public.trips": "dropped"}) == ""
    add("x", 150, {"rebuilt": True})  # cdc recover's marker: the rows follow at its one position
    assert _resync_refusal(client, "public.rides", ["cdc:ride"], holds, 200, {}) == ""
    add("x", 300, marker)  # after the snapshot's position
    assert _resync_refusal(client, "public.rides", ["cdc:ride"], holds, 200, {}) == ""
    refused = _resync_refusal(client, "public.rides", ["cdc:ride"], holds, 400, {})  # the marker at 300 is below
    assert "table public.rides was being resynced at the snapshot (table public.rides dropped)" in refused, refused
    assert _resync_refusal(client, "public.rides", ["cdc:ride"], {"cdc:ride": early}, 200, {}) == ""
