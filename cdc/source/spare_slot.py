"""A spare copy of the slot, for the loss of the standby that decodes (`postgres.spare_slot_dsn`).

A logical slot on a standby (`postgres.slot_dsn`) is lost with the standby. A second slot of
the same name on another server of the cluster (the primary, or a second standby) can stand
in for it: LSNs are the same on every server of a physical replication cluster, so the
spare decodes the same transactions at the same positions, and Redis' high-water marks skip
those it already holds. It is usable exactly while its confirmed position is no further than
what Redis holds (`judge`): the changes between the two are decoded again and skipped by
position; none after Redis' record is missing. The bridge keeps it there (`advance`), so that
it retains no more WAL and catalog rows than the slot it stands in for.

`cdc init` creates the spare before the slot, so that it starts no later than the slot does.
Advancing it reads the WAL in between without decoding the changes (PostgreSQL's fast
forward): a small cost on the spare's server.
"""

from __future__ import annotations

from dataclasses import dataclass

import psycopg

from .lsn import Lsn
from .slot_server import create_on_standby, in_recovery

__all__ = ["SpareReading", "advance", "create", "judge", "read"]


@dataclass(frozen=True)
class SpareReading:
    """The spare as read on its server: None fields when it is missing."""

    exists: bool
    confirmed: Lsn | None = None
    #: pg_replication_slots.wal_status ('lost': the WAL it needs is gone)
    wal_status: str | None = None
    #: the slot on a standby was invalidated (pg_replication_slots.conflicting)
    conflicting: bool = False
    #: its server is the primary (else a standby)
    on_primary: bool = True
    #: the slot is in use (a walsender streams it: the bridge carries on from it)
    active: bool = False


def read(conn: psycopg.Connection, slot: str) -> SpareReading:
    """The spare slot `slot` on the server of `conn`."""
    primary = not in_recovery(conn)
    row = conn.execute(
        "SELECT confirmed_flush_lsn::text, wal_status, coalesce(conflicting, false), active "
        "FROM pg_replication_slots WHERE slot_name = %s AND slot_type = 'logical'", (slot,)).fetchone()
    if row is None:
        return SpareReading(False, on_primary=primary)
    return SpareReading(True, None if row[0] is None else Lsn.parse(row[0]), row[1], bool(row[2]), primary, bool(row[3]))


def judge(reading: SpareReading, held: Lsn | None) -> str | None:
    """Why the spare cannot stand in for the slot with Redis holding the source up to `held`; None when it can."""
    if not reading.exists:
        return "the spare slot does not exist on it (cdc init creates it)"
    if reading.wal_status == "lost" or reading.conflicting:
        return "the spare slot was invalidated (the WAL or the catalog rows it needs are gone); drop it and run cdc init"
    if reading.confirmed is None:
        return "the spare slot has no confirmed position yet"
    if held is None:
        return "Redis has no record of the slot yet"
    if reading.confirmed > held:
        return (f"the spare slot confirmed {reading.confirmed}, past what Redis holds ({held}): the changes in between "
                "would be missing; it is usable once the bridge wrote up to it")
    return None


def create(conn: psycopg.Connection, primary_conn: psycopg.Connection, slot: str) -> str:
    """Create the spare (pgoutput, never a failover slot: it must not take the place of a standby's synced copy) on
    the server of `conn`; returns its confirmed position."""
    if in_recovery(conn):
        return create_on_standby(conn, primary_conn, slot, what="postgres.spare_slot_dsn")
    row = conn.execute("SELECT lsn::text FROM pg_create_logical_replication_slot(%s, 'pgoutput')", (slot,)).fetchone()
    assert row is not None
    return str(row[0])


def advance(conn: psycopg.Connection, slot: str, to: Lsn) -> Lsn | None:
    """Move the spare up to `to` (no further than its server has: PostgreSQL caps it); returns where it is now, or
    None when it does not exist. A spare already there, or past it, is left alone."""
    reading = read(conn, slot)
    if not reading.exists or reading.confirmed is None:
        return None
    if reading.confirmed >= to or reading.active:
        return reading.confirmed
    row = conn.execute("SELECT end_lsn::text FROM pg_replication_slot_advance(%s, %s::pg_lsn)", (slot, str(to))).fetchone()
    return None if row is None or row[0] is None else Lsn.parse(row[0])
