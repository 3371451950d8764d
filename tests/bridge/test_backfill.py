"""Initial snapshot and online backfill through watermarks: consistent with the stream,
resumable after kill -9, never a stale snapshot row after a newer change."""

from __future__ import annotations

import random
import signal
import threading
import time
from decimal import Decimal

import psycopg
import pytest

from cdc.demo.local import wait_for
from conftest import read_stream
from replay import replay, ride_rows

pytestmark = pytest.mark.integration

RIDE = "entity: ride\ntable: public.rides\nkey: [id]\nfields: {id: id, distance: distance_m, rider: rider_id}\n"


class Writer(threading.Thread):
    def __init__(self, dsn: str, seconds: float) -> None:
        super().__init__(daemon=True)
        self.dsn, self.seconds, self.error = dsn, seconds, None

    def run(self) -> None:
        rng = random.Random(3)
        try:
            with psycopg.connect(self.dsn, autocommit=True) as conn:
                deadline = time.monotonic() + self.seconds
                while time.monotonic() < deadline:
                    roll, rid = rng.random(), rng.randint(1, 6000)
                    if roll < 0.4:
                        conn.execute("UPDATE rides SET distance_m = distance_m + 1 WHERE id = %s", (rid,))
                    elif roll < 0.55:
                        conn.execute("DELETE FROM rides WHERE id = %s", (rid,))
                    else:
                        conn.execute("INSERT INTO rides (rider_id, distance_m) VALUES (1, %s)", (Decimal(rng.randint(1, 999)),))
                    time.sleep(0.002)  # pacing: the writer runs during the whole snapshot
        except BaseException as exc:
            self.error = exc


def setup(env, extra: str = "", rows: int = 5000, chunk: int = 300) -> None:
    env.apply_sql("10_rocket_rides.sql")
    env.execute("INSERT INTO riders (id, name, email) VALUES (1, 'a', 'b')")
    env.execute(f"INSERT INTO rides (rider_id, distance_m) SELECT 1, g / 10.0 FROM generate_series(1, {rows}) g")
    env.write_mapping("ride.yaml", RIDE + extra)
    env.write_config(f"batch: {{backfill_chunk_rows: {chunk}}}\n")


def rows_done(env) -> int:
    return env.execute("SELECT rows_done FROM cdc_backfills ORDER BY id LIMIT 1")[0][0]


def backfill_done(env) -> bool:
    return env.execute("SELECT bool_and(status = 'done') FROM cdc_backfills")[0][0]


def test_initial_snapshot_with_concurrent_writes_reproduces_the_table(env):
    setup(env, "snapshot: initial\n")
    out = env.cdc("init", check=True).stdout
    assert "initial snapshot of ride queued" in out
    writer = Writer(env.dsn, 4)
    writer.start()
    proc = env.start_bridge()
    watched = env.cdc("backfill", "--watch", timeout=120)  # the initial snapshot's progress, until read
    assert watched.returncode == 0
    if "no snapshot or backfill in progress" not in watched.stdout:  # it may be over already
        assert "backfill 1 of ride: " in watched.stderr and "backfill 1: done" in watched.stdout
    writer.join()
    assert writer.error is None, writer.error
    wait_for(lambda: backfill_done(env), 60, "the snapshot to be read")
    assert proc.poll() is None
    target = env.current_wal()
    wait_for(lambda: env.confirmed_flush() >= target, 60, "the bridge to catch up")
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(30) == 0
    entries = read_stream(env.redis, "cdc:ride")
    reads = [e for e in entries if e["op"] == "r"]
    assert len(reads) >= 4000  # rows inserted meanwhile may be read too; rows deleted before their chunk are not
    assert len({e["key"]["id"] for e in reads}) == len(reads), "each row read once"
    assert replay(entries, strict_reads=True) == ride_rows(env)


def test_backfill_resumes_after_kill_9_without_duplicates(env):
    setup(env, rows=60000, chunk=200)
    env.cdc("init", check=True)
    out = env.cdc("backfill", "--entity", "ride", "--where", "id <= 40000", check=True).stdout
    assert "queued" in out
    rng = random.Random(9)
    progress = []
    for _ in range(4):
        proc = env.start_bridge()
        # a crash instant during the backfill: after this bridge wrote a random number of chunks (not
        # after a time, which a loaded machine can spend starting up), within a chunk's round trip
        target = (progress[-1] if progress else 0) + rng.randint(1, 20) * 200
        wait_for(lambda: rows_done(env) >= target, 60, f"the bridge to read the backfill up to row {target}")
        time.sleep(rng.uniform(0, 0.05))
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        env.wait_slot_inactive()
        progress.append(rows_done(env))
    assert 0 < progress[0] < progress[-1] < 40000, f"every kill interrupts the backfill: {progress}"
    proc = env.start_bridge()
    wait_for(env.slot_active, 30, "the last bridge to attach")
    wait_for(lambda: backfill_done(env), 60, "the backfill to finish")
    target = env.current_wal()
    wait_for(lambda: env.confirmed_flush() >= target, 60, "the bridge to catch up")
    reads = [e["key"]["id"] for e in read_stream(env.redis, "cdc:ride") if e["op"] == "r"]
    assert sorted(reads) == list(range(1, 40001)), "every row of the filtered part exactly once"
    status = env.execute("SELECT status, rows_done, rows_total, chunks FROM cdc_backfills")
    assert status == [("done", 40000, 40000, 201)]
    text = env.cdc("status", check=True).stdout
    assert ["1", "ride", "id", "<=", "40000", "done", "40000", "40000"] in [line.split()[:8] for line in text.splitlines()]
    # a second, filtered backfill, followed with a progress bar until done
    waited = env.cdc("backfill", "--entity", "ride", "--where", "id <= 10", "--wait", timeout=60)
    assert waited.returncode == 0 and "backfill 2: done, 10 row(s) read" in waited.stdout
    assert "backfill 2 of ride: 10/10 rows (100%)" in waited.stderr
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(30) == 0
