"""`cdc check`: the complete preflight, every problem at once.

Whatever `cdc run` (or a consumer, `cdc backfill`, `cdc status`, `cdc trim`) would reject
at start or at its first change is found here first, without changing anything:

- PostgreSQL: wal_level, the role's REPLICATION attribute, USAGE and SELECT on every
  mapped table, each mapping bound to the live table with the stream's own code, the
  publication (covering each mapped table under its name, each with a replica identity that
  carries updates and deletes) and the slot, the tables cdc run bound before (same OIDs and
  partitions, and the publication's rows for them unchanged, `cdc.bridge.gate`), what snapshots
  and backfills need (`cdc_backfills` and its grants, `pg_logical_emit_message`);
- Redis: reachable, the login, and the ACL's verdict on every command the bridge and
  consumers send, with the keys they send it to, asked with ``ACL DRYRUN`` (Redis 7),
  which runs nothing; warnings for a Redis that would lose acknowledged entries (no AOF)
  or evict keys (a ``maxmemory-policy`` other than ``noeviction``).

Each problem is a `CdcError` (what, where, the fix) whose exit code is the one the
failing command would exit with; `CheckReport.exit_code` is the smallest among them.
"""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Sequence
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import psycopg
import redis
from psycopg.conninfo import conninfo_to_dict

from .. import keys
from ..config import Settings
from ..bridge.gate import ROWS_FIELD, PublicationRows, TableGate, load_bound, load_resync, needed_operations
from ..keys import written_streams
from ..bridge.encoding import sql_ascii_warning
from ..bridge.guards import (check_redis_has_flushed, check_source_history, invalidated_slot_error, missing_slot_error,
                             redis_record, slot_database_error, stream_problems)
from ..bridge.held_transactions import spill_dir_error, spill_place
from ..errors import CdcError, DataLossError, MappingError, PrivilegeError, PublishError, SlotError, SourceError, TransientError
from ..mapping.model import Mapping, mapped_columns, resync_tables
from ..sink.claims import BridgeIdentity, claim_problems, unmapped_owned
from ..sink.redisconn import connect_redis, is_sentinel_url, parse_sentinel_url
from ..source.standbys import read_copies
from ..source.slot_server import in_recovery, standby_problems
from ..source import spare_slot
from ..source.replication import SESSION_OPTIONS
from ..source.failover import failover_readiness, supports_failover
from ..source.history import ServerHistory, read_history
from ..source.lsn import Lsn
from ..source.coverage import (PUBLISH, Publication, TableCoverage, identity_problem, operations_problem,
                               publication_problem, read_coverage, read_publication)
from ..source.pubcolumns import INIT_FIX, plan, sends_less, surplus
from ..source.privileges import BACKFILL_GRANTS
from ..source.replication import classify_pg_error
from ..source.values import TypeCatalog
from ..mapping.uniqueness import key_uniqueness_problem
from .admin import bind_live, _tables, _wal_level, connect, slot_connection

__all__ = ["CheckReport", "acl_probes", "check", "redis_held"]

_ANY_SHA = "0" * 40  # EVALSHA is judged by the ACL before the script is looked up


@dataclass
class CheckReport:
    ok: list[str] = field(default_factory=list)
    problems: list[CdcError] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)

    @property
    def exit_code(self) -> int:
        return min((p.exit_code for p in self.problems), default=0)


def check(settings: Settings, mappings: Sequence[Mapping]) -> CheckReport:
    """Every problem `cdc run` and the consumers would meet, from both servers."""
    report = CheckReport()
    confirmed = _check_postgres(settings, mappings, report)
    _check_redis(settings, mappings, report, confirmed)
    _check_bound_tables(settings, mappings, report)
    _check_http(settings, report)
    _check_spill(settings, report)
    if settings.transactions.stream:
        report.ok.append(f"transactions: an END record per source transaction to {settings.transactions.stream}")
    return report


def _check_bound_tables(settings: Settings, mappings: Sequence[Mapping], report: CheckReport) -> None:
    """cdc run refuses to start when a table it bound was dropped and re-created, renamed, or lost or gained
    partitions holding rows while it was stopped, or when the publication's rows for the mapped tables changed
    since it last read them (see cdc.bridge.gate)."""
    gate = TableGate(settings.postgres.slot, settings.postgres.publication, mappings)
    if not gate.tables:
        return
    try:
        conn = connect(settings)
        client = connect_redis(settings.redis)
    except CdcError:
        return  # reported by the checks of each server
    try:
        with conn:
            if slot_database_error(conn, settings.postgres.slot) is not None:
                return  # the OIDs recorded are another database's: the slot's check says what to do
            problems = gate.recorded_problems(conn, client)
        report.problems.extend(problems)
        if not problems:
            report.ok.append("the mapped tables are the ones cdc run bound (same OIDs and partitions), and the "
                             "publication's rows for them the versions it last read")
    except (psycopg.Error, redis.RedisError):
        pass  # reported by the checks of each server
    finally:
        client.close()


