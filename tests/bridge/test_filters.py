"""A mapping's `filter:` is exact: a consumer applying the stream holds exactly the table's rows that pass it.

With REPLICA IDENTITY FULL the bridge judges an update on its old and new rows (a row leaving the filter is
deleted, one entering it created) and a delete on its old row. A filter that updates or deletes would not let
it judge (a column the replica identity does not carry) is refused by cdc init, cdc check and cdc run with the
same line, and a replica identity changed under a running bridge stops it, slot held.
"""

from __future__ import annotations

import random
import string

import pytest

from cdc.demo.local import wait_for
from conftest import read_stream

pytestmark = pytest.mark.integration

TABLE = """
CREATE TABLE public.t (id int PRIMARY KEY, status text, v text, body text);
ALTER TABLE public.t REPLICA IDENTITY FULL;
"""

MAPPING = """\
    entity: item
    table: public.t
    key: [id]
    filter: {status: active, v: {ne: hidden}}
    fields: {id: id, status: status, v: v, body: body}
    """

STATUSES = ["active", "inactive", None]
VALUES = ["a", "b", "hidden", None]


def mirror(env, stream: str = "cdc:item") -> dict:
    """What a consumer holds after applying the stream by key; it never deletes a key it does not hold nor
    creates one it holds (nothing invented)."""
    rows: dict = {}
    for e in read_stream(env.redis, stream):
        if e["op"] == "x":  # cdc recover's marker: the rows follow
            rows.clear()
            continue
        key = e["key"]["id"]
        if e["op"] in ("c", "r"):
            assert e["op"] == "r" or key not in rows, f"create of a key already held: {e}"
            rows[key] = e["data"]
        elif e["op"] == "u":
            old = e["before"]["id"] if "before" in e else key  # no before-image: the key did not change
            assert old in rows, f"update of a key not held: {e}"
            kept = {f: rows[old][f] for f in e.get("unchanged", [])}  # fields the server did not resend
            del rows[old]
            rows[key] = {**e["data"], **kept}
        elif e["op"] == "d":
            assert key in rows, f"delete of a key not held: {e}"
            del rows[key]
        else:
            raise AssertionError(f"unexpected entry {e}")
    return rows


def filtered(env) -> dict:
    """The table's rows that pass the mapping's filter, as the mapping projects them."""
    return {r[0]: {"id": r[0], "status": r[1], "v": r[2], "body": r[3]} for r in env.execute(
        "SELECT id, status, v, body FROM t WHERE status = 'active' AND v IS DISTINCT FROM 'hidden'")}


def workload(env, rng: random.Random, steps: int) -> None:
    """Seeded random inserts, updates of the filtered columns, of others only, of the key, and deletes; some
    in one transaction, some of large values the server TOASTs (and leaves out of an update that keeps them)."""
    with env.connect() as conn:
        ids = [r[0] for r in conn.execute("SELECT id FROM t").fetchall()]
        for _ in range(steps):
            with conn.transaction():
                for _ in range(rng.choice([1, 1, 1, 3])):
                    kind = rng.random()
                    if kind < 0.3 or not ids:
                        new = max(ids, default=0) + 1 + rng.randrange(3)
                        body = "".join(rng.choice("abcdefghij0123456789") for _ in range(3000)) if rng.random() < 0.2 \
                            else f"b{new}"
                        conn.execute("INSERT INTO t VALUES (%s, %s, %s, %s)",
                                     (new, rng.choice(STATUSES), rng.choice(VALUES), body))
                        ids.append(new)
                    elif kind < 0.55:
                        conn.execute("UPDATE t SET status = %s WHERE id = %s", (rng.choice(STATUSES), rng.choice(ids)))
                    elif kind < 0.7:
                        conn.execute("UPDATE t SET v = %s WHERE id = %s", (rng.choice(VALUES), rng.choice(ids)))
                    elif kind < 0.8:
                        old = rng.choice(ids)
                        new = max(ids) + 1
                        conn.execute("UPDATE t SET id = %s, status = %s WHERE id = %s",
                                     (new, rng.choice(STATUSES + ["active"]), old))
                        ids[ids.index(old)] = new
                    elif kind < 0.88:
                        old = rng.choice(ids)
                        new = max(ids) + 1
                        conn.execute("UPDATE t SET id = %s WHERE id = %s", (new, old))
                        ids[ids.index(old)] = new
                    else:
                        old = rng.choice(ids)
                        conn.execute("DELETE FROM t WHERE id = %s", (old,))
                        ids.remove(old)


