"""What `cdc status` shows: the slot's position and lag, and each stream's state (`status_view` draws it)."""

from __future__ import annotations

from collections.abc import Sequence

import psycopg
import redis

from datetime import datetime, timezone

from .. import keys
from .admin import connect, slot_connection
from .preflight import redis_held
from ..bridge.backfill import has_error_column
from ..bridge.gate import RESYNC_FIX, load_resync
from ..bridge.guards import invalidated_slot_error, missing_slot_error, redis_record
from ..config import Settings
from ..sink.entry import reply_text
from ..exits import as_cdc_error
from ..source.lsn import lsn_text
from ..mapping.model import Mapping
from ..sink.claims import other_bridges
from ..sink.publisher import Publisher
from ..sink.redisconn import connect_redis
from ..source.failover import failover_readiness
from ..source.lsn import Lsn
from ..source.standbys import read_copies
from ..source.slot_server import POSITION_SQL
from ..source.replication import SESSION_OPTIONS, classify_pg_error
from ..source import spare_slot

__all__ = ["STALE_AFTER_S", "collect"]  # `cdc.ops.status_view.render` shows it

#: a consumer that has not read for this long is listed as stale (`cdc status --stale-after-s`)
STALE_AFTER_S = 3600.0

SLOT_QUERY = f"""
SELECT s.active, s.confirmed_flush_lsn::text, ({POSITION_SQL})::text,
       pg_wal_lsn_diff({POSITION_SQL}, s.confirmed_flush_lsn)::bigint,
       pg_wal_lsn_diff({POSITION_SQL}, s.restart_lsn)::bigint, s.wal_status,
       extract(epoch FROM r.flush_lag)::float8, current_setting('max_slot_wal_keep_size'), s.safe_wal_size
FROM pg_replication_slots s LEFT JOIN pg_stat_replication r ON r.pid = s.active_pid
WHERE s.slot_name = %s
"""

#: what the server decoded for the slot (PostgreSQL 14+): how much it spilled to its own disk
#: (`pg_replslot/`) and how much it streamed in progress (`postgres.streaming`)
DECODING_QUERY = """
SELECT total_txns, total_bytes, spill_txns, spill_bytes, stream_txns, stream_bytes, stats_reset
FROM pg_stat_replication_slots WHERE slot_name = %s
"""


def collect(settings: Settings, mappings: Sequence[Mapping], stale_after_s: float = STALE_AFTER_S) -> dict:
    """Everything `cdc status` shows: the slot, backfills and reconciliations (PostgreSQL), then the bridge,
    each stream and its groups (Redis)."""
    result: dict = {"slot": None, "streams": []}
    row, decoding, failover, backfills, reconciliations = _read_postgres(settings)
    result["reconciliations"] = [
        {"spec": r[0], "consumer": r[1], "status": r[2], "reason": r[3],
         "finished_at": r[4].isoformat(timespec="seconds").replace("+00:00", "Z"), "dry_run": r[5],
         "keys_compared": r[6], "keys_drifted": r[7], "position": lsn_text(r[8])}
        for r in reconciliations
    ]
    result["backfills"] = [
        {"id": b[0], "entity": b[1], "status": b[2], "rows_done": b[3], "rows_total": b[4], "chunks": b[5],
         "where": b[6], "rows_per_s": round(b[3] / b[7], 1) if b[7] else None, "error": b[8]}
        for b in backfills
    ]
    if row:
        result["slot"] = {
            "name": settings.postgres.slot, "active": row[0], "confirmed_flush_lsn": row[1],
            "current_wal_lsn": row[2], "lag_bytes": row[3], "lag_seconds": row[6],
            "retained_wal_bytes": row[4], "max_slot_wal_keep_size": row[7], "safe_wal_size_bytes": row[8],
            "wal_status": row[5], "decoding": _decoding(decoding, settings.postgres.streaming),
            "failover": failover.as_dict(),
        }
    if settings.postgres.spare_slot_dsn:
        result["spare"] = spare_state(settings)
    _collect_redis(settings, mappings, stale_after_s, result)
    return result


