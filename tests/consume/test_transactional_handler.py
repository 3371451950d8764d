"""`TransactionalHandler` on its own against PostgreSQL: a batch is all or nothing (its BEGIN and COMMIT travel
with the checkpoint's statements), the checkpoint skips what was applied, any stream or consumer name is data."""

from __future__ import annotations

import psycopg
import pytest

from cdc.consume.checkpoint import TransactionalHandler
from cdc.sink.entry import parse_entry

pytestmark = pytest.mark.integration

NAMES = ["cdc:ride", "cdc:o'brien", 'cdc:"quoted"', "cdc:back\\slash; DROP TABLE seen; --"]


def batch(stream: str, first: int, n: int) -> list:
    return [parse_entry(stream, f"{i}-0", {b"op": b"c", b"key": b'{"id":%d}' % i, b"data": b'{"id":%d}' % i,
                                           b"lsn": str(100 + i).encode(), b"seq": b"0"})
            for i in range(first, first + n)]


def seen_rows(conn: psycopg.Connection) -> list:
    return [tuple(r) for r in conn.execute("SELECT stream, id FROM seen ORDER BY stream, id")]


@pytest.fixture
def state(env):
    env.apply_sql("20_consumer_state.sql")
    with env.connect() as conn:
        conn.execute("CREATE TABLE seen (stream text, id int, PRIMARY KEY (stream, id))")
        conn.commit()
    return env


@pytest.fixture
def handlers():
    """Makes handlers, closed at the end of the test."""
    made: list[TransactionalHandler] = []

    def make(*args, **kwargs) -> TransactionalHandler:
        made.append(TransactionalHandler(*args, **kwargs))
        return made[-1]

    yield make
    for handler in made:
        handler.close()


def record(conn: psycopg.Connection, entries: list, consumer: str) -> None:
    with conn.cursor() as cur:
        cur.executemany("INSERT INTO seen VALUES (%s, %s)", [(e.stream, e.data["id"]) for e in entries])


def test_a_failing_batch_leaves_nothing_and_the_next_one_applies(state, handlers):
    calls = {"n": 0}

    def apply(conn, entries, consumer):
        record(conn, entries, consumer)
        calls["n"] += 1
        if calls["n"] == 2:
            raise ValueError("the handler fails after writing")

    handler = handlers(state.dsn, "c", apply)
    handler(batch("cdc:ride", 1, 3))
    with pytest.raises(ValueError):
        handler(batch("cdc:ride", 4, 3))
    with state.connect() as conn:
        assert seen_rows(conn) == [("cdc:ride", i) for i in (1, 2, 3)]
        assert conn.execute("SELECT entry_id FROM cdc_checkpoints WHERE consumer = 'c'").fetchone()[0] == "3-0"
    # the same connection goes on: the failed batch again (delivered again), then one that overlaps it
    handler(batch("cdc:ride", 4, 3))
    handler(batch("cdc:ride", 5, 4))
    assert handler.conn is not None and handler.conn.info.transaction_status == psycopg.pq.TransactionStatus.IDLE
    with state.connect() as conn:
        assert seen_rows(conn) == [("cdc:ride", i) for i in range(1, 9)]
    assert (handler.applied, handler.skipped) == (3 + 3 + 2, 2)


def test_a_database_error_in_the_batch_rolls_it_back(state, handlers):
    def apply(conn, entries, consumer):
        record(conn, entries, consumer)
        conn.execute("SELECT 1 / 0")

    handler = handlers(state.dsn, "c", apply)
    with pytest.raises(psycopg.errors.DivisionByZero):
        handler(batch("cdc:ride", 1, 2))
    with state.connect() as conn:
        assert seen_rows(conn) == []
        assert conn.execute("SELECT count(*) FROM cdc_checkpoints WHERE entry_id IS NOT NULL").fetchone()[0] == 0
    handler.apply = record
    handler(batch("cdc:ride", 1, 2))
    with state.connect() as conn:
        assert seen_rows(conn) == [("cdc:ride", 1), ("cdc:ride", 2)]


@pytest.mark.parametrize("ending", ["commit", "rollback"])
def test_an_apply_function_cannot_end_the_batchs_transaction(state, handlers, ending):
    """A commit inside apply would keep its writes without the checkpoint (applied again when redelivered):
    psycopg refuses it, as inside conn.transaction(), and the batch leaves nothing."""
    def apply(conn, entries, consumer):
        record(conn, entries, consumer)
        getattr(conn, ending)()

    handler = handlers(state.dsn, "c", apply)
    with pytest.raises(psycopg.ProgrammingError, match=f"Explicit {ending}\\(\\) forbidden"):
        handler(batch("cdc:ride", 1, 2))
    with state.connect() as conn:
        assert seen_rows(conn) == []
    handler.apply = record
    handler(batch("cdc:ride", 1, 2))
    with state.connect() as conn:
        assert seen_rows(conn) == [("cdc:ride", 1), ("cdc:ride", 2)]


def test_a_savepoint_inside_the_apply_function_is_its_own(state, handlers):
    def apply(conn, entries, consumer):
        record(conn, entries[:1], consumer)
        try:
            with conn.transaction():  # a savepoint: its failure undoes only what it did
                record(conn, entries[1:], consumer)
                conn.execute("SELECT 1 / 0")
        except psycopg.errors.DivisionByZero:
            pass

    handlers(state.dsn, "c", apply)(batch("cdc:ride", 1, 3))
    with state.connect() as conn:
        assert seen_rows(conn) == [("cdc:ride", 1)]
        assert conn.execute("SELECT entry_id FROM cdc_checkpoints WHERE consumer = 'c'").fetchone()[0] == "3-0"


@pytest.mark.parametrize("consumer", ["c", "o'brien", "x'); DROP TABLE seen; --"])
def test_any_stream_or_consumer_name_is_data(state, handlers, consumer):
    handler = handlers(state.dsn, consumer, record)
    for round_ in range(2):  # the second round is a redelivery: every entry skipped by its checkpoint
        handler([e for i, name in enumerate(NAMES) for e in batch(name, 10 * i + 1, 2)])
    with state.connect() as conn:
        assert sorted(seen_rows(conn)) == sorted((name, 10 * i + n) for i, name in enumerate(NAMES) for n in (1, 2))
        assert sorted(conn.execute("SELECT stream, entry_id FROM cdc_checkpoints WHERE consumer = %s",
                                   (consumer,)).fetchall()) == sorted((name, f"{10 * i + 2}-0") for i, name in enumerate(NAMES))
    assert (handler.applied, handler.skipped) == (2 * len(NAMES), 2 * len(NAMES))
