"""cdc schema, cdc status, and the `make run` demo."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import orjson
import pytest

from cdc.demo.local import wait_for

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
    one = orjson.loads(env.cdc("schema", "--entity", "ride", check=True).stdout)
    assert one["title"] == "ride"


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
    text = env.cdc("status", check=True).stdout
    assert f"slot {env.slot}: inactive" in text and "cdc:ride" in text and "of max_slot_wal_keep_size -1" in text


@pytest.mark.slow
def test_demo_streams_stops_cleanly_on_ctrl_c_and_runs_again(servers_root):
    root = servers_root / "demo"
    cmd = [sys.executable, "-m", "cdc.demo", "--root", str(root), "--rate", "20"]
    for _ in range(2):
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
        lines: list[str] = []

        def saw_rides() -> bool:
            line = proc.stdout.readline()
            lines.append(line)
            return line.startswith("cdc:ride ") and "op=c" in line

        wait_for(saw_rides, 90, "ride entries in the demo output", interval=0)
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=60)
        assert proc.returncode == 0, "".join(lines) + out
        assert "stopped postgres and redis" in out
        assert "Traceback" not in out
