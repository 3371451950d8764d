"""A stream entry as consumers see it: the fields of the entry contract, parsed."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

import orjson

from ..errors import PublishError
from ..keys import DEAD_LETTER_PREFIX

__all__ = ["Entry", "ForeignEntryError", "foreign_entry", "next_stream_id", "parse_entry", "parse_stream_id", "reply_text", "stream_id_for"]


@dataclass(frozen=True, slots=True)
class Entry:
    stream: str
    id: str
    op: str
    key: dict
    data: dict | None
    before: dict | None
    unchanged: tuple[str, ...]
    lsn: int
    seq: int
    xid: int
    ts_ms: int
    v: int
    fields: dict  # every field as sent, bytes to bytes

    @property
    def position(self) -> tuple[int, int]:
        """Where the change sits in the source: (commit LSN, seq); duplicates share it."""
        return (self.lsn, self.seq)

    @property
    def id_ms(self) -> int:
        return int(self.id.partition("-")[0])


class ForeignEntryError(PublishError):
    """An entry of a stream the bridge (or, in a dead-letter stream, a consumer) did not write."""


def foreign_entry(stream: str, entry_id: str, reason: str) -> ForeignEntryError:
    """The one-line error naming an entry the bridge or a consumer did not write, and the fix."""
    what = "dead letter" if stream.startswith(DEAD_LETTER_PREFIX) else "bridge entry"
    return ForeignEntryError(
        f"{stream} {entry_id} is not a {what} ({reason}): something else writes to that stream",
        hint=f"find what wrote it (redis-cli XRANGE {stream} {entry_id} {entry_id}) and give it a stream of its own; "
        f"to drop it: redis-cli XDEL {stream} {entry_id}",
    )


def parse_entry(stream: str | bytes, entry_id: str | bytes, fields: dict) -> Entry:
    """An `Entry` from XREADGROUP/XRANGE output (bytes keys and values); `ForeignEntryError` for an
    entry the bridge did not write (no ``op``, ``lsn`` or ``seq``, or a field that does not parse)."""
    if isinstance(stream, bytes):
        stream = stream.decode()
    if isinstance(entry_id, bytes):
        entry_id = entry_id.decode()
    try:
        return _entry(stream, entry_id, fields)
    except (KeyError, ValueError, TypeError, UnicodeDecodeError) as exc:  # orjson.JSONDecodeError is a ValueError
        missing = [name for name in ("op", "lsn", "seq") if name.encode() not in fields]
        reason = f"no {', '.join(missing)} field" if missing else f"a field that does not parse: {type(exc).__name__}"
        raise foreign_entry(stream, entry_id, reason) from None


class _Building:
    """An `Entry` while it is filled in: the same slots, plain attributes (a frozen dataclass' own
    constructor sets each field through object.__setattr__, which was half of a consumer's CPU per
    entry); its class becomes `Entry` once complete."""

    __slots__ = Entry.__slots__  # type: ignore[attr-defined]


_loads = orjson.loads


def _entry(stream: str, entry_id: str, fields: dict) -> Entry:
    get = fields.get
    e = _Building()
    e.stream = stream  # type: ignore[attr-defined]
    e.id = entry_id  # type: ignore[attr-defined]
    e.op = fields[b"op"].decode()  # type: ignore[attr-defined]
    raw = get(b"key")
    e.key = (_loads(raw) if raw is not None else None) or {}  # type: ignore[attr-defined]
    raw = get(b"data")
    e.data = _loads(raw) if raw is not None else None  # type: ignore[attr-defined]
    raw = get(b"before")
    e.before = _loads(raw) if raw is not None else None  # type: ignore[attr-defined]
    raw = get(b"unchanged")
    e.unchanged = tuple((_loads(raw) if raw is not None else None) or ())  # type: ignore[attr-defined]
    e.lsn = int(fields[b"lsn"])  # type: ignore[attr-defined]
    e.seq = int(fields[b"seq"])  # type: ignore[attr-defined]
    e.xid = int(get(b"xid", b"0"))  # type: ignore[attr-defined]
    e.ts_ms = int(get(b"ts_ms", b"0"))  # type: ignore[attr-defined]
    e.v = int(get(b"v", b"1"))  # type: ignore[attr-defined]
    e.fields = fields  # type: ignore[attr-defined]
    e.__class__ = Entry  # type: ignore[assignment]
    return e  # type: ignore[return-value]


def reply_text(value: Any) -> str:
    """A Redis reply value (bytes, or str with decode_responses) as text."""
    return value.decode() if isinstance(value, bytes) else str(value)


def parse_stream_id(entry_id: str | bytes) -> tuple[int, int]:
    """A stream entry ID ("ms-seq", as text or bytes) as a tuple that sorts like the IDs."""
    ms, _, seq = reply_text(entry_id).partition("-")
    return int(ms), int(seq or 0)


def next_stream_id(entry_id: str | bytes) -> str:
    """The smallest ID after `entry_id`: where an exclusive range continues."""
    ms, seq = parse_stream_id(entry_id)
    return f"{ms}-{seq + 1}"


def stream_id_for(start: str | datetime | int) -> str:
    """A stream ID from '$', '0', an entry ID, epoch milliseconds, or an ISO-8601 time."""
    if isinstance(start, datetime):
        return f"{int(start.timestamp() * 1000)}-0"
    if isinstance(start, int):
        return f"{start}-0"
    text = str(start).strip()
    if text in ("$", "0", "0-0") or text.replace("-", "").isdigit():
        return text
    try:
        moment = datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        raise ValueError(f"{start!r} is not '$', '0', a stream ID or an ISO-8601 time") from None
    if moment.tzinfo is None:
        raise ValueError(f"{start!r} has no time zone; add Z or an offset")
    return f"{int(moment.timestamp() * 1000)}-0"
