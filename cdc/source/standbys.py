"""The standbys' copies of the slot, read where they are: what a promoted standby would resume from.

A failover slot (PostgreSQL 17+) survives a failover only on a standby that holds a
*persisted* synced copy of it. The slot sync worker first creates the copy as a temporary
slot and persists it only once the slot on the primary has passed the position the standby
reserved for it (its restart LSN and catalog xmin); a temporary copy is dropped at
promotion, and with it every change the bridge had not written to Redis yet. So readiness
is judged on each standby that could be promoted, never on the primary alone:

- the copy exists, is a synced copy, persisted (not temporary) and not invalidated;
- the standby has received the WAL of everything Redis holds (else a promoted standby
  would lack changes already in the streams);
- the copy does not claim more than Redis holds (else the bridge would resume past
  changes Redis lacks).

The standbys are the hosts of the DSN other than the primary, or those of
`postgres.standbys`. A standby that cannot be read makes readiness *unknown*, never yes.
Reading (`read_copy`) is I/O; judging (`judge_copy`) is pure.
"""

from __future__ import annotations

from dataclasses import dataclass

import psycopg
from psycopg import conninfo

from .. import redact
from .lsn import Lsn, lsn_text

__all__ = ["PrimarySlot", "StandbyCopy", "StandbyTarget", "copy_summary", "judge_copy", "read_copies", "read_copy",
           "standby_targets"]

#: seconds to wait for a standby to answer before its copy counts as unknown
CONNECT_TIMEOUT_S = 5


@dataclass(frozen=True)
class StandbyTarget:
    """A standby to read: `label` (host:port, never a secret) and the connection string to reach it."""

    label: str
    dsn: str


@dataclass(frozen=True)
class PrimarySlot:
    """The slot on the primary, for explaining why a copy is still temporary."""

    restart_lsn: Lsn | None
    catalog_xmin: str | None


@dataclass(frozen=True)
class StandbyCopy:
    """What one standby says of its copy of the slot (`error`: it could not be read)."""

    label: str
    error: str | None = None
    in_recovery: bool = True
    server_version: int = 0
    #: WAL the standby has received from the primary (None: not streaming)
    received: Lsn | None = None
    exists: bool = False
    synced: bool = False
    temporary: bool = False
    invalidation: str | None = None
    confirmed_flush: Lsn | None = None
    restart_lsn: Lsn | None = None
    catalog_xmin: str | None = None
    #: the standby's settings the slot sync worker needs (None: not readable)
    sync_replication_slots: str | None = None
    hot_standby_feedback: str | None = None
    primary_slot_name: str | None = None

    def as_dict(self) -> dict:
        return {
            "standby": self.label, "error": self.error, "in_recovery": self.in_recovery, "exists": self.exists,
            "synced": self.synced, "temporary": self.temporary, "invalidation": self.invalidation,
            "received": None if self.received is None else lsn_text(self.received),
            "confirmed_flush": None if self.confirmed_flush is None else lsn_text(self.confirmed_flush),
        }


def _split(value: str | None) -> list[str]:
    return [] if not value else [part.strip() for part in value.split(",")]


def _hosts(params: dict) -> list[tuple[str, str, str]]:
    """(host, hostaddr, port) of each server a connection string names, as libpq pairs them."""
    hosts, addrs, ports = _split(params.get("host")), _split(params.get("hostaddr")), _split(params.get("port"))
    count = max(len(hosts), len(addrs), 1)
    hosts = hosts or [""] * count
    addrs = addrs or [""] * count
    ports = ports * count if len(ports) == 1 else (ports or ["5432"] * count)
    return [(hosts[i] if i < len(hosts) else "", addrs[i] if i < len(addrs) else "", ports[i] or "5432")
            for i in range(count)]


