"""Nightly reconciliation: the snapshot's exact position, Spark's truth, drift reports and exact resets."""

from __future__ import annotations

import random
import re
import textwrap
import threading
import time
from decimal import Decimal
from pathlib import Path

import pytest

from cdc.config import Settings
from cdc.errors import CdcError, ConfigError
from cdc.reconcile.exported_snapshot import ExportedSnapshot, import_snapshot
from cdc.demo.local import wait_for
from cdc.source.lsn import Lsn
from cdc.mapping.model import load_mappings
from cdc.reconcile.job import preflight, reconcile_spec
from cdc.reconcile.spec import load_specs, parse_spec
from cdc.sink.entry import parse_stream_id
from cdc.demo.rocketrides import ride_totals
from cdc.yamlsrc import load_yaml_documents

from conftest import read_stream
from ride_consumers import RideTraffic, Supervisor, state, truth

pytestmark = pytest.mark.integration

JAR = "/usr/share/java/postgresql.jar"


def spec_yaml(*consumers: str, partitions: int = 4) -> str:
    listed = "".join(
        f"  - name: {c}\n    entity: ride\n    handler: cdc.demo.rocketrides:ride_totals\n"
        f"    state: {{table: consumer_states, scope: {{consumer: {c}}}}}\n"
        for c in consumers
    )
    return (
        "name: totals\n"
        f"source: {{table: public.rides, partition_column: id, partitions: {partitions}, fetch_size: 500}}\n"
        "truth:\n  group_by: [rider_id]\n  overall: {rider_id: 0}\n  values: {total_distance: sum(distance_m)}\n"
        f"consumers:\n{listed}"
    )


def setup(env, *consumers: str, riders: int = 20) -> None:
    (env.tmp / "reconcile").mkdir()
    (env.tmp / "reconcile" / "totals.yaml").write_text(spec_yaml(*consumers))
    env.init_rides("ride.yaml", sql=("10_rocket_rides.sql", "20_consumer_state.sql"), riders=riders,
                   config=f"reconcile: {{specs: reconcile/, jdbc_jar: {JAR}, wait_for_bridge_s: 60, lock_timeout_s: 30}}\n")


def reconcile(env, spark, dry_run: bool = False, say=lambda line: None):
    settings = Settings.from_file(env.config_path)
    [spec] = load_specs(Path(settings.reconcile.specs))
    targets = preflight(settings, load_mappings(settings.mappings), spec)
    return reconcile_spec(settings, spec, targets, spark, dry_run=dry_run, say=say)


def rows(env, table: str, order: str) -> list[tuple]:
    return env.execute(f"SELECT * FROM {table} ORDER BY {order}")


def checkpoints(env) -> list[tuple]:
    return env.execute("SELECT consumer, stream, entry_id, lsn, seq FROM cdc_checkpoints ORDER BY 1, 2")


def insert_rides(env, n: int, seed: int) -> None:
    rng = random.Random(seed)
    with env.connect() as conn, conn.transaction():
        for _ in range(n):
            conn.execute("INSERT INTO rides (rider_id, distance_m) VALUES (%s, %s)",
                         (rng.randint(1, 20), Decimal(rng.randint(1, 10**7)) / 1000))
        conn.execute("UPDATE rides SET distance_m = distance_m + 1.25, rider_id = 5 WHERE id IN (SELECT id FROM rides ORDER BY id LIMIT 3)")
        conn.execute("DELETE FROM rides WHERE id IN (SELECT id FROM rides ORDER BY id DESC LIMIT 2)")


def exact_consumer(env, rides: int, seed: int):
    """The bridge and a ride-totals consumer, once it holds the exact totals of `rides` new rides."""
    setup(env, "ride-totals")
    bridge = env.start_bridge()
    consumers = Supervisor(env, "ride-totals", 1, {})
    consumers.start()
    try:
        insert_rides(env, rides, seed=seed)
        wait_for(lambda: state(env, "ride-totals") == truth(env), 60, "the consumer to reach the totals")
    except BaseException:
        consumers.stop()
        bridge.kill()
        bridge.wait(30)
        raise
    return bridge, consumers


def reset_directly(env, streams: list[str], position: int, holds: dict[str, str], truth_at: dict):
    """The ride-totals consumer's reset against a hand-made truth, as the job runs it (no Spark)."""
    from cdc.reconcile.reset import reset_consumer

    [spec] = load_specs(env.tmp / "reconcile")
    with env.connect() as conn:
        return reset_consumer(conn, env.redis, spec, spec.consumers[0], streams, position, holds, truth_at, ride_totals)


