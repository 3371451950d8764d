"""`cdc status` as text, without servers: `collect()`'s data drawn as tables."""

from __future__ import annotations

from cdc.ops.status_view import render

SLOT = {"name": "cdc", "active": True, "confirmed_flush_lsn": "0/1A", "current_wal_lsn": "0/2B", "lag_bytes": 17,
        "lag_seconds": 0.25, "retained_wal_bytes": 90, "max_slot_wal_keep_size": "-1", "wal_status": "reserved",
        "safe_wal_size_bytes": None}
STREAM = {"entity": "ride", "stream": "cdc:ride", "length": 2, "first_time": "2026-01-01T00:00:00.000Z",
          "last_time": None, "last_lsn": 123, "trimmed": 4, "force_trimmed": 0,
          "groups": [{"group": "totals", "lag": None, "pending": 1, "oldest_pending_idle_ms": 1500, "dead_letters": 2,
                      "consumers": [{"name": "worker-1", "pending": 1, "idle_ms": 300}]}]}


def rows(text: str, first_cell: str) -> list[list[str]]:
    return [line.split() for line in text.splitlines() if line.split()[:1] == [first_cell]]


def test_the_slot_line_and_one_table_per_subject():
    text = render({"slot": SLOT, "streams": [STREAM], "backfills": [
        {"id": 3, "entity": "ride", "status": "running", "rows_done": 500, "rows_total": 40000, "chunks": 2,
         "where": "id <= 40000", "rows_per_s": 1234.5}], "reconciliations": []})
    assert text.splitlines()[0] == ("slot cdc: active, confirmed 0/1A, current 0/2B, lag 17 bytes (0.25s), "
                                    "retained WAL 90 bytes of max_slot_wal_keep_size -1, wal_status reserved")
    assert rows(text, "ride") == [["ride", "cdc:ride", "2", "2026-01-01T00:00:00.000Z", "-", "0/7B", "4", "0"]]
    assert rows(text, "cdc:ride") == [["cdc:ride", "totals", "?", "1", "1.5s", "2"],
                                      ["cdc:ride", "totals", "worker-1", "1", "0.3s"]]
    assert rows(text, "3") == [["3", "ride", "id", "<=", "40000", "running", "500", "40000", "1,234"]]
    assert "last reconciliations" not in text and "WARNING" not in text
    assert "\x1b" not in text, "no colour off a terminal"


def test_a_missing_slot_and_force_trimmed_entries_are_called_out():
    text = render({"slot": None, "streams": [dict(STREAM, force_trimmed=5, groups=[])]})
    assert text.startswith("slot: missing (run cdc init)\n")
    assert "WARNING: cdc:ride: 5 unconsumed entries dropped by the hard trim cap" in text
    assert "consumer groups" not in text


def test_long_values_are_not_cut_off_a_terminal():
    where = "created_at > now() - interval '1 day' AND " + "x" * 120
    text = render({"slot": SLOT, "streams": [], "backfills": [
        {"id": 1, "entity": "ride", "status": "pending", "rows_done": 0, "rows_total": None, "chunks": 0,
         "where": where, "rows_per_s": None}]})
    assert where in text


def test_the_servers_decoding_counters_go_under_the_slot_line():
    decoding = {"transactions": 1234, "bytes": 3 * 2**20 // 2, "spilled_transactions": 2, "spilled_bytes": 380 * 2**20,
                "streamed_transactions": 0, "streamed_bytes": 0, "since": "2026-11-24T04:00:00Z", "streaming": False}
    text = render({"slot": dict(SLOT, decoding=decoding), "streams": []})
    assert text.splitlines()[1] == (
        "decoded since 2026-11-24T04:00:00Z: 1,234 transactions, 1.5 MiB; spilled to the server's disk: "
        "2 transactions, 380.0 MiB; streamed in progress (postgres.streaming off): 0 transactions, 0.0 MiB")
    assert "decoded" not in render({"slot": dict(SLOT, decoding=None), "streams": []}), "nothing before PostgreSQL 14"


def test_the_other_bridges_on_the_redis_get_one_line():
    others = [{"slot": "cdc_riders", "publication": "cdc_riders", "database": "app", "system_id": "7",
               "streams": ["cdc:rider", "cdc:rocket"]}]
    text = render({"slot": SLOT, "streams": [], "other_bridges": others})
    assert text.splitlines()[1] == "other bridges on this redis: slot cdc_riders (publication cdc_riders, 2 stream(s))"
    assert "other bridges" not in render({"slot": SLOT, "streams": [], "other_bridges": []})