def _check_spill(settings: Settings, report: CheckReport) -> None:
    """cdc run refuses to start when streamed transactions could not spill where batch.spill_dir says."""
    if not settings.postgres.streaming:
        return
    error = spill_dir_error(settings.batch.spill_dir, settings.source)
    if error is None:
        report.ok.append(f"streamed transactions past {settings.batch.stream_buffer_mb} MiB spill to "
                         f"{spill_place(settings.batch.spill_dir)}")
    else:
        report.problems.append(error)


def _check_http(settings: Settings, report: CheckReport) -> None:
    """cdc run serves /metrics on http.host:http.port and stops (exit 2) when it cannot bind it."""
    http = settings.http
    if not http.port:
        return
    try:
        with socket.create_server((http.host, http.port)):
            report.ok.append(f"http {http.host}:{http.port} is free for /metrics, /healthz, /readyz")
    except OSError as exc:  # a warning: on a live system the running bridge itself holds the port
        report.warnings.append(
            f"http {http.host}:{http.port}: {exc.strerror}; unless the running bridge holds it, cdc run will stop "
            "(exit 2): set http.port to a free port, or 0 to serve none")


# -- PostgreSQL ------------------------------------------------------------------------------------

def _check_postgres(settings: Settings, mappings: Sequence[Mapping], report: CheckReport) -> Lsn | None:
    """The PostgreSQL half; returns the slot's confirmed position (None without a slot)."""
    pgs = settings.postgres
    try:
        conn = connect(settings)
    except CdcError as exc:
        report.problems.append(exc)
        return None
    with conn:
        try:
            try:
                _wal_level(conn)
                report.ok.append("wal_level is logical")
                encoding = conn.execute("SELECT current_setting('server_encoding')").fetchone()[0]
                if encoding == "SQL_ASCII":
                    report.warnings.append(sql_ascii_warning(conn.info.dbname))
                if pgs.streaming and conn.info.server_version < 140000:
                    report.warnings.append(
                        f"PostgreSQL {conn.info.server_version // 10000} cannot stream transactions in progress "
                        "(14 and later can): a large transaction reaches the bridge only once the server has "
                        "decoded it whole (set postgres.streaming: false to silence this)")
            except CdcError as exc:
                report.problems.append(exc)
            superuser = _check_role(conn, report)
            _check_mappings(conn, mappings, superuser, report)
            with contextlib.ExitStack() as stack:
                sconn: psycopg.Connection | None = None
                try:
                    sconn = stack.enter_context(slot_connection(settings, conn))  # the slot's server
                except CdcError as exc:
                    report.problems.append(exc)
                if sconn is not None:
                    _check_slot_server(conn, sconn, settings, report)
                _check_publication_and_slot(conn, sconn, settings, mappings, report)
                if sconn is not None:
                    _check_failover(sconn, settings, report)
                if settings.postgres.spare_slot_dsn:
                    _check_spare(conn, settings, report)
                _check_backfills(conn, superuser, report)
                row = None if sconn is None else sconn.execute(
                    "SELECT confirmed_flush_lsn::text FROM pg_replication_slots WHERE slot_name = %s "
                    "AND wal_status IS DISTINCT FROM 'lost'", (pgs.slot,)).fetchone()  # lost: nothing to compare
            return Lsn.parse(row[0]) if row and row[0] else None
        except psycopg.Error as exc:
            report.problems.append(classify_pg_error(exc, slot=pgs.slot, publication=pgs.publication,
                                                     role=conn.info.user))
    return None


def _check_role(conn: psycopg.Connection, report: CheckReport) -> bool:
    role = conn.info.user
    replication, superuser = conn.execute(
        "SELECT rolreplication, rolsuper FROM pg_roles WHERE rolname = current_user").fetchone()
    if replication or superuser:
        report.ok.append(f"role {role} may replicate")
    else:
        report.problems.append(PrivilegeError(
            f"postgres role {role} lacks the REPLICATION attribute: cdc run cannot read the slot",
            hint=f"run: ALTER ROLE {role} REPLICATION"))
    return superuser


