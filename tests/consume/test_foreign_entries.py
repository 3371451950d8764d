"""An entry the bridge (or a consumer) did not write, in a mapped stream or a dead-letter stream:
`cdc read` and `cdc dlq` name it, show or replay nothing of it, and never end in a traceback;
a mapping cannot name its stream like one of the bridge's own keys."""

from __future__ import annotations

import orjson
import pytest

# the consumer parses replies on the path the run picked (cdc.sink._entries or cdc.sink.entry): both run
pytestmark = [pytest.mark.integration, pytest.mark.both_paths]


@pytest.fixture
def rides(env):
    env.init_rides("ride.yaml", sql=("10_rocket_rides.sql", "20_consumer_state.sql"), riders=3)
    env.execute("INSERT INTO rides (id, rider_id, distance_m) SELECT g, g, g FROM generate_series(1, 3) g")
    env.cdc("run", "--until-caught-up", check=True)
    return env


def _one_error(result, code: int, *says: str) -> str:
    assert result.returncode == code, result
    assert "Traceback" not in result.stderr and "internal error" not in result.stderr, result.stderr
    error = [line for line in result.stderr.splitlines() if line.startswith("cdc: error: ")]
    assert len(error) == 1 and all(s in error[0] for s in says), result.stderr
    return error[0]


def test_cdc_read_skips_a_foreign_entry_by_its_id_and_ends_with_its_error(rides):
    bridge_ids = [i.decode() for i, _ in rides.redis.xrange("cdc:ride")]
    foreign = rides.redis.xadd("cdc:ride", {"hello": "world"}).decode()
    result = rides.cdc("read", "--entity", "ride")
    rows = [orjson.loads(line) for line in result.stdout.splitlines()]
    assert [r["id"] for r in rows] == bridge_ids and len(rows) == 3 and all(r["op"] == "c" for r in rows), result
    assert f"warning: skipped: cdc:ride {foreign} is not a bridge entry (no op, lsn, seq field)" in result.stderr
    _one_error(result, 5, f"cdc:ride {foreign} is not a bridge entry", f"redis-cli XDEL cdc:ride {foreign}")
    rides.redis.xadd("cdc:ride", {"op": "c", "lsn": "x", "seq": "1"})  # the bridge's field names, not its values
    _one_error(rides.cdc("read", "--entity", "ride"), 5, "(2 entries skipped in all)")
    bad_json = rides.redis.xadd("cdc:ride", {"op": "c", "key": '{"id": 9}', "data": "{", "lsn": "9", "seq": "0"}).decode()
    result = rides.cdc("read", "--entity", "ride")
    assert f"skipped: cdc:ride {bad_json} is not a bridge entry (its data field does not parse as JSON)" in result.stderr
    _one_error(result, 5, "(3 entries skipped in all)")
    # the advice works: once the foreign entries are deleted, cdc read shows every entry and exits 0
    for entry_id, fields in rides.redis.xrange("cdc:ride"):
        if b"v" not in fields:
            rides.redis.xdel("cdc:ride", entry_id)
    result = rides.cdc("read", "--entity", "ride", check=True)
    assert len(result.stdout.splitlines()) == 3 and not result.stderr


def test_cdc_dlq_never_shows_or_replays_a_foreign_entry(rides):
    foreign = rides.redis.xadd("cdc:dlq:audit", {"op": "c", "data": "{}"}).decode()
    listed = rides.cdc("dlq", "list", "--group", "audit")
    assert "0 dead letter(s) for group audit" in listed.stdout
    _one_error(listed, 5, f"cdc:dlq:audit {foreign} is not a dead letter (no source_stream, source_id, deliveries, "
               "error field)")
    _one_error(rides.cdc("dlq", "show", "--group", "audit", foreign), 5, f"cdc:dlq:audit {foreign} is not a dead letter")
    before = rides.redis.xlen("cdc:ride")
    _one_error(rides.cdc("dlq", "replay", "--group", "audit", foreign), 5, f"cdc:dlq:audit {foreign} is not a dead letter")
    _one_error(rides.cdc("dlq", "replay", "--group", "audit"), 5, f"cdc:dlq:audit {foreign} is not a dead letter")
    assert rides.redis.xlen("cdc:ride") == before and rides.redis.xlen("cdc:dlq:audit") == 1  # nothing replayed or lost
    # a dead letter whose entry is not JSON is foreign too
    bad = rides.redis.xadd("cdc:dlq:audit", {"source_stream": "cdc:ride", "source_id": "1-0", "deliveries": "5",
                                             "error": "x", "entry": "{not json"}).decode()
    _one_error(rides.cdc("dlq", "show", "--group", "audit", bad), 5, f"{bad} is not a dead letter (its entry field is not JSON)")