def _read_postgres(settings: Settings) -> tuple:
    """The slot's row, its decoding statistics and failover readiness, the backfills and the last reconciliations."""
    with connect(settings) as conn:
        try:
            with slot_connection(settings, conn) as sconn:  # the slot's server: the primary, or a standby
                row = sconn.execute(SLOT_QUERY, (settings.postgres.slot,)).fetchone()
                decoding = (sconn.execute(DECODING_QUERY, (settings.postgres.slot,)).fetchone()
                            if row and sconn.info.server_version >= 140000 else None)  # the view is new in 14
                failover = _failover(sconn, settings) if row else None
        except psycopg.Error as exc:
            raise classify_pg_error(exc) from exc
        try:
            readable = conn.execute(
                "SELECT coalesce(has_table_privilege(to_regclass('public.cdc_backfills'), 'SELECT'), false)"
            ).fetchone()[0]
            error = "error" if readable and has_error_column(conn) else "NULL::text"
            backfills = conn.execute(
                "SELECT id, entity, status, rows_done, rows_total, chunks, where_sql, "
                f"extract(epoch FROM updated_at - created_at)::float8, {error} FROM cdc_backfills WHERE slot = %s ORDER BY id",
                (settings.postgres.slot,),
            ).fetchall() if readable else []
            reconciliations = conn.execute(
                "SELECT DISTINCT ON (spec, consumer) spec, consumer, status, reason, finished_at, dry_run, "
                "keys_compared, keys_drifted, position FROM cdc_reconcile_runs ORDER BY spec, consumer, id DESC"
            ).fetchall() if conn.execute(
                "SELECT coalesce(has_table_privilege(to_regclass('public.cdc_reconcile_runs'), 'SELECT'), false)"
            ).fetchone()[0] else []
        except psycopg.Error as exc:
            raise classify_pg_error(exc) from exc
    return row, decoding, failover, backfills, reconciliations


def _failover(conn: psycopg.Connection, settings: Settings):
    """Failover readiness, each standby's copy read where it is and held to what Redis holds."""
    pgs = settings.postgres
    copies = () if pgs.slot_dsn else read_copies(conn, pgs.dsn, pgs.standbys, pgs.slot)  # a standby's slot: see failover
    return failover_readiness(conn, pgs.slot, copies, _redis_holds(settings))


def spare_state(settings: Settings) -> dict:
    """The spare slot of postgres.spare_slot_dsn: whether it could stand in for the slot now, held to what Redis
    holds (`cdc.source.spare_slot`)."""
    pgs = settings.postgres
    try:
        with psycopg.connect(pgs.spare_slot_dsn, autocommit=True, options=SESSION_OPTIONS, connect_timeout=10) as conn:
            reading = spare_slot.read(conn, pgs.slot)
    except psycopg.Error as exc:
        return {"ready": False, "reason": f"its server did not answer: {str(exc).strip().splitlines()[0]}",
                "confirmed_flush_lsn": None, "behind_bytes": None, "on": None}
    held = _redis_holds(settings)
    why = spare_slot.judge(reading, held)
    behind = None if held is None or reading.confirmed is None else int(held) - int(reading.confirmed)
    return {"ready": why is None, "reason": why or "it exists and is no further than what Redis holds",
            "confirmed_flush_lsn": None if reading.confirmed is None else str(reading.confirmed),
            "behind_bytes": behind, "on": "primary" if reading.on_primary else "standby"}


def _redis_holds(settings: Settings) -> Lsn | None:
    """How far Redis records holding the source (None: no record, or Redis cannot say)."""
    held = redis_held(settings)
    return held if isinstance(held, Lsn) else None


def _collect_redis(settings: Settings, mappings: Sequence[Mapping], stale_after_s: float, result: dict) -> None:
    """The bridge's state, other bridges, the slot's alarm, each stream and the stale consumers, into `result`."""
    publisher = Publisher(settings.redis.url, cluster=settings.redis.cluster, settings=settings.redis)
    client = connect_redis(settings.redis)
    try:
        streams = [(m.entity, s) for m in mappings for s in m.stream_keys()]
        if settings.transactions.stream:
            streams.append((keys.TRANSACTIONS_OWNER, settings.transactions.stream))
        marks = publisher.marks(s for _, s in streams)
        trim_stats = {k.decode(): int(v) for k, v in client.hgetall(keys.TRIM_STATS).items()}
        bridge_state = {k.decode(): v.decode() for k, v in client.hgetall(keys.bridge_state_key(settings.postgres.slot)).items()}
        result["bridge"] = _bridge(bridge_state, bool(result["slot"] and result["slot"]["active"]))
        result["other_bridges"] = other_bridges(client, settings.postgres.slot)  # on the same Redis
        result["resyncing"] = _resyncing(client, settings.postgres.slot, mappings)
        alarm = (missing_slot_error(settings.postgres.slot, redis_record(client, settings.postgres.slot))
                 if result["slot"] is None else
                 invalidated_slot_error(settings.postgres.slot) if result["slot"]["wal_status"] == "lost" else None)
        # `cdc status` exits 4 with it, after showing everything else
        result["slot_alarm"] = None if alarm is None else {"error": alarm.message, "fix": alarm.hint}
        for entity, stream in streams:
            result["streams"].append(_stream(client, entity, stream, marks.get(stream), trim_stats, stale_after_s))
        result["stale_consumers"] = [
            {"stream": s["stream"], "group": g["group"], "consumer": c["name"], "idle_ms": c["idle_ms"], "pending": c["pending"]}
            for s in result["streams"] for g in s["groups"] for c in g["consumers"] if c["stale"]
        ]
    except redis.RedisError as exc:  # unreachable: 75; a refused login or command: 5
        raise as_cdc_error(exc) from exc
    finally:
        publisher.close()
        client.close()