@pytest.mark.parametrize("seed", [1, 2])
def test_a_consumer_of_a_filtered_stream_holds_exactly_the_rows_that_pass(env, seed):
    env.execute(TABLE)
    env.write_mapping("item.yaml", MAPPING)
    env.cdc("init", check=True)
    rng = random.Random(seed)
    for _ in range(3):
        workload(env, rng, 60)
        env.cdc("run", "--until-caught-up", check=True)
        assert mirror(env) == filtered(env)
    ops = {e["op"] for e in read_stream(env.redis, "cdc:item")}
    assert ops == {"c", "u", "d"}


def test_an_update_leaving_the_filter_is_a_delete_and_one_entering_it_a_create(env):
    """The case that kept a row in the mirror for ever: a row deleted after it passed the filter."""
    env.execute(TABLE)
    env.write_mapping("item.yaml", MAPPING)
    env.cdc("init", check=True)
    env.execute("INSERT INTO t VALUES (5, 'active', 'e', 'b')")
    env.execute("DELETE FROM t WHERE id = 5")
    env.execute("INSERT INTO t VALUES (6, 'active', 'e', 'b')")
    env.execute("UPDATE t SET status = 'inactive' WHERE id = 6")
    env.execute("UPDATE t SET status = 'active' WHERE id = 6")
    env.execute("UPDATE t SET v = 'f' WHERE id = 6")
    env.execute("UPDATE t SET v = 'hidden' WHERE id = 6")
    env.cdc("run", "--until-caught-up", check=True)
    entries = read_stream(env.redis, "cdc:item")
    assert [(e["op"], e["key"]["id"]) for e in entries] == [
        ("c", 5), ("d", 5), ("c", 6), ("d", 6), ("c", 6), ("u", 6), ("d", 6)]
    assert entries[3]["before"]["status"] == "active" and entries[4]["data"]["status"] == "active"
    assert mirror(env) == filtered(env) == {}


REFUSED = ("mappings/item.yaml:4: entity 'item': filter on column 'status' cannot be judged on the updates and deletes "
           "of public.t: its replica identity (default: the primary key) does not carry the column, so the bridge "
           "cannot tell whether the row passed the filter before the change; run: ALTER TABLE public.t REPLICA "
           "IDENTITY FULL; or filter only on replica identity columns (id); or publish only inserts (ops: [c])")


def _nothing_created(env) -> bool:
    return env.execute("SELECT (SELECT count(*) FROM pg_publication) + (SELECT count(*) FROM pg_replication_slots "
                       "WHERE database = current_database())")[0][0] == 0


def _refused_alike(env, line: str) -> None:
    """cdc init (creating nothing), cdc check and cdc run refuse with the same line, exit 3."""
    init = env.cdc("init")
    assert init.returncode == 3 and init.stderr.strip().splitlines() == [f"cdc: error: {line}"], init.stderr
    assert _nothing_created(env)
    check = env.cdc("check")
    assert check.returncode == 3 and f"problem: {line}" in check.stderr.splitlines(), check.stderr
    run = env.cdc("run", "--until-caught-up")
    assert run.returncode == 3 and f"cdc: error: {line}" in run.stderr.splitlines(), run.stderr
    assert "Traceback" not in init.stderr + check.stderr + run.stderr


@pytest.mark.one_path
def test_a_filter_deletes_would_not_carry_is_refused_alike_by_init_check_and_run(env):
    env.execute(TABLE.replace("ALTER TABLE public.t REPLICA IDENTITY FULL;", ""))
    path = env.write_mapping("item.yaml", MAPPING)
    _refused_alike(env, REFUSED.replace("mappings/item.yaml", str(path)))


