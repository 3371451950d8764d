"""Exactly-once state in PostgreSQL: the handler's writes and the checkpoint commit together.

Each batch runs in one transaction that locks the consumer's checkpoint rows,
skips every entry at or below the checkpoint's source position ``(lsn, seq)``
(a redelivery, or an entry the producer sent twice), applies the rest, and moves
the checkpoint. A crash before the commit loses nothing (the entries are still
pending); a crash after it re-applies nothing. The lease epoch stored with the
checkpoint fences a consumer that lost its lease while paused.
"""

from __future__ import annotations

import logging
import os
import random
from collections.abc import Callable, Iterable, Sequence

import psycopg
from psycopg import sql

from .consumer import Fenced
from ..loader import APPLY_PARAMETERS, check_signature
from ..sink.entry import Entry
from .statedb import StateConnection, StateTable

__all__ = ["TransactionalHandler", "Apply", "ResetCount", "lock_checkpoints"]

log = logging.getLogger("cdc.checkpoint")

#: apply(conn, entries, consumer): write the consumer's state for new entries, inside the transaction.
Apply = Callable[[psycopg.Connection, list[Entry], str], None]

_LOCK = """
SELECT stream, entry_id, lsn, seq, epoch FROM cdc_checkpoints
WHERE consumer = %s AND stream = ANY(%s) ORDER BY stream FOR UPDATE
"""
_ENSURE = "INSERT INTO cdc_checkpoints (consumer, stream) SELECT %s, unnest(%s::text[]) ON CONFLICT DO NOTHING"
_SAVE = """
UPDATE cdc_checkpoints SET entry_id = %s, lsn = %s, seq = %s, epoch = %s, updated_at = now()
WHERE consumer = %s AND stream = %s
"""
_REPLAYED = "INSERT INTO cdc_replays (consumer, replay_of) VALUES (%s, %s) ON CONFLICT DO NOTHING"
#: what the queries above need (cdc/sql/20_consumer_state.sql creates both tables)
STATE_TABLES = [
    StateTable("cdc_checkpoints", ("SELECT", "INSERT", "UPDATE"), "run what cdc sql --file 20_consumer_state.sql prints there (as the owner)"),
    StateTable("cdc_replays", ("INSERT",), "run what cdc sql --file 20_consumer_state.sql prints there (as the owner)"),
]


_RESETS = "SELECT count(*) FROM cdc_reconcile_runs WHERE consumer = %s AND status = 'repaired'"


class ResetCount:
    """How many reconciliation resets repaired `consumer`'s state (`cdc_reconcile_runs`, written by
    `cdc reconcile`), for /metrics: read on the metrics schedule over a connection of its own.

    None when the history cannot be read (no table, no SELECT on it): the metric is left out."""

    def __init__(self, dsn: str, consumer: str) -> None:
        self.dsn, self.consumer = dsn, consumer
        self.conn: psycopg.Connection | None = None
        self.unreadable = False

    def __call__(self) -> int | None:
        if self.unreadable:
            return None
        try:
            if self.conn is None or self.conn.closed:
                self.conn = psycopg.connect(self.dsn, autocommit=True, connect_timeout=5)
            return int(self.conn.execute(_RESETS, (self.consumer,)).fetchone()[0])
        except (psycopg.errors.UndefinedTable, psycopg.errors.InsufficientPrivilege) as exc:
            self.unreadable = True
            log.warning("cdc_consumer_resets_total left out: %s (grant SELECT on cdc_reconcile_runs to show it)",
                        str(exc).splitlines()[0])
            return None
        except psycopg.Error:
            self.close()
            raise

    def close(self) -> None:
        if self.conn is not None:
            self.conn.close()
            self.conn = None


def lock_checkpoints(conn: psycopg.Connection, consumer: str, streams: list[str]) -> dict[str, tuple[str, tuple[int, int], int]]:
    """Lock (creating if needed) `consumer`'s checkpoint rows on `streams`, always in stream order so that
    every holder (each batch, a reset) takes them alike: stream -> (entry_id, (lsn, seq), epoch)."""
    conn.execute(_ENSURE, (consumer, streams))
    return _checkpoints(conn.execute(_LOCK, (consumer, streams)))


