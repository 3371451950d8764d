"""Backfills that fail visibly and never pin the slot: a failing chunk closes its window and marks
its backfill failed, a writer that died never holds the slot, and watermarks are scoped to the
slot whose bridge wrote them."""

from __future__ import annotations

import signal
import subprocess
import sys

import orjson
import pytest

from cdc.demo.local import wait_for
from conftest import read_stream

pytestmark = pytest.mark.integration

RIDE = "entity: ride\ntable: public.rides\nkey: [id]\nfields: {id: id, distance: distance_m, rider: rider_id}\n"
#: true for every ride of rider 1; division by zero on a ride of rider 2 (a real error, row by row, in the read)
FAILS_ON_RIDER_2 = "100 / (rider_id - 2) <> 0"


def setup(env, rows: int = 1000, chunk: int = 300) -> None:
    env.apply_sql("10_rocket_rides.sql")
    env.execute("INSERT INTO riders (id, name, email) VALUES (1, 'a', 'b'), (2, 'c', 'd')")
    env.execute(f"INSERT INTO rides (rider_id, distance_m) SELECT 1, g FROM generate_series(1, {rows}) g")
    env.write_mapping("ride.yaml", RIDE)
    env.write_config(f"batch: {{backfill_chunk_rows: {chunk}}}\n")
    env.cdc("init", check=True)


def backfills(env) -> dict:
    return {i: (s, n, e) for i, s, n, e in env.execute("SELECT id, status, rows_done, error FROM cdc_backfills ORDER BY id")}


def caught_up(env, what: str) -> None:
    target = env.current_wal()
    wait_for(lambda: env.confirmed_flush() >= target, 60, what)


def reads(env) -> list[int]:
    return [e["key"]["id"] for e in read_stream(env.redis, "cdc:ride") if e["op"] == "r"]


def test_a_failing_chunk_fails_its_backfill_visibly_and_the_slot_moves_on(env):
    setup(env)
    # `cdc backfill --wait` queues the backfill (its count passes: no ride of rider 2 yet) and follows it
    waiting = env._start("backfill-wait", "backfill", "--entity", "ride", "--where", FAILS_ON_RIDER_2, "--wait", env=None)
    wait_for(lambda: env.execute("SELECT count(*) FROM cdc_backfills")[0][0] == 1, 60, "the backfill to be queued")
    env.execute("UPDATE rides SET rider_id = 2 WHERE id = 500")  # its second chunk (301..600) now fails to read
    env.cdc("backfill", "--entity", "ride", "--where", "id <= 50", check=True)  # queued behind it
    proc = env.start_bridge()
    assert waiting.wait(60) == 1
    out = waiting.log_path.read_text()
    assert ("cdc: error: backfill 1 of ride failed after 300 row(s): division by zero; fix the cause, then run "
            "cdc backfill again (streaming went on: no change was lost)") in out
    wait_for(lambda: backfills(env)[2][0] == "done", 60, "the next backfill to go on")
    assert backfills(env) == {1: ("failed", 300, "division by zero"), 2: ("done", 50, None)}
    env.execute("INSERT INTO rides (rider_id, distance_m) VALUES (1, 7)")
    caught_up(env, "the slot to move past the failed chunk")
    entries = read_stream(env.redis, "cdc:ride")
    assert [e["op"] for e in entries][-1] == "c", "the mapping keeps streaming"
    assert reads(env) == list(range(1, 301)) + list(range(1, 51)), "the first chunk, then the next backfill"
    log = proc.log_path.read_text()
    assert "backfill 1 of ride failed: division by zero; streaming goes on" in log
    status = env.cdc("status")
    assert status.returncode == 0, status.stderr
    line = next(line for line in status.stdout.splitlines() if line.split()[:2] == ["1", "ride"])
    assert " FAILED " in line and line.endswith("division by zero")

    # across a restart: the replay meets the failed chunk's window and closes it again; nothing is re-read
    proc.send_signal(signal.SIGKILL)
    proc.wait(10)
    env.wait_slot_inactive()
    proc = env.start_bridge()
    wait_for(env.slot_active, 30, "the bridge to attach again")
    env.execute("INSERT INTO rides (rider_id, distance_m) VALUES (1, 8)")
    caught_up(env, "the slot to move after the restart")
    waited = env.cdc("backfill", "--entity", "ride", "--where", "id <= 10", "--wait", timeout=60)
    assert waited.returncode == 0 and "backfill 3: done, 10 row(s) read" in waited.stdout, waited.stderr
    caught_up(env, "the later backfill to be acknowledged")
    assert reads(env) == list(range(1, 301)) + list(range(1, 51)) + list(range(1, 11))
    assert backfills(env)[1] == ("failed", 300, "division by zero")
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(30) == 0