def caught_up(env, group: str) -> bool:
    """The group has every entry of cdc:ride delivered and acknowledged."""
    info = env.redis.xinfo_stream("cdc:ride")
    [g] = [g for g in env.redis.xinfo_groups("cdc:ride") if g["name"].decode() == group]
    return g["last-delivered-id"] == info["last-generated-id"] and g["pending"] == 0


@pytest.fixture(scope="module")
def spark():
    from cdc.reconcile.truth import start_spark

    session = start_spark("local[2]", JAR, "1g")
    yield session
    session.stop()


# -- the spec ---------------------------------------------------------------------------


def test_spec_errors_name_the_line():
    def load(text: str):
        [doc] = load_yaml_documents(text, "totals.yaml")
        return parse_spec(doc, "totals.yaml")

    good = spec_yaml("ride-totals")
    assert load(good).key_columns == ("rider_id",)
    with pytest.raises(ConfigError, match=r"totals.yaml:6: value total_distance: expected sum\(column\)"):
        load(good.replace("sum(distance_m)", "avg(distance_m)"))
    with pytest.raises(ConfigError, match=r"totals.yaml:2: .*partition_column"):
        load(good.replace("partition_column: id, ", ""))
    with pytest.raises(ConfigError, match=r"totals.yaml:\d+: unknown key 'tabel' in state"):
        load(good.replace("{table: consumer_states", "{tabel: consumer_states"))
    with pytest.raises(ConfigError, match=r"totals.yaml:\d+: handler must be module:function"):
        load(good.replace("cdc.demo.rocketrides:ride_totals", "ride_totals"))
    with pytest.raises(ConfigError, match=r"overall must give a value for each group_by column"):
        load(good.replace("overall: {rider_id: 0}", "overall: {rider: 0}"))


def test_the_truth_spills_to_disk_and_reads_back_exactly():
    from cdc.reconcile.truth import Truth

    rows = [((i, f"k{i}"), (Decimal(i) / 1000, i % 7 or None)) for i in range(Truth.CHUNK * 2 + 17)]
    with Truth() as truth:
        for key, values in rows[:-5]:
            truth.add(key, values)
        assert truth._chunk == rows[Truth.CHUNK * 2:-5]  # only the last partial chunk is in memory
        assert list(truth.items()) == rows[:-5]
        partial = truth.items()
        next(partial)  # a reader stopped early does not disturb what is added next
        for key, values in rows[-5:]:
            truth.add(key, values)
        assert list(truth.items()) == rows and len(truth) == len(rows)


def test_unconstrained_numeric_needs_a_declared_scale():
    from cdc.reconcile.truth import NUMERIC_OID, source_query

    [doc] = load_yaml_documents(spec_yaml("c").replace("total_distance: sum(distance_m)", "total_distance: sum(amount)"), "s.yaml")
    spec = parse_spec(doc, "s.yaml")
    types = {"rider_id": (20, None, None), "amount": (NUMERIC_OID, None, None), "id": (20, None, None)}
    with pytest.raises(ConfigError, match=r"s.yaml:6: amount is numeric without a precision"):
        source_query(spec, types)
    [doc] = load_yaml_documents(spec_yaml("c").replace(
        "total_distance: sum(distance_m)", "total_distance: {of: sum(amount), decimal: [38, 6]}"), "s.yaml")
    sql = source_query(parse_spec(doc, "s.yaml"), types)
    assert '"amount"::numeric(38,6) AS "amount"' in sql
    assert "pg_current_snapshot()" in sql


# -- the position -----------------------------------------------------------------------


def test_the_snapshot_position_splits_transactions_exactly(env):
    """Rides the snapshot sees are exactly those whose create entry has lsn < position."""
    setup(env, "ride-totals")
    bridge = env.start_bridge()
    traffic = RideTraffic(env.dsn, pause_s=0)
    traffic.start()
    try:
        wait_for(lambda: traffic.transactions > 100, 30, "rides to be written")
        with ExportedSnapshot(env.dsn) as snap, env.connect() as conn:
            import_snapshot(conn, snap.name)
            seen = {i for (i,) in conn.execute("SELECT id FROM rides")}
            conn.execute("COMMIT")
            position = snap.position
        written = traffic.transactions
        wait_for(lambda: traffic.transactions > written + 100, 30, "more rides after the snapshot")
    finally:
        traffic.stop()
    end = env.current_wal()
    wait_for(lambda: env.confirmed_flush() >= end, 30, "the bridge to publish everything")
    bridge.terminate()
    bridge.wait(30)
    entries = read_stream(env.redis, "cdc:ride")
    created_before = {e["key"]["id"] for e in entries if e["op"] == "c" and int(e["lsn"]) < position}
    created_after = {e["key"]["id"] for e in entries if e["op"] == "c" and int(e["lsn"]) >= position}
    deleted_before = {e["key"]["id"] for e in entries if e["op"] == "d" and int(e["lsn"]) < position}
    assert created_before and created_after, "the writer must commit on both sides of the position"
    assert seen == created_before - deleted_before
    assert not seen & created_after