@pytest.mark.one_path
@pytest.mark.parametrize("fix", ["full", "key", "inserts"])
def test_each_fix_the_refusal_names_is_accepted(env, fix):
    env.execute(TABLE.replace("ALTER TABLE public.t REPLICA IDENTITY FULL;", ""))
    mapping = {"full": MAPPING, "key": MAPPING.replace("{status: active, v: {ne: hidden}}", "{id: {gt: 1}}"),
               "inserts": MAPPING.replace("key: [id]", "key: [id]\n    ops: [c]")}[fix]
    if fix == "full":
        env.execute("ALTER TABLE public.t REPLICA IDENTITY FULL")
    env.write_mapping("item.yaml", mapping)
    env.cdc("init", check=True)
    assert env.cdc("check").returncode == 0
    env.execute("INSERT INTO t VALUES (1, 'active', 'a', 'b'), (2, 'active', 'a', 'b'), (3, 'no', 'a', 'b')")
    env.execute("UPDATE t SET id = 4 WHERE id = 1")
    env.execute("DELETE FROM t WHERE id = 2")
    env.cdc("run", "--until-caught-up", check=True)
    ops = [(e["op"], e["key"]["id"]) for e in read_stream(env.redis, "cdc:item")]
    assert ops == {"full": [("c", 1), ("c", 2), ("u", 4), ("d", 2)],
                   "key": [("c", 2), ("c", 3), ("c", 4), ("d", 2)],
                   "inserts": [("c", 1), ("c", 2)]}[fix]


@pytest.mark.one_path
def test_a_cast_check_and_run_refuse_is_refused_by_init_before_anything_is_created(env):
    env.execute(TABLE)
    path = env.write_mapping("item.yaml", MAPPING.replace("v: v,", "v: {column: v, cast: date},"))
    _refused_alike(env, f"{path}:5: entity 'item': cast 'date' does not apply to column 'v' of type text; "
                        "use cast: string, or remove the cast")


def test_a_replica_identity_changed_under_a_running_bridge_stops_it_slot_held_and_the_fix_works(env):
    env.execute(TABLE)
    env.write_mapping("item.yaml", MAPPING)
    env.cdc("init", check=True)
    proc = env.start_bridge()
    env.execute("INSERT INTO t VALUES (1, 'active', 'a', 'b'), (2, 'active', 'a', 'b')")
    wait_for(lambda: env.redis.xlen("cdc:item") == 2, 30, "both rows")
    env.execute("ALTER TABLE t REPLICA IDENTITY DEFAULT")
    before = env.current_wal()
    env.execute("UPDATE t SET status = 'inactive' WHERE id = 1")  # its old row no longer carries status
    assert proc.wait(30) == 3
    log = proc.log_path.read_text()
    assert "filter on column 'status' cannot be judged" in log and "the replica identity changed after" in log, log
    assert "Traceback" not in log
    fix = next(line for line in log.splitlines() if line.startswith("cdc: error:")).split("; run: ", 1)[1]
    assert fix == (f"ALTER TABLE public.t REPLICA IDENTITY FULL; then, as the changes written meanwhile cannot be "
                   f"judged, SELECT pg_drop_replication_slot('{env.slot}'), cdc init and cdc recover (which rebuilds "
                   "the streams from the tables) before cdc run")
    assert env.confirmed_flush() <= before, "the slot is held before the change"
    assert env.redis.xlen("cdc:item") == 2
    # restarted, it refuses the table as it is now, before streaming
    again = env.cdc("run", "--until-caught-up")
    assert again.returncode == 3 and "filter on column 'status' cannot be judged" in again.stderr
    assert env.confirmed_flush() <= before

    # the fix, as the error says it
    env.execute("ALTER TABLE public.t REPLICA IDENTITY FULL")
    env.execute("UPDATE t SET v = 'c' WHERE id = 2")
    env.wait_slot_inactive()
    env.execute("SELECT pg_drop_replication_slot(%s)", (env.slot,))
    env.cdc("init", check=True)
    env.cdc("recover", check=True)
    env.execute("UPDATE t SET status = 'active' WHERE id = 1")
    env.execute("DELETE FROM t WHERE id = 2")
    env.cdc("run", "--until-caught-up", check=True)
    assert mirror(env) == filtered(env) == {1: {"id": 1, "status": "active", "v": "a", "body": "b"}}