def test_a_low_watermark_whose_writer_died_never_pins_the_slot(env):
    """The low watermark of a writer killed before its high (as after a crash mid-chunk): the next
    session's resume watermark closes its window, and the backfill goes on from its recorded progress."""
    setup(env, rows=100, chunk=30)
    env.cdc("backfill", "--entity", "ride", check=True)
    low = {"kind": "low", "chunk": "1:0:deadbeef", "schema": "public", "table": "rides", "slot": env.slot}
    env.execute("SELECT pg_logical_emit_message(true, 'cdc.wm', %s)", (orjson.dumps(low).decode(),))
    env.execute("UPDATE rides SET distance_m = 0.5 WHERE id = 3")  # a change inside the dead window
    proc = env.start_bridge()
    wait_for(lambda: backfills(env)[1][0] == "done", 60, "the backfill to finish")
    env.execute("INSERT INTO rides (rider_id, distance_m) VALUES (1, 7)")
    caught_up(env, "the slot to move past the dead writer's low watermark")
    assert sorted(reads(env)) == list(range(1, 101))
    assert "backfill chunk 1:0:deadbeef: its writer is gone; window closed without rows" in proc.log_path.read_text()
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(30) == 0


@pytest.mark.one_path
def test_a_bridge_on_another_slot_neither_logs_nor_holds_for_a_backfill(env):
    """Two bridges on one database, two slots: watermarks of slot A (a live backfill, and a window
    that never closes) are none of B's business."""
    setup(env, rows=3000, chunk=100)
    other = env.tmp / "other"
    (other / "mappings").mkdir(parents=True)
    (other / "mappings" / "rider.yaml").write_text("entity: rider\ntable: public.riders\nkey: [id]\nfields: {id: id}\n")
    config = other / "cdc.yaml"
    config.write_text(env.config_path.read_text().replace(f"slot: {env.slot}", f"slot: {env.slot}_b")
                      .replace("publication: cdc", "publication: cdc_b").replace("mappings: mappings/", f"mappings: {other}/mappings/"))
    def cdc_b(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "cdc", "--log-format", "text", args[0], "--config", str(config),
                               *args[1:]], capture_output=True, text=True, timeout=120)

    assert cdc_b("init").returncode == 0
    log_b = other / "bridge-b.log"
    with open(log_b, "w") as out:
        bridge_b = subprocess.Popen([sys.executable, "-m", "cdc", "--log-format", "text", "run", "--config", str(config)],
                                    stdout=out, stderr=subprocess.STDOUT)
    env.procs.append(bridge_b)
    try:
        # a window of slot A that never closes (A's bridge is not even running)
        low = {"kind": "low", "chunk": "9:0:deadbeef", "schema": "public", "table": "riders", "slot": env.slot}
        env.execute("SELECT pg_logical_emit_message(true, 'cdc.wm', %s)", (orjson.dumps(low).decode(),))
        env.execute("INSERT INTO riders (id, name, email) VALUES (3, 'e', 'f')")
        slot_b = f"{env.slot}_b"

        def confirmed_b() -> int:
            return int(env.execute("SELECT confirmed_flush_lsn - '0/0'::pg_lsn FROM pg_replication_slots "
                                   "WHERE slot_name = %s", (slot_b,))[0][0])

        target = env.current_wal()
        wait_for(lambda: confirmed_b() >= target, 60, "slot B to move past slot A's open window")
        # and a live backfill on slot A, while B streams
        proc = env.start_bridge()
        env.cdc("backfill", "--entity", "ride", check=True)
        env.execute("INSERT INTO riders (id, name, email) VALUES (4, 'g', 'h')")
        wait_for(lambda: backfills(env)[1][0] == "done", 60, "slot A's backfill")
        target = env.current_wal()
        wait_for(lambda: confirmed_b() >= target, 60, "slot B to follow")
        assert [e["key"]["id"] for e in read_stream(env.redis, "cdc:rider")] == [3, 4]
        assert sorted(reads(env)) == list(range(1, 3001))
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
    finally:
        bridge_b.send_signal(signal.SIGTERM)
        bridge_b.wait(30)
    text = log_b.read_text()
    assert "backfill" not in text and "watermark" not in text and "chunk" not in text, text