# -- drift and resets -------------------------------------------------------------------


def test_injected_drift_is_reported_then_repaired_exactly_and_a_second_run_changes_nothing(env, spark):
    bridge, consumers = exact_consumer(env, rides=300, seed=1)
    try:

        # drift 1: corrupted totals (one wrong, one row lost)
        env.execute("UPDATE consumer_states SET total_distance = total_distance + 5 WHERE consumer = 'ride-totals' AND rider_id = 3")
        env.execute("DELETE FROM consumer_states WHERE consumer = 'ride-totals' AND rider_id = 4")
        # drift 2: stream entries deleted before the consumer read them
        consumers.stop()
        last = env.redis.xinfo_stream("cdc:ride")["last-generated-id"].decode()
        env.execute("INSERT INTO rides (rider_id, distance_m) VALUES (7, 100.5), (7, 200.25)")
        wait_for(lambda: len(env.redis.xrange("cdc:ride", "(" + last, "+")) == 2, 30, "the two rides in the stream")
        deleted = [i for i, _ in env.redis.xrange("cdc:ride", "(" + last, "+")]
        env.redis.xdel("cdc:ride", *deleted)

        expected = truth(env)
        states_before, checkpoints_before = rows(env, "consumer_states", "1, 2"), checkpoints(env)
        result = reconcile(env, spark, dry_run=True)
        [outcome] = result.outcomes
        assert outcome.status == "drift" and not result.exact
        found = {(d.key, d.column): (d.expected, d.actual) for d in outcome.drift.drifted}
        assert found == {
            ((3,), "total_distance"): (expected[3], expected[3] + 5),
            ((4,), "total_distance"): (expected[4], Decimal(0)),
            ((7,), "total_distance"): (expected[7], expected[7] - Decimal("300.75")),
            ((0,), "total_distance"): (expected[0], expected[0] - Decimal("300.75")),  # the overall row: only the lost entries
        }
        assert outcome.drift.only_truth == 1 and outcome.drift.only_truth_totals["total_distance"] == expected[4]
        assert result.source_rows == env.execute("SELECT count(*) FROM rides")[0][0]
        assert rows(env, "consumer_states", "1, 2") == states_before, "a dry run changes nothing"
        assert checkpoints(env) == checkpoints_before
        assert env.execute("SELECT status, keys_drifted, dry_run FROM cdc_reconcile_runs") == [("drift", 4, True)]
        assert env.execute("SELECT count(*) FROM cdc_drift")[0][0] == 4

        result = reconcile(env, spark)
        assert [o.status for o in result.outcomes] == ["repaired"] and result.exact
        assert state(env, "ride-totals") == truth(env)
        # the reset counts what lies before its snapshot as delivered to the group, the deleted rides included
        [group] = env.redis.xinfo_groups("cdc:ride")
        past_the_hole = group["last-delivered-id"].decode()
        assert parse_stream_id(past_the_hole) >= max(parse_stream_id(i) for i in deleted)

        # the consumer goes on from the reset: exact after more changes
        consumers = Supervisor(env, "ride-totals", 1, {})
        consumers.start()
        insert_rides(env, 100, seed=2)
        wait_for(lambda: state(env, "ride-totals") == truth(env), 60, "the consumer to stay exact after the reset")

        # drift 3: the checkpoint is dropped and the group rewound, so everything since the reset is applied twice
        # (rewound no further: a group rewound across the deleted rides stops there, as nothing is skipped silently)
        consumers.stop()
        env.execute("DELETE FROM cdc_checkpoints WHERE consumer = 'ride-totals'")
        env.redis.xgroup_setid("cdc:ride", "ride-totals", past_the_hole)
        consumers = Supervisor(env, "ride-totals", 1, {})
        consumers.start()
        wait_for(lambda: caught_up(env, "ride-totals"), 60, "the rewound consumer to re-read everything")
        assert state(env, "ride-totals") != truth(env)
        result = reconcile(env, spark)
        assert [o.status for o in result.outcomes] == ["repaired"]
        assert state(env, "ride-totals") == truth(env)

        # idempotent: a second run finds nothing and changes nothing
        states_before, checkpoints_before = rows(env, "consumer_states", "1, 2"), checkpoints(env)
        result = reconcile(env, spark)
        assert [o.status for o in result.outcomes] == ["clean"] and result.exact
        assert rows(env, "consumer_states", "1, 2") == states_before
        assert checkpoints(env) == checkpoints_before
    finally:
        consumers.stop()
        bridge.terminate()
        bridge.wait(30)


