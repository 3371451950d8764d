"""The server holding the slot: the primary, or a physical standby that decodes (PostgreSQL 16+).

Decoding on a standby spares the primary its walsender's CPU. The slot, the replication
stream, the slot's health and the catalog readings then live on the standby
(`postgres.slot_dsn`); whatever the bridge writes (heartbeats, backfill bookkeeping and
their watermark messages, the publication) goes to the primary (`postgres.dsn`), whose WAL
the standby replays and decodes in order. LSNs are the same on every server of a physical
replication cluster, so Redis' positions mean the same on both.

A standby can decode only with ``wal_level = logical`` on the primary (and on itself), and
``hot_standby_feedback = on`` with a physical slot on the primary (``primary_slot_name``),
or the primary removes catalog rows the slot still needs and the standby invalidates it.
Creating a slot on a standby waits for a running-transactions record from the primary:
`create_on_standby` asks the primary for one (``pg_log_standby_snapshot()``) instead of
waiting for the primary's background writer.
"""

from __future__ import annotations

import threading
import time

import psycopg

from ..errors import SourceError
from .lsn import Lsn

__all__ = ["POSITION_SQL", "STANDBY_MIN_VERSION", "create_on_standby", "in_recovery", "position", "standby_problems"]

#: logical decoding on a standby is new in PostgreSQL 16
STANDBY_MIN_VERSION = 160000

#: the server's WAL position: what it wrote (a primary) or replayed (a standby)
POSITION_SQL = "CASE WHEN pg_is_in_recovery() THEN pg_last_wal_replay_lsn() ELSE pg_current_wal_lsn() END"

#: how long `cdc init` waits for a standby to create the slot
CREATE_TIMEOUT_S = 120.0


def _row(conn: psycopg.Connection, query, params=None) -> tuple:
    row = conn.execute(query, params).fetchone()
    if row is None:  # pragma: no cover - a query of functions always answers a row
        raise SourceError("postgres answered no row to a settings query")
    return row


def in_recovery(conn: psycopg.Connection) -> bool:
    return bool(_row(conn, "SELECT pg_is_in_recovery()")[0])


def position(conn: psycopg.Connection) -> Lsn:
    return Lsn.parse(_row(conn, f"SELECT ({POSITION_SQL})::text")[0])


def standby_problems(slot_conn: psycopg.Connection, primary_conn: psycopg.Connection) -> list[tuple[str, str]]:
    """What a standby named by postgres.slot_dsn lacks to decode: (what, fix) pairs; empty when it can."""
    problems: list[tuple[str, str]] = []
    version = slot_conn.info.server_version
    if version < STANDBY_MIN_VERSION:
        return [(f"postgres.slot_dsn names a standby running PostgreSQL {version // 10000}, which cannot decode "
                 "(16 and later can)", "upgrade the standby, or leave postgres.slot_dsn empty to decode on the primary")]
    level, feedback, primary_slot = _row(
        slot_conn, "SELECT current_setting('wal_level'), current_setting('hot_standby_feedback'), "
        "current_setting('primary_slot_name', true)")
    if level != "logical":
        problems.append((f"the standby of postgres.slot_dsn has wal_level {level!r}; decoding on it needs 'logical'",
                         "set wal_level = logical in the standby's postgresql.conf and restart it"))
    if feedback != "on":
        problems.append(("the standby of postgres.slot_dsn has hot_standby_feedback off: the primary would remove "
                         "catalog rows the slot needs and the standby would invalidate the slot",
                         "set hot_standby_feedback = on on the standby and reload it"))
    if not primary_slot:
        problems.append(("the standby of postgres.slot_dsn streams without a physical slot (primary_slot_name is "
                         "empty): while it is disconnected the primary forgets its feedback and may remove catalog "
                         "rows the slot needs",
                         "create a physical slot on the primary (SELECT pg_create_physical_replication_slot('standby1')) "
                         "and set primary_slot_name = 'standby1' on the standby"))
    primary_level = _row(primary_conn, "SELECT current_setting('wal_level')")[0]
    if primary_level != "logical":
        problems.append((f"the primary has wal_level {primary_level!r}: its WAL carries nothing a standby can decode",
                         "set wal_level = logical on the primary and restart it (then on the standby)"))
    return problems


def create_on_standby(slot_conn: psycopg.Connection, primary_conn: psycopg.Connection, slot: str,
                      timeout_s: float = CREATE_TIMEOUT_S, what: str = "postgres.slot_dsn") -> str:
    """Create the logical slot (pgoutput) on the standby; returns its confirmed position.

    The standby waits for a running-transactions record from the primary; the primary is asked for one
    every second (``pg_log_standby_snapshot()``, PostgreSQL 16+); for a role that may not call it, a heartbeat
    message every 5 s makes the primary's background writer log one within 15 s.
    """
    result: dict = {}

    def create() -> None:
        try:
            result["lsn"] = _row(slot_conn, "SELECT lsn::text FROM pg_create_logical_replication_slot(%s, 'pgoutput')",
                                 (slot,))[0]
        except BaseException as exc:  # handed to the caller's thread
            result["error"] = exc

    worker = threading.Thread(target=create, name="cdc-create-standby-slot", daemon=True)
    worker.start()
    deadline = time.monotonic() + timeout_s
    ways = ["SELECT pg_log_standby_snapshot()",  # the record at once (superuser, or granted)
            # WAL the background writer counts as activity: it logs the record within 15 s
            "SELECT pg_logical_emit_message(false, 'cdc.heartbeat', now()::text)"]
    while worker.is_alive() and time.monotonic() < deadline:
        if ways:
            try:
                primary_conn.execute(ways[0])
            except psycopg.errors.InsufficientPrivilege:
                ways.pop(0)
                continue
        worker.join(1.0 if len(ways) == 2 else 5.0)
    if worker.is_alive():
        slot_conn.cancel_safe()
        worker.join(30)
        raise SourceError(
            f"the standby of {what} did not create slot {slot} within {timeout_s:.0f}s: it waits for a "
            "running-transactions record from the primary",
            hint="check that the standby replays the primary's WAL (pg_last_wal_replay_lsn() moves on it) and "
                 f"that role {primary_conn.info.user} may call pg_logical_emit_message on the primary, then cdc init again")
    if "error" in result:
        raise result["error"]
    return str(result["lsn"])