def _check_mappings(conn: psycopg.Connection, mappings: Sequence[Mapping], superuser: bool, report: CheckReport) -> None:
    catalog = TypeCatalog()
    role = conn.info.user
    resync = resync_tables(mappings)
    for m in mappings:
        if m.table is None:
            report.ok.append(f"entity {m.entity}: logical messages with prefix {m.message_prefix!r} -> {m.stream_key()}")
            continue
        try:
            bind_live(conn, m, catalog)
        except CdcError as exc:
            if isinstance(exc, MappingError) and m.table in resync:  # cdc run resyncs it, as cdc status then says
                report.warnings.append(f"{exc.message}: cdc run gives up its stream's changes and resyncs it from the "
                                       f"table once fixed ({m.entity} says on_unaccountable: resync); {exc.hint}")
            else:
                report.problems.append(exc)
            continue
        ambiguous = key_uniqueness_problem(conn, m)
        if ambiguous is not None:
            report.problems.append(ambiguous)
            continue
        schema, table = m.table
        usage, select = (True, True) if superuser else conn.execute(
            "SELECT has_schema_privilege(%s, 'USAGE'), has_table_privilege(format('%%I.%%I', %s::text, %s::text), 'SELECT')",
            (schema, schema, table)).fetchone()
        if not usage:
            report.problems.append(PrivilegeError(
                f"{m.where}: entity {m.entity}: role {role} may not use schema {schema}",
                hint=f"run: GRANT USAGE ON SCHEMA {schema} TO {role}"))
        elif not select:
            report.problems.append(PrivilegeError(
                f"{m.where}: entity {m.entity}: role {role} may not read {schema}.{table} "
                "(snapshots, backfills and cdc reconcile read it)",
                hint=f"run: GRANT SELECT ON TABLE {schema}.{table} TO {role}"))
        else:
            report.ok.append(f"entity {m.entity}: {m.qualified_table} -> {', '.join(m.stream_keys())}")


def _check_slot_server(conn: psycopg.Connection, sconn: psycopg.Connection, settings: Settings,
                       report: CheckReport) -> None:
    """With postgres.slot_dsn: the standby can decode (PostgreSQL 16+, wal_level, hot_standby_feedback, a
    physical slot) and belongs to the primary's cluster."""
    if sconn is conn:
        return
    if not in_recovery(sconn):
        report.warnings.append("postgres.slot_dsn names a server that accepts writes, not a standby (a promoted "
                               "standby?): the slot is decoded there; its writes still go to postgres.dsn")
    else:
        problems = standby_problems(sconn, conn)
        for what, fix in problems:
            report.problems.append(SourceError(what, hint=fix))
        if not problems:
            report.ok.append("postgres.slot_dsn: the standby can decode (PostgreSQL 16+, wal_level logical on both, "
                             "hot_standby_feedback on, a physical slot on the primary)")
    primary, standby = read_history(settings.postgres.dsn), read_history(settings.postgres.slot_dsn)
    if primary.system_id != standby.system_id:
        report.problems.append(SourceError(
            f"postgres.slot_dsn names a server of another cluster (system identifier {standby.system_id}, the "
            f"primary's is {primary.system_id}): it does not replay the primary's WAL",
            hint="point postgres.slot_dsn at a physical standby of postgres.dsn's server"))


def _check_spare(conn: psycopg.Connection, settings: Settings, report: CheckReport) -> None:
    """postgres.spare_slot_dsn: a server of the primary's cluster, a standby there able to decode, and the spare
    slot on it no further than what Redis holds (else a warning: cdc run streams on, without a stand-in)."""
    pgs = settings.postgres
    try:
        with psycopg.connect(pgs.spare_slot_dsn, autocommit=True, options=SESSION_OPTIONS, connect_timeout=10) as spare:
            if read_history(pgs.spare_slot_dsn).system_id != read_history(pgs.dsn).system_id:
                report.problems.append(SourceError(
                    "postgres.spare_slot_dsn names a server of another cluster (another system identifier): a spare "
                    "there decodes other transactions", hint="name the primary or a physical standby of it"))
                return
            if in_recovery(spare):
                for what, fix in standby_problems(spare, conn):
                    report.problems.append(SourceError(what.replace("postgres.slot_dsn", "postgres.spare_slot_dsn"),
                                                       hint=fix))
            reading = spare_slot.read(spare, pgs.slot)
    except psycopg.Error as exc:
        report.warnings.append(f"postgres.spare_slot_dsn: its server did not answer ({str(exc).strip().splitlines()[0]}); "
                               "cdc run streams on without a spare until it does")
        return
    held = redis_held(settings)
    why = spare_slot.judge(reading, held if isinstance(held, Lsn) else None)
    if why is None:
        report.ok.append(f"postgres.spare_slot_dsn: the spare slot {pgs.slot} on the "
                         f"{'primary' if reading.on_primary else 'standby'} could stand in for the slot (no further "
                         "than what Redis holds)")
    else:
        report.warnings.append(f"postgres.spare_slot_dsn: the spare slot cannot stand in for the slot now: {why}")


