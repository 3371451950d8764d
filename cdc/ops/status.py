"""What `cdc status` shows: the slot's position and lag, and each stream's state."""

from __future__ import annotations

from collections.abc import Sequence

import psycopg
import redis

from datetime import datetime, timezone

from .. import keys
from .admin import connect
from ..config import Settings
from ..sink.entry import reply_text
from ..exits import as_cdc_error
from ..source.lsn import Lsn
from ..mapping.model import Mapping
from ..sink.publisher import Publisher
from ..sink.redisconn import connect_redis
from ..source.replication import classify_pg_error

__all__ = ["collect", "render"]

SLOT_QUERY = """
SELECT s.active, s.confirmed_flush_lsn::text, pg_current_wal_lsn()::text,
       pg_wal_lsn_diff(pg_current_wal_lsn(), s.confirmed_flush_lsn)::bigint,
       pg_wal_lsn_diff(pg_current_wal_lsn(), s.restart_lsn)::bigint, s.wal_status,
       extract(epoch FROM r.flush_lag)::float8, current_setting('max_slot_wal_keep_size'), s.safe_wal_size
FROM pg_replication_slots s LEFT JOIN pg_stat_replication r ON r.pid = s.active_pid
WHERE s.slot_name = %s
"""


def collect(settings: Settings, mappings: Sequence[Mapping]) -> dict:
    result: dict = {"slot": None, "streams": []}
    with connect(settings) as conn:
        try:
            row = conn.execute(SLOT_QUERY, (settings.postgres.slot,)).fetchone()
        except psycopg.Error as exc:
            raise classify_pg_error(exc) from exc
        try:
            backfills = conn.execute(
                "SELECT id, entity, status, rows_done, rows_total, chunks, where_sql, "
                "extract(epoch FROM updated_at - created_at)::float8 FROM cdc_backfills WHERE slot = %s ORDER BY id",
                (settings.postgres.slot,),
            ).fetchall() if conn.execute(
                "SELECT coalesce(has_table_privilege(to_regclass('public.cdc_backfills'), 'SELECT'), false)"
            ).fetchone()[0] else []
            reconciliations = conn.execute(
                "SELECT DISTINCT ON (spec, consumer) spec, consumer, status, reason, finished_at, dry_run, "
                "keys_compared, keys_drifted, position FROM cdc_reconcile_runs ORDER BY spec, consumer, id DESC"
            ).fetchall() if conn.execute(
                "SELECT coalesce(has_table_privilege(to_regclass('public.cdc_reconcile_runs'), 'SELECT'), false)"
            ).fetchone()[0] else []
        except psycopg.Error as exc:
            raise classify_pg_error(exc) from exc
    result["reconciliations"] = [
        {"spec": r[0], "consumer": r[1], "status": r[2], "reason": r[3],
         "finished_at": r[4].isoformat(timespec="seconds").replace("+00:00", "Z"), "dry_run": r[5],
         "keys_compared": r[6], "keys_drifted": r[7], "position": str(Lsn(int(r[8])))}
        for r in reconciliations
    ]
    result["backfills"] = [
        {"id": b[0], "entity": b[1], "status": b[2], "rows_done": b[3], "rows_total": b[4], "chunks": b[5],
         "where": b[6], "rows_per_s": round(b[3] / b[7], 1) if b[7] else None}
        for b in backfills
    ]
    if row:
        result["slot"] = {
            "name": settings.postgres.slot, "active": row[0], "confirmed_flush_lsn": row[1],
            "current_wal_lsn": row[2], "lag_bytes": row[3], "lag_seconds": row[6],
            "retained_wal_bytes": row[4], "max_slot_wal_keep_size": row[7], "safe_wal_size_bytes": row[8],
            "wal_status": row[5],
        }
    publisher = Publisher(settings.redis.url, cluster=settings.redis.cluster)
    client = connect_redis(settings.redis)
    try:
        streams = [(m.entity, s) for m in mappings for s in m.stream_keys()]
        marks = publisher.marks(s for _, s in streams)
        trim_stats = {k.decode(): int(v) for k, v in client.hgetall(keys.TRIM_STATS).items()}
        for entity, stream in streams:
            length = client.xlen(stream)
            first = client.xrange(stream, count=1)
            last = client.xrevrange(stream, count=1)
            mark = marks.get(stream)
            result["streams"].append({
                "entity": entity, "stream": stream, "length": length,
                "first_id": first[0][0].decode() if first else None,
                "first_time": _id_time(first[0][0]) if first else None,
                "last_id": last[0][0].decode() if last else None,
                "last_time": _id_time(last[0][0]) if last else None,
                "last_lsn": mark[0] if mark else None, "last_seq": mark[1] if mark else None,
                "trimmed": trim_stats.get(f"{stream}:trimmed", 0),
                "force_trimmed": trim_stats.get(f"{stream}:forced", 0),
                "groups": _groups(client, stream) if length or client.exists(stream) else [],
            })
    except redis.RedisError as exc:  # unreachable: 75; a refused login or command: 5
        raise as_cdc_error(exc) from exc
    finally:
        publisher.close()
        client.close()
    return result