def _checkpoints(rows: Iterable[tuple]) -> dict[str, tuple[str, tuple[int, int], int]]:
    """`_LOCK`'s rows: stream -> (entry_id, (lsn, seq), epoch)."""
    return {stream: (entry_id, (int(lsn), seq), epoch) for stream, entry_id, lsn, seq, epoch in rows}


class TransactionalHandler(StateConnection):
    """A batch handler for `Consumer.run` that keeps state and checkpoint in one transaction."""

    def __init__(
        self,
        dsn: str,
        consumer: str,
        apply: Apply,
        *,
        epoch_of: Callable[[str], int] = lambda stream: 0,
        group: str | None = None,
        crash_before_commit: float = 0.0,
    ) -> None:
        super().__init__(dsn)
        check_signature(apply, APPLY_PARAMETERS, f"the apply function of consumer {consumer}")
        self.consumer = consumer
        self.group = group or consumer
        self.apply = apply
        self.epoch_of = epoch_of
        self.crash_before_commit = crash_before_commit
        self.applied = 0
        self.skipped = 0
        self._openings: dict[tuple[str, ...], str] = {}

    def __repr__(self) -> str:
        return f"<TransactionalHandler {self.consumer} applied={self.applied} skipped={self.skipped}>"

    def state_tables(self) -> list[StateTable]:
        """The checkpoints and replays (the apply function's own tables are its business)."""
        return STATE_TABLES

    def _opening(self, conn: psycopg.Connection, streams: list[str]) -> str:
        """BEGIN, then `lock_checkpoints`' two statements, in one query (one round trip: the opening of each batch)."""
        key = tuple(streams)
        text = self._openings.get(key)
        if text is None:
            consumer, listed = sql.Literal(self.consumer), sql.Literal(streams)
            text = self._openings[key] = "; ".join(
                sql.SQL(statement.replace("%s", "{}")).format(consumer, listed).as_string(conn)
                for statement in ("BEGIN", _ENSURE, _LOCK))
        return text

    def _closing(self, conn: psycopg.Connection, last: dict[str, Entry]) -> str:
        """The checkpoints' updates, then COMMIT, in one query (one round trip: the closing of each batch)."""
        statements = [
            sql.SQL(_SAVE.replace("%s", "{}")).format(*map(sql.Literal, (
                e.id, e.lsn, e.seq, self.epoch_of(stream), self.consumer, stream))).as_string(conn)
            for stream, e in last.items()
        ]
        return "; ".join([*statements, "COMMIT"])

    def __call__(self, entries: Sequence[Entry]) -> None:
        streams = sorted({e.stream for e in entries})
        with self.transaction(opened=True) as conn:
            cur = conn.execute(self._opening(conn, streams), prepare=False)
            cur.nextset()
            cur.nextset()  # the lock's rows
            marks = {}
            for stream, (_, mark, epoch) in _checkpoints(cur).items():
                mine = self.epoch_of(stream)
                if epoch > mine:
                    raise Fenced(f"{self.consumer} on {stream}: state written by epoch {epoch}, this consumer holds {mine}")
                marks[stream] = mark
            fresh: list[Entry] = []
            last: dict[str, Entry] = {}
            stream, mark = None, (0, 0)
            for e in entries:
                if b"replay_for" in e.fields:
                    # a dead letter sent back: for its group only, applied once
                    if e.fields[b"replay_for"].decode() == self.group and conn.execute(
                        _REPLAYED, (self.consumer, e.fields[b"replay_of"].decode())
                    ).rowcount:
                        fresh.append(e)
                    continue
                if e.stream != stream:
                    if stream is not None:
                        marks[stream] = mark
                    stream = e.stream
                    mark = marks[stream]
                position = (e.lsn, e.seq)
                if position > mark:
                    fresh.append(e)
                    mark = position
                    last[stream] = e
            if stream is not None:
                marks[stream] = mark
            if fresh:
                self.apply(conn, fresh, self.consumer)
            if self.crash_before_commit and random.random() < self.crash_before_commit:
                log.warning("fault injection: crashing before commit")
                os._exit(86)
            conn.execute(self._closing(conn, last), prepare=False)
        self.applied += len(fresh)
        self.skipped += len(entries) - len(fresh)