def _check_publication_and_slot(conn: psycopg.Connection, sconn: psycopg.Connection | None, settings: Settings,
                                mappings: Sequence[Mapping], report: CheckReport) -> None:
    pgs = settings.postgres
    init = "run: cdc init --config <file> (as the tables' owner)"
    pub = read_publication(conn, pgs.publication)
    if not pub.exists:
        report.problems.append(SlotError(f"publication {pgs.publication!r} does not exist", hint=init))
    slot = None if sconn is None else sconn.execute(
        "SELECT plugin, wal_status FROM pg_replication_slots WHERE slot_name = %s", (pgs.slot,)).fetchone()
    # an operation left out is never decoded: once the slot exists, what it held meanwhile needs a rebuild
    fix = "run: cdc init --config <file> as the tables' owner (or {alter})"
    if slot is not None:
        fix += ", then cdc recover --config <file> (rebuilds the streams from the tables), then cdc run"
    problem = operations_problem(pub, needed_operations(mappings), fix)
    if problem is not None:
        report.problems.append(problem)
    elif pub.exists and _tables(mappings):
        report.ok.append(f"publication {pgs.publication} publishes {', '.join(PUBLISH[op] for op in PUBLISH if op in pub.publishes)}")
    # a publication cdc init would create publishes updates and deletes
    would = pub if pub.exists else Publication(pgs.publication, exists=True)
    resynced = _resynced_by_run(settings, mappings)
    for c in read_coverage(conn, pgs.publication, _tables(mappings)).values():
        if c.oid is None:
            continue  # binding the mapping reported it
        problem = identity_problem(c, would)
        if problem is not None:
            report.problems.append(problem)
        problem = publication_problem(c, pub, init) if pub.exists else None
        if problem is not None and (c.schema, c.name) in resynced:
            report.warnings.append(f"{problem.message}: cdc run gives up its stream's changes and resyncs it from the "
                                   f"table once it is back (on_unaccountable: resync); {problem.hint}")
        elif problem is not None:
            report.problems.append(problem)
        elif pub.exists:
            report.ok.append(f"publication {pgs.publication} covers {c.qualified}"
                             + (" and every partition of it" if c.partitioned else ""))
            _check_columns(c, mapped_columns(mappings).get((c.schema, c.name), ()), pub, report,
                           (c.schema, c.name) in resynced)
    if sconn is None:
        return  # the slot's server could not be reached: reported
    held = redis_held(settings) if slot is None else None
    if slot is None and held is None:  # a new deployment
        report.problems.append(SlotError(f"replication slot {pgs.slot!r} does not exist", hint=init))
    elif slot is None:  # changes since Redis' record were lost to it
        report.problems.append(missing_slot_error(pgs.slot, held))
    elif slot[1] == "lost":
        report.problems.append(invalidated_slot_error(pgs.slot))
    elif (other := slot_database_error(sconn, pgs.slot)) is not None:
        report.problems.append(other)
    elif slot[0] != "pgoutput":
        report.problems.append(SlotError(f"replication slot {pgs.slot!r} uses plugin {slot[0]!r}, not pgoutput",
                                         hint="drop it or choose another postgres.slot"))
    else:
        report.ok.append(f"slot {pgs.slot} (pgoutput) exists")


def _resynced_by_run(settings: Settings, mappings: Sequence[Mapping]) -> set[tuple[str, str]]:
    """The `on_unaccountable: resync` tables cdc run resyncs rather than refuses when they are out of the publication
    or sent with fewer columns: those a bridge bound, is resyncing, or `cdc init` recorded published (Redis says;
    `cdc.bridge.gate`). Nothing when Redis cannot be read (its own check says why)."""
    resync = resync_tables(mappings)
    if not resync:
        return set()
    slot = settings.postgres.slot
    try:
        client = connect_redis(settings.redis)
    except CdcError:
        return set()
    try:
        raw = client.hmget(keys.bound_tables_key(slot), [ROWS_FIELD])[0]
        known = set(load_bound(client, slot)) | set(load_resync(client, slot))
        if raw is not None:
            known |= set(PublicationRows.decode(raw).tables)
        return resync & known
    except (redis.RedisError, ValueError):
        return set()
    finally:
        client.close()


def _check_columns(c: TableCoverage, mapped: Sequence[str], pub: Publication, report: CheckReport,
                   resynced: bool = False) -> None:
    """Less than the mappings need stops cdc run (a `resync` table's stream is resynced: a warning); more is sent
    for nothing (the bridge drops it)."""
    problem = sends_less(c, mapped, pub.name, fix=INIT_FIX.replace("run: cdc init", "run: cdc init --config <file>", 1))
    if problem is not None and resynced:
        report.warnings.append(f"{problem.message}: cdc run gives up its stream's changes and resyncs it from the "
                               f"table once fixed (on_unaccountable: resync); {problem.hint}")
        return
    if problem is not None:
        report.problems.append(problem)
        return
    column_plan = plan(c, mapped, pub)
    extra = surplus(column_plan)
    if extra:
        report.warnings.append(
            f"publication {pub.name} sends column(s) {', '.join(extra)} of {c.qualified} that no mapping reads "
            "(the bridge drops them): run cdc init --config <file> to send only the columns the mappings need")
    elif column_plan.reason is not None:
        report.ok.append(f"publication {pub.name} sends every column of {c.qualified} ({column_plan.reason}): the "
                         "bridge drops the unmapped ones")
    else:
        report.ok.append(f"publication {pub.name} sends only the columns of {c.qualified} the mappings and its "
                         f"replica identity need: {', '.join(column_plan.wanted)}")