@pytest.mark.slow
def test_resets_are_exact_while_rides_keep_changing_and_faults_stay_on(env, spark):
    """One consumer stopped behind the snapshot, one running ahead of it through kills and crashes;
    a writer changes rides during the whole job; both end exactly at the ground truth."""
    setup(env, "totals-a", "totals-b")
    bridge = env.start_bridge(env={"CDC_FAULT_DOUBLE_SEND": "0.1"})
    faults = {"CDC_FAULT_CRASH_BEFORE_COMMIT": "0.1"}
    a, b = Supervisor(env, "totals-a", 1, faults), Supervisor(env, "totals-b", 2, faults)
    supervisors = [a, b]
    for s in supervisors:
        s.start()
    traffic = RideTraffic(env.dsn, pause_s=0.01)
    traffic.start()
    killing = threading.Event()
    rng = random.Random(3)

    def kill_b() -> None:
        while not killing.wait(rng.uniform(1.0, 2.5)):
            b.kill_one(rng)

    positions: list[Lsn] = []

    def say(line: str) -> None:
        """Called by the job as it goes: once the truth is read, let totals-b get past the snapshot."""
        if m := re.search(r"at position (\S+)", line):
            positions.append(Lsn.parse(m.group(1)))
        if re.search(r": read \d+ rows", line):
            wait_for(lambda: env.execute("SELECT min(lsn) FROM cdc_checkpoints WHERE consumer = 'totals-b'")[0][0]
                     >= positions[0], 60, "totals-b to apply entries after the snapshot")

    killer = threading.Thread(target=kill_b, daemon=True)
    try:
        wait_for(lambda: len(state(env, "totals-a")) > 5 and len(state(env, "totals-b")) > 5, 60, "both consumers to start")
        env.execute("UPDATE consumer_states SET total_distance = total_distance * 2 WHERE rider_id IN (1, 2)")
        a.stop()  # totals-a is behind the snapshot when the reset comes
        killer.start()
        result = reconcile(env, spark, say=say)
        killing.set()
        killer.join()
        outcomes = {o.consumer: o for o in result.outcomes}
        assert {c: o.status for c, o in outcomes.items()} == {"totals-a": "repaired", "totals-b": "repaired"}
        assert all(p.behind for p in outcomes["totals-a"].streams) and outcomes["totals-a"].caught_up > 0
        assert not any(p.behind for p in outcomes["totals-b"].streams) and outcomes["totals-b"].replayed > 0
        a = Supervisor(env, "totals-a", 1, faults)
        supervisors.append(a)
        a.start()
        written = traffic.transactions
        wait_for(lambda: traffic.transactions > written + 100, 60, "the writer to go on after the job")
        while b.kills < 2:  # whatever the job's speed, totals-b is killed at least twice
            b.kill_one(rng)
            time.sleep(0.5)
        traffic.stop()
        expected = truth(env)
        for group in ("totals-a", "totals-b"):
            wait_for(lambda: state(env, group) == expected, 120, f"{group} to reach the ground truth")
    finally:
        killing.set()
        traffic.stopped.set()
        for s in supervisors:
            s.stop()
        bridge.terminate()
        bridge.wait(30)
    assert b.kills >= 2 and 86 in a.exits + b.exits, "kills and crashes before commit happened"


