"""Time travel over streams: start or rewind a group, read a range, handle dead letters.

Stream IDs begin with the Redis server's clock in milliseconds, so a wall-clock
time is an ID: replaying "from 09:00" means moving a group to the first entry
written at or after 09:00.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from datetime import datetime

import orjson
import redis

from .. import keys
from ..sink.entry import Entry, ForeignEntryError, foreign_entry, parse_entry, stream_id_for
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


#: what a dead letter holds beside ``entry`` (which is missing when the entry was trimmed while pending)
DEAD_LETTER_FIELDS = ("source_stream", "source_id", "deliveries", "error")


def read_range(client: redis.Redis, stream: str, start: str = "-", end: str = "+", page: int = 1000,
               on_foreign: Callable[[ForeignEntryError], None] | None = None) -> Iterator[Entry]:
    """Every entry of `stream` between two bounds (inclusive), in pages.

    An entry the bridge did not write (no ``op``, ``lsn`` or ``seq``, or one that does not parse) raises
    `foreign_entry`'s error; with `on_foreign`, it is handed that error and skipped instead.
    """
    while True:
        items = client.xrange(stream, start, end, count=page)
        for entry_id, fields in items:
            try:
                entry = parse_entry(stream, entry_id, fields).parsed()
            except ForeignEntryError as error:
                if on_foreign is None:
                    raise
                on_foreign(error)
                continue
            yield entry
        if len(items) < page:
            return
        start = "(" + items[-1][0].decode()


def dead_letters(client: redis.Redis, group: str) -> list[dict]:
    """The dead letters of `group`; a row the consumers did not write has ``foreign`` (the error naming it)."""
    rows = []
    stream = keys.dead_letter_key(group)
    for entry_id, fields in client.xrange(stream):
        row = {k.decode(errors="replace"): v.decode(errors="replace") for k, v in fields.items()}
        row["id"] = entry_id.decode()
        missing = [name for name in DEAD_LETTER_FIELDS if name not in row]
        reason = f"no {', '.join(missing)} field" if missing else None
        if reason is None and "entry" in row:
            try:
                entry = orjson.loads(row["entry"])
            except orjson.JSONDecodeError:
                reason = "its entry field is not JSON"
            else:
                if not isinstance(entry, dict):
                    reason = "its entry field is not a JSON object"
        if reason is not None:
            row = {"id": row["id"], "foreign": foreign_entry(stream, row["id"], reason)}
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
        if "foreign" in row:
            done.append(f"{row['id']}: not a dead letter; skipped ({row['foreign'].message})")
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