def _resyncing(client: redis.Redis, slot: str, mappings: Sequence[Mapping]) -> list[dict]:
    """The mappings whose tables the bridge is resyncing (`on_unaccountable: resync`), with the cause and the fix."""
    records = load_resync(client, slot)
    out = []
    for m in mappings:
        record = records.get(m.table) if m.table is not None else None
        if record is None:
            continue
        waiting = record["state"] in ("waiting", "failed")  # failed: a backfill of the resync ended without its rows
        out.append({"entity": m.entity, "table": m.qualified_table, "cause": record["cause"], "state": record["state"],
                    "vouched": record["vouched"], "backfills": record.get("backfills") or [],
                    "fix": (record.get("fix") or RESYNC_FIX) if waiting else
                    "none: its backfill is replaying the table into the stream"})
    return out


def _stream(client: redis.Redis, entity: str, stream: str, mark, trim_stats: dict, stale_after_s: float) -> dict:
    """One stream's length, first and last entries, high-water mark, trims and groups."""
    length = client.xlen(stream)
    first = client.xrange(stream, count=1)
    last = client.xrevrange(stream, count=1)
    return {
        "entity": entity, "stream": stream, "length": length,
        "first_id": first[0][0].decode() if first else None,
        "first_time": _id_time(first[0][0]) if first else None,
        "last_id": last[0][0].decode() if last else None,
        "last_time": _id_time(last[0][0]) if last else None,
        # the decimal (as the mark holds it) and as PostgreSQL prints it
        "last_lsn": mark[0] if mark else None, "last_lsn_text": lsn_text(mark[0]) if mark else None,
        "last_seq": mark[1] if mark else None,
        "trimmed": trim_stats.get(f"{stream}:trimmed", 0),
        "force_trimmed": trim_stats.get(f"{stream}:forced", 0),
        "groups": _groups(client, stream, stale_after_s) if length or client.exists(stream) else [],
    }


def _id_time(entry_id: bytes) -> str:
    return _ms_time(int(entry_id.split(b"-")[0]))


def _ms_time(ms: int) -> str:
    return datetime.fromtimestamp(ms / 1000, tz=timezone.utc).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def _decoding(row: tuple | None, streaming: bool) -> dict | None:
    """The server's decoding counters for the slot since `stats_reset` (None before PostgreSQL 14)."""
    if row is None:
        return None
    return {
        "transactions": row[0], "bytes": row[1], "spilled_transactions": row[2], "spilled_bytes": row[3],
        "streamed_transactions": row[4], "streamed_bytes": row[5],
        "since": row[6].isoformat(timespec="seconds").replace("+00:00", "Z") if row[6] else None,
        "streaming": streaming,
    }


def _bridge(state: dict[str, str], attached: bool) -> dict:
    """What the bridge recorded (`cdc.bridge.guards`): a pause for Redis memory counts only while a
    bridge is attached to the slot (a bridge killed while paused is not paused, it is gone)."""
    paused = attached and state.get("paused") == "1"
    ratio = state.get("memory_ratio")
    loss = None
    if state.get("data_loss_to"):
        loss = {"from_lsn": state.get("data_loss_from") or None, "to_lsn": state["data_loss_to"],
                "detected_at": _ms_time(int(state["data_loss_at_ms"])) if state.get("data_loss_at_ms") else None,
                "message": state.get("data_loss", "")}
    return {
        "paused_for_memory": paused,
        "memory_ratio": float(ratio) if paused and ratio else None,
        "paused_since": _ms_time(int(state["paused_since_ms"])) if paused and state.get("paused_since_ms") else None,
        "data_loss": loss,
    }


def _groups(client: redis.Redis, stream: str, stale_after_s: float = STALE_AFTER_S) -> list[dict]:
    """The consumer view of one stream: per group, lag, pending, consumers, dead letters."""
    groups = []
    for g in client.xinfo_groups(stream):
        name = reply_text(g["name"])
        oldest_idle_ms = None
        if g["pending"]:
            first = client.xpending_range(stream, name, "-", "+", 1)
            oldest_idle_ms = first[0]["time_since_delivered"] if first else None
        consumers = [
            {"name": reply_text(c["name"]), "pending": c["pending"], "idle_ms": c["idle"],
             "stale": c["idle"] >= stale_after_s * 1000}
            for c in client.xinfo_consumers(stream, name)
        ]
        groups.append({
            "group": name, "lag": g.get("lag"), "pending": g["pending"],
            "oldest_pending_idle_ms": oldest_idle_ms, "last_delivered_id": reply_text(g["last-delivered-id"]),
            "consumers": consumers, "dead_letters": client.xlen(keys.dead_letter_key(name)),
        })
    return groups
