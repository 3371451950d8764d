"""The ack gate: a change of a mapped table the bridge could not see never lets the slot move past it.

Against real PostgreSQL and Redis: partitioned tables mapped by their parent, tables dropped
and re-created (while the bridge runs, and while it is stopped), renamed, moved to another
schema, and replica identities that cannot carry updates.
"""

from __future__ import annotations

import random
import re

import pytest

from cdc.bridge.gate import Bound, TableGate
from cdc.demo.local import wait_for
from cdc.errors import SlotError
from cdc.mapping.model import parse_mapping
from cdc.source.lsn import Lsn
from cdc.yamlsrc import load_yaml_documents
from conftest import read_stream

pytestmark = pytest.mark.integration

RIDES = """
CREATE TABLE public.rides (
    id          bigint PRIMARY KEY,
    rider_id    bigint NOT NULL,
    distance_m  numeric(12, 3) NOT NULL,
    status      text NOT NULL DEFAULT 'done',
    created_at  timestamptz NOT NULL DEFAULT now(),
    internal_note text
);
ALTER TABLE public.rides REPLICA IDENTITY FULL;
"""

MEAS = """
CREATE TABLE public.meas (id bigint NOT NULL, at date NOT NULL, v int, PRIMARY KEY (id, at)) PARTITION BY RANGE (at);
CREATE TABLE public.meas_2025 PARTITION OF public.meas FOR VALUES FROM ('2025-01-01') TO ('2026-01-01');
CREATE TABLE public.meas_2026 PARTITION OF public.meas FOR VALUES FROM ('2026-01-01') TO ('2027-01-01');
"""


def error_line(text: str) -> str:
    lines = [line for line in text.splitlines() if line.startswith("cdc: error:")]
    assert len(lines) == 1, text
    assert "Traceback" not in text
    return lines[0]


def replayed(client, stream: str) -> dict:
    """What a consumer replaying `stream` from its start holds: key -> data."""
    state = {}
    for e in read_stream(client, stream):
        key = tuple(sorted(e["key"].items()))
        if e["op"] in ("c", "u", "r"):
            state[key] = e["data"]
        elif e["op"] == "d":
            state.pop(key, None)
        elif e["op"] == "t":
            state.clear()
    return state


def rides_now(env) -> dict:
    rows = env.execute("SELECT id, distance_m::text, rider_id FROM rides")
    return {(("id", i),): {"id": i, "distance": d, "rider": r} for i, d, r in rows}


@pytest.fixture
def rides(env):
    env.execute(RIDES)
    env.copy_mappings("ride.yaml")
    env.cdc("init", check=True)
    return env


def lsn_now(env) -> int:
    return env.current_wal()


def running_with_one_ride(env):
    """A bridge checking its tables every 0.2 s, one ride published; the bridge and the WAL position after it."""
    env.write_config("batch: {status_interval_s: 0.2}\n")
    proc = env.start_bridge()
    env.execute("INSERT INTO rides (id, rider_id, distance_m) VALUES (1, 1, 1)")
    wait_for(lambda: env.redis.xlen("cdc:ride") == 1, 30, "the first row")
    return proc, lsn_now(env)


def recreate(env) -> int:
    """Drop and re-create rides in one transaction; the WAL position before it."""
    before = lsn_now(env)
    env.execute("BEGIN; DROP TABLE rides; " + RIDES + " COMMIT;")
    return before


def test_a_table_dropped_and_recreated_while_running_stops_the_bridge_and_recover_repairs_it(rides):
    rides.write_config("batch: {status_interval_s: 0.2}\n")
    proc = rides.start_bridge()
    rides.execute("INSERT INTO rides (id, rider_id, distance_m) SELECT g, 1, g FROM generate_series(1, 5) g")
    wait_for(lambda: rides.redis.xlen("cdc:ride") == 5, 30, "the first rows")
    drop = recreate(rides)
    rides.execute("INSERT INTO rides (id, rider_id, distance_m) SELECT g, 2, g FROM generate_series(3, 8) g")
    assert proc.wait(30) == 4
    line = error_line(proc.log_path.read_text())
    assert "mapped table public.rides was dropped and re-created" in line, line
    assert "cdc init, then cdc recover" in line
    assert rides.confirmed_flush() <= drop, "the slot moved past the drop"
    assert rides.redis.xlen("cdc:ride") == 5, "nothing of the new table reached the stream"

    # a restart refuses too, and so does cdc check
    result = rides.cdc("run", "--until-caught-up")
    assert result.returncode == 4 and "dropped and re-created" in error_line(result.stderr)
    check = rides.cdc("check")
    assert check.returncode == 4 and "dropped and re-created" in check.stderr
    assert rides.confirmed_flush() <= drop

    # the fix the error names
    rides.cdc("init", check=True)
    rides.cdc("recover", check=True)
    rides.execute("UPDATE rides SET distance_m = 100 WHERE id = 4; DELETE FROM rides WHERE id = 8; "
                  "INSERT INTO rides (id, rider_id, distance_m) VALUES (20, 3, 20)")
    rides.cdc("run", "--until-caught-up", check=True)
    assert replayed(rides.redis, "cdc:ride") == rides_now(rides)
    assert rides.cdc("check").returncode == 0


