"""Several bridges on one database and one Redis: each with its own slot, publication and streams.

What two configs would share (a stream, a slot name, a publication) is refused by cdc init, cdc check
and cdc run, naming the other bridge and the fix; disjoint bridges each stay exact through kill -9."""

from __future__ import annotations

import orjson
import pytest

from cdc import keys
from several_bridges import RIDER_MAPPING, assert_exact, ride_and_rider_bridges, run_two_bridges, second_env

pytestmark = [pytest.mark.integration, pytest.mark.one_path]


def _refused(e, *words: str) -> None:
    """cdc check and cdc run both refuse `e`'s config with exit 2, in one line naming `words`."""
    for args in (("check",), ("run", "--until-caught-up")):
        result = e.cdc(*args)
        assert result.returncode == 2, f"cdc {args[0]}: {result.returncode}\n{result.stdout}{result.stderr}"
        line = next(line for line in result.stderr.splitlines() if all(w in line for w in words))
        assert line.startswith("problem: " if args[0] == "check" else "cdc: error: "), line


def test_a_stream_slot_or_publication_of_another_bridge_is_refused(env, tmp_path):
    a = env.init_rides("ride.yaml")
    a.cdc("run", "--until-caught-up", check=True)
    b = second_env(env, tmp_path / "b", "b")  # its own slot and publication: accepted, and claimed
    b.write_mapping("rider.yaml", RIDER_MAPPING)
    b.write_config()
    b.cdc("init", check=True)
    assert b.cdc("check").returncode == 0
    b.cdc("run", "--until-caught-up", check=True)
    owners = {k.decode(): v.decode() for k, v in a.redis.hgetall(keys.STREAM_OWNERS).items()}
    assert owners == {"cdc:ride": a.slot, "cdc:rider": b.slot}

    # the same stream in the second config: both bridges would drop each other's entries at the mark
    b.copy_mappings("ride.yaml")
    _refused(b, "stream cdc:ride (entity ride) is written by the bridge of slot", repr(a.slot),
             f"redis-cli HDEL {keys.STREAM_OWNERS} cdc:ride")
    result = b.cdc("init")  # refused before it adds the table to its publication
    assert result.returncode == 2 and "stream cdc:ride" in result.stderr, result.stderr
    assert b.execute("SELECT count(*) FROM pg_publication_tables WHERE pubname = %s", (b.publication,)) == [(1,)]
    (b.mappings_dir / "ride.yaml").unlink()

    # another slot on the first bridge's publication
    b.slot, b.publication = f"{a.slot}_c", a.publication
    b.execute("SELECT pg_create_logical_replication_slot(%s, 'pgoutput')", (b.slot,))
    b.write_config()
    _refused(b, f"publication {a.publication!r} of database {a.dbname!r}", f"is already read by slot {a.slot!r}")

    # the first bridge's slot name with another publication
    b.slot, b.publication = a.slot, "cdc_b"
    b.write_config()
    _refused(b, f"slot {a.slot!r} is registered on this redis for publication {a.publication!r}",
             "two configs name the same postgres.slot")

    # nothing was taken from the first bridge, and its status names the other one
    a.cdc("run", "--until-caught-up", check=True)
    assert {k.decode(): v.decode() for k, v in a.redis.hgetall(keys.STREAM_OWNERS).items()} == owners
    status = orjson.loads(a.cdc("status", "--json", check=True).stdout)
    assert [(o["slot"], o["publication"], o["streams"]) for o in status["other_bridges"]] == [
        (f"{a.slot}_b", "cdc_b", ["cdc:rider"])]
    assert f"other bridges on this redis: slot {a.slot}_b (publication cdc_b, 1 stream(s))" in a.cdc("status").stdout


@pytest.mark.slow
def test_two_bridges_on_disjoint_tables_stay_exact_through_kill_9(env, tmp_path):
    a, b = ride_and_rider_bridges(env, tmp_path / "b")
    try:
        workload = run_two_bridges(a, b, rounds=16, seed=11, transactions=1500)
    finally:
        b.close()
    assert len(workload.expected["cdc:rider"]) > 10 and len(workload.expected["cdc:ride"]) > 1000
    assert_exact(env.redis, workload)
