"""Which server history the source positions belong to: system identifier, timeline, branch points.

An LSN only orders changes within one server's history. A restore from backup, another
server, or a promoted standby that lacked the last transactions (its timeline branched off
below a position Redis already holds) makes the same LSNs name other transactions: the
high-water marks would then drop the server's changes as "already written", and the
streams would keep transactions the server never had. `read_history` asks the server
(``IDENTIFY_SYSTEM`` and ``TIMELINE_HISTORY`` on a replication connection, once per
session); `divergence` is the pure judgement against what Redis recorded.
"""

from __future__ import annotations

from dataclasses import dataclass

import psycopg

from .lsn import Lsn
from .replication import SESSION_OPTIONS, classify_pg_error

__all__ = ["Divergence", "ServerHistory", "divergence", "parse_history", "read_history"]


@dataclass(frozen=True)
class ServerHistory:
    """The server's identity and, per ancestor timeline, the LSN where its history left that timeline."""

    system_id: str
    timeline: int
    #: ancestor timeline -> switch point (the first LSN the newer timeline does not share with it)
    switches: dict[int, Lsn]
    #: the server's WAL insert position (None on a standby)
    wal: Lsn | None = None
    #: the database the connection reads (IDENTIFY_SYSTEM's dbname)
    database: str = ""


@dataclass(frozen=True)
class Divergence:
    """Redis holds positions in (`since`, `held`] the server's history does not have; `since` None: unknown."""

    since: Lsn | None
    held: Lsn
    cause: str


def parse_history(text: str) -> dict[int, Lsn]:
    """A timeline history file (``<parent tli>\\t<switch LSN>\\t<reason>`` per line) as tli -> switch point."""
    switches: dict[int, Lsn] = {}
    for line in text.splitlines():
        parts = line.strip().split("\t") if "\t" in line else line.split()
        if len(parts) < 2 or not parts[0].isdigit():
            continue  # comments and blank lines
        switches[int(parts[0])] = Lsn.parse(parts[1].strip())
    return switches


def read_history(dsn: str) -> ServerHistory:
    """The server's system identifier, current timeline and branch points (one replication connection)."""
    try:
        with psycopg.connect(dsn, replication="database", autocommit=True, options=SESSION_OPTIONS,
                             connect_timeout=10) as conn:
            system_id, timeline, _, database = conn.execute("IDENTIFY_SYSTEM").fetchone()[:4]
            timeline = int(timeline)
            switches: dict[int, Lsn] = {}
            if timeline > 1:
                content = conn.execute(f"TIMELINE_HISTORY {timeline}").fetchone()[1]
                switches = parse_history(content.decode() if isinstance(content, bytes) else content)
            row = conn.execute("SELECT CASE WHEN pg_is_in_recovery() THEN NULL "
                               "ELSE pg_current_wal_lsn()::text END").fetchone()
    except psycopg.Error as exc:
        raise classify_pg_error(exc) from exc
    return ServerHistory(str(system_id), timeline, switches, None if row[0] is None else Lsn.parse(row[0]),
                         database or "")


def divergence(system_id: str, timeline: int, held: Lsn, server: ServerHistory) -> Divergence | None:
    """Whether Redis, holding the source up to `held` on (`system_id`, `timeline`), holds changes the server's
    history lacks. None: every position up to `held` is the server's too."""
    if system_id != server.system_id:
        return Divergence(None, held, f"redis holds the changes of PostgreSQL system {system_id}, but this server is "
                          f"system {server.system_id}: another server, or one restored from a logical dump")
    if timeline > server.timeline:
        return Divergence(None, held, f"redis holds changes of timeline {timeline}, but this server is on timeline "
                          f"{server.timeline}: restored from a backup taken before")
    if timeline < server.timeline:
        switch = server.switches.get(timeline)
        if switch is None:
            return Divergence(None, held, f"redis holds changes of timeline {timeline}, which is not in the history "
                              f"of this server's timeline {server.timeline}")
        if switch < held:
            return Divergence(switch, held, f"this server's timeline {server.timeline} branched off timeline "
                              f"{timeline} at {switch}, below what redis holds: a promoted standby or a "
                              "point-in-time restore lacked the last transactions")
    if server.wal is not None and server.wal < held:
        return Divergence(server.wal, held, f"this server's WAL is at {server.wal} only, below what redis holds: a promoted "
                          "standby or a restored backup lacked the last transactions")
    return None