def test_a_table_recreated_while_the_bridge_is_stopped_is_refused_at_start(rides):
    rides.execute("INSERT INTO rides (id, rider_id, distance_m) SELECT g, 1, g FROM generate_series(1, 3) g")
    rides.cdc("run", "--until-caught-up", check=True)
    slot_before = rides.confirmed_flush()
    drop = recreate(rides)
    rides.cdc("init", check=True)  # even published again: its rows before that were never decoded
    rides.execute("INSERT INTO rides (id, rider_id, distance_m) SELECT g, 2, g FROM generate_series(2, 6) g")
    result = rides.cdc("run", "--until-caught-up")
    assert result.returncode == 4
    line = error_line(result.stderr)
    assert "was dropped and re-created" in line and "cdc recover" in line
    assert slot_before <= rides.confirmed_flush() <= drop
    rides.cdc("recover", check=True)
    rides.cdc("run", "--until-caught-up", check=True)
    assert replayed(rides.redis, "cdc:ride") == rides_now(rides)


@pytest.mark.parametrize("change, says", [
    ("ALTER PUBLICATION cdc DROP TABLE rides", "table public.rides is not in publication 'cdc'"),
    ("DROP TABLE rides", "was dropped: its changes since are not in the stream"),
])
def test_a_table_leaving_the_publication_or_dropped_while_running_holds_the_slot(rides, change, says):
    proc, before = running_with_one_ride(rides)
    rides.execute(change)
    if "DROP TABLE" not in change:
        rides.execute("INSERT INTO rides (id, rider_id, distance_m) VALUES (2, 1, 2); DELETE FROM rides WHERE id = 1")
    assert proc.wait(30) == 4
    line = error_line(proc.log_path.read_text())
    assert says in line and "cdc init, then cdc recover" in line, line
    assert rides.confirmed_flush() <= before
    if "DROP TABLE" in change:
        return
    rides.cdc("init", check=True)
    # cdc init put it back, but what it left out meanwhile is in no slot: recorded until cdc recover
    for refused in (rides.cdc("run", "--until-caught-up"), rides.cdc("check")):
        assert refused.returncode == 4 and "lacked table public.rides" in refused.stderr, refused.stderr
        assert "cdc recover" in refused.stderr
    rides.cdc("recover", check=True)
    rides.cdc("run", "--until-caught-up", check=True)
    assert replayed(rides.redis, "cdc:ride") == rides_now(rides) == {(("id", 2),): {"id": 2, "distance": "2.000", "rider": 1}}


@pytest.mark.parametrize("change, now", [
    ("ALTER TABLE rides RENAME TO rides_old", "public.rides_old"),
    ("CREATE SCHEMA archive; ALTER TABLE rides SET SCHEMA archive", "archive.rides"),
])
def test_a_table_renamed_or_moved_while_running_stops_the_bridge(rides, change, now):
    proc, before = running_with_one_ride(rides)
    rides.execute(change)
    rides.execute(f"INSERT INTO {now} (id, rider_id, distance_m) VALUES (2, 1, 2)")
    assert proc.wait(30) == 4
    line = error_line(proc.log_path.read_text())
    # the gate's reading or the Relation message naming it, whichever comes first
    assert "mapped table public.rides (OID" in line and "was renamed or moved" in line and now in line, line
    assert "cdc recover" in line
    assert rides.confirmed_flush() <= before


