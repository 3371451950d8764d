"""What a stream key holds, judged against its high-water mark before anything is appended to it.

``XADD`` silently creates a missing stream, and fails at run time on a key of another
type; Redis does not roll back the rest of a transaction when one command fails. So both
append paths read each stream key's type beside its mark, and refuse the whole append
before writing anything when:

- the key holds another type and the mark is unset: something else sits where the
  stream belongs (exit 5; nothing was ever lost, freeing the key is the fix);
- the mark says the stream held entries, but the key is gone or holds another type: the
  stream's history vanished, a data loss (exit 6; `cdc recover` rebuilds it). Re-creating
  the stream with only the entries after the loss would hide it for good.
"""

from __future__ import annotations

from ..errors import DataLossError, PublishError
from ..keys import mark_key
from ..source.lsn import Lsn

__all__ = ["MISSING", "STREAM", "stream_key_error", "vanished_mark_error", "wrong_type_error"]

STREAM = "stream"
MISSING = "none"  # what TYPE answers for a key that does not exist


def _text(value: str | bytes | None) -> str:
    return value.decode() if isinstance(value, bytes) else value or ""


def _what(stream: str, entity: str | None) -> str:
    return f"stream of entity {entity}" if entity else "stream the bridge writes"


def wrong_type_error(stream: str, key_type: str, entity: str | None, command: str = "cdc run") -> PublishError:
    """A key of another type where a stream that never held an entry belongs (exit 5)."""
    return PublishError(
        f"redis key {stream} holds a {key_type}, not a stream, {_what(stream, entity)}; the bridge appended nothing",
        hint=f"rename or delete that key (redis-cli TYPE/DEL {stream}) and run {command} again",
    )


def stream_key_error(stream: str, key_type: str | bytes, mark: str | bytes | None,
                     entity: str | None = None) -> PublishError | None:
    """Why nothing may be appended to `stream` (its key's TYPE, its mark's value), or None when it may."""
    key_type, mark = _text(key_type), _text(mark)
    if key_type == STREAM or (key_type == MISSING and not mark):
        return None
    if not mark:
        return wrong_type_error(stream, key_type, entity)
    lsn, seq = Lsn(int(mark[:20])), int(mark[20:])
    held = f"its mark {mark_key(stream)} says it held entries up to {lsn} (seq {seq})"
    if key_type == MISSING:
        error = DataLossError(
            f"stream {stream} ({_what(stream, entity)}) is gone from redis, but {held}: entries of transactions "
            f"committed up to {lsn} are missing from it; the bridge appended nothing (it never re-creates a vanished stream)",
            hint="restore Redis from a backup holding the stream, or stop the bridge and run cdc recover "
            "to rebuild it from its table",
        )
    else:
        error = DataLossError(
            f"redis key {stream} holds a {key_type}, not a stream, {_what(stream, entity)}, and {held}: the stream's "
            "history is gone from that key; the bridge appended nothing",
            hint=f"if the stream was moved away, rename that key away and the stream back (redis-cli RENAME); "
            f"otherwise rename that key away (redis-cli RENAME {stream} <new name>), stop the bridge and run "
            "cdc recover to rebuild the stream from its table",
        )
    error.lost_stream, error.lost_to = stream, lsn  # what the bridge records for cdc status
    return error


def vanished_mark_error(key: str, held: str) -> DataLossError:
    """A mark or the flushed record, watched while the bridge writes, that was set and is gone: Redis was
    emptied (FLUSHALL, FLUSHDB) or lost data under the bridge (exit 6)."""
    lsn = Lsn(int(held[:20]))
    error = DataLossError(
        f"redis key {key} vanished while the bridge was writing (it held {lsn}): redis was emptied (FLUSHALL, "
        "FLUSHDB) or lost data; the bridge appended nothing",
        hint="restore Redis from a backup, or stop the bridge and run cdc recover to rebuild the streams",
    )
    error.lost_stream, error.lost_to = key, lsn
    return error