def _id_time(entry_id: bytes) -> str:
    ms = int(entry_id.split(b"-")[0])
    return datetime.fromtimestamp(ms / 1000, tz=timezone.utc).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def _groups(client: redis.Redis, stream: str) -> list[dict]:
    """The consumer view of one stream: per group, lag, pending, consumers, dead letters."""
    groups = []
    for g in client.xinfo_groups(stream):
        name = reply_text(g["name"])
        oldest_idle_ms = None
        if g["pending"]:
            first = client.xpending_range(stream, name, "-", "+", 1)
            oldest_idle_ms = first[0]["time_since_delivered"] if first else None
        consumers = [
            {"name": reply_text(c["name"]), "pending": c["pending"], "idle_ms": c["idle"]}
            for c in client.xinfo_consumers(stream, name)
        ]
        groups.append({
            "group": name, "lag": g.get("lag"), "pending": g["pending"],
            "oldest_pending_idle_ms": oldest_idle_ms, "last_delivered_id": reply_text(g["last-delivered-id"]),
            "consumers": consumers, "dead_letters": client.xlen(keys.dead_letter_key(name)),
        })
    return groups


def render(status: dict) -> str:
    lines = []
    slot = status["slot"]
    if slot is None:
        lines.append("slot: missing (run cdc init)")
    else:
        lag_s = "" if slot["lag_seconds"] is None else f" ({slot['lag_seconds']:.2f}s)"
        lines.append(
            f"slot {slot['name']}: {'active' if slot['active'] else 'inactive'}, confirmed {slot['confirmed_flush_lsn']}, "
            f"current {slot['current_wal_lsn']}, lag {slot['lag_bytes']} bytes{lag_s}, "
            f"retained WAL {slot['retained_wal_bytes']} bytes of max_slot_wal_keep_size {slot['max_slot_wal_keep_size']}, "
            f"wal_status {slot['wal_status']}"
        )
    lines.append(f"{'entity':<14} {'stream':<24} {'length':>9} {'first entry':<25} {'last entry':<25} last lsn")
    for s in status["streams"]:
        lines.append(
            f"{s['entity']:<14} {s['stream']:<24} {s['length']:>9} {s['first_time'] or '-':<25} "
            f"{s['last_time'] or '-':<25} {s['last_lsn'] or '-'}"
        )
        if s["force_trimmed"]:
            lines.append(f"{'':<14} WARNING: {s['force_trimmed']} unconsumed entries dropped by the hard trim cap")
        for g in s["groups"]:
            idle = "-" if g["oldest_pending_idle_ms"] is None else f"{g['oldest_pending_idle_ms'] / 1000:.1f}s"
            lines.append(
                f"{'':<14} group {g['group']}: lag {g['lag'] if g['lag'] is not None else '?'}, pending {g['pending']} "
                f"(oldest idle {idle}), dead letters {g['dead_letters']}"
            )
            for c in g["consumers"]:
                lines.append(f"{'':<16} consumer {c['name']}: pending {c['pending']}, idle {c['idle_ms'] / 1000:.1f}s")
    for b in status.get("backfills", []):
        rate = f", {b['rows_per_s']:,.0f} rows/s" if b["rows_per_s"] else ""
        part = f" where {b['where']}" if b["where"] else ""
        lines.append(f"backfill {b['id']} of {b['entity']}{part}: {b['status']}, {b['rows_done']}/{b['rows_total']} rows{rate}")
    for r in status.get("reconciliations", []):
        dry = " (dry run)" if r["dry_run"] else ""
        why = f": {r['reason']}" if r["reason"] else ""
        lines.append(
            f"last reconciliation {r['spec']}/{r['consumer']}: {r['status']}{dry} at {r['finished_at']}, "
            f"{r['keys_drifted']} of {r['keys_compared']} keys drifted, position {r['position']}{why}"
        )
    return "\n".join(lines) + "\n"
