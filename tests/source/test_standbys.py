"""Which servers are read as standbys, and how one standby's copy of the slot is judged (pure)."""

from __future__ import annotations

from psycopg import conninfo

from cdc.source.lsn import Lsn
from cdc.source.standbys import PrimarySlot, StandbyCopy, judge_copy, standby_targets

DSN = ("host=db-a,db-b,db-c port=5432,5433,5434 dbname=app user=cdc_bridge password=Sekr1t "
       "target_session_attrs=read-write connect_timeout=30")


def test_the_dsn_hosts_other_than_the_primary_are_the_standbys_with_its_credentials():
    targets = standby_targets(DSN, "", "db-b", "5433")
    assert [t.label for t in targets] == ["db-a:5432", "db-c:5434"]
    params = conninfo.conninfo_to_dict(targets[0].dsn)
    assert params["host"] == "db-a" and params["port"] == "5432" and params["dbname"] == "app"
    assert params["password"] == "Sekr1t" and "target_session_attrs" not in params
    assert params["connect_timeout"] == "5"  # a standby that does not answer is unknown soon
    assert all("Sekr1t" not in t.label for t in targets)


def test_postgres_standbys_names_them_instead_and_overrides_keywords():
    targets = standby_targets(DSN, "host=replica-1,replica-2 port=6432 sslmode=require", "db-a", "5432")
    assert [t.label for t in targets] == ["replica-1:6432", "replica-2:6432"]
    params = conninfo.conninfo_to_dict(targets[1].dsn)
    assert params["sslmode"] == "require" and params["user"] == "cdc_bridge"


def test_a_single_host_dsn_names_no_standby():
    assert standby_targets("host=db-a dbname=app", "", "db-a", "5432") == []


PRIMARY = PrimarySlot(Lsn(0x3000000), "754")
GOOD = StandbyCopy("db-b:5432", server_version=180000, received=Lsn(0x5000000), exists=True, synced=True,
                   confirmed_flush=Lsn(0x3800000), restart_lsn=Lsn(0x3000000), catalog_xmin="754",
                   sync_replication_slots="on", hot_standby_feedback="on", primary_slot_name="standby1")


def _judge(copy: StandbyCopy, redis_holds: int | None = 0x4000000):
    return judge_copy(copy, "cdc", PRIMARY, None if redis_holds is None else Lsn(redis_holds))


def test_a_persisted_copy_with_what_redis_holds_is_ready():
    assert _judge(GOOD) == (None, None)


def test_a_temporary_copy_is_never_ready_and_says_what_it_waits_for():
    from dataclasses import replace

    problem, unknown = _judge(replace(GOOD, temporary=True, catalog_xmin="794"))
    assert unknown is None and "temporary copy" in problem and "794" in problem and "754" in problem


def test_each_way_a_failover_would_lose_is_a_problem():
    from dataclasses import replace

    cases = {
        "holds no copy": replace(GOOD, exists=False, sync_replication_slots="off"),
        "invalidated": replace(GOOD, invalidation="rows_removed"),
        "not a synced copy": replace(GOOD, synced=False),
        "bytes short of what Redis holds": replace(GOOD, received=Lsn(0x3F00000)),
        "past what Redis holds": replace(GOOD, confirmed_flush=Lsn(0x4100000)),
        "not a standby": replace(GOOD, in_recovery=False),
        "keeps no copies": replace(GOOD, server_version=160000),
        "not streaming WAL": replace(GOOD, received=None),
    }
    for words, copy in cases.items():
        problem, unknown = _judge(copy)
        assert problem is not None and words in problem and unknown is None, (words, problem)
    problem, _ = _judge(cases["holds no copy"])
    assert "sync_replication_slots = on" in problem


def test_a_standby_that_cannot_be_read_is_unknown_never_ready():
    problem, unknown = _judge(StandbyCopy("db-b:5432", error="connection refused"))
    assert problem is None and "unknown" in unknown and "db-b:5432" in unknown


def test_a_standby_short_of_redis_by_keepalive_positions_only_is_ready_when_the_primary_waits_for_it():
    from dataclasses import replace

    short = replace(GOOD, received=Lsn(0x3F00000))
    assert _judge(short)[0] is not None
    assert judge_copy(short, "cdc", PRIMARY, Lsn(0x4000000), primary_waits=True) == (None, None)
