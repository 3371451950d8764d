"""Redis ahead of the server's history is never streamed over (PostgreSQL 18, primary + standby).

The standby stops while the primary keeps committing and the bridge publishes; the primary
crashes and the stopped standby is started and promoted: its timeline branches off below what
Redis holds. The positions in (branch point, Redis' record] name, on the new primary,
transactions other than those the streams hold: the high-water marks would drop the new
primary's changes there as already written, and the streams would keep transactions the new
primary never had. The bridge, cdc init and cdc check stop (exit 6) naming the range; cdc
recover, once the server's WAL passed Redis' record, rebuilds streams that replay exactly to
the new primary's tables.
"""

from __future__ import annotations

import re

import orjson
import psycopg
import pytest

from cdc import keys
from cdc.demo.local import wait_for
from conftest import Env, read_stream
from pg_pair import PrimaryStandby, env_on, running_pair

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.pg18, pytest.mark.one_path]

RIDER_MAPPING = """
entity: rider
table: public.riders
key: [id]
fields: {id: id, name: name}
"""


@pytest.fixture
def pair(servers_root, tmp_path):
    with running_pair(servers_root, tmp_path, "div", wait_for_standby=False) as p:
        yield p


@pytest.fixture
def div_env(pair, redis_server, tmp_path):
    with env_on(pair, redis_server, tmp_path) as e:
        yield e


def _run(pair: PrimaryStandby, sql: str, params=None) -> None:
    with psycopg.connect(pair.dsn, autocommit=True) as conn:
        conn.execute(sql, params)


def _error(result) -> str:
    lines = [line for line in (result.stdout + result.stderr).splitlines() if "error:" in line or "redis holds" in line]
    return "\n".join(lines)


def _diverge(env: Env, pair: PrimaryStandby, failover: bool) -> tuple[object, int, int]:
    """Publish riders 1-20 (the standby has them), stop the standby, publish riders 21-40 and a rename of 1-5
    (the standby lacks them), crash the primary, start and promote the standby. Returns the bridge's process,
    the standby's branch point and Redis' record."""
    env.execute("CREATE TABLE riders (id int PRIMARY KEY, name text)")
    env.write_mapping("rider.yaml", RIDER_MAPPING)
    env.write_config("batch: {max_entries: 40, max_delay_ms: 5}\n", dsn=pair.dsn,
                     postgres=f", receive_timeout_s: 5, slot_check_interval_s: 1, failover_slot: {str(failover).lower()}")
    env.cdc("init", check=True)
    _run(pair, "INSERT INTO riders SELECT g, 'old' || g FROM generate_series(1, 20) g")
    proc = env.start_bridge()
    wait_for(lambda: env.redis.xlen("cdc:rider") == 20, 60, "riders 1-20 published")
    if failover:
        wait_for(lambda: pair.standby_has_synced(env.slot), 90, "the standby to hold a synced copy of the slot")
    wal = pair.primary_wal()
    wait_for(lambda: pair.standby_replayed() >= wal, 30, "the standby to replay riders 1-20")
    pair.standby.stop("fast")
    branch = pair.primary_wal()  # the standby's WAL ends at or below this
    for i in range(21, 41):
        _run(pair, "INSERT INTO riders VALUES (%s, %s)", (i, f"lost{i}"))
    _run(pair, "UPDATE riders SET name = 'renamed' || id WHERE id <= 5")
    wait_for(lambda: env.redis.xlen("cdc:rider") == 45, 60, "the last transactions published")
    held = int(env.redis.get(keys.flushed_key(env.slot)))
    assert held > branch
    pair.primary.stop("immediate")
    pair.standby.start()
    pair.standby.promote()
    return proc, branch, held


def _new_primary(pair: PrimaryStandby) -> dict[int, str]:
    with psycopg.connect(pair.dsn_for(pair.standby), autocommit=True) as conn:
        return dict(conn.execute("SELECT id, name FROM riders").fetchall())


def _replay_after_marker(entries: list[dict]) -> dict[int, str]:
    table: dict[int, str] = {}
    for e in entries:
        if e["op"] == "x":
            table = {}  # a consumer resets its state at cdc recover's marker
        elif e["op"] == "d":
            table.pop(e["key"]["id"], None)
        else:
            table[e["key"]["id"]] = e["data"]["name"]
    return table


