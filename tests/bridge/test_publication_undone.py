"""A change to the publication undone before anyone reads it again: an option turned off and on again
while the bridge streams, a mapped table dropped from the publication and added again while the bridge
is stopped. The catalog then looks as before, but pgoutput skipped the changes of the window; the
catalog rows' versions (xmin, and a member's OID) tell, so `cdc run`, `cdc check` and `cdc init` stop
or record it until `cdc recover`, whose rebuild brings the streams back to the tables. Changes that
leave no window (`cdc init`'s own, an unmapped table joining) pass."""

from __future__ import annotations

import os
import signal
from contextlib import contextmanager

import pytest

from cdc.bridge.gate import PublicationRows
from cdc.demo.local import wait_for
from conftest import read_stream
from replay import replay, ride_rows

pytestmark = pytest.mark.integration

WRITES = ("UPDATE rides SET distance_m = 0.5 WHERE id <= 3; DELETE FROM rides WHERE id IN (4, 5); "
          "INSERT INTO rides (rider_id, distance_m) VALUES (1, 70)")


def error_line(text: str) -> str:
    lines = [line for line in text.splitlines() if line.startswith("cdc: error:")]
    assert len(lines) == 1 and "Traceback" not in text, text
    return lines[0]


@contextmanager
def frozen(env, proc):
    """The bridge stopped (SIGSTOP) with no query of it in flight: no reading of the catalog can see what happens
    meanwhile."""
    os.kill(proc.pid, signal.SIGSTOP)
    try:
        wait_for(lambda: env.execute("SELECT count(*) FROM pg_stat_activity WHERE backend_type = 'client backend' "
                                     "AND state = 'active' AND pid <> pg_backend_pid()")[0][0] == 0,
                 30, "the bridge's queries to end")
        yield
    finally:
        os.kill(proc.pid, signal.SIGCONT)


def recovered_to_the_table(env) -> None:
    """`cdc recover`, more writes, `cdc run`: every stream replays to its table, and cdc check passes."""
    env.cdc("recover", check=True)
    env.execute("UPDATE rides SET distance_m = 9 WHERE id = 6; INSERT INTO rides (rider_id, distance_m) VALUES (2, 80)")
    env.cdc("run", "--until-caught-up", check=True)
    assert replay(read_stream(env.redis, "cdc:ride")) == ride_rows(env)
    assert env.cdc("check").returncode == 0


def streaming_rides(env, publication: str = "") -> object:
    """rides mapped (the publication created as `publication` says, else by `cdc init`), ten rides in it."""
    env.apply_sql("10_rocket_rides.sql")
    if publication:
        env.execute(f"CREATE PUBLICATION cdc {publication} WITH (publish_via_partition_root = true)")
    env.copy_mappings("ride.yaml")
    env.cdc("init", check=True)
    env.execute("INSERT INTO riders (id, name, email) VALUES (1, 'a', 'e'), (2, 'b', 'e')")
    env.execute("INSERT INTO rides (rider_id, distance_m) SELECT 1 + g % 2, g FROM generate_series(1, 10) g")
    return env


@pytest.fixture
def rides(env):
    return streaming_rides(env)


def test_publish_turned_off_and_on_between_two_readings_stops_the_bridge_until_recover(rides):
    rides.write_config("batch: {status_interval_s: 0.2}\n")
    proc = rides.start_bridge()
    wait_for(lambda: rides.redis.xlen("cdc:ride") == 10, 30, "the first rows")
    with frozen(rides, proc):
        before = rides.current_wal()
        rides.execute("ALTER PUBLICATION cdc SET (publish = 'insert')")
        rides.execute(WRITES)  # its update and deletes are not decoded
        rides.execute("ALTER PUBLICATION cdc SET (publish = 'insert, update, delete, truncate')")
    assert proc.wait(30) == 4
    line = error_line(proc.log_path.read_text())
    assert "publication 'cdc' changed since it was last read: its pg_publication row changed" in line, line
    assert "table public.rides" in line and "run: cdc recover" in line, line
    assert rides.confirmed_flush() <= before, "the slot moved past the change"

    # recorded: a restart, cdc check and cdc init do not get past it
    for refused in (rides.cdc("run", "--until-caught-up"), rides.cdc("check")):
        assert refused.returncode == 4, refused.stderr
        assert "publication 'cdc' changed while slot" in refused.stderr and "cdc recover" in refused.stderr
    rides.cdc("init", check=True)
    assert rides.cdc("run", "--until-caught-up").returncode == 4
    recovered_to_the_table(rides)


def test_init_putting_a_table_back_before_the_running_bridge_read_it_stops_the_bridge_until_recover(rides):
    rides.write_config("batch: {status_interval_s: 0.2}\n")
    proc = rides.start_bridge()
    wait_for(lambda: rides.redis.xlen("cdc:ride") == 10, 30, "the first rows")
    with frozen(rides, proc):  # cdc init runs before the bridge's next reading
        before = rides.current_wal()
        rides.execute("ALTER PUBLICATION cdc DROP TABLE rides")
        rides.execute(WRITES)  # never decoded
        rides.cdc("init", check=True)  # puts it back, and records what it found
    rides.execute("INSERT INTO rides (rider_id, distance_m) VALUES (2, 90)")
    assert proc.wait(30) == 4, "the bridge streamed on past the changes it never received"
    line = error_line(proc.log_path.read_text())
    assert "publication 'cdc' changed while slot" in line and "run: cdc recover" in line, line
    assert rides.confirmed_flush() <= before, "the slot moved past the change"
    recovered_to_the_table(rides)


