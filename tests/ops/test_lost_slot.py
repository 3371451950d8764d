"""A lost slot is never streamed from as if nothing happened: the errors say what was lost and give
`cdc init` then `cdc recover`; `cdc init` records the gap; the README's recovery, followed literally
with `snapshot: initial` mappings, puts each row once after the marker."""

from __future__ import annotations

from collections import Counter

import pytest

from cdc.source.lsn import Lsn
from conftest import read_stream
from replay import replay, ride_rows

pytestmark = pytest.mark.integration

RIDE = ("entity: ride\ntable: public.rides\nkey: [id]\nsnapshot: initial\n"
        "fields: {id: id, distance: distance_m, rider: rider_id}\n")


def after_marker(entries: list[dict]) -> list[dict]:
    markers = [i for i, e in enumerate(entries) if e["op"] == "x"]
    assert len(markers) == 1, markers
    return entries[markers[0] + 1:]


def test_the_readme_recovery_of_a_lost_slot_puts_each_row_once_after_the_marker(env):
    env.apply_sql("10_rocket_rides.sql")
    env.execute("INSERT INTO riders (id, name, email) VALUES (1, 'a', 'b'), (2, 'c', 'd')")
    env.execute("INSERT INTO rides (rider_id, distance_m) SELECT 1 + g % 2, g FROM generate_series(1, 100) g")
    env.write_mapping("ride.yaml", RIDE)
    env.write_config("batch: {backfill_chunk_rows: 30}\n")
    env.cdc("init", check=True)  # queues the initial snapshot
    env.execute("UPDATE rides SET distance_m = 1.5 WHERE id <= 5")
    env.cdc("run", "--until-caught-up", check=True)
    held = Lsn(int(env.redis.get(f"cdc:bridge:{env.slot}:flushed")))  # how far redis holds the source

    env.execute("SELECT pg_drop_replication_slot(%s)", (env.slot,))  # a failover without a failover slot
    env.execute("DELETE FROM rides WHERE id % 10 = 0")
    env.execute("UPDATE rides SET distance_m = 0.5 WHERE id % 10 = 1")
    env.execute("INSERT INTO rides (rider_id, distance_m) VALUES (1, 3), (2, 4)")

    fix = ("run cdc init, then cdc recover before cdc run (the streams then replay to the tables' current state; "
           "the individual changes in between cannot be restored); cdc init alone would stream on past the gap")
    lost = (f"cdc: error: replication slot '{env.slot}' does not exist, and redis holds the source up to {held}: "
            "every change committed since was lost to the slot (dropped, invalidated, or not carried over a failover); "
            + fix)
    run = env.cdc("run", "--until-caught-up")
    assert run.returncode == 4 and run.stderr.strip().endswith(lost), run.stderr
    check = env.cdc("check")
    assert check.returncode == 4 and "problem: " + lost[len("cdc: error: "):] in check.stderr, check.stderr
    status = env.cdc("status")
    assert status.returncode == 4 and status.stdout.startswith("slot: MISSING: ") and status.stderr.strip() == lost

    init = env.cdc("init", check=True).stdout  # README: cdc init, then cdc recover
    assert f"but redis holds the source up to {held} only: every change committed in ({held}, " in init
    assert "was lost to the slot; run cdc recover before cdc run" in init
    assert "initial snapshot of ride queued (backfill 2)" in init
    run = env.cdc("run", "--until-caught-up")  # the gap is recorded: nothing streams past it
    assert run.returncode == 6 and f"slot '{env.slot}' was created at " in run.stderr, run.stderr
    assert "run cdc recover (the bridge stopped), then cdc run" in run.stderr
    status = env.cdc("status")
    assert status.returncode == 0 and "REDIS DATA LOSS detected at " in status.stdout
    assert env.cdc("check").returncode == 6

    recovered = env.cdc("recover")
    assert recovered.returncode == 0, recovered.stderr
    assert "backfill 2 of ride: superseded (the rebuild holds every row)" in recovered.stdout
    env.execute("UPDATE rides SET distance_m = 2.5 WHERE id = 3")
    env.execute("INSERT INTO rides (rider_id, distance_m) VALUES (2, 9)")
    env.cdc("run", "--until-caught-up", check=True)

    entries = read_stream(env.redis, "cdc:ride")
    tail = after_marker(entries)
    snapshot_rows = Counter(e["key"]["id"] for e in tail if e["op"] == "r")
    assert len(snapshot_rows) == 92 and set(snapshot_rows.values()) == {1}, "each row once after the marker"
    assert [e["op"] for e in tail[92:]] == ["u", "c"]
    assert replay(tail) == replay(entries) == ride_rows(env)
    statuses = env.execute("SELECT id, status, error FROM cdc_backfills ORDER BY id")
    assert statuses[0][:2] == (1, "done") and statuses[1][:2] == (2, "superseded")
    assert statuses[1][2].startswith("superseded by cdc recover at ")
    assert env.cdc("status").returncode == 0
