"""Time travel over streams: start or rewind a group, read a range, handle dead letters.

Stream IDs begin with the Redis server's clock in milliseconds, so a wall-clock
time is an ID: replaying "from 09:00" means moving a group to the first entry
written at or after 09:00.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from datetime import datetime

import orjson
import redis

from .. import keys
from ..sink.entry import Entry, parse_entry, stream_id_for
from .consumer import ensure_group

__all__ = ["dead_letters", "read_range", "replay_dead_letters", "replay_group", "range_bound"]


def range_bound(value: str | None, default: str) -> str:
    """An XRANGE bound from a time, an ID, or nothing ('-' / '+')."""
    if value is None:
        return default
    if value in ("-", "+"):
        return value
    sid = stream_id_for(value)
    if default == "+" and sid.endswith("-0") and not value.replace("-", "").isdigit():
        return sid[:-2]  # an incomplete ID as an end bound covers the whole millisecond
    return sid


def replay_group(client: redis.Redis, streams: Sequence[str], group: str, start: str | datetime) -> list[str]:
    """Create `group` at `start` on each stream, or move it there if it exists (XGROUP SETID)."""
    sid = stream_id_for(start)
    done = []
    for stream in streams:
        if ensure_group(client, stream, group, sid):
            done.append(f"group {group} on {stream}: created at {sid}")
        else:
            client.xgroup_setid(stream, group, id=sid)
            done.append(f"group {group} on {stream}: reset to {sid}")
    return done


def read_range(client: redis.Redis, stream: str, start: str = "-", end: str = "+", page: int = 1000) -> Iterator[Entry]:
    """Every entry of `stream` between two bounds (inclusive), in pages."""
    while True:
        items = client.xrange(stream, start, end, count=page)
        for entry_id, fields in items:
            yield parse_entry(stream, entry_id, fields)
        if len(items) < page:
            return
        start = "(" + items[-1][0].decode()


def dead_letters(client: redis.Redis, group: str) -> list[dict]:
    rows = []
    for entry_id, fields in client.xrange(keys.dead_letter_key(group)):
        row = {k.decode(): v.decode() for k, v in fields.items()}
        row["id"] = entry_id.decode()
        rows.append(row)
    return rows


def replay_dead_letters(client: redis.Redis, group: str, ids: Sequence[str] = ()) -> list[str]:
    """Send dead letters back to their streams, for `group` only (other groups skip them).

    Each replayed entry carries ``replay_of`` (the dead-letter ID) and ``replay_for``
    (the group); a transactional consumer applies it once, whatever its checkpoint.
    The dead letter is removed in the same transaction.
    """
    dlq = keys.dead_letter_key(group)
    done = []
    for row in dead_letters(client, group):
        if ids and row["id"] not in ids:
            continue
        if "entry" not in row:
            done.append(f"{row['id']}: the original entry was gone (trimmed) when it was dead-lettered; skipped")
            continue
        fields = orjson.loads(row["entry"])
        fields.update({"replay_of": row["id"], "replay_for": group})
        pipe = client.pipeline(transaction=True)
        pipe.xadd(row["source_stream"], fields)
        pipe.xdel(dlq, row["id"])
        new_id = pipe.execute()[0].decode()
        done.append(f"{row['id']}: replayed into {row['source_stream']} as {new_id}")
    return done