@pytest.mark.one_path
def test_a_partition_whose_identity_is_not_full_is_refused_under_a_full_parent(env):
    """The server describes a partitioned table by its parent's replica identity, but each partition's own decides
    what its updates and deletes carry: the catalog names the partition to fix."""
    env.execute("""
        CREATE TABLE public.t (id int NOT NULL, status text, v text, body text, PRIMARY KEY (id)) PARTITION BY RANGE (id);
        CREATE TABLE public.t_low PARTITION OF public.t FOR VALUES FROM (0) TO (100);
        CREATE TABLE public.t_high PARTITION OF public.t FOR VALUES FROM (100) TO (200);
        ALTER TABLE public.t REPLICA IDENTITY FULL;
        ALTER TABLE public.t_low REPLICA IDENTITY FULL;
        """)
    path = env.write_mapping("item.yaml", MAPPING)
    line = (f"{path}:4: entity 'item': filter on column 'status' cannot be judged on the updates and deletes of "
            "public.t: the replica identity of its partition public.t_high (not full) does not carry the column, so "
            "the bridge cannot tell whether the row passed the filter before the change; run: ALTER TABLE "
            "public.t_high REPLICA IDENTITY FULL; or filter only on replica identity columns (id); or publish only "
            "inserts (ops: [c])")
    _refused_alike(env, line)
    env.execute("ALTER TABLE public.t_high REPLICA IDENTITY FULL")
    env.cdc("init", check=True)
    env.execute("INSERT INTO t VALUES (1, 'active', 'a', 'b'), (150, 'active', 'a', 'b')")
    env.execute("UPDATE t SET status = 'no' WHERE id = 150")
    env.execute("DELETE FROM t WHERE id = 1")
    env.execute("INSERT INTO t VALUES (2, 'active', 'a', 'b')")
    env.cdc("run", "--until-caught-up", check=True)
    assert mirror(env) == filtered(env) == {2: {"id": 2, "status": "active", "v": "a", "body": "b"}}


def test_a_row_entering_a_key_filter_without_a_value_the_server_did_not_resend_stops_the_bridge(env):
    """Without FULL an update moving the key into a key filter leaves an unchanged value stored out of line out
    of the new row: its create would lack the field, so the bridge stops, slot held, and the fix it names works."""
    env.execute(TABLE.replace("ALTER TABLE public.t REPLICA IDENTITY FULL;", ""))
    env.write_mapping("item.yaml", MAPPING.replace("{status: active, v: {ne: hidden}}", "{id: {gt: 3}}"))
    env.cdc("init", check=True)
    rng = random.Random(7)
    big = "".join(rng.choice(string.ascii_letters + string.digits) for _ in range(20000))
    env.execute("INSERT INTO t VALUES (1, 'a', 'a', %s), (5, 'a', 'a', 'b')", (big,))
    assert env.execute("SELECT pg_column_size(body) FROM t WHERE id = 1")[0][0] > 4000  # stored out of line
    env.execute("UPDATE t SET v = 'z' WHERE id = 5")
    before = env.current_wal()
    env.execute("UPDATE t SET id = 10 WHERE id = 1")  # enters the filter; body not resent
    run = env.cdc("run", "--until-caught-up")
    assert run.returncode == 3, run.stderr
    line = next(line for line in run.stderr.splitlines() if line.startswith("cdc: error:"))
    assert "an update brought a row of public.t into the filter without resending field 'body'" in line, line
    fix = line.split("; run: ", 1)[1]
    assert fix == (f"ALTER TABLE public.t REPLICA IDENTITY FULL (the old row then carries every value); then, as this "
                   f"change cannot be judged, SELECT pg_drop_replication_slot('{env.slot}'), cdc init and cdc recover "
                   "(which rebuilds the streams from the tables) before cdc run")
    assert env.confirmed_flush() <= before
    assert [(e["op"], e["key"]["id"]) for e in read_stream(env.redis, "cdc:item")] == [("c", 5), ("u", 5)]

    env.execute("ALTER TABLE public.t REPLICA IDENTITY FULL")
    env.wait_slot_inactive()
    env.execute("SELECT pg_drop_replication_slot(%s)", (env.slot,))
    env.cdc("init", check=True)
    env.cdc("recover", check=True)
    env.execute("UPDATE t SET id = 2 WHERE id = 10")  # leaves
    env.execute("UPDATE t SET id = 11 WHERE id = 2")  # enters again: the old row carries body now
    env.cdc("run", "--until-caught-up", check=True)
    assert mirror(env) == {r[0]: {"id": r[0], "status": r[1], "v": r[2], "body": r[3]}
                           for r in env.execute("SELECT id, status, v, body FROM t WHERE id > 3")}
    assert mirror(env)[11]["body"] == big