def test_init_refuses_a_table_whose_replica_identity_cannot_carry_updates(env):
    env.execute(RIDES + "ALTER TABLE rides REPLICA IDENTITY NOTHING;")
    env.copy_mappings("ride.yaml")
    result = env.cdc("init")
    assert result.returncode == 4
    line = error_line(result.stderr)
    assert "REPLICA IDENTITY NOTHING" in line and "run: ALTER TABLE public.rides REPLICA IDENTITY FULL" in line, line
    assert env.execute("SELECT count(*) FROM pg_publication")[0][0] == 0, "nothing created"
    assert env.execute("SELECT count(*) FROM pg_replication_slots WHERE slot_name = %s", (env.slot,))[0][0] == 0
    check = env.cdc("check")
    assert check.returncode in (3, 4), check.stderr  # 3: the mapping's deletes cannot carry its key either
    assert "problem: table public.rides has REPLICA IDENTITY NOTHING" in check.stderr, check.stderr
    assert "ALTER TABLE public.rides REPLICA IDENTITY FULL" in check.stderr

    env.execute("ALTER TABLE rides REPLICA IDENTITY DEFAULT; ALTER TABLE rides DROP CONSTRAINT rides_pkey")
    result = env.cdc("init")
    assert result.returncode == 4 and "no primary key" in error_line(result.stderr)

    env.execute("ALTER TABLE rides ADD PRIMARY KEY (id)")
    env.cdc("init", check=True)
    # changed while the bridge runs: the gate stops it
    env.write_config("batch: {status_interval_s: 0.2}\n")
    proc = env.start_bridge()
    env.execute("INSERT INTO rides (id, rider_id, distance_m) VALUES (1, 1, 1)")
    wait_for(lambda: env.redis.xlen("cdc:ride") == 1, 30, "the first row")
    env.execute("ALTER TABLE rides REPLICA IDENTITY NOTHING")
    assert proc.wait(30) == 4
    assert "REPLICA IDENTITY NOTHING" in error_line(proc.log_path.read_text())


@pytest.fixture
def meas(env):
    env.execute(MEAS)
    env.write_mapping("meas.yaml", "entity: meas\ntable: public.meas\nkey: [id, at]\nfields: {id: id, at: at, v: v}\n")
    env.write_config("batch: {status_interval_s: 0.2}\n")
    return env


def meas_now(env) -> dict:
    return {(("at", str(a)), ("id", i)): {"id": i, "at": str(a), "v": v}
            for i, a, v in env.execute("SELECT id, at, v FROM meas")}


def test_a_partitioned_table_mapped_by_its_parent(meas):
    meas.cdc("init", check=True)
    second = meas.cdc("init", check=True)  # idempotent
    assert "already covers the mapped tables" in second.stdout, second.stdout
    assert meas.execute("SELECT pubviaroot FROM pg_publication WHERE pubname = 'cdc'")[0][0] is True
    assert meas.execute("SELECT tablename FROM pg_publication_tables WHERE pubname = 'cdc'") == [("meas",)]
    assert meas.cdc("check").returncode == 0

    proc = meas.start_bridge()
    meas.execute("INSERT INTO meas VALUES (1, '2025-03-01', 1), (2, '2026-03-01', 2), (3, '2025-04-01', 3), "
                 "(4, '2026-04-01', 4)")
    meas.execute("UPDATE meas SET v = v * 10 WHERE id IN (1, 2)")
    meas.execute("DELETE FROM meas WHERE id IN (3, 4)")
    wait_for(lambda: meas.redis.xlen("cdc:meas") == 8, 30, "changes of both partitions")
    assert [e["op"] for e in read_stream(meas.redis, "cdc:meas")] == ["c"] * 4 + ["u"] * 2 + ["d"] * 2

    # a new partition, empty when it joins, then written to
    meas.execute("CREATE TABLE meas_2027 PARTITION OF meas FOR VALUES FROM ('2027-01-01') TO ('2028-01-01')")
    wait_for(lambda: "joined public.meas empty" in proc.log_path.read_text(), 30, "the gate to bind the partition")
    meas.execute("INSERT INTO meas VALUES (5, '2027-02-01', 5)")
    wait_for(lambda: meas.redis.xlen("cdc:meas") == 9, 30, "a change of the new partition")
    assert replayed(meas.redis, "cdc:meas") == meas_now(meas)

    # a partition leaves with its rows: no change says so
    before = meas.current_wal()
    meas.execute("ALTER TABLE meas DETACH PARTITION meas_2025")
    meas.execute("INSERT INTO meas VALUES (6, '2026-05-01', 6)")
    assert proc.wait(30) == 4
    line = error_line(proc.log_path.read_text())
    assert "partition public.meas_2025 left mapped table public.meas" in line and "cdc recover" in line, line
    assert meas.confirmed_flush() <= before
    result = meas.cdc("run", "--until-caught-up")
    assert result.returncode == 4 and "left mapped table" in result.stderr
    meas.cdc("recover", check=True)
    meas.cdc("run", "--until-caught-up", check=True)
    assert replayed(meas.redis, "cdc:meas") == meas_now(meas)
    assert meas.cdc("init").returncode == 0


