"""cdc schema, cdc status, and the demo (`cdc demo`, which `make run` runs)."""

from __future__ import annotations

import signal
import subprocess
import sys

import orjson
import pytest

from cdc.demo.local import wait_for
from cdc.source.lsn import Lsn

from conftest import TEST_HASH_KEY

pytestmark = pytest.mark.integration


def test_schema_describes_each_entity_from_the_live_types(env):
    env.apply_sql("10_rocket_rides.sql")
    env.copy_mappings("ride.yaml", "rocket.yaml", "rider.yaml", "ride_event.yaml")
    result = env.cdc("schema", check=True)
    schemas = orjson.loads(result.stdout)
    assert set(schemas) == {"ride", "rocket", "rider", "ride_event"}
    ride = schemas["ride"]
    data = ride["properties"]["data"]["contentSchema"]["properties"]
    assert data["id"] == {"type": "integer"}
    assert data["distance"] == {"anyOf": [{"type": "string"}, {"type": "null"}]}  # numeric: exact string
    assert ride["properties"]["key"]["contentSchema"]["required"] == ["id"]
    assert ride["properties"]["v"] == {"const": "1"}
    rocket = schemas["rocket"]["properties"]["data"]["contentSchema"]["properties"]
    assert rocket["tags"]["anyOf"][0]["type"] == "array"
    assert rocket["source"] == {"const": "rocket-rides", "type": "string"}
    # a cast's type: epoch_ms writes a number (a fraction when the value has one), never a string
    since = schemas["rider"]["properties"]["data"]["contentSchema"]["properties"]["since"]["anyOf"][0]
    assert since["type"] == "number" and since["description"].startswith("exact")
    one = orjson.loads(env.cdc("schema", "--entity", "ride", check=True).stdout)
    assert one["title"] == "ride"
    email = schemas["rider"]["properties"]["data"]["contentSchema"]["properties"]["email"]["anyOf"][0]
    assert email["pattern"] == "^[0-9a-f]{64}$" and email["description"].startswith("HMAC-SHA256 of the source value")
    assert "cannot be reversed without the key" in email["description"] and "rotating the key changes every value" in email["description"]
    # the key is needed to load the mapping, and never shown
    missing = env.cdc("schema", env={"CDC_HASH_KEY": ""})
    assert missing.returncode == 2 and "field 'email' is hashed with hmac-sha256, and no hash key is set" in missing.stderr
    assert "CDC_HASH_KEY_FILE" in missing.stderr and missing.stderr.count("\n") == 1
    assert TEST_HASH_KEY not in result.stdout + result.stderr


def test_status_shows_slot_and_streams(env):
    env.init_rides("ride.yaml", riders=1)
    env.execute("INSERT INTO rides (rider_id, distance_m) VALUES (1, 2), (1, 3)")
    env.cdc("run", "--until-caught-up", check=True)
    status = orjson.loads(env.cdc("status", "--json", check=True).stdout)
    assert status["slot"]["name"] == env.slot and status["slot"]["active"] is False
    assert status["slot"]["wal_status"] == "reserved"
    assert status["slot"]["max_slot_wal_keep_size"] == "-1" and status["slot"]["lag_seconds"] is None  # inactive
    (stream,) = status["streams"]
    assert stream["stream"] == "cdc:ride" and stream["length"] == 2 and stream["last_seq"] == 1
    # the JSON keeps the decimal position and gives it as PostgreSQL prints it; the table shows only the latter
    assert stream["last_lsn_text"] == str(Lsn(stream["last_lsn"])) and "/" in stream["last_lsn_text"]
    text = env.cdc("status", check=True).stdout
    (row,) = [line.split() for line in text.splitlines() if line.split()[:2] == ["ride", "cdc:ride"]]
    assert stream["last_lsn_text"] in row and str(stream["last_lsn"]) not in row
    assert f"slot {env.slot}: inactive" in text and "cdc:ride" in text and "of max_slot_wal_keep_size -1" in text
    decoding = status["slot"]["decoding"]  # what the server decoded for the slot: a small transaction, neither spilled nor streamed
    assert decoding["transactions"] >= 1 and decoding["bytes"] > 0 and decoding["streaming"] is False
    assert decoding["spilled_transactions"] == decoding["streamed_transactions"] == 0
    assert f"decoded: {decoding['transactions']:,} transactions" in text
    assert "spilled to the server's disk: 0 transactions, 0.0 MiB; streamed in progress (postgres.streaming off): 0" in text