def test_a_partition_whose_identity_changes_under_a_running_bridge_stops_it_at_the_gate(env):
    """The server describes a partitioned table by its parent: the partition's own Relation before its next change
    (or the ack gate's reading of the catalog, every 0.2 s here, whichever comes first) finds it no longer FULL and
    stops the bridge, slot held before the change."""
    env.execute("""
        CREATE TABLE public.t (id int NOT NULL, status text, v text, body text, PRIMARY KEY (id)) PARTITION BY RANGE (id);
        CREATE TABLE public.t_low PARTITION OF public.t FOR VALUES FROM (0) TO (100);
        CREATE TABLE public.t_high PARTITION OF public.t FOR VALUES FROM (100) TO (200);
        ALTER TABLE public.t REPLICA IDENTITY FULL;
        ALTER TABLE public.t_low REPLICA IDENTITY FULL;
        ALTER TABLE public.t_high REPLICA IDENTITY FULL;
        """)
    env.write_mapping("item.yaml", MAPPING)
    env.write_config("batch: {status_interval_s: 0.2}\n")
    env.cdc("init", check=True)
    proc = env.start_bridge()
    env.execute("INSERT INTO t VALUES (1, 'active', 'a', 'b'), (150, 'active', 'a', 'b')")
    wait_for(lambda: env.redis.xlen("cdc:item") == 2, 30, "both rows")
    before = env.current_wal()
    env.execute("ALTER TABLE t_high REPLICA IDENTITY DEFAULT")
    env.execute("UPDATE t SET status = 'no' WHERE id = 150")
    assert proc.wait(30) == 3
    line = next(line for line in proc.log_path.read_text().splitlines() if line.startswith("cdc: error:"))
    assert "the replica identity of its partition public.t_high (not full) does not carry the column" in line, line
    assert "the replica identity changed after the mapping was accepted" in line, line
    assert f"SELECT pg_drop_replication_slot('{env.slot}'), cdc init and cdc recover" in line, line
    assert env.confirmed_flush() <= before


PARTITIONED_FULL = """
    CREATE TABLE public.t (id int NOT NULL, status text, v text, body text, PRIMARY KEY (id)) PARTITION BY RANGE (id);
    CREATE TABLE public.t_low PARTITION OF public.t FOR VALUES FROM (0) TO (100);
    CREATE TABLE public.t_high PARTITION OF public.t FOR VALUES FROM (100) TO (200);
    ALTER TABLE public.t REPLICA IDENTITY FULL;
    ALTER TABLE public.t_low REPLICA IDENTITY FULL;
    ALTER TABLE public.t_high REPLICA IDENTITY FULL;
    """