def redis_held(settings: Settings) -> Lsn | None | bool:
    """How far Redis records holding the source for the slot (see `redis_record`), for a missing slot's advice."""
    try:
        client = connect_redis(settings.redis)
    except Exception:  # a bad URL or an unreachable cluster: the Redis half reports it
        return True
    try:
        return redis_record(client, settings.postgres.slot)
    finally:
        client.close()


def _check_failover(conn: psycopg.Connection, settings: Settings, report: CheckReport) -> None:
    """Whether the slot would survive a failover to a standby: warnings (not refusals) where a standby is in
    evidence (a physical replication slot, synchronized_standby_slots, or a DSN naming several hosts)."""
    pgs = settings.postgres
    hosts = len(conninfo_to_dict(pgs.dsn).get("host", "").split(","))
    standbys = conn.execute("SELECT count(*) FROM pg_replication_slots WHERE slot_type = 'physical'").fetchone()[0]
    ha = hosts > 1 or standbys > 0
    if not supports_failover(conn):
        if pgs.failover_slot:
            text = (f"postgres.failover_slot is ignored: PostgreSQL {conn.info.server_version // 10000} has no failover "
                    "slots (17 and later), so after a failover to a standby the slot is gone and the changes since "
                    "Redis' recorded position must be recovered (cdc init, then cdc recover)")
            (report.warnings if ha else report.ok).append(text)
        return
    if not pgs.failover_slot:
        report.ok.append(f"slot {pgs.slot}: postgres.failover_slot is false, so the slot would not survive a failover")
        return
    if conn.execute("SELECT 1 FROM pg_replication_slots WHERE slot_name = %s", (pgs.slot,)).fetchone() is None:
        return  # reported above
    held = redis_held(settings)
    copies = () if pgs.slot_dsn else read_copies(conn, pgs.dsn, pgs.standbys, pgs.slot)  # a standby's slot: see failover
    readiness = failover_readiness(conn, pgs.slot, copies, held if isinstance(held, Lsn) else None)
    ha = ha or bool(readiness.synchronized_standby_slots) or bool(pgs.standbys.strip())
    if readiness.ready:
        report.ok.append(f"failover-ready: yes: {readiness.reason}")
    elif not ha:
        report.ok.append(f"failover-ready: no standby (no physical replication slot): {readiness.reason}")
    else:
        for problem in readiness.problems:
            report.warnings.append(f"slot {pgs.slot} would not survive a failover: {problem}")
        for unknown in readiness.unknowns:
            report.warnings.append(f"slot {pgs.slot}: failover readiness unknown: {unknown}")
    if ha and hosts < 2:
        report.warnings.append(
            "postgres.dsn names one host: after a failover the bridge follows the new primary only if this address "
            "moves to it; otherwise name every server, e.g. host=a,b port=5432,5432 target_session_attrs=read-write")


def emit_message_signature(conn: psycopg.Connection) -> str:
    """pg_logical_emit_message's text variant: PostgreSQL 17 added a fourth argument (flush)."""
    return "pg_logical_emit_message(boolean, text, text" + (", boolean)" if conn.info.server_version >= 170000 else ")")


def _check_backfills(conn: psycopg.Connection, superuser: bool, report: CheckReport) -> None:
    """What snapshots (cdc run) and backfills (cdc backfill) need: the table, its grants, logical messages."""
    role = conn.info.user
    if not conn.execute("SELECT to_regclass('public.cdc_backfills') IS NOT NULL").fetchone()[0]:
        report.problems.append(SlotError(
            "table public.cdc_backfills does not exist: snapshots and backfills cannot run",
            hint="run: cdc init --config <file> (as the tables' owner), or apply what cdc sql --file 25_backfills.sql prints"))
        return
    if superuser:
        report.ok.append("snapshots and backfills: cdc_backfills is usable")
        return
    rights = conn.execute(
        "SELECT has_table_privilege('public.cdc_backfills', 'SELECT'), has_table_privilege('public.cdc_backfills', 'UPDATE'), "
        "has_table_privilege('public.cdc_backfills', 'INSERT'), has_sequence_privilege('public.cdc_backfills_id_seq', 'USAGE'), "
        "has_function_privilege(%s, 'EXECUTE')", (emit_message_signature(conn),)).fetchone()
    grants = BACKFILL_GRANTS.format(role=role)
    if not (rights[0] and rights[1]):
        report.problems.append(PrivilegeError(
            f"role {role} may not read and update public.cdc_backfills: cdc run stops at the first snapshot or backfill",
            hint=f"run: {grants}"))
    elif not (rights[2] and rights[3]):
        report.problems.append(PrivilegeError(
            f"role {role} may not insert into public.cdc_backfills: cdc backfill is refused", hint=f"run: {grants}"))
    else:
        report.ok.append(f"snapshots and backfills: role {role} may use cdc_backfills")
    if not rights[4]:
        report.problems.append(PrivilegeError(
            f"role {role} may not call pg_logical_emit_message: no heartbeats, snapshots or backfills",
            hint=f"run: GRANT EXECUTE ON FUNCTION {emit_message_signature(conn)} TO {role}"))