@pytest.mark.parametrize("recorded", [True, False], ids=["history-recorded", "older-deployment"])
def test_a_new_slot_on_a_promoted_standby_that_lacked_redis_positions_stops_until_recover(div_env, pair, recorded):
    """`older-deployment`: Redis has no recorded history; the slot created below Redis' record tells."""
    env = div_env
    proc, branch, held = _diverge(env, pair, failover=False)
    assert proc.wait(90) == 4, proc.log_path.read_text()[-3000:]  # the slot did not survive: missing slot
    _run(pair, "INSERT INTO riders VALUES (21, 'new21'), (22, 'new22')")  # positions Redis holds, other transactions
    _run(pair, "UPDATE riders SET name = 'new' || id WHERE id = 6")
    if not recorded:
        assert env.redis.delete(keys.source_key(env.slot)) == 1

    init = env.cdc("init")
    assert init.returncode == 6, init.stdout + init.stderr
    message = _error(init)
    print("\ncdc init:", message)
    hexed = f"{held >> 32:X}/{held & 0xFFFFFFFF:X}"
    assert re.search(rf"positions in \([0-9A-F]+/[0-9A-F]+, {hexed}\]", message), message
    if recorded:
        assert "timeline 2 branched off timeline 1" in message, message
    else:
        assert "this server's WAL is at" in message or "below the position redis holds" in message, message
    start = re.search(r"positions in \(([0-9A-F]+)/([0-9A-F]+),", message)
    switch = (int(start[1], 16) << 32) + int(start[2], 16)
    assert switch <= (branch if recorded else pair.primary_wal_of_standby()) < held
    status = orjson.loads(env.cdc("status", "--json", check=True).stdout)
    loss = status["bridge"]["data_loss"]
    assert loss["to_lsn"] == hexed and loss["message"] in message, loss

    for command in ("run", "check"):
        result = env.cdc(command, timeout=120)
        assert result.returncode == 6, (command, result.stdout + result.stderr)
        assert f", {hexed}]" in _error(result), (command, result.stdout + result.stderr)
    assert env.redis.xlen("cdc:rider") == 45  # nothing streamed

    early = env.cdc("recover")
    assert early.returncode == 75, early.stdout + early.stderr
    print("cdc recover:", early.stderr.strip())
    assert "pg_switch_wal()" in early.stderr and hexed in early.stderr, early.stderr
    assert env.redis.xlen("cdc:rider") == 45  # nothing changed
    with psycopg.connect(pair.dsn_for(pair.standby), autocommit=True) as conn:
        while int(conn.execute("SELECT pg_current_wal_lsn() - '0/0'::pg_lsn").fetchone()[0]) <= held:
            conn.execute("INSERT INTO riders VALUES (100, 'filler') ON CONFLICT (id) DO UPDATE SET name = 'filler2'")
            conn.execute("SELECT pg_switch_wal()")
    env.cdc("recover", check=True, timeout=300)
    _run(pair, "INSERT INTO riders VALUES (50, 'after')")
    _run(pair, "UPDATE riders SET name = 'after' || id WHERE id IN (21, 7)")
    _run(pair, "DELETE FROM riders WHERE id = 8")
    env.cdc("check", check=True)
    env.cdc("run", "--until-caught-up", check=True, timeout=300)

    entries = read_stream(env.redis, "cdc:rider")
    positions = [(int(e["lsn"]), int(e["seq"])) for e in entries]
    assert positions == sorted(positions) and len(set(positions)) == len(positions), positions
    marker = max(i for i, e in enumerate(entries) if e["op"] == "x")
    assert min(positions[marker:]) > max(positions[:marker])  # nothing after the marker is placed before it
    assert _replay_after_marker(entries) == _new_primary(pair)
    assert int(env.redis.get(keys.flushed_key(env.slot))) > held
    source = env.redis.hgetall(keys.source_key(env.slot))
    assert source[b"timeline"] == b"2"
    status = orjson.loads(env.cdc("status", "--json", check=True).stdout)
    assert status["bridge"].get("data_loss") is None


def test_a_synced_failover_slot_behind_redis_stops_the_bridge_instead_of_streaming(div_env, pair):
    """A failover slot without synchronized_standby_slots: the promoted standby's synced copy lies behind what
    the bridge published. The bridge follows the DSN to the new primary and stops there (exit 6)."""
    env = div_env
    proc, branch, held = _diverge(env, pair, failover=True)
    _run(pair, "INSERT INTO riders VALUES (21, 'new21')")
    assert proc.wait(90) == 6, proc.log_path.read_text()[-3000:]
    log = proc.log_path.read_text()
    hexed = f"{held >> 32:X}/{held & 0xFFFFFFFF:X}"
    (error,) = [line for line in log.splitlines() if line.startswith("cdc: error: ")]
    assert f", {hexed}]" in error and "branched off" in error and "cdc recover" in error, error
    assert env.redis.xlen("cdc:rider") == 45  # nothing of the new primary streamed over the old entries