def test_a_partition_attached_holding_rows_stops_the_bridge_until_recover(meas):
    meas.cdc("init", check=True)
    proc = meas.start_bridge()
    meas.execute("INSERT INTO meas VALUES (1, '2025-03-01', 1)")
    wait_for(lambda: meas.redis.xlen("cdc:meas") == 1, 30, "the first change")
    meas.execute("CREATE TABLE meas_2027 (LIKE meas INCLUDING ALL); INSERT INTO meas_2027 VALUES (7, '2027-02-01', 7)")
    before = meas.current_wal()
    meas.execute("ALTER TABLE meas ATTACH PARTITION meas_2027 FOR VALUES FROM ('2027-01-01') TO ('2028-01-01')")
    meas.execute("INSERT INTO meas VALUES (8, '2027-03-01', 8)")
    assert proc.wait(30) == 4
    line = error_line(proc.log_path.read_text())
    assert "partition public.meas_2027 joined mapped table public.meas holding rows" in line and "cdc recover" in line
    assert meas.confirmed_flush() <= before
    meas.cdc("recover", check=True)
    meas.cdc("run", "--until-caught-up", check=True)
    assert replayed(meas.redis, "cdc:meas") == meas_now(meas)
    assert len(meas_now(meas)) == 3


@pytest.mark.one_path
def test_init_refuses_a_partition_mapped_while_its_parent_is_published(meas):
    meas.cdc("init", check=True)
    meas.write_mapping("part.yaml", "entity: part\ntable: public.meas_2025\nkey: [id, at]\nfields: {id: id, at: at}\n")
    result = meas.cdc("init")
    assert result.returncode == 4
    line = error_line(result.stderr)
    assert "published as those of its partitioned parent" in line and "map the parent table" in line, line
    assert meas.cdc("init").returncode == 4, "the same answer again, not an error of PostgreSQL"


@pytest.mark.parametrize("target", ["FOR TABLE meas", "FOR ALL TABLES"])
def test_init_sets_publish_via_partition_root_on_an_existing_publication(meas, target):
    meas.execute(f"CREATE PUBLICATION cdc {target}")  # partitions published as themselves
    check = meas.cdc("check")
    assert check.returncode == 4 and "lacks publish_via_partition_root" in check.stderr and "cdc init" in check.stderr
    meas.cdc("init", check=True)
    meas.cdc("init", check=True)
    assert meas.execute("SELECT pubviaroot FROM pg_publication WHERE pubname = 'cdc'")[0][0] is True
    meas.execute("INSERT INTO meas VALUES (1, '2025-03-01', 1)")
    meas.cdc("run", "--until-caught-up", check=True)
    assert meas.redis.xlen("cdc:meas") == 1


# -- the Relation rule, without servers ------------------------------------------------------------

def gate_with(bound: dict, resync: bool = False) -> TableGate:
    policy = "on_unaccountable: resync\n" if resync else ""
    ride = parse_mapping(load_yaml_documents(f"entity: ride\ntable: public.rides\nkey: [id]\n{policy}fields: {{id: id}}\n",
                                             "m.yaml")[0], {})
    gate = TableGate("s", "p", [ride])
    gate.bound = bound
    gate._index()
    return gate


@pytest.mark.parametrize("relid, name, lsn, stops", [
    (100, "rides", 5000, False),  # the table bound
    (200, "rides", 5000, True),  # the name, another table: re-created
    (200, "rides", 999, False),  # ... in a transaction before the binding: history a rebuild covers
    (100, "rides_old", 5000, True),  # the table bound, under another name: renamed
    (300, "other", 5000, False),  # not mapped
])
def test_a_relation_message_is_checked_against_the_tables_bound(relid, name, lsn, stops):
    gate = gate_with({("public", "rides"): Bound(100, Lsn(1000), (100,))})
    if stops:
        with pytest.raises(SlotError):
            gate.relation(relid, "public", name, lsn)
    else:
        gate.relation(relid, "public", name, lsn)