# -- Redis -----------------------------------------------------------------------------------------

def acl_probes(settings: Settings, mappings: Sequence[Mapping]) -> list[tuple[str, tuple[str, ...]]]:
    """(who sends it, command) for every command the bridge, consumers, status and trim send, with their keys."""
    group, consumer = "<group>", "<consumer>"
    flushed = keys.flushed_key(settings.postgres.slot)
    probes: list[tuple[str, tuple[str, ...]]] = [
        ("cdc run", ("PING",)), ("cdc run", ("INFO", "memory")), ("cdc run", ("SCRIPT", "LOAD", "return 1")),
        ("cdc run", ("GET", flushed)), ("cdc run", ("SET", flushed, "0")), ("cdc status", ("SCAN", "0")),
        ("cdc trim", ("HINCRBY", keys.TRIM_STATS, "f", "1")), ("cdc status", ("HGETALL", keys.TRIM_STATS)),
        ("cdc run", ("HMGET", keys.TRIM_ACCOUNTED, "f")), ("cdc trim", ("HSET", keys.TRIM_ACCOUNTED, "f", "v")),
        ("consumers", ("XADD", keys.dead_letter_key(group), "*", "f", "v")),
        ("consumers", ("MULTI",)), ("consumers", ("EXEC",)),
        ("consumers", ("HMGET", keys.bridge_state_key(settings.postgres.slot), "data_loss_at_ms")),
        ("cdc run", ("HSET", keys.bridge_state_key(settings.postgres.slot), "f", "v")),
        ("cdc run", ("HDEL", keys.bridge_state_key(settings.postgres.slot), "f")),
        ("cdc status", ("HGETALL", keys.bridge_state_key(settings.postgres.slot))),
        ("cdc run", ("HGETALL", keys.bound_tables_key(settings.postgres.slot))),
        ("cdc run", ("HSET", keys.bound_tables_key(settings.postgres.slot), "f", "v")),
        ("cdc run", ("HMGET", keys.bound_tables_key(settings.postgres.slot), "f")),
        ("cdc run", ("HGETALL", keys.source_key(settings.postgres.slot))),
        ("cdc run", ("HGETALL", keys.BRIDGE_SLOTS)), ("cdc run", ("HGETALL", keys.STREAM_OWNERS)),
        ("cdc run", ("EVAL", "return 1", "2", keys.BRIDGE_SLOTS, keys.STREAM_OWNERS)),
        ("cdc run", ("HSET", keys.BRIDGE_SLOTS, "f", "v")), ("cdc run", ("HSET", keys.STREAM_OWNERS, "f", "v")),
        ("cdc run", ("HMGET", keys.BRIDGE_SLOTS, "f")), ("cdc run", ("HMGET", keys.STREAM_OWNERS, "f")),
        ("cdc run", ("HSET", keys.source_key(settings.postgres.slot), "f", "v")),
    ]
    if settings.redis.append == "transaction":  # appends: MULTI/EXEC under WATCH of the marks and the record
        probes += [("cdc run", ("MULTI",)), ("cdc run", ("EXEC",)), ("cdc run", ("WATCH", flushed)),
                   ("cdc run", ("MGET", flushed))]
    else:
        probes.append(("cdc run", ("EVAL", "return 1", "1", flushed)))
    if settings.redis.wait_replicas:
        probes.append(("cdc run", ("WAIT", "1", "0")))
    if is_sentinel_url(settings.redis.url):  # every connection checks it reached the master
        probes.append(("cdc run", ("ROLE",)))
    for s in written_streams(settings, mappings):
        mark, lease, epoch = keys.mark_key(s), keys.lease_key(s, group), keys.lease_epoch_key(s, group)
        probes += [
            ("cdc run", ("TYPE", s)), ("cdc run", ("XINFO", "STREAM", s)), ("cdc run", ("XINFO", "GROUPS", s)),
            ("cdc run", ("XPENDING", s, group)), ("cdc run", ("XRANGE", s, "-", "+", "COUNT", "1")),
            *((("cdc run", ("XADD", s, "*", "f", "v")), ("cdc run", ("SET", mark, "0")),
               ("cdc run", ("WATCH", mark, s)), ("cdc run", ("MGET", mark)))
              if settings.redis.append == "transaction" else
              (("cdc run", ("EVALSHA", _ANY_SHA, "2", s, mark)), ("cdc run", ("EVAL", "return 1", "2", s, mark)))),
            ("cdc status", ("XINFO", "STREAM", s)), ("cdc status", ("XINFO", "GROUPS", s)),
            ("cdc status", ("XLEN", s)), ("cdc status", ("XREVRANGE", s, "+", "-", "COUNT", "1")),
            ("cdc status", ("GET", mark)), ("cdc trim", ("XPENDING", s, group)),
            ("cdc trim", ("XTRIM", s, "MINID", "0")), ("cdc trim", ("HGETALL", keys.holds_key(s))),
            ("cdc trim", ("EVAL", "return 1", "2", s, keys.removed_key(s))),
            ("cdc trim", ("HINCRBY", keys.removed_key(s), "count", "1")),
            ("cdc trim", ("HMGET", keys.removed_key(s), "count")), ("cdc trim", ("HSET", keys.removed_key(s), "count", "0")),
            ("cdc trim", ("HMGET", keys.TRIM_STATS, "f")),
            ("cdc run", ("HMGET", keys.removed_key(s), "count", "deleted")),
            ("cdc run", ("HMGET", keys.TRIM_STATS, "f")), ("cdc run", ("HSET", keys.removed_key(s), "count", "0")),
            ("consumers", ("XINFO", "STREAM", s)), ("consumers", ("HMGET", keys.removed_key(s), "count", "deleted")),
            ("consumers", ("HMGET", keys.TRIM_STATS, "f")), ("consumers", ("HMGET", keys.TRIM_ACCOUNTED, "f")),
            ("consumers", ("XPENDING", s, group)),
            ("consumers", ("XGROUP", "CREATE", s, group, "$", "MKSTREAM")),
            ("consumers", ("XREADGROUP", "GROUP", group, consumer, "COUNT", "1", "STREAMS", s, ">")),
            ("consumers", ("XACK", s, group, "0-1")), ("consumers", ("XAUTOCLAIM", s, group, consumer, "1", "0-0")),
            ("consumers", ("XCLAIM", s, group, consumer, "1", "0-1")), ("consumers", ("XRANGE", s, "-", "+")),
            ("consumers", ("EVALSHA", _ANY_SHA, "2", lease, epoch)), ("consumers", ("SET", lease, "x", "PX", "1")),
            ("consumers", ("PEXPIRE", lease, "1")), ("consumers", ("DEL", lease)), ("consumers", ("INCR", epoch)),
            ("consumers", ("HINCRBY", keys.failures_key(s, group), "0-1", "1")),
            ("consumers", ("HSET", keys.failures_key(s, group), "0-1:error", "e")),
            ("consumers", ("HMGET", keys.failures_key(s, group), "0-1", "0-1:error")),
            ("consumers", ("HDEL", keys.failures_key(s, group), "0-1")),
            ("consumers", ("XINFO", "GROUPS", s)), ("consumers", ("XPENDING", s, group, "-", "+", "1")),
        ]
    return probes