@pytest.mark.parametrize("out, back", [
    ("ALTER PUBLICATION cdc DROP TABLE rides", "ALTER PUBLICATION cdc ADD TABLE rides"),
    ("ALTER PUBLICATION cdc DROP TABLES IN SCHEMA public", "ALTER PUBLICATION cdc ADD TABLES IN SCHEMA public"),
])
def test_a_table_out_of_the_publication_and_back_while_the_bridge_is_stopped_is_refused(env, out, back):
    rides = streaming_rides(env, "FOR TABLES IN SCHEMA public" if "SCHEMA" in out else "")
    rides.cdc("run", "--until-caught-up", check=True)
    before = rides.confirmed_flush()
    rides.execute(out)
    rides.execute(WRITES)  # never decoded
    rides.execute(back)
    check = rides.cdc("check")
    assert check.returncode == 4, check.stderr
    assert "publication 'cdc' changed since it was last read: its entries for table public.rides were removed or " \
           "replaced" in check.stderr and "run: cdc recover" in check.stderr, check.stderr
    init = rides.cdc("init", check=True)  # says it, and records it: putting things back is not enough
    assert "publication 'cdc' changed while slot" in init.stdout, init.stdout
    run = rides.cdc("run", "--until-caught-up")
    assert run.returncode == 4, run.stderr
    line = error_line(run.stderr)
    assert "publication 'cdc' changed while slot" in line and "table public.rides" in line, line
    assert "run: cdc recover" in line, line
    assert rides.confirmed_flush() == before
    recovered_to_the_table(rides)


def test_init_for_new_mappings_and_an_unmapped_table_joining_leave_the_bridge_running(rides):
    rides.write_config("batch: {status_interval_s: 0.2}\n")
    proc = rides.start_bridge()
    wait_for(lambda: rides.redis.xlen("cdc:ride") == 10, 30, "the first rows")
    rides.execute("CREATE TABLE extra (id int PRIMARY KEY); ALTER PUBLICATION cdc ADD TABLE extra; "
                  "INSERT INTO extra VALUES (1)")
    # the documented way to lift a table's column list while the bridge runs: out and back in one transaction
    member = "SELECT oid FROM pg_publication_rel WHERE prrelid = 'rides'::regclass"
    was = rides.execute(member)
    rides.execute("BEGIN; ALTER PUBLICATION cdc DROP TABLE rides; ALTER PUBLICATION cdc ADD TABLE rides; COMMIT;")
    assert rides.execute(member) != was
    # a new mapping, cdc init while the old bridge runs: riders joins the publication
    rides.copy_mappings("rider.yaml")
    rides.cdc("init", check=True)
    rides.execute(WRITES)
    target = rides.current_wal()  # the slot moves there only after a reading passed, after all of it
    wait_for(lambda: rides.confirmed_flush() >= target or proc.poll() is not None, 30, "the bridge to move the slot")
    assert proc.poll() is None, proc.log_path.read_text()
    assert replay(read_stream(rides.redis, "cdc:ride")) == ride_rows(rides)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(30) == 0
    rides.cdc("run", "--until-caught-up", check=True)  # with the new mappings
    assert rides.cdc("check").returncode == 0


def test_what_counts_as_a_change_of_the_publications_rows():
    rides, riders = ("public", "rides"), ("public", "riders")
    was = PublicationRows("10:100", {rides: {"r1": "20:100", "n2": "21:100"}, riders: {"r3": "22:100"}})
    same = PublicationRows.decode(was.encode())
    assert same == was and same.changed_since(was, [rides, riders]) is None
    # the publication's own row: any change (another publication, another OID, is not this check's)
    assert "pg_publication row changed" in PublicationRows("10:105", was.tables).changed_since(was, [rides])
    assert PublicationRows("11:105", {}).changed_since(was, [rides]) is None
    # a member removed or replaced, unless it stayed covered by another row or came back in one transaction
    replaced = {rides: {"r1": "30:105", "n2": "31:106"}, riders: was.tables[riders]}
    assert "entries for table public.rides were removed" in PublicationRows("10:100", replaced).changed_since(was, [rides])
    assert PublicationRows("10:100", replaced, frozenset({"30:105", "31:106"})).changed_since(was, [rides]) is None
    assert PublicationRows("10:100", replaced, frozenset({"30:105"})).changed_since(was, [rides]) is not None
    kept = {rides: {"r1": "30:105", "n2": "21:100"}}
    assert PublicationRows("10:100", kept).changed_since(was, [rides]) is None
    # tables the mappings do not read, and rows added, do not count
    assert PublicationRows("10:100", {rides: {**was.tables[rides], "r9": "40:107"}}).changed_since(was, [rides]) is None