def test_a_mapping_whose_stream_is_reserved_stops_cdc_check_at_its_line(env):
    env.apply_sql("10_rocket_rides.sql")
    env.copy_mappings("ride.yaml")
    path = env.write_mapping("audit.yaml", "entity: audit\ntable: public.rides\nkey: [id]\nfields: {id: id}\nstream: cdc:dlq:g1\n")
    for command in (("check",), ("read", "--entity", "ride"), ("dlq", "list", "--group", "g1")):
        _one_error(env.cdc(*command), 3, f"{path}:5: stream 'cdc:dlq:g1' of entity 'audit' is a reserved name",
                   "give the mapping a stream of its own")
    path.unlink()
    result = env.cdc("consume", "--entity", "ride", "--group", "g", "--handler", "cdc.demo.rocketrides:ride_totals",
                     "--transactions", "{cdc:ride}:hwm")
    _one_error(result, 2, "--transactions {cdc:ride}:hwm is a reserved name")


def test_a_consumer_handed_a_foreign_entry_stops_naming_it(rides):
    foreign = rides.redis.xadd("cdc:ride", {"hello": "world"}).decode()
    result = rides.cdc("consume", "--entity", "ride", "--group", "g", "--start", "0",
                       "--handler", "cdc.demo.rocketrides:ride_totals", timeout=120)
    _one_error(result, 5, f"cdc:ride {foreign} is not a bridge entry (no op, lsn, seq field)",
               f"redis-cli XDEL cdc:ride {foreign}")
    _advice_followed(rides, foreign)


def _advice_followed(rides, foreign: str) -> None:
    """The error's advice works: once the entry is deleted, `cdc consume` (a new process: it takes over what the
    stopped one was handed, the deleted entry leaving the pending list as Redis claims it) applies every bridge
    entry, acknowledges them and runs on."""
    from cdc.demo.local import wait_for

    rides.redis.xdel("cdc:ride", foreign)
    proc = rides.start_consumer("g")
    try:
        wait_for(lambda: rides.execute("SELECT total_distance FROM consumer_states WHERE consumer = 'g' AND rider_id = 0")
                 == [(6,)] and rides.redis.xpending("cdc:ride", "g")["pending"] == 0, 60,
                 "every bridge entry applied and acknowledged")
        assert proc.poll() is None, proc.log_path.read_text()
    finally:
        proc.terminate()
        assert proc.wait(30) == 0, proc.log_path.read_text()


def test_an_entry_whose_json_does_not_parse_stops_a_handler_reading_it_and_is_dead_lettered_by_the_table_sink(rides):
    """An entry's JSON is parsed when the handler reads it: a handler reading it stops the consumer with the
    entry's error (nothing of the batch acknowledged); the table sink passes the text to PostgreSQL, which
    refuses it: the entry's own failure, dead-lettered, the others applied."""
    import threading

    from cdc.consume.consumer import Consumer
    from cdc.consume.table_sink import TableSink
    from cdc.demo.local import wait_for

    last = int(rides.redis.xrevrange("cdc:ride", count=1)[0][1][b"lsn"])  # past the bridge's: not taken for a redelivery
    bad = rides.redis.xadd("cdc:ride", {"op": "c", "key": '{"id": 9}', "data": "{", "lsn": str(last + 1), "seq": "0",
                                        "xid": "1", "ts_ms": "0", "v": "1"}).decode()
    result = rides.cdc("consume", "--entity", "ride", "--group", "g", "--start", "0",
                       "--handler", "cdc.demo.rocketrides:ride_totals", timeout=120)
    _one_error(result, 5, f"cdc:ride {bad} is not a bridge entry (its data field does not parse as JSON)",
               f"redis-cli XDEL cdc:ride {bad}")
    assert rides.redis.xpending("cdc:ride", "g")["pending"] == 4, "nothing of the batch acknowledged"
    consumer = Consumer(rides.redis, ["cdc:ride"], "mirror", "m1", max_deliveries=2, block_ms=50)
    consumer.create_group("0")
    sink = TableSink(rides.dsn, "public.ride_mirror")
    stop = threading.Event()
    thread = threading.Thread(target=consumer.run, args=(sink, stop), daemon=True)
    thread.start()
    try:
        wait_for(lambda: rides.redis.xlen("cdc:dlq:mirror") == 1 and consumer.acked == 3, 60,
                 "the entry that is not JSON to be dead-lettered, the others applied")
    finally:
        stop.set()
        thread.join(30)
        sink.close()
    [(_, letter)] = rides.redis.xrange("cdc:dlq:mirror")
    assert letter[b"source_id"].decode() == bad and b"InvalidTextRepresentation" in letter[b"error"]
    assert sorted(k for (k,) in rides.execute("SELECT key->>'id' FROM ride_mirror")) == ["1", "2", "3"]
    _advice_followed(rides, bad)