def standby_targets(dsn: str, standbys: str, primary_host: str, primary_port: str) -> list[StandbyTarget]:
    """The standbys to read: those `standbys` names (its other keywords override the DSN's), else every host
    of `dsn` except the primary the bridge is connected to (`primary_host`, `primary_port`)."""
    base = conninfo.conninfo_to_dict(dsn)
    if standbys.strip():
        extra = conninfo.conninfo_to_dict(standbys)
        names = {k: extra.pop(k) for k in ("host", "hostaddr", "port") if k in extra}
        base.update(extra)
        servers = _hosts(names)
        exclude = None
    else:
        servers = _hosts(base)
        exclude = (primary_host, str(primary_port))
    for key in ("host", "hostaddr", "port", "target_session_attrs", "load_balance_hosts"):
        base.pop(key, None)
    timeout = base.get("connect_timeout")
    if not timeout or not str(timeout).isdigit() or int(timeout) == 0 or int(timeout) > CONNECT_TIMEOUT_S:
        base["connect_timeout"] = str(CONNECT_TIMEOUT_S)
    targets = []
    for host, addr, port in servers:
        if exclude is not None and ((host or addr, port) == exclude or (addr, port) == exclude):
            continue
        params = dict(base, port=port)
        if host:
            params["host"] = host
        if addr:
            params["hostaddr"] = addr
        targets.append(StandbyTarget(f"{host or addr or 'localhost'}:{port}", conninfo.make_conninfo("", **params)))
    return targets


def _lsn(text: str | None) -> Lsn | None:
    return None if text is None else Lsn.parse(text)


def read_copy(target: StandbyTarget, slot: str, application: str = "cdc failover check") -> StandbyCopy:
    """Read one standby's copy of `slot` (never raises for a standby that cannot be read: `error` says why)."""
    try:
        with psycopg.connect(target.dsn, autocommit=True, application_name=application) as conn:
            return _read(conn, target.label, slot)
    except psycopg.Error as exc:
        reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        return StandbyCopy(target.label, error=redact.redact(reason))


def _read(conn: psycopg.Connection, label: str, slot: str) -> StandbyCopy:
    version = conn.info.server_version
    settings = conn.execute(
        "SELECT pg_is_in_recovery(), pg_last_wal_receive_lsn()::text, current_setting('sync_replication_slots', true), "
        "current_setting('hot_standby_feedback', true), current_setting('primary_slot_name', true)").fetchone()
    assert settings is not None
    in_recovery, received, sync, feedback, primary_slot = settings
    common = dict(in_recovery=in_recovery, server_version=version, received=_lsn(received),
                  sync_replication_slots=sync, hot_standby_feedback=feedback, primary_slot_name=primary_slot)
    if version < 170000:
        return StandbyCopy(label, **common)
    row = conn.execute(
        "SELECT synced, temporary, invalidation_reason, confirmed_flush_lsn::text, restart_lsn::text, catalog_xmin::text "
        "FROM pg_replication_slots WHERE slot_name = %s", (slot,)).fetchone()
    if row is None:
        return StandbyCopy(label, **common)
    synced, temporary, invalidation, confirmed, restart, catalog_xmin = row
    return StandbyCopy(label, exists=True, synced=bool(synced), temporary=bool(temporary), invalidation=invalidation,
                       confirmed_flush=_lsn(confirmed), restart_lsn=_lsn(restart), catalog_xmin=catalog_xmin, **common)


def _missing_copy_reason(copy: StandbyCopy, slot: str) -> str:
    fixes = []
    if copy.sync_replication_slots is not None and copy.sync_replication_slots != "on":
        fixes.append("sync_replication_slots = on")
    if copy.hot_standby_feedback is not None and copy.hot_standby_feedback != "on":
        fixes.append("hot_standby_feedback = on")
    if copy.primary_slot_name is not None and not copy.primary_slot_name:
        fixes.append("primary_slot_name (its physical slot on the primary)")
    if fixes:
        return f"set {', '.join(fixes)} on the standby"
    return ("its slot sync worker has not copied it yet: check that primary_conninfo names dbname and the standby's "
            "log for 'could not synchronize replication slot'")