@pytest.mark.parametrize("change", ["update", "key", "delete"])
def test_a_partition_whose_identity_changes_under_a_running_bridge_stops_it_before_its_next_change(env, change):
    """The server describes a partitioned table by its parent (FULL): a partition set to DEFAULT sends updates
    without an old row and deletes whose old row holds only the key. Before the first of them, pgoutput describes
    the partition itself: the bridge stops there (not at the gate's next reading, which never comes here), no
    entry written for that change, slot held before it, and the fix the error names makes the stream exact."""
    env.execute(PARTITIONED_FULL)
    env.write_mapping("item.yaml", MAPPING)
    env.write_config("batch: {status_interval_s: 60}\n")  # no reading of the gate's while the bridge runs
    env.cdc("init", check=True)
    proc = env.start_bridge()
    env.execute("INSERT INTO t VALUES (1, 'active', 'a', 'b'), (150, 'active', 'a', 'b'), (151, 'no', 'a', 'b')")
    wait_for(lambda: env.redis.xlen("cdc:item") == 2, 30, "both rows that pass")
    env.execute("ALTER TABLE t_high REPLICA IDENTITY DEFAULT")
    before = env.current_wal()
    with env.connect() as conn, conn.transaction():
        if change == "update":  # leaves the filter: no old row, so it would be judged on the new one (no entry)
            conn.execute("UPDATE t SET status = 'no' WHERE id = 150")
            conn.execute("UPDATE t SET status = 'active' WHERE id = 151")  # enters: would be a 'u' of a key not held
        elif change == "key":  # the old row holds only the key: judged as not passing, so a create of 160
            conn.execute("UPDATE t SET id = 160 WHERE id = 150")
        else:  # the old row holds only the key: judged as not passing, the delete is lost
            conn.execute("DELETE FROM t WHERE id = 150")
    assert proc.wait(30) == 3
    log = proc.log_path.read_text()
    assert "Traceback" not in log
    line = next(line for line in log.splitlines() if line.startswith("cdc: error:"))
    assert "the replica identity of its partition public.t_high (not full) does not carry the column" in line, line
    assert "the replica identity changed after the mapping was accepted" in line, line
    assert line.split("; run: ", 1)[1] == (
        "ALTER TABLE public.t_high REPLICA IDENTITY FULL; then, as the changes written meanwhile cannot be judged, "
        f"SELECT pg_drop_replication_slot('{env.slot}'), cdc init and cdc recover (which rebuilds the streams from "
        "the tables) before cdc run")
    assert env.confirmed_flush() <= before, "the slot is held before the change"
    assert [(e["op"], e["key"]["id"]) for e in read_stream(env.redis, "cdc:item")] == [("c", 1), ("c", 150)]

    env.execute("ALTER TABLE public.t_high REPLICA IDENTITY FULL")
    env.wait_slot_inactive()
    env.execute("SELECT pg_drop_replication_slot(%s)", (env.slot,))
    env.cdc("init", check=True)
    env.cdc("recover", check=True)
    env.execute("UPDATE t SET status = 'active' WHERE id = 1")
    env.execute("UPDATE t SET status = 'active', id = 170 WHERE id = 151")
    env.execute("DELETE FROM t WHERE id = 1")
    env.cdc("run", "--until-caught-up", check=True)
    assert mirror(env) == filtered(env)


def test_a_partition_set_to_default_under_a_filter_on_the_key_keeps_streaming_exactly(env):
    """A filter its partitions' identity carries (the key) is judged on their updates without an old row, as on a
    table's own: no stop, and the stream stays exact (without before-images, which such a partition's old rows
    would not carry)."""
    env.execute(PARTITIONED_FULL)
    env.write_mapping("item.yaml", MAPPING.replace("{status: active, v: {ne: hidden}}", "{id: {gt: 120}}")
                      + "before: false\n")
    env.cdc("init", check=True)
    env.execute("INSERT INTO t VALUES (1, 'active', 'a', 'b'), (150, 'active', 'a', 'b'), (151, 'no', 'a', 'b')")
    env.cdc("run", "--until-caught-up", check=True)
    env.execute("ALTER TABLE t_high REPLICA IDENTITY DEFAULT")
    env.execute("UPDATE t SET status = 'no' WHERE id = 150")  # no old row: the key, all the filter reads, kept
    env.execute("UPDATE t SET id = 110 WHERE id = 151")  # leaves the filter: the old key carried
    env.execute("UPDATE t SET id = 160 WHERE id = 110")  # enters it
    env.execute("DELETE FROM t WHERE id = 150")
    env.cdc("run", "--until-caught-up", check=True)
    assert mirror(env) == {r[0]: {"id": r[0], "status": r[1], "v": r[2], "body": r[3]}
                           for r in env.execute("SELECT id, status, v, body FROM t WHERE id > 120")}
    assert [(e["op"], e["key"]["id"]) for e in read_stream(env.redis, "cdc:item")][2:] == [
        ("u", 150), ("d", 151), ("c", 160), ("d", 150)]