@pytest.mark.parametrize("relid, name, lsn, resyncs", [
    (100, "rides", 5000, False),  # the table bound
    (200, "rides", 5000, True),  # the name, another table: re-created
    (200, "rides", 999, False),  # ... in a transaction before the binding: history a rebuild covers
    (100, "rides_old", 5000, True),  # the table bound, under another name: renamed
    (100, "rides_old", 999, False),  # ... before the binding
    (300, "other", 5000, False),  # not mapped
])
def test_a_relation_message_of_a_resync_table_starts_its_resync_instead_of_stopping(relid, name, lsn, resyncs):
    gate = gate_with({("public", "rides"): Bound(100, Lsn(1000), (100,))}, resync=True)
    assert gate.relation(relid, "public", name, lsn) is resyncs
    assert bool(gate.resyncing) is resyncs
    if resyncs:
        record = gate.resyncing[("public", "rides")]
        assert record["state"] == "waiting", record
        assert ("renamed or moved: the stream names it public.rides_old" if name == "rides_old" else
                "dropped and re-created (OID 100, now 200)") in record["cause"], record
        # described again before its marker: still left out, and not broken twice
        assert gate.relation(relid, "public", name, lsn + 10) is True
        assert gate.resyncing[("public", "rides")] is record


def test_bound_tables_round_trip_through_their_record():
    bound = Bound(16400, Lsn(123456), (16401, 16402))
    assert Bound.decode(bound.encode()) == bound
    assert Bound.decode(Bound(5, Lsn(0), ()).encode()) == Bound(5, Lsn(0), ())


# -- the publication's publish option ----------------------------------------------------------------

ALTER = re.compile(r"ALTER PUBLICATION \S+ SET \(publish = '[^']*'\)")


def publishes(env) -> tuple:
    return env.execute("SELECT pubinsert, pubupdate, pubdelete, pubtruncate FROM pg_publication WHERE pubname = 'cdc'")[0]


def test_publish_losing_update_and_delete_while_running_stops_the_bridge_until_init_and_recover(rides):
    proc, before = running_with_one_ride(rides)
    rides.execute("ALTER PUBLICATION cdc SET (publish = 'insert')")
    rides.execute("INSERT INTO rides (id, rider_id, distance_m) VALUES (2, 1, 2), (3, 1, 3)")
    rides.execute("UPDATE rides SET distance_m = 50 WHERE id = 1; DELETE FROM rides WHERE id = 2")
    assert proc.wait(30) == 4
    line = error_line(proc.log_path.read_text())
    assert "publication 'cdc' does not publish update, delete" in line and "entity ride" in line, line
    assert ("run: cdc init (or ALTER PUBLICATION cdc SET (publish = 'insert, update, delete, truncate')), "
            "then cdc recover") in line, line
    assert rides.confirmed_flush() <= before, "the slot moved past the point where the flags went off"
    assert {e["op"] for e in read_stream(rides.redis, "cdc:ride")} <= {"c"}

    check = rides.cdc("check")
    assert check.returncode == 4 and "does not publish update, delete" in check.stderr, check.stderr
    assert "ALTER PUBLICATION cdc SET (publish = 'insert, update, delete, truncate')" in check.stderr
    assert "cdc recover" in check.stderr

    # the fix, as the message says: cdc init ...
    init = rides.cdc("init", check=True)
    assert "publication cdc now publishes update, delete" in init.stdout, init.stdout
    assert publishes(rides) == (True, True, True, True)
    # ... then cdc recover: the update and delete made meanwhile were never decoded, no restart brings them back
    result = rides.cdc("run", "--until-caught-up")
    assert result.returncode == 4, result.stderr
    line = error_line(result.stderr)
    assert "lacked update, delete" in line and "run: cdc recover" in line, line
    assert rides.confirmed_flush() <= before
    check = rides.cdc("check")
    assert check.returncode == 4 and "lacked update, delete" in check.stderr, check.stderr

    rides.cdc("recover", check=True)
    rides.execute("UPDATE rides SET distance_m = 60 WHERE id = 3; INSERT INTO rides (id, rider_id, distance_m) "
                  "VALUES (4, 2, 4); DELETE FROM rides WHERE id = 1")
    rides.cdc("run", "--until-caught-up", check=True)
    assert replayed(rides.redis, "cdc:ride") == rides_now(rides)
    assert set(rides_now(rides)) == {(("id", 3),), (("id", 4),)}
    assert rides.cdc("check").returncode == 0