@pytest.mark.slow
def test_a_local_redis_whose_free_port_was_taken_meanwhile_starts_on_another(servers_root, monkeypatch):
    """The demo's Redis (and the tests'): a port found free can be taken before the server binds it; the
    server then exits at once, its log says why, and another free port is used. A port given is kept."""
    import socket

    from cdc.demo import local

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        real = local.free_port
        ports = iter([port])
        monkeypatch.setattr(local, "free_port", lambda: next(ports, None) or real())
        redis_server = local.LocalRedis(servers_root / "taken-redis", appendonly=False).start()
        try:
            assert redis_server.port != port and redis_server.ready()
        finally:
            redis_server.stop()
        given = local.LocalRedis(servers_root / "given-redis", port, appendonly=False)
        with pytest.raises(local.ServerExited, match="redis-server exited with 1"):
            given.start()
        assert given.port_taken()


def test_demo_streams_every_stream_refuses_a_second_run_stops_cleanly_and_runs_again(servers_root):
    root = servers_root / "demo"
    cmd = [sys.executable, "-m", "cdc", "demo", "--root", str(root), "--rate", "20"]
    cwd = servers_root  # any folder: the demo reads only the package's files
    for run in range(2):
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=cwd)
        lines: list[str] = []
        seen: set[str] = set()

        def saw(prefixes: set[str]):
            def check() -> bool:
                line = proc.stdout.readline()
                lines.append(line)
                if " op=" in line:
                    seen.add(line.split()[0].split(":p")[0])  # cdc:rocket:p0 -> cdc:rocket
                return prefixes <= seen
            return check

        wait_for(saw({"cdc:ride"}), 90, "the demo to stream", interval=0)
        streaming = len(lines)
        # every stream shows from its first new entry, within seconds (rockets: ~10% of transactions)
        wait_for(saw({"cdc:ride", "cdc:rider", "cdc:ride_event", "cdc:rocket"}), 20, "an entry of every stream", interval=0)
        assert any(line.startswith("cdc:ride ") and " op=c key={\"id\":" in line for line in lines[streaming - 1:])
        if run == 0:
            config = (root / "cdc.yaml").read_text()
            # a second run while this one runs: refused in one line, and this one is untouched
            second = subprocess.run(cmd, capture_output=True, text=True, cwd=cwd, timeout=60)
            assert second.returncode == 1
            assert second.stdout == "" and second.stderr.count("\n") == 1
            assert second.stderr.startswith(f"cdc: error: cdc demo is already running with {root} (pid {proc.pid})")
            assert (root / "cdc.yaml").read_text() == config
            seen.clear()
            wait_for(saw({"cdc:ride"}), 20, "the first run to stream on", interval=0)
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=60)
        assert proc.returncode == 0, "".join(lines) + out
        assert "stopped postgres and redis" in out
        assert "Traceback" not in "".join(lines) + out
        # one server and no standby: whether a failover would keep the slot is no warning for the demo
        assert "failover" not in "".join(lines) + out and " WARNING " not in "".join(lines) + out


@pytest.mark.slow
def test_the_demo_config_reconciles_and_reports_a_consumer_that_never_ran(servers_root):
    root = servers_root / "demo-reconcile"
    cwd = servers_root
    proc = subprocess.Popen([sys.executable, "-m", "cdc", "demo", "--root", str(root), "--rate", "20"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=cwd)
    lines: list[str] = []
    try:
        def streaming() -> bool:
            lines.append(proc.stdout.readline())
            return lines[-1].startswith("cdc:ride ")

        wait_for(streaming, 90, "the demo to stream", interval=0)
        assert any("cdc reconcile --config" in line and "--dry-run" in line for line in lines)
        result = subprocess.run([sys.executable, "-m", "cdc", "--log-format", "text", "reconcile", "--config",
                                 str(root / "cdc.yaml"), "--dry-run", "--master", "local[1]"],
                                capture_output=True, text=True, cwd=cwd, timeout=300)
        assert result.returncode == 0, result.stderr
        assert "ride-totals: never consumed: no checkpoint in cdc_checkpoints" in result.stdout
        assert "drifted" not in result.stdout and "Traceback" not in result.stderr
    finally:
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, "".join(lines) + out


def test_status_masks_a_secret_in_a_recorded_error(env):
    """An error recorded by another program (a failed backfill's) is shown with its secrets masked."""
    env.init_rides("ride.yaml")
    env.cdc("run", "--until-caught-up", check=True)
    from cdc.bridge.backfill import ensure_table

    with env.connect() as conn:
        ensure_table(conn)
        conn.execute("INSERT INTO cdc_backfills (slot, entity, status, error) VALUES (%s, 'ride', 'failed', %s)",
                     (env.slot, "could not connect to postgresql://app:Hunter2Secret@db/app token=Tok3nValue"))
    for args in (("status",), ("status", "--json")):
        result = env.cdc(*args)
        assert "postgresql://app:***@db/app" in result.stdout and "token=***" in result.stdout, result.stdout
        assert "Hunter2Secret" not in result.stdout + result.stderr and "Tok3nValue" not in result.stdout + result.stderr