def test_a_reset_catches_up_a_stream_behind_and_replays_one_ahead(env):
    """Per stream, with P = 250: one stream's consumer is behind P (an entry pending, one undelivered),
    the other's is past it (with a double-sent entry). The reset measures the state at P, repairs it,
    and the consumer carries on to the exact final total."""
    from cdc.consume.checkpoint import TransactionalHandler
    from cdc.sink.entry import parse_entry
    setup(env, "ride-totals")
    r = env.redis

    def add(stream: str, lsn: int, distance: int) -> str:
        return r.xadd(stream, {"op": "c", "lsn": str(lsn), "seq": "0", "key": "{}",
                               "data": f'{{"rider": 1, "distance": "{distance}"}}'}).decode()

    behind, ahead = "cdc:t:0", "cdc:t:1"
    for stream in (behind, ahead):
        r.xgroup_create(stream, "ride-totals", id="0", mkstream=True)
    handler = TransactionalHandler(env.dsn, "ride-totals", ride_totals)

    def consume(stream: str, count: int) -> None:
        """Like a consumer: its pending entries first, then new ones; apply, then acknowledge."""
        raw = [e for start in ("0", ">") for _, entries in r.xreadgroup("ride-totals", "c1", {stream: start}, count=count)
               for e in entries]
        handler([parse_entry(stream, i, f) for i, f in raw])
        r.xack(stream, "ride-totals", *[i for i, _ in raw])

    try:
        add(behind, 100, 1)
        consume(behind, 1)                   # applied: 1
        add(behind, 200, 2)
        r.xreadgroup("ride-totals", "c1", {behind: ">"}, count=1)  # delivered, never applied: pending
        add(behind, 300, 4)                  # after P, not delivered
        hold = add(ahead, 150, 10)
        add(ahead, 260, 20)
        add(ahead, 260, 20)                  # the same change sent twice
        consume(ahead, 3)                    # applied: 10 + 20 (the copy skipped)
        add(ahead, 270, 40)                  # after P, not delivered
        env.execute("UPDATE consumer_states SET total_distance = total_distance + 5 WHERE rider_id = 1")  # drift
        truth_at_p = {(1,): (Decimal(13),), (0,): (Decimal(13),)}  # 1 + 2 + 10: every change before P
        outcome = reset_directly(env, [behind, ahead], 250, {behind: "0-0", ahead: hold}, truth_at_p)
        plans = {p.stream: p for p in outcome.streams}
        assert [e.lsn for e in plans[behind].catch_up] == [200] and plans[behind].behind
        assert [e.lsn for e in plans[ahead].replay] == [260] and not plans[ahead].behind
        found = {d.key: (d.expected, d.actual) for d in outcome.drift.drifted}
        assert found == {(1,): (Decimal(33), Decimal(38))}, "measured at P: 13 + 20 replayed, against 31 + 5 + 2 caught up"
        assert outcome.status == "repaired"
        assert state(env, "ride-totals") == {0: Decimal(33), 1: Decimal(33)}
        assert env.execute("SELECT stream, lsn, seq FROM cdc_checkpoints ORDER BY stream") == [
            (behind, 250, -1), (ahead, 260, 0)]
        consume(behind, 10)                  # the pending 200 is skipped, 300 applied
        consume(ahead, 10)                   # 270 applied
        assert state(env, "ride-totals") == {0: Decimal(77), 1: Decimal(77)}  # 1 + 2 + 4 + 10 + 20 + 40
        assert handler.skipped == 2, "the copy of 260, and 200, which the reset had caught up"
    finally:
        handler.close()


def test_an_older_reset_never_overwrites_a_newer_one(env):
    setup(env, "ride-totals")
    env.execute("INSERT INTO cdc_checkpoints (consumer, stream, entry_id, lsn, seq) VALUES ('ride-totals', 'cdc:ride', '1-0', 500, 0)")
    newer = reset_directly(env, ["cdc:ride"], 2000, {}, {(0,): (Decimal(7),), (1,): (Decimal(7),)})
    assert newer.status == "repaired"
    older = reset_directly(env, ["cdc:ride"], 1000, {}, {(0,): (Decimal(1),)})
    assert older.status == "stale"
    assert state(env, "ride-totals") == {0: Decimal(7), 1: Decimal(7)}
    assert env.execute("SELECT lsn, seq FROM cdc_checkpoints WHERE consumer = 'ride-totals'") == [(2000, -1)]


def test_entries_deleted_after_the_snapshot_refuse_an_inexact_reset(env):
    setup(env, "ride-totals")
    env.redis.xadd("cdc:ride", {"op": "c", "lsn": "5000", "seq": "0", "key": '{"id": 1}', "data": '{"id": 1, "rider": 1, "distance": "2"}'}, id="1-1")
    env.redis.xadd("cdc:ride", {"op": "c", "lsn": "5001", "seq": "0", "key": '{"id": 2}', "data": '{"id": 2, "rider": 1, "distance": "3"}'}, id="2-1")
    env.redis.xdel("cdc:ride", "2-1")
    env.execute("INSERT INTO cdc_checkpoints (consumer, stream, entry_id, lsn, seq) VALUES ('ride-totals', 'cdc:ride', '2-1', 5001, 0)")
    outcome = reset_directly(env, ["cdc:ride"], 4000, {"cdc:ride": "0-0"}, {(0,): (Decimal(1),)})
    assert outcome.status == "failed" and "deleted" in outcome.reason


# -- Spark's read -----------------------------------------------------------------------


def test_every_partition_must_read_the_snapshot(env, spark, monkeypatch):
    """Without the snapshot import, partitions read "now": the job notices and refuses."""
    import cdc.reconcile.truth

    setup(env, "ride-totals")
    insert_rides(env, 200, seed=4)
    [spec] = load_specs(env.tmp / "reconcile")
    with ExportedSnapshot(env.dsn) as snap, env.connect() as ref:
        reference = import_snapshot(ref, snap.name)
        types = cdc.reconcile.truth.describe_source(ref, spec)
        bounds = cdc.reconcile.truth.partition_bounds(ref, spec)
        ref.execute("COMMIT")
        env.execute("INSERT INTO rides (rider_id, distance_m) VALUES (1, 1)")  # after the snapshot
        with cdc.reconcile.truth.compute_truth(spark, spec, env.dsn, snap.name, reference, bounds, types) as truth_at:
            assert truth_at.partitions == 4
            assert truth_at.source_rows == env.execute("SELECT count(*) FROM rides")[0][0] - 1
        monkeypatch.setattr(cdc.reconcile.truth, "session_init_statement", lambda name: "SELECT 1")
        with pytest.raises(CdcError, match="did not all read snapshot"):
            cdc.reconcile.truth.compute_truth(spark, spec, env.dsn, snap.name, reference, bounds, types)