def test_publish_losing_truncate_while_running_stops_the_bridge_and_its_alter_repairs_it(rides):
    proc, before = running_with_one_ride(rides)
    rides.execute("ALTER PUBLICATION cdc SET (publish = 'insert, update, delete')")
    rides.execute("TRUNCATE rides")
    rides.execute("INSERT INTO rides (id, rider_id, distance_m) VALUES (2, 1, 2)")
    assert proc.wait(30) == 4
    line = error_line(proc.log_path.read_text())
    assert "publication 'cdc' does not publish truncate" in line and "(ops t)" in line, line
    assert rides.confirmed_flush() <= before
    assert "t" not in {e["op"] for e in read_stream(rides.redis, "cdc:ride")}

    # the ALTER the message names instead of cdc init, then cdc recover, then cdc run
    rides.execute(ALTER.search(line).group(0))
    assert publishes(rides) == (True, True, True, True)
    rides.cdc("recover", check=True)
    rides.cdc("run", "--until-caught-up", check=True)
    assert replayed(rides.redis, "cdc:ride") == rides_now(rides) == {(("id", 2),): {"id": 2, "distance": "2.000", "rider": 1}}


def test_publish_via_partition_root_turned_off_while_running_stops_the_bridge_until_init_and_recover(meas):
    # without a column list (PostgreSQL 15 and later refuse to turn it off while a partitioned table has one)
    meas.execute("CREATE PUBLICATION cdc FOR ALL TABLES WITH (publish_via_partition_root = true)")
    meas.cdc("init", check=True)
    proc = meas.start_bridge()
    meas.execute("INSERT INTO meas VALUES (1, '2025-03-01', 1)")
    wait_for(lambda: meas.redis.xlen("cdc:meas") == 1, 30, "the first change")
    before = meas.current_wal()
    meas.execute("ALTER PUBLICATION cdc SET (publish_via_partition_root = false)")
    meas.execute("INSERT INTO meas VALUES (2, '2026-03-01', 2); UPDATE meas SET v = 10 WHERE id = 1")
    assert proc.wait(30) == 4
    line = error_line(proc.log_path.read_text())
    assert "partitioned table public.meas is not published under its own name" in line, line
    assert "lacks publish_via_partition_root" in line and "cdc init, then cdc recover" in line, line
    assert meas.confirmed_flush() <= before
    assert meas.redis.xlen("cdc:meas") == 1, "its partitions' changes are no entity's"

    meas.cdc("init", check=True)
    assert meas.execute("SELECT pubviaroot FROM pg_publication WHERE pubname = 'cdc'")[0][0] is True
    # its changes while it was off came as those of the partitions: only a rebuild brings them
    result = meas.cdc("run", "--until-caught-up")
    assert result.returncode == 4 and "lacked publish_via_partition_root" in error_line(result.stderr), result.stderr
    meas.cdc("recover", check=True)
    meas.cdc("run", "--until-caught-up", check=True)
    assert replayed(meas.redis, "cdc:meas") == meas_now(meas)
    assert meas.cdc("check").returncode == 0