def test_a_key_a_partition_set_to_default_does_not_carry_stops_the_bridge_before_its_delete(env):
    """Without a filter too: a delete of a partition not FULL carries only its identity's columns (the others
    null), so a key beyond them would name no row. Refused at start as while running, naming the partition."""
    env.execute(PARTITIONED_FULL + "CREATE UNIQUE INDEX ON public.t (id, v);")
    env.write_mapping("item.yaml", "entity: item\ntable: public.t\nkey: [id, v]\nfields: {id: id, v: v, status: status}\n")
    env.execute("ALTER TABLE t ALTER COLUMN v SET NOT NULL")
    env.cdc("init", check=True)
    proc = env.start_bridge()
    env.execute("INSERT INTO t VALUES (1, 'active', 'a', 'b'), (150, 'active', 'a', 'b')")
    wait_for(lambda: env.redis.xlen("cdc:item") == 2, 30, "both rows")
    env.execute("ALTER TABLE t_high REPLICA IDENTITY DEFAULT")
    before = env.current_wal()
    env.execute("DELETE FROM t WHERE id = 150")  # its old row: id only, v null
    assert proc.wait(30) == 3
    line = next(line for line in proc.log_path.read_text().splitlines() if line.startswith("cdc: error:"))
    assert ("key field 'v' (column 'v') is not in the replica identity of partition public.t_high of public.t "
            "(not full), so deletes would carry no key") in line, line
    assert "the replica identity changed after the mapping was accepted" in line, line
    assert "run: ALTER TABLE public.t_high REPLICA IDENTITY FULL; then" in line, line
    assert env.confirmed_flush() <= before
    assert env.redis.xlen("cdc:item") == 2
    check = env.cdc("check")  # the table as it is now: refused alike, before streaming
    assert check.returncode == 3 and "is not in the replica identity of partition public.t_high" in check.stderr


@pytest.mark.parametrize("before", [True, False])
def test_a_before_image_a_partition_set_to_default_does_not_carry_stops_the_bridge_before_its_delete(env, before):
    """The server marks such a partition's old rows as whole rows (its parent is FULL) though they hold only the
    key: a before-image would show nulls the row never had, so `before: true` stops the bridge before the delete,
    slot held; with `before: false` it streams on, exactly."""
    env.execute(PARTITIONED_FULL)
    env.write_mapping("item.yaml", "entity: item\ntable: public.t\nkey: [id]\nfields: {id: id, v: v, status: status}\n"
                      + ("" if before else "before: false\n"))
    env.cdc("init", check=True)
    proc = env.start_bridge()
    env.execute("INSERT INTO t VALUES (1, 'active', 'a', 'b'), (150, 'active', 'a', 'b'), (151, 'x', 'a', 'b')")
    wait_for(lambda: env.redis.xlen("cdc:item") == 3, 30, "the rows")
    env.execute("ALTER TABLE t_high REPLICA IDENTITY DEFAULT")
    held = env.current_wal()
    env.execute("DELETE FROM t WHERE id = 150")  # its old row: id only, marked whole
    env.execute("UPDATE t SET id = 160 WHERE id = 151")
    if before:
        assert proc.wait(30) == 3
        line = next(line for line in proc.log_path.read_text().splitlines() if line.startswith("cdc: error:"))
        assert ("the before-image (before: true) cannot be written exactly for the updates and deletes of public.t: "
                "the replica identity of its partition public.t_high (not full) carries only (id) of the old row") in line
        assert "run: ALTER TABLE public.t_high REPLICA IDENTITY FULL; then" in line, line
        assert env.confirmed_flush() <= held
        assert env.redis.xlen("cdc:item") == 3
        return
    wait_for(lambda: env.redis.xlen("cdc:item") == 5, 30, "the delete and the update")
    proc.terminate()
    proc.wait(30)
    entries = read_stream(env.redis, "cdc:item")[3:]
    assert [(e["op"], e["key"], e.get("before")) for e in entries] == [
        ("d", {"id": 150}, None), ("u", {"id": 160}, {"id": 151})]