def test_a_late_high_of_a_writer_that_lost_the_slot_is_dropped_and_fails_its_backfill(env):
    """A writer whose commit reached the server after the next session's resume (it had lost the slot):
    its rows cannot be checked against the changes since its low, so they are never published."""
    setup(env, rows=100, chunk=30)
    env.cdc("backfill", "--entity", "ride", check=True)

    def emit(info: dict) -> None:
        env.execute("SELECT pg_logical_emit_message(true, 'cdc.wm', %s)", (orjson.dumps({**info, "slot": env.slot}).decode(),))

    emit({"kind": "low", "chunk": "1:0:0ld0ld00", "schema": "public", "table": "rides"})
    emit({"kind": "resume", "writer": "5ecd5ecd"})
    emit({"kind": "high", "chunk": "1:0:0ld0ld00", "schema": "public", "table": "rides", "entity": "ride",
          "columns": ["id", "rider_id", "distance_m"], "rows": [["5", "1", "12345"]], "last": False})
    proc = env.start_bridge()
    wait_for(lambda: backfills(env)[1][0] == "failed", 60, "the backfill to be marked failed")
    assert backfills(env)[1][2] == "chunk 1:0:0ld0ld00 was read by a writer that had lost the slot; run cdc backfill again"
    env.execute("INSERT INTO rides (rider_id, distance_m) VALUES (1, 7)")
    caught_up(env, "the slot to move on")
    entries = read_stream(env.redis, "cdc:ride")
    assert all(e["data"]["distance"] != "12345.000" for e in entries), "a late chunk is never published unfiltered"
    assert sorted(reads(env)) == list(range(1, 31)), "the new writer's first chunk only"
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(30) == 0


def test_a_chunk_whose_backfill_changed_while_it_was_read_closes_its_window_without_rows(env):
    """The driver against the database alone: a backfill superseded while its chunk waits for the row
    lock records no progress and emits a drop watermark; a failing read emits a failed one."""
    import threading

    from cdc.bridge.backfill import BackfillDriver, enqueue
    from cdc.mapping.model import parse_mapping
    from cdc.yamlsrc import load_yaml_documents

    setup(env, rows=100, chunk=30)
    env.execute("SELECT pg_create_logical_replication_slot('wm_peek', 'test_decoding')")
    ride = parse_mapping(load_yaml_documents(RIDE, "ride.yaml")[0], {})
    with env.connect() as conn:
        enqueue(conn, env.slot, ride)
    driver = BackfillDriver(env.slot, [ride], chunk_rows=30)
    with env.connect() as locker, env.connect() as conn:
        locker.execute("BEGIN")
        locker.execute("UPDATE cdc_backfills SET status = 'superseded' WHERE id = 1")  # holds the row lock
        ticking = threading.Thread(target=driver.tick, args=(conn,))
        ticking.start()
        wait_for(lambda: env.execute("SELECT count(*) FROM pg_locks WHERE NOT granted")[0][0] > 0, 30,
                 "the chunk's update to wait for the lock")
        locker.execute("COMMIT")
        ticking.join(30)
        assert driver.waiting_for == f"1:0:{driver.token}"
        assert env.execute("SELECT status, chunks, rows_done FROM cdc_backfills") == [("superseded", 0, 0)]
        env.execute("INSERT INTO cdc_backfills (slot, entity, where_sql) VALUES (%s, 'ride', '1 / 0 = 0')", (env.slot,))
        driver.seen(driver.waiting_for)
        driver.tick(conn)
    assert backfills(env)[2] == ("failed", 0, "division by zero")
    messages = [orjson.loads(text.partition(" content:")[2]) for (text,) in env.execute(
        "SELECT data FROM pg_logical_slot_peek_changes('wm_peek', NULL, NULL) WHERE data LIKE 'message:%%cdc.wm%%'")]
    token = driver.token
    assert [(m["kind"], m.get("chunk"), m["slot"]) for m in messages] == [
        ("resume", None, env.slot), ("low", f"1:0:{token}", env.slot), ("drop", f"1:0:{token}", env.slot),
        ("low", f"2:0:{token}", env.slot), ("failed", f"2:0:{token}", env.slot)]
    assert messages[-1]["error"] == "division by zero"