def judge_copy(copy: StandbyCopy, slot: str, primary: PrimarySlot | None,
               redis_holds: Lsn | None, primary_waits: bool = False) -> tuple[str | None, str | None]:
    """(problem, unknown) for one standby: a problem when a failover to it now would lose the slot or changes,
    an unknown when its copy could not be read; both None when it holds a copy a failover can resume from.

    `primary_waits`: the primary holds the bridge's changes back until the standbys flushed them
    (synchronized_standby_slots): Redis' record may then run ahead of a standby's WAL by keepalive positions
    only, which carry no change, so the standby's WAL is not held to it."""
    who = f"standby {copy.label}"
    if copy.error is not None:
        return None, (f"{who} cannot be read ({copy.error}), so whether it holds a copy of slot {slot} is unknown: "
                      "make it reachable with the bridge's credentials, or list the standbys in postgres.standbys")
    if not copy.in_recovery:
        return (f"{copy.label} accepts writes, so it is not a standby of this primary: remove it from the servers "
                "the bridge reads, or make it a standby again"), None
    if copy.server_version < 170000:
        return (f"{who} runs PostgreSQL {copy.server_version // 10000}, which keeps no copies of failover slots "
                "(17 and later)"), None
    if not copy.exists:
        return f"{who} holds no copy of slot {slot}: {_missing_copy_reason(copy, slot)}", None
    if copy.invalidation:
        return (f"{who}'s copy of slot {slot} is invalidated ({copy.invalidation}): a promoted standby could not "
                "decode from it"), None
    if not copy.synced:
        return (f"{who} has a slot named {slot} that is not a synced copy of the primary's (created by hand?): "
                "drop it on the standby so the slot sync worker can copy the primary's"), None
    if copy.temporary:
        theirs = "" if primary is None else (f"the primary's slot: restart_lsn {_text(primary.restart_lsn)}, "
                                              f"catalog_xmin {primary.catalog_xmin}; ")
        return (f"{who} holds only a temporary copy of slot {slot}, which a promotion drops: PostgreSQL persists it "
                f"once the slot on the primary has passed what the standby reserved ({theirs}the standby's copy: "
                f"restart_lsn {_text(copy.restart_lsn)}, catalog_xmin {copy.catalog_xmin}); that happens as the bridge "
                "streams and long-running transactions on the primary end; wait for it before a switchover"), None
    if redis_holds is not None and copy.received is not None and copy.received < redis_holds and not primary_waits:
        return (f"{who} has received WAL up to {lsn_text(copy.received)}, {int(redis_holds) - int(copy.received)} "
                f"bytes short of what Redis holds ({lsn_text(redis_holds)}): a promoted standby would lack changes "
                "already in the streams; set synchronized_standby_slots on the primary to this standby's slot"), None
    if redis_holds is not None and copy.received is None:
        return f"{who} is not streaming WAL from the primary: it cannot have what Redis holds", None
    if redis_holds is not None and copy.confirmed_flush is not None and copy.confirmed_flush > redis_holds:
        return (f"{who}'s copy of slot {slot} is at {lsn_text(copy.confirmed_flush)}, past what Redis holds "
                f"({lsn_text(redis_holds)}): a promoted standby would resume past changes Redis lacks "
                "(Redis lost writes? see cdc status)"), None
    return None, None


def _text(lsn: Lsn | None) -> str:
    return "none" if lsn is None else str(lsn_text(lsn))


def copy_summary(copy: StandbyCopy, redis_holds: Lsn | None) -> str:
    """How a good copy stands, for the "yes" reason."""
    if copy.confirmed_flush is None or redis_holds is None:
        return f"{copy.label} (persisted copy)"
    return f"{copy.label} (persisted copy, {max(0, int(redis_holds) - int(copy.confirmed_flush))} bytes behind Redis)"


def read_copies(conn: psycopg.Connection, dsn: str, standbys: str, slot: str) -> tuple[StandbyCopy, ...]:
    """Every standby's copy of `slot`: the standbys of `standbys`, else the hosts of `dsn` other than the
    primary `conn` is connected to."""
    targets = standby_targets(dsn, standbys, conn.info.host, str(conn.info.port))
    return tuple(read_copy(target, slot) for target in targets)
