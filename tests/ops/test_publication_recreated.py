"""A publication dropped and re-created by hand while the slot still had changes to decode: the changes
written while it did not exist were never published (PostgreSQL 18 skips them silently; 15 to 17 cannot
decode them, on every restart). The bridge knows the publication by its OID, says what happened and the
way out (the slot dropped, `cdc init`, `cdc recover`), and following it literally leads back to an exact
stream, on both server versions."""

from __future__ import annotations

import pytest

from conftest import read_stream
from replay import replay, ride_rows

pytestmark = pytest.mark.integration


def test_a_publication_recreated_by_hand_names_the_way_out_and_it_works(env):
    env.init_rides("ride.yaml", riders=2)
    env.execute("INSERT INTO rides (rider_id, distance_m) SELECT 1 + g % 2, g FROM generate_series(1, 20) g")
    env.cdc("run", "--until-caught-up", check=True)

    env.execute(f"DROP PUBLICATION {env.publication}")
    env.execute("UPDATE rides SET distance_m = 0.5 WHERE id <= 3")  # written while no publication existed
    env.execute(f"CREATE PUBLICATION {env.publication} FOR TABLE rides")  # re-created by hand
    env.execute("INSERT INTO rides (rider_id, distance_m) VALUES (1, 7)")

    run = env.cdc("run", "--until-caught-up")
    assert run.returncode == 4, run.stderr
    line = run.stderr.strip().splitlines()[-1]
    assert f"publication '{env.publication}' was dropped and re-created (OID " in line, line
    assert f"SELECT pg_drop_replication_slot('{env.slot}')" in line and "cdc init" in line and "cdc recover" in line
    assert "Traceback" not in run.stderr
    check = env.cdc("check")
    assert check.returncode == 4 and f"publication '{env.publication}' was dropped and re-created" in check.stderr
    assert env.cdc("init").returncode == 0  # init alone changes nothing: the message does not say it would
    assert env.cdc("run", "--until-caught-up").returncode == 4

    # the way out, literally
    env.execute(f"SELECT pg_drop_replication_slot('{env.slot}')")
    assert env.cdc("init").returncode == 0
    recovered = env.cdc("recover")
    assert recovered.returncode == 0, recovered.stderr
    env.execute("UPDATE rides SET distance_m = 9 WHERE id = 20")
    env.cdc("run", "--until-caught-up", check=True)
    assert replay(read_stream(env.redis, "cdc:ride")) == ride_rows(env)