def _where(url: str) -> str:
    if is_sentinel_url(url):
        return parse_sentinel_url(url).describe()
    parts = urlsplit(url)
    return f"redis at {parts.hostname or parts.path}{':' + str(parts.port) if parts.port else ''}"


def _check_claims(client, settings: Settings, streams: dict[str, str], server: ServerHistory, report: CheckReport) -> None:
    """What cdc run refuses because another bridge on this Redis holds it: the slot's name, the publication,
    a stream (`cdc.sink.claims`); a stream this slot claims that no mapping writes is a warning."""
    pgs = settings.postgres
    problems = claim_problems(client, BridgeIdentity(pgs.slot, server.system_id, server.database, pgs.publication),
                              streams)
    report.problems += problems
    if not problems:
        report.ok.append(f"slot {pgs.slot}, publication {pgs.publication} and the {len(streams)} mapped stream(s) are "
                         "no other bridge's on this redis")
    for stream in unmapped_owned(client, pgs.slot, streams):
        report.warnings.append(
            f"stream {stream} is claimed by slot {pgs.slot}, but no mapping of this config writes it: if another config "
            "names the same slot, give it its own postgres.slot and postgres.publication (cdc run would acknowledge its "
            f"changes without an entry); if the mapping was removed, release it: redis-cli HDEL {keys.STREAM_OWNERS} {stream}")


def _check_history(client, settings: Settings, server: ServerHistory, report: CheckReport,
                   confirmed: Lsn | None) -> bool:
    """True when Redis holds positions the server's history lacks (cdc run refuses, exit 6; recorded for status)."""
    try:
        check_source_history(client, settings.postgres.slot, server, record=False,
                             reread=lambda: read_history(settings.postgres.slot_server),
                             decoded_here=confirmed if settings.postgres.slot_dsn else None)
    except DataLossError as exc:
        report.problems.append(exc)
        return True
    report.ok.append(f"postgres system {server.system_id}, timeline {server.timeline}: redis holds nothing "
                     "this server's history lacks")
    return False


