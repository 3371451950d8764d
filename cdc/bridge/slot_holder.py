"""Who holds the replication slot, asked before `cdc run` starts.

A slot streams to one connection at a time. A second `cdc run` on a slot another bridge
holds stops at once, before it binds the metrics port, naming the slot and its holder
(exit 75: running it again later may succeed). With ``--standby`` it waits instead, says
once that it is the standby and who holds the slot, and starts when the slot is free.

The holder is the walsender `pg_replication_slots.active_pid`; the bridge's replication
connection names its host and process in ``application_name`` (`cdc.source.replication.application_name`),
which `pg_stat_replication` shows to the same role (or a superuser). A holder named as a bridge
of this host whose process is gone (killed, its walsender not yet timed out) is ended at once
instead: waiting for it would only delay a restart.
"""

from __future__ import annotations

import logging
import os
import re
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass

import psycopg

from ..errors import TransientError
from ..source.replication import classify_pg_error

__all__ = ["SlotHolder", "gone", "slot_holder", "wait_for_slot"]

log = logging.getLogger("cdc.bridge")

#: how a bridge names its replication connection (`cdc.source.replication.application_name`)
_NAMED = re.compile(r"cdc run on (?P<host>\S+) pid (?P<pid>\d+)")
#: how often a standby asks whether the slot is free
STANDBY_POLL_S = 0.5

_HOLDER = """
SELECT s.active_pid, r.application_name, host(r.client_addr)
FROM pg_replication_slots s LEFT JOIN pg_stat_replication r ON r.pid = s.active_pid
WHERE s.slot_name = %s AND s.active
"""


@dataclass(frozen=True)
class SlotHolder:
    pid: int
    application_name: str | None
    client_addr: str | None

    def __str__(self) -> str:
        about = [f"{self.application_name}" if self.application_name else "",
                 f"from {self.client_addr}" if self.client_addr else ""]
        about = [a for a in about if a]
        return f"walsender pid {self.pid}" + (f" ({', '.join(about)})" if about else "")


def slot_holder(conn: psycopg.Connection, slot: str) -> SlotHolder | None:
    """The connection streaming `slot` now, or None (free, or no such slot: the bridge reports that)."""
    row = conn.execute(_HOLDER, (slot,)).fetchone()
    return SlotHolder(*row) if row else None


def gone(holder: SlotHolder, hostname: str, pid: int) -> bool:
    """The holder names a bridge of this host (`hostname`) whose process no longer runs (or is this very
    process, `pid`, which holds nothing yet: an earlier life under the same pid, as pid 1 of a container)."""
    named = _NAMED.fullmatch(holder.application_name or "")
    if named is None or named["host"] != hostname:
        return False
    holder_pid = int(named["pid"])
    if holder_pid == pid:
        return True
    try:
        os.kill(holder_pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # another user's process: it runs
        return False
    return False


def _ask(dsn: str, slot: str) -> SlotHolder | None:
    """Who holds `slot`; a dead bridge of this host is ended first (its walsender would hold the slot
    until wal_sender_timeout), and then nobody does."""
    try:
        with psycopg.connect(dsn, autocommit=True, connect_timeout=10) as conn:
            holder = slot_holder(conn, slot)
            if holder is None or not gone(holder, socket.gethostname(), os.getpid()):
                return holder
            try:
                conn.execute("SELECT pg_terminate_backend(%s)", (holder.pid,))
            except psycopg.errors.InsufficientPrivilege:
                return holder
            log.info("slot %s was held by %s, whose process is gone: ended it", slot, holder)
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:
                holder = slot_holder(conn, slot)
                if holder is None:
                    return None
                time.sleep(0.05)  # the backend is exiting
            return holder
    except psycopg.Error as exc:
        raise classify_pg_error(exc) from exc


def wait_for_slot(dsn: str, slot: str, *, standby: bool, stopping: Callable[[], bool]) -> None:
    """Return when `slot` is free (or cannot be asked about now: the bridge's own retries take over).

    Not `standby`: a held slot is a `TransientError` naming its holder. `standby`: wait, logging
    once who holds it, until it is free or `stopping()`."""
    said = away = False
    while not stopping():
        try:
            holder = _ask(dsn, slot)
        except TransientError as exc:
            if not standby:
                return  # postgres away: the bridge retries with its backoff, and finds the slot then
            if not away:
                log.warning("standby: cannot ask who holds slot %s, asking again: %s", slot, exc)
            away = True
            _pause(stopping)
            continue
        away = False
        if holder is None:
            if said:
                log.info("slot %s is free: the standby takes over", slot)
            return
        if not standby:
            raise TransientError(
                f"a bridge is already running on slot {slot}, {holder}",
                hint="stop it first, or start this one with cdc run --standby to take over when the slot is free; "
                     f"if that bridge is gone, PostgreSQL ends its walsender within wal_sender_timeout "
                     f"(or now: SELECT pg_terminate_backend({holder.pid}))")
        if not said:
            log.info("standby: slot %s is held by %s; taking over when it is free", slot, holder)
            said = True
        _pause(stopping)


def _pause(stopping: Callable[[], bool]) -> None:
    deadline = time.monotonic() + STANDBY_POLL_S
    while not stopping() and time.monotonic() < deadline:
        time.sleep(0.05)
