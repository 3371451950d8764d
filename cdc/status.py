"""What `cdc status` shows: the slot's position and lag, and each stream's state."""

from __future__ import annotations

from collections.abc import Sequence

import psycopg
import redis

from .admin import connect
from .config import Settings
from .errors import TransientError
from .mapping import Mapping
from .publisher import Publisher
from .replication import classify_pg_error

__all__ = ["collect", "render"]

SLOT_QUERY = """
SELECT active, confirmed_flush_lsn::text, pg_current_wal_lsn()::text,
       pg_wal_lsn_diff(pg_current_wal_lsn(), confirmed_flush_lsn)::bigint,
       pg_wal_lsn_diff(pg_current_wal_lsn(), restart_lsn)::bigint, wal_status
FROM pg_replication_slots WHERE slot_name = %s
"""


def collect(settings: Settings, mappings: Sequence[Mapping]) -> dict:
    result: dict = {"slot": None, "streams": []}
    with connect(settings) as conn:
        try:
            row = conn.execute(SLOT_QUERY, (settings.postgres.slot,)).fetchone()
        except psycopg.Error as exc:
            raise classify_pg_error(exc) from exc
    if row:
        result["slot"] = {
            "name": settings.postgres.slot, "active": row[0], "confirmed_flush_lsn": row[1],
            "current_wal_lsn": row[2], "lag_bytes": row[3], "retained_wal_bytes": row[4], "wal_status": row[5],
        }
    publisher = Publisher(settings.redis.url)
    client = redis.Redis.from_url(settings.redis.url, socket_connect_timeout=5)
    try:
        streams = [(m.entity, s) for m in mappings for s in m.stream_keys()]
        marks = publisher.marks(s for _, s in streams)
        for entity, stream in streams:
            length = client.xlen(stream)
            last = client.xrevrange(stream, count=1)
            mark = marks.get(stream)
            result["streams"].append({
                "entity": entity, "stream": stream, "length": length,
                "last_id": last[0][0].decode() if last else None,
                "last_lsn": mark[0] if mark else None, "last_seq": mark[1] if mark else None,
            })
    except redis.RedisError as exc:
        raise TransientError(f"redis unavailable: {exc}") from exc
    finally:
        publisher.close()
        client.close()
    return result


def render(status: dict) -> str:
    lines = []
    slot = status["slot"]
    if slot is None:
        lines.append("slot: missing (run cdc init)")
    else:
        lines.append(
            f"slot {slot['name']}: {'active' if slot['active'] else 'inactive'}, confirmed {slot['confirmed_flush_lsn']}, "
            f"current {slot['current_wal_lsn']}, lag {slot['lag_bytes']} bytes, retained WAL {slot['retained_wal_bytes']} bytes, "
            f"wal_status {slot['wal_status']}"
        )
    lines.append(f"{'entity':<16} {'stream':<28} {'length':>10} {'last id':<22} last lsn")
    for s in status["streams"]:
        lines.append(f"{s['entity']:<16} {s['stream']:<28} {s['length']:>10} {s['last_id'] or '-':<22} {s['last_lsn'] or '-'}")
    return "\n".join(lines) + "\n"
