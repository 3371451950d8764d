"""Bounded memory on a huge transaction; quiet and unmapped changes still advance the slot."""

from __future__ import annotations

import re
import threading

import psutil
import pytest

from cdc.demo.local import wait_for

pytestmark = pytest.mark.integration

ROWS = 2_000_000


@pytest.mark.slow
# the per-change path is the same in both; what differs, holding and spilling a streamed transaction, has no twin:
# the pure-Python pass of make test runs the streamed one
@pytest.mark.parametrize("streaming", [True, pytest.param(False, marks=pytest.mark.one_path)], ids=["streamed", "unstreamed"])
def test_two_million_row_transaction_streams_in_bounded_memory(env, streaming):
    """Streamed (the server sends it while decoding, the bridge holds it, spilling past its
    64 MiB default) or not (the server decodes it whole first), within 200 MB."""
    env.apply_sql("10_rocket_rides.sql")
    env.copy_mappings("ride.yaml")
    env.write_config(postgres=", streaming: " + ("true" if streaming else "false"))
    env.cdc("init", check=True)
    env.execute("INSERT INTO riders (id, name, email) VALUES (1, 'a', 'b')")
    env.execute(f"INSERT INTO rides (rider_id, distance_m) SELECT 1, g / 1000.0 FROM generate_series(1, {ROWS}) g")
    proc = env.start_bridge("--until-caught-up")
    process = psutil.Process(proc.pid)
    peak = 0
    done = threading.Event()

    def sample() -> None:
        nonlocal peak
        while not done.is_set():
            try:
                peak = max(peak, process.memory_info().rss)
            except psutil.NoSuchProcess:
                return
            done.wait(0.05)

    sampler = threading.Thread(target=sample)
    sampler.start()
    try:
        assert proc.wait(900) == 0, proc.log_path.read_text()[-2000:]
    finally:
        done.set()
        sampler.join()
    assert env.redis.xlen("cdc:ride") == ROWS
    last = env.redis.xrevrange("cdc:ride", count=1)[0][1]
    assert last[b"seq"] == str(ROWS - 1).encode()
    print(f"peak RSS {peak / 2**20:.1f} MiB for a {ROWS}-row transaction, streaming {streaming}")
    assert 0 < peak < 200 * 2**20
    summary = re.search(r"streamed transactions since start: 1 committed, 0 aborted, 0 left open; (\d+) bytes spilled",
                        proc.log_path.read_text())
    if streaming:
        assert summary and int(summary.group(1)) > 0, proc.log_path.read_text()[-2000:]
    else:
        assert summary is None


def test_unmapped_changes_and_quiet_periods_still_advance_the_slot(env):
    env.apply_sql("10_rocket_rides.sql")
    env.copy_mappings("ride.yaml")
    env.cdc("init", check=True)
    env.execute("CREATE TABLE scratch (id int)")
    proc = env.start_bridge()
    env.execute("INSERT INTO scratch SELECT generate_series(1, 1000)")
    target = env.current_wal()
    # answered keepalives: the slot follows the server even though nothing was published
    wait_for(lambda: env.confirmed_flush() >= target, 30, "the slot to pass the unmapped changes")
    assert env.redis.xlen("cdc:ride") == 0
    assert proc.poll() is None