def truth_now(env, spark, spec):
    """compute_truth over a fresh exported snapshot, as the job does (close what it returns)."""
    import cdc.reconcile.truth

    with ExportedSnapshot(env.dsn) as snap, env.connect() as ref:
        reference = import_snapshot(ref, snap.name)
        types = cdc.reconcile.truth.describe_source(ref, spec)
        bounds = cdc.reconcile.truth.partition_bounds(ref, spec)
        ref.execute("COMMIT")
        return cdc.reconcile.truth.compute_truth(spark, spec, env.dsn, snap.name, reference, bounds, types)


def test_a_query_source_and_min_max_count(env, spark):
    env.execute("CREATE TABLE ledger (id bigint PRIMARY KEY, account int NOT NULL, amount numeric(12, 2) NOT NULL, "
                "kind text NOT NULL, secret text)")
    env.execute("INSERT INTO ledger SELECT g, g % 4, g * 1.25, CASE WHEN g % 3 = 0 THEN 'fee' ELSE 'sale' END, 'x' "
                "FROM generate_series(1, 1000) g")
    text = textwrap.dedent("""\
        name: sales
        source:
          query: SELECT id, account AS acct, amount FROM ledger WHERE kind = 'sale'
          partition_column: id
          partitions: 3
        truth:
          group_by: [acct]
          values: {total: sum(amount), smallest: min(amount), largest: max(amount), n: count(*)}
        consumers: [{name: x, entity: e, handler: 'm:f', state: {table: t}}]
    """)
    spec = parse_spec(load_yaml_documents(text, "sales.yaml")[0], "sales.yaml")
    want = {(acct,): (total, lo, hi, n) for acct, total, lo, hi, n in env.execute(
        "SELECT account, sum(amount), min(amount), max(amount), count(*) FROM ledger WHERE kind = 'sale' GROUP BY account")}
    with truth_now(env, spark, spec) as got:
        assert dict(got.items()) == want and got.partitions == 3
        assert got.source_rows == sum(n for *_, n in want.values())
    clash = parse_spec(load_yaml_documents(text.replace("group_by: [acct]", "group_by: [acct]\n  overall: {acct: 2}"),
                                           "sales.yaml")[0], "sales.yaml")
    with pytest.raises(ConfigError, match=r"sales.yaml:1: the overall key \{'acct': 2\} is also a key of the source"):
        truth_now(env, spark, clash)


@pytest.mark.parametrize("column", ["booked_on", "booked_at", "booked_local"])
def test_a_read_splits_on_a_date_or_timestamp_and_reads_every_row_once(env, spark, column):
    env.execute("CREATE TABLE ledger (id bigint PRIMARY KEY, account int NOT NULL, amount numeric(12, 2) NOT NULL, "
                "booked_on date, booked_at timestamptz, booked_local timestamp, ratio float8)")
    env.execute("INSERT INTO ledger SELECT g, g % 5, g * 0.25, date '2026-01-01' + g % 300, "
                "timestamptz '2026-01-01 00:00:00+05' + g * interval '17 minutes 3.5 seconds', "
                "timestamp '2026-03-01' + g * interval '1 hour', g / 7.0 FROM generate_series(1, 4000) g")
    env.execute(f"UPDATE ledger SET {column} = NULL WHERE id % 97 = 0")  # the first range takes the NULLs
    text = (f"name: ledger\nsource: {{table: ledger, partition_column: {column}, partitions: 4}}\n"
            "truth:\n  group_by: [account]\n  values: {total: sum(amount), n: count(*)}\n"
            "consumers: [{name: x, entity: e, handler: 'm:f', state: {table: t}}]\n")
    spec = parse_spec(load_yaml_documents(text, "ledger.yaml")[0], "ledger.yaml")
    want = {(acct,): (total, n) for acct, total, n in env.execute(
        "SELECT account, sum(amount), count(*) FROM ledger GROUP BY account")}
    with truth_now(env, spark, spec) as got:
        assert got.partitions == 4 and dict(got.items()) == want and got.source_rows == 4000
    floats = parse_spec(load_yaml_documents(text.replace(column, "ratio"), "ledger.yaml")[0], "ledger.yaml")
    with pytest.raises(ConfigError, match="ledger.yaml:2: partition_column ratio must be an integer, date or timestamp"):
        truth_now(env, spark, floats)