def _check_redis(settings: Settings, mappings: Sequence[Mapping], report: CheckReport, confirmed: Lsn | None) -> None:
    if is_sentinel_url(settings.redis.url):
        from .sentinels import check_sentinels

        found = check_sentinels(settings.redis)
        report.ok += found.ok
        report.warnings += found.warnings
        report.problems += found.problems
        if found.problems:
            return
    where = _where(settings.redis.url)
    try:
        client = connect_redis(settings.redis)
    except CdcError as exc:
        report.problems.append(exc)
        return
    try:
        node = client.get_redis_connection(client.get_random_node()) if settings.redis.cluster else client
        node.ping()
        report.ok.append(f"{where} answers")
        _check_durability(node, where, settings.redis.wait_replicas, report)
        _check_acl(node, where, acl_probes(settings, mappings), report)
        streams = written_streams(settings, mappings)
        try:
            server = read_history(settings.postgres.slot_server)
        except CdcError:  # the connection's problem is reported by the postgres checks
            server = None
        if server is not None:
            _check_claims(client, settings, streams, server, report)
        diverged = server is not None and _check_history(client, settings, server, report, confirmed)
        if confirmed is not None and not diverged:  # what cdc run checks first on every connection
            try:
                check_redis_has_flushed(client, settings.postgres.slot, confirmed)
                report.ok.append(f"{where} holds the source up to slot {settings.postgres.slot}'s position {confirmed}")
            except DataLossError as exc:
                report.problems.append(exc)
        if settings.redis.append == "script":
            from ..sink.script import SCRIPT_MODE_BLIND

            report.warnings.append(SCRIPT_MODE_BLIND)
        problems = stream_problems(client, streams)  # a key of another type, a stream whose history vanished
        report.problems += problems
        if streams and not problems:
            report.ok.append(f"{where}: every mapped stream key holds a stream, or nothing yet")
    except CdcError as exc:  # a refused login or a TLS mismatch, named by the connection (cdc.sink.redisconn)
        report.problems.append(exc)
    except redis.AuthenticationError as exc:
        report.problems.append(PublishError(f"{where} refused the login: {exc}",
                                            hint="check the user and password in redis.url"))
    except (redis.ConnectionError, redis.TimeoutError) as exc:
        report.problems.append(TransientError(f"{where} is unreachable: {exc}",
                                              hint="check redis.url and that Redis is running"))
    except redis.RedisError as exc:
        report.problems.append(PublishError(f"{where} refused: {exc}", hint="check the redis user's ACL"))
    finally:
        client.close()


def _check_durability(node: redis.Redis, where: str, wait_replicas: int, report: CheckReport) -> None:
    persistence, memory = node.info("persistence"), node.info("memory")
    replicas = node.info("replication").get("connected_slaves", 0)
    if wait_replicas > replicas:
        report.warnings.append(
            f"{where} has {replicas} connected replica(s) but redis.wait_replicas is {wait_replicas}: "
            "cdc run retries every batch until enough replicas connect")
    if not persistence.get("aof_enabled"):
        report.warnings.append(
            f"{where} runs without AOF (appendonly no): a restart loses entries the slot was already told "
            "Redis holds (cdc run then stops with exit 6); set appendonly yes (deploy/redis/redis.conf)")
    policy = memory.get("maxmemory_policy", "noeviction")
    if policy != "noeviction":
        what = "stream keys and high-water marks" if policy.startswith("allkeys") else "leases and holds (keys with a TTL)"
        report.warnings.append(
            f"{where} has maxmemory-policy {policy}: when full it evicts {what}; set maxmemory-policy noeviction "
            "(the bridge pauses at redis.pause_at_memory_fraction instead)")


def _check_acl(node: redis.Redis, where: str, probes: list[tuple[str, tuple[str, ...]]], report: CheckReport) -> None:
    try:
        user = node.execute_command("ACL", "WHOAMI")
        user = user.decode() if isinstance(user, bytes) else str(user)
        pipe = node.pipeline(transaction=False)
        for _, command in probes:
            pipe.execute_command("ACL", "DRYRUN", user, *command)
        verdicts = pipe.execute(raise_on_error=False)
    except redis.ResponseError as exc:  # NoPermissionError, or a Redis older than 7 (no ACL DRYRUN)
        if isinstance(exc, redis.exceptions.NoPermissionError) or "unknown" in str(exc).lower():
            report.warnings.append(
                f"{where}: cannot ask the ACL which commands are allowed ({exc}); allow +acl|whoami +acl|dryrun "
                "(Redis 7) to let cdc check verify them")
            return
        raise
    refused: dict[tuple[str, str], str] = {}
    for (who, command), verdict in zip(probes, verdicts):
        text = verdict.decode() if isinstance(verdict, bytes) else str(verdict)
        if text != "OK":
            refused.setdefault((command[0].lower(), who), text)
    for (command, who), text in refused.items():
        report.problems.append(PublishError(
            f"{where}: redis user {user!r} may not run {command.upper()} ({who} sends it): {text}",
            hint=f"add +{command} and the keys ~cdc:* ~{{cdc:* to the user's ACL (see deploy/redis/redis.conf)"))
    if not refused:
        report.ok.append(f"{where}: user {user!r} may run the {len({c[0] for _, c in probes})} commands cdc sends")