def random_writes(env, rng: random.Random, count: int) -> None:
    """`count` seeded transactions of inserts, updates, deletes and (rarely) a truncate of rides."""
    for _ in range(count):
        ids = [i for (i,) in env.execute("SELECT id FROM rides")]
        statements = []
        for _ in range(rng.randint(1, 3)):
            roll = rng.random()
            if roll < 0.05:
                statements.append("TRUNCATE rides")
                ids = []
            elif roll < 0.45 or not ids:
                new = rng.randint(1, 10_000)
                statements.append(f"INSERT INTO rides (id, rider_id, distance_m) VALUES ({new}, {rng.randint(1, 5)}, "
                                  f"{rng.randint(1, 999)}) ON CONFLICT (id) DO UPDATE SET rider_id = excluded.rider_id")
                ids.append(new)
            elif roll < 0.8:
                statements.append(f"UPDATE rides SET distance_m = {rng.randint(1, 999)} WHERE id = {rng.choice(ids)}")
            else:
                gone = ids.pop(rng.randrange(len(ids)))
                statements.append(f"DELETE FROM rides WHERE id = {gone}")
        env.execute("BEGIN; " + "; ".join(statements) + "; COMMIT;")


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_a_random_publish_option_lacking_operations_stops_the_bridge_and_the_fix_is_exact(rides, seed):
    """Seeded writes before, while and after the publish option lacks an operation the mapping publishes: the
    bridge stops with the slot before the change, and cdc init, cdc recover, cdc run make every stream replay
    to its table."""
    rng = random.Random(seed)
    rides.write_config("batch: {status_interval_s: 0.2}\n")
    proc = rides.start_bridge()
    random_writes(rides, rng, 20)
    wait_for(lambda: rides.redis.xlen("cdc:ride") > 0 and rides.confirmed_flush() >= rides.current_wal() - 4096,
             30, "the bridge to catch up")
    before = rides.current_wal()
    kept = rng.sample(["insert", "update", "delete", "truncate"], rng.randint(0, 3))
    rides.execute(f"ALTER PUBLICATION cdc SET (publish = '{', '.join(kept)}')")
    random_writes(rides, rng, 20)
    assert proc.wait(30) == 4
    line = error_line(proc.log_path.read_text())
    missing = [op for op in ("insert", "update", "delete", "truncate") if op not in kept]
    assert f"publication 'cdc' does not publish {', '.join(missing)}" in line, line
    assert rides.confirmed_flush() <= before

    rides.cdc("init", check=True)
    random_writes(rides, rng, 10)
    result = rides.cdc("run", "--until-caught-up")
    assert result.returncode == 4 and "run: cdc recover" in error_line(result.stderr)
    rides.cdc("recover", check=True)
    random_writes(rides, rng, 10)
    rides.cdc("run", "--until-caught-up", check=True)
    assert replayed(rides.redis, "cdc:ride") == rides_now(rides)


@pytest.mark.one_path
def test_check_reports_and_init_repairs_the_publish_option_and_a_mapping_may_leave_out_truncates(env):
    env.execute(RIDES + "CREATE PUBLICATION cdc FOR TABLE rides WITH (publish = 'insert, delete');")
    env.copy_mappings("ride.yaml")
    check = env.cdc("check")
    assert check.returncode == 4
    assert "problem: publication 'cdc' does not publish update, truncate" in check.stderr, check.stderr
    assert "ALTER PUBLICATION cdc SET (publish = 'insert, update, delete, truncate')" in check.stderr
    assert "cdc recover" not in check.stderr, "no slot yet: nothing was decoded without them"
    init = env.cdc("init", check=True)
    assert "publication cdc now publishes update, truncate (publish = 'insert, update, delete, truncate')" in init.stdout
    assert publishes(env) == (True, True, True, True)
    assert "now publishes" not in env.cdc("init", check=True).stdout, "idempotent"
    assert env.cdc("check").returncode == 0

    # a mapping whose ops leave out t needs no truncates
    env.write_mapping("ride.yaml", "entity: ride\ntable: public.rides\nkey: [id]\nops: [c, u, d, r]\n"
                                   "fields: {id: id, distance: distance_m, rider: rider_id}\n")
    env.execute("ALTER PUBLICATION cdc SET (publish = 'insert, update, delete')")
    # altered by hand under the slot: the catalog keeps no trace of what it sent meanwhile, so only a rebuild vouches
    check = env.cdc("check")
    assert check.returncode == 4 and "publication 'cdc' changed since it was last read" in check.stderr, check.stderr
    env.cdc("recover", check=True)
    assert env.cdc("check").returncode == 0
    env.cdc("init", check=True)
    assert publishes(env) == (True, True, True, False), "init leaves the publish option as it is"
    env.execute("INSERT INTO rides (id, rider_id, distance_m) VALUES (1, 1, 1); TRUNCATE rides; "
                "INSERT INTO rides (id, rider_id, distance_m) VALUES (2, 1, 2)")
    env.cdc("run", "--until-caught-up", check=True)
    assert [e["op"] for e in read_stream(env.redis, "cdc:ride")] == ["x", "c", "c"]  # the marker of cdc recover