def test_numeric_values_stay_exact(env, spark):
    env.execute("CREATE TABLE ledger (id bigint PRIMARY KEY, account int NOT NULL, amount numeric NOT NULL, "
                "fee numeric(30, 12) NOT NULL)")
    env.execute("INSERT INTO ledger SELECT g, g % 3, 12345678901234567890.123456 + g, 0.000000000001 * g FROM generate_series(1, 3000) g")
    text = (
        "name: ledger\nsource: {table: ledger, partition_column: id, partitions: 3}\n"
        "truth:\n  group_by: [account]\n  values:\n    total: {of: sum(amount), decimal: [38, 6]}\n"
        "    fees: sum(fee)\n    biggest: max(amount)\n    n: count(*)\n"
        "consumers: [{name: x, entity: e, handler: 'm:f', state: {table: t}}]\n"
    )
    [doc] = load_yaml_documents(text, "ledger.yaml")
    spec = parse_spec(doc, "ledger.yaml")
    undeclared = parse_spec(load_yaml_documents(text.replace("{of: sum(amount), decimal: [38, 6]}", "sum(amount)"),
                                                "ledger.yaml")[0], "ledger.yaml")
    with pytest.raises(ConfigError, match=r"ledger.yaml:6: amount is numeric without a precision"):
        truth_now(env, spark, undeclared)
    with truth_now(env, spark, spec) as got:
        got_rows = dict(got.items())
    want = {(acct,): (total, fees, biggest, n) for acct, total, fees, biggest, n in env.execute(
        "SELECT account, sum(amount), sum(fee), max(amount), count(*) FROM ledger GROUP BY account")}
    assert got_rows == want
    env.execute("UPDATE ledger SET amount = amount + 0.0000001 WHERE id = 17")  # needs a 7th decimal place
    with pytest.raises(CdcError, match="values of amount need a larger scale"):
        truth_now(env, spark, spec)


def test_an_unreachable_source_is_one_clear_error(env, spark):
    import cdc.reconcile.truth
    from cdc.demo.local import free_port

    setup(env, "ride-totals")
    [spec] = load_specs(env.tmp / "reconcile")
    types = {"rider_id": (20, None, None), "distance_m": (1700, 12, 3), "id": (20, None, None)}
    dsn = f"postgresql://postgres@127.0.0.1:{free_port()}/postgres"
    with pytest.raises(CdcError) as caught:
        cdc.reconcile.truth.compute_truth(spark, spec, dsn, "00000003-00000002-1", "1:1:", (1, 10), types)
    message = str(caught.value)
    assert message.startswith("the Spark read failed:") and "connect" in message and "check the host" in message
    assert "\n" not in message and "at org." not in message


def test_a_consumer_that_cannot_apply_an_entry_is_reported_and_left_alone(env):
    setup(env, "ride-totals")
    env.redis.xadd("cdc:ride", {"op": "u", "lsn": "5000", "seq": "0", "key": '{"id": 1}', "data": '{"id": 1, "rider": 1, "distance": "2"}'})
    env.execute("INSERT INTO cdc_checkpoints (consumer, stream, entry_id, lsn, seq) VALUES ('ride-totals', 'cdc:ride', '1-0', 5000, 0)")
    env.execute("INSERT INTO consumer_states VALUES ('ride-totals', 0, 42)")
    outcome = reset_directly(env, ["cdc:ride"], 4000, {"cdc:ride": "0-0"}, {(0,): (Decimal(1),)})
    assert outcome.status == "failed" and "without a before-image" in outcome.reason
    assert env.execute("SELECT rider_id, total_distance FROM consumer_states") == [(0, 42)]


# -- the command ------------------------------------------------------------------------


def textfile(path) -> dict:
    """The samples of a textfile-collector file: (name, labels) -> value."""
    from prometheus_client.parser import text_string_to_metric_families

    return {(s.name, frozenset(s.labels.items())): s.value
            for f in text_string_to_metric_families(path.read_text()) for s in f.samples}


