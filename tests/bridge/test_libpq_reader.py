"""The compiled loop reads each message from libpq itself (`ReplicationStream.copy_reader`): the same
messages, counts and commits as through psycopg's `get_copy_data`, from a real walsender."""

from __future__ import annotations

import time

import pytest

from cdc.bridge import changes
from cdc.bridge.backfill import Windows
from cdc.bridge.batcher import Batcher
from cdc.bridge.positions import Transaction
from cdc.source import pgoutput as po
from cdc.source.replication import ReplicationStream, libpq_copy_functions

pytestmark = [pytest.mark.integration, pytest.mark.one_path]


class Hidden:
    """The stream without its `copy_reader`: the compiled loop then reads through psycopg."""

    def __init__(self, stream: ReplicationStream) -> None:
        self.stream = stream
        self.get_copy_data = stream.get_copy_data
        self.failure = stream.failure


def drain(env, slot: str, through_psycopg: bool, burst, commits: int) -> tuple[int, list[bytes], list[int]]:
    """Every change counted, each message other than changes, Begins and Commits (its pgoutput part), and
    each commit's end LSN, until `commits` commits were read; the messages burst hands back, or that
    arrive while it has none, handled as the loop handles them."""
    stream = ReplicationStream(env.dsn, slot, "cdc", timeout=10)
    stream.start(0, messages=True)
    try:
        if not through_psycopg:
            assert stream.copy_reader == (stream.conn.pgconn.pgconn_ptr, *libpq_copy_functions())
        reader = Hidden(stream) if through_psycopg else stream
        decoder, tx, batcher, ends = po.PgOutputDecoder(), Transaction(), Batcher(10**6, 60.0), []
        changes_seen, others = 0, []
        deadline = time.monotonic() + 30
        while len(ends) < commits and time.monotonic() < deadline:
            count, raw = burst(reader, {}, tx, batcher, Windows(), decoder, lambda end: ends.append(int(end)), None)
            changes_seen += count
            if raw is None:
                raw = stream.read(0.2)
            if raw is None or raw[:1] != b"w":
                continue  # nothing yet, or a keepalive
            msg = decoder.decode(raw[25:])  # as the loop does with what burst hands back or the read gives
            if isinstance(msg, (po.Insert, po.Update, po.Delete)):
                changes_seen += 1
            elif isinstance(msg, po.Begin):
                tx.begin(msg)
            elif isinstance(msg, po.Commit):
                ends.append(int(tx.commit(msg)))
            else:
                others.append(raw[25:])
        return changes_seen, others, ends
    finally:
        stream.close()


def test_the_compiled_loop_reads_from_libpq_what_psycopg_reads(env):
    burst = changes.burst_changes
    if burst is changes.burst:
        pytest.skip("the compiled hot path does not run")
    assert libpq_copy_functions() is not None, "psycopg's libpq is found in this process"
    env.init_rides("ride.yaml", riders=3)
    slots = [f"{env.slot}_{i}" for i in range(2)]
    for slot in slots:
        env.execute("SELECT pg_create_logical_replication_slot(%s, 'pgoutput')", (slot,))
    inserted = 0
    for i in range(40):  # transactions of 1-3 changes, a Relation first
        first, last = i * 3 + 1, i * 3 + 1 + i % 3
        env.execute(f"INSERT INTO rides (id, rider_id, distance_m) SELECT g, 1, g FROM generate_series({first}, {last}) g")
        inserted += last - first + 1
    updated = len(env.execute("UPDATE rides SET distance_m = distance_m + 1 WHERE id % 2 = 0 RETURNING id"))
    direct = drain(env, slots[0], False, burst, 41)
    wrapped = drain(env, slots[1], True, burst, 41)
    assert direct == wrapped
    assert direct[0] == inserted + updated and len(direct[2]) == 41 and direct[1][0][:1] == b"R"
