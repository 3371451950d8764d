"""Failover slots (PostgreSQL 17+): creating the slot as one, and whether it would survive a failover.

A logical slot lives on one server. PostgreSQL 17 copies a slot created with
``failover`` to physical standbys that run ``sync_replication_slots = on``, so a
promoted standby has the slot and the bridge resumes from it. The copy is only as far
as the standby has confirmed, which is why the primary must hold logical walsenders
back with ``synchronized_standby_slots`` until the standby has flushed: otherwise the
bridge can publish changes that a promoted standby never received.

Readiness is judged on both sides: the primary's (the slot's flag,
``synchronized_standby_slots``, the physical slots of the standbys) and each standby's own
copy of the slot (`cdc.source.standbys`): "yes" only when every standby that could be
promoted holds a persisted synced copy and has what Redis holds; "unknown" when a standby
cannot be read; "no" with the reason otherwise.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import psycopg

from .lsn import Lsn
from .replication import quote_ident
from .standbys import PrimarySlot, StandbyCopy, copy_summary, judge_copy

__all__ = ["FAILOVER_MIN_VERSION", "FailoverReadiness", "StandbySlot", "create_slot", "failover_readiness",
           "make_failover_slot", "standby_settings", "supports_failover"]

log = logging.getLogger("cdc.failover")

#: failover slots and slot synchronisation are new in PostgreSQL 17
FAILOVER_MIN_VERSION = 170000


@dataclass(frozen=True)
class StandbySlot:
    """A physical replication slot on the primary: what a standby streams from."""

    name: str
    active: bool
    #: WAL between the primary's current position and what the standby has confirmed (None: never connected)
    behind_bytes: int | None


@dataclass(frozen=True)
class FailoverReadiness:
    slot: str
    server_version: int
    #: the slot's failover flag (None: no such slot, or a server without failover slots)
    slot_failover: bool | None = None
    synchronized_standby_slots: tuple[str, ...] = ()
    standby_slots: tuple[StandbySlot, ...] = ()
    #: why the slot would not survive a failover, each with the setting that fixes it (empty: ready)
    problems: tuple[str, ...] = field(default=())
    #: the standbys' copies of the slot, as each standby says (`cdc.source.standbys`)
    copies: tuple[StandbyCopy, ...] = ()
    #: why readiness cannot be told (a standby that cannot be read): never "yes" while there is one
    unknowns: tuple[str, ...] = ()
    #: how far Redis holds the source, which each standby must have received
    redis_holds: Lsn | None = None

    @property
    def ready(self) -> bool:
        return not self.problems and not self.unknowns

    @property
    def standby_in_evidence(self) -> bool:
        """A standby is in sight (a physical slot, synchronized_standby_slots, a standby named to read)."""
        return bool(self.standby_slots or self.synchronized_standby_slots or self.copies)

    @property
    def state(self) -> str:
        """yes, no or unknown (a problem found wins over a standby that could not be read)."""
        return "no" if self.problems else "unknown" if self.unknowns else "yes"

    @property
    def reason(self) -> str:
        if self.problems or self.unknowns:
            return "; ".join(self.problems + self.unknowns)
        names = ", ".join(f"{s.name} ({_behind(s)})" for s in self.standby_slots if s.name in self.synchronized_standby_slots)
        copies = ", ".join(copy_summary(c, self.redis_holds) for c in self.copies)
        return (f"slot {self.slot} is a failover slot, the primary waits for standby slot(s) {names}, and each "
                f"standby holds a copy a promotion keeps: {copies}")

    def as_dict(self) -> dict:
        return {
            "ready": self.ready,
            "state": self.state,
            "reason": self.reason,
            "standbys": [c.as_dict() for c in self.copies],
            "slot_failover": self.slot_failover,
            "synchronized_standby_slots": list(self.synchronized_standby_slots),
            "standby_slots": [{"name": s.name, "active": s.active, "behind_bytes": s.behind_bytes}
                              for s in self.standby_slots],
        }


def _behind(slot: StandbySlot) -> str:
    state = "active" if slot.active else "inactive"
    return f"{state}, {slot.behind_bytes} bytes behind" if slot.behind_bytes is not None else f"{state}, never confirmed"


def standby_settings(standby_slot: str, dbname: str) -> str:
    """What a standby needs to keep a synced copy of the slot, and what the primary needs."""
    return (f"on the standby: sync_replication_slots = on, hot_standby_feedback = on, "
            f"primary_slot_name = '{standby_slot}', dbname={dbname} in primary_conninfo; "
            f"on the primary: synchronized_standby_slots = '{standby_slot}'")


def supports_failover(conn: psycopg.Connection) -> bool:
    return conn.info.server_version >= FAILOVER_MIN_VERSION


def create_slot(conn: psycopg.Connection, slot: str, failover: bool) -> tuple[str, str]:
    """Create the logical slot (pgoutput), a failover slot when asked and the server has them.

    Returns (the slot's confirmed position, what was done).
    """
    if failover and supports_failover(conn):
        confirmed = conn.execute(
            "SELECT lsn::text FROM pg_create_logical_replication_slot(%s, 'pgoutput', false, false, true)", (slot,)
        ).fetchone()[0]
        return confirmed, f"created logical slot {slot} (pgoutput) at {confirmed} as a failover slot"
    confirmed = conn.execute("SELECT lsn::text FROM pg_create_logical_replication_slot(%s, 'pgoutput')", (slot,)).fetchone()[0]
    return confirmed, f"created logical slot {slot} (pgoutput) at {confirmed}"


def make_failover_slot(dsn: str, conn: psycopg.Connection, slot: str) -> str | None:
    """Turn an existing slot into a failover slot (17+); returns what was done, None when nothing was to do.

    ``ALTER_REPLICATION_SLOT`` needs a replication connection and the slot not in use: while a
    bridge reads it the change waits for the next `cdc init`, which the message says.
    """
    if not supports_failover(conn):
        return None
    row = conn.execute("SELECT failover, active FROM pg_replication_slots WHERE slot_name = %s", (slot,)).fetchone()
    if row is None or row[0]:
        return None
    if row[1]:
        return (f"slot {slot} is in use, so it is not a failover slot yet: stop cdc run and run cdc init again "
                "to make it one")
    with psycopg.connect(dsn, replication="database", autocommit=True, connect_timeout=10) as repl:
        repl.execute(f"ALTER_REPLICATION_SLOT {quote_ident(slot)} ( FAILOVER true )")
    return f"made slot {slot} a failover slot"


def failover_readiness(conn: psycopg.Connection, slot: str, copies: tuple[StandbyCopy, ...] | None = None,
                       redis_holds: Lsn | None = None) -> FailoverReadiness:
    """Whether `slot` would survive a failover to a physical standby: the primary's side read on `conn`, each
    standby's side from `copies` (`cdc.source.standbys.read_copy`; None: not read, so never "yes"), each
    standby held to having received `redis_holds` (how far Redis holds the source)."""
    version = conn.info.server_version
    in_recovery = conn.execute("SELECT pg_is_in_recovery()").fetchone()[0]
    if in_recovery and conn.execute("SELECT 1 FROM pg_replication_slots WHERE slot_name = %s", (slot,)).fetchone():
        return FailoverReadiness(slot, version, problems=(
            f"slot {slot} lives on a standby (postgres.slot_dsn), which keeps it when it is promoted; a failover to "
            "any other server leaves the bridge without it: it then stops with the missing slot's error (cdc init, "
            "then cdc recover)",))
    behind = "NULL" if in_recovery else "pg_current_wal_lsn() - restart_lsn"
    standbys = tuple(
        StandbySlot(name, active, int(lag) if lag is not None else None)
        for name, active, lag in conn.execute(
            f"SELECT slot_name, active, {behind} FROM pg_replication_slots WHERE slot_type = 'physical' ORDER BY slot_name"))
    if version < FAILOVER_MIN_VERSION:
        return FailoverReadiness(slot, version, standby_slots=standbys, copies=tuple(copies or ()), problems=(
            f"PostgreSQL {version // 10000} has no failover slots (17 and later): a promoted standby would not "
            "have the slot",))
    row = conn.execute("SELECT failover, restart_lsn::text, catalog_xmin::text FROM pg_replication_slots "
                       "WHERE slot_name = %s", (slot,)).fetchone()
    synchronized = tuple(
        name.strip().strip('"') for name in conn.execute("SELECT current_setting('synchronized_standby_slots')").fetchone()[0].split(",")
        if name.strip())
    problems: list[str] = []
    physical = {s.name: s for s in standbys}
    example = standbys[0].name if standbys else "standby1"
    dbname = conn.info.dbname
    if row is None:
        problems.append(f"slot {slot} does not exist: run cdc init")
    elif not row[0]:
        problems.append(f"slot {slot} is not a failover slot, so standbys do not copy it: set postgres.failover_slot: "
                        "true and run cdc init (with cdc run stopped) to make it one")
    if not standbys:
        problems.append(f"no physical replication slot for a standby on the primary: create one "
                        f"(SELECT pg_create_physical_replication_slot('{example}')) and set "
                        + standby_settings(example, dbname))
    if not synchronized:
        problems.append(f"synchronized_standby_slots is not set on the primary: the bridge may receive changes the "
                        f"standby has not flushed, which a promoted standby and its copy of the slot would not have; "
                        f"set synchronized_standby_slots = '{example}' on the primary")
    for name in synchronized:
        standby = physical.get(name)
        if standby is None:
            problems.append(f"synchronized_standby_slots names {name}, which is not a physical slot on the primary: "
                            f"create it or fix the setting")
        elif not standby.active:
            problems.append(f"standby slot {name} is not active ({_behind(standby)}): no standby streams from it, so "
                            "its copy of the slot falls behind and the primary holds the bridge back until it returns; "
                            "start the standby with " + standby_settings(name, dbname))
    unknowns: list[str] = []
    primary = None if row is None else PrimarySlot(None if row[1] is None else Lsn.parse(row[1]), row[2])
    if copies is None:
        unknowns.append("the standbys' copies of the slot were not read")
    elif not copies and standbys:
        unknowns.append(f"the standbys' copies of slot {slot} cannot be read: postgres.dsn names one server; name "
                        "every server in it (host=a,b port=5432,5432 target_session_attrs=read-write) or the "
                        "standbys in postgres.standbys")
    waits = bool(synchronized) and all(name in physical and physical[name].active for name in synchronized)
    for copy in copies or ():
        problem, unknown = judge_copy(copy, slot, primary, redis_holds, primary_waits=waits)
        if problem:
            problems.append(problem)
        if unknown:
            unknowns.append(unknown)
    return FailoverReadiness(slot, version, bool(row[0]) if row else None, synchronized, standbys, tuple(problems),
                             tuple(copies or ()), tuple(unknowns), redis_holds)