def test_cdc_reconcile_reports_repairs_and_exits_by_outcome(env):
    bridge, consumers = exact_consumer(env, rides=50, seed=5)
    try:
        env.execute("UPDATE consumer_states SET total_distance = total_distance - 1 WHERE consumer = 'ride-totals' AND rider_id = 2")
        report = env.tmp / "report.json"
        prom = env.tmp / "cdc.prom"
        scratch = env.tmp / "scratch"
        scratch.mkdir()
        dry = env.cdc("reconcile", "--dry-run", "--master", "local[1]", "--report", str(report), "--metrics-file", str(prom),
                      timeout=300, env={"TMPDIR": str(scratch)})
        assert dry.returncode == 7, dry.stderr
        assert not list(scratch.glob("cdc-spark-conf-*"))  # Spark's log settings go with the process
        assert "NOT repaired (dry run)" in dry.stdout
        assert "rider_id" in dry.stdout and "difference" in dry.stdout
        assert "reading" in dry.stderr and "snapshot" in dry.stderr
        # off a terminal: one progress line per change, a fixed total, the Spark start in the summary's total
        reading = [line for line in dry.stderr.splitlines() if ": reading: " in line]
        assert reading and len({re.search(r"/(\d+) partitions", line).group(1) for line in reading}) == 1
        assert len(reading) == len(set(reading)) and " 0 partitions/s" not in dry.stderr
        summary = re.search(r"Spark start ([\d.]+)s, read ([\d.]+)s, total ([\d.]+)s", dry.stdout)
        assert summary and float(summary[3]) >= float(summary[1]) + float(summary[2]) - 0.1 and float(summary[1]) > 0
        assert "consumer paused" in dry.stdout and "while its checkpoints were locked" in dry.stdout
        import orjson

        [doc] = orjson.loads(report.read_bytes())
        assert doc["consumers"][0]["status"] == "drift"
        assert {tuple(d["key"].values()) for d in doc["consumers"][0]["drift"]} == {(2,)}
        assert all(Decimal(d["difference"]) == 1 for d in doc["consumers"][0]["drift"])
        who = {"spec": "totals", "consumer": "ride-totals"}
        dry_metrics = textfile(prom)
        assert dry_metrics[("cdc_reconcile_status", frozenset({**who, "status": "drift"}.items()))] == 1
        assert dry_metrics[("cdc_reconcile_status", frozenset({**who, "status": "repaired"}.items()))] == 0
        assert dry_metrics[("cdc_reconcile_keys_drifted", frozenset(who.items()))] == 1
        assert dry_metrics[("cdc_reconcile_dry_run", frozenset({"spec": "totals"}.items()))] == 1
        ran_at = dry_metrics[("cdc_reconcile_last_run_timestamp_seconds", frozenset({"spec": "totals"}.items()))]
        assert time.time() - 300 < ran_at <= time.time()
        fixed = env.cdc("reconcile", "--json", "--metrics-file", str(prom), timeout=300)
        assert fixed.returncode == 0, fixed.stderr
        assert orjson.loads(fixed.stdout)[0]["consumers"][0]["status"] == "repaired"
        fixed_metrics = textfile(prom)
        assert fixed_metrics[("cdc_reconcile_status", frozenset({**who, "status": "repaired"}.items()))] == 1
        assert fixed_metrics[("cdc_reconcile_dry_run", frozenset({"spec": "totals"}.items()))] == 0
        assert fixed_metrics[("cdc_reconcile_last_run_timestamp_seconds", frozenset({"spec": "totals"}.items()))] >= ran_at
        assert [p.name for p in prom.parent.iterdir() if p.name.startswith("cdc.prom")] == ["cdc.prom"]  # no leftover
        assert state(env, "ride-totals") == truth(env)
        assert "Traceback" not in dry.stderr + fixed.stderr
        status = env.cdc("status", check=True).stdout
        # spec, consumer, status, finished at, keys compared, keys drifted
        row = next(line.split() for line in status.splitlines() if line.split()[:2] == ["totals", "ride-totals"])
        assert row[2] == "repaired" and row[4].isdigit() and row[5] == "1"
    finally:
        consumers.stop()
        bridge.terminate()
        bridge.wait(30)


def test_cdc_reconcile_explains_a_missing_driver_and_a_bad_spec(env):
    setup(env, "ride-totals")
    result = env.cdc("reconcile", env={"CDC_RECONCILE_JDBC_JAR": "/nonexistent/postgresql.jar"})
    assert result.returncode == 2
    assert "libpostgresql-jdbc-java" in result.stderr and "Traceback" not in result.stderr
    spec = env.tmp / "reconcile" / "totals.yaml"
    env.execute("DROP TABLE cdc_drift")
    result = env.cdc("reconcile")
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert f"{spec}:8: consumer ride-totals's state database has no table cdc_drift" in result.stderr
    assert "run what cdc sql --file 20_consumer_state.sql prints there" in result.stderr
    assert "starting Spark" not in result.stderr  # found before the slow start
    env.apply_sql("20_consumer_state.sql")
    spec.write_text(spec.read_text().replace("sum(distance_m)", "median(distance_m)"))
    result = env.cdc("reconcile")
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert f"{spec}:6: value total_distance: expected sum(column)" in result.stderr
