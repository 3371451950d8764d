"""A stream entry as consumers see it: the fields of the entry contract, parsed."""

from __future__ import annotations

import dataclasses
from datetime import datetime
from collections.abc import Iterable
from typing import Any

import orjson

from ..errors import PublishError
from ..keys import DEAD_LETTER_PREFIX

__all__ = ["Entry", "ForeignEntryError", "foreign_entry", "next_stream_id", "parse_entries", "parse_entry", "parse_reply",
           "parse_stream_id", "reply_text", "stream_id_for"]


_UNREAD: Any = object()  # a JSON field not parsed yet


class Entry:
    """A stream entry, frozen. Its JSON fields (``key``, ``data``, ``before``, ``unchanged``) are parsed
    the first time they are read, from `fields`: a handler that passes an entry's text on (`TableSink`)
    or never looks at its data pays nothing for them. A field that does not parse raises
    `ForeignEntryError` when it is read, naming the entry."""

    __slots__ = ("stream", "id", "op", "lsn", "seq", "xid", "ts_ms", "v", "fields",
                 "_key", "_data", "_before", "_unchanged")

    stream: str
    id: str
    op: str
    lsn: int
    seq: int
    xid: int
    ts_ms: int
    v: int
    fields: dict  # every field as sent, bytes to bytes
    _key: Any  # the JSON fields, parsed, or _UNREAD
    _data: Any
    _before: Any
    _unchanged: Any

    def __init__(self, stream: str, id: str, op: str, key: dict, data: dict | None, before: dict | None,
                 unchanged: tuple[str, ...], lsn: int, seq: int, xid: int, ts_ms: int, v: int, fields: dict) -> None:
        for name, value in (("stream", stream), ("id", id), ("op", op), ("_key", key), ("_data", data),
                            ("_before", before), ("_unchanged", unchanged), ("lsn", lsn), ("seq", seq), ("xid", xid),
                            ("ts_ms", ts_ms), ("v", v), ("fields", fields)):
            object.__setattr__(self, name, value)

    def __setattr__(self, name: str, value: Any) -> None:
        raise dataclasses.FrozenInstanceError(f"cannot assign to field {name!r}")

    def __delattr__(self, name: str) -> None:
        raise dataclasses.FrozenInstanceError(f"cannot delete field {name!r}")

    def _unparsed(self, name: bytes) -> ForeignEntryError:
        return foreign_entry(self.stream, self.id, f"its {name.decode()} field does not parse as JSON")

    @property
    def key(self) -> dict:
        value = self._key
        if value is _UNREAD:  # (inline: read once per entry by most handlers)
            raw = self.fields.get(b"key")
            try:
                value = (_loads(raw) if raw is not None else None) or {}
            except ValueError:  # orjson.JSONDecodeError
                raise self._unparsed(b"key") from None
            _set_key(self, value)
        return value

    @property
    def data(self) -> dict | None:
        value = self._data
        if value is _UNREAD:  # (inline: read once per entry by most handlers)
            raw = self.fields.get(b"data")
            try:
                value = (_loads(raw) if raw is not None else None)
            except ValueError:  # orjson.JSONDecodeError
                raise self._unparsed(b"data") from None
            _set_data(self, value)
        return value

    @property
    def before(self) -> dict | None:
        value = self._before
        if value is _UNREAD:  # (inline: read once per entry by most handlers)
            raw = self.fields.get(b"before")
            try:
                value = (_loads(raw) if raw is not None else None)
            except ValueError:  # orjson.JSONDecodeError
                raise self._unparsed(b"before") from None
            _set_before(self, value)
        return value

    @property
    def unchanged(self) -> tuple[str, ...]:
        value = self._unchanged
        if value is _UNREAD:
            raw = self.fields.get(b"unchanged")
            try:
                listed = (_loads(raw) if raw is not None else None) or ()
            except ValueError:
                raise self._unparsed(b"unchanged") from None
            if not isinstance(listed, list | tuple):
                raise foreign_entry(self.stream, self.id, "its unchanged field is no list")
            value = tuple(listed)
            _set_unchanged(self, value)
        return value

    def _values(self) -> tuple:
        return (self.stream, self.id, self.op, self.key, self.data, self.before, self.unchanged, self.lsn, self.seq,
                self.xid, self.ts_ms, self.v, self.fields)

    def __eq__(self, other: object) -> bool:
        if other.__class__ is not Entry:
            return NotImplemented
        return self._values() == other._values()  # type: ignore[attr-defined]

    __hash__ = None  # type: ignore[assignment]  # (its dicts are not hashable)

    def __repr__(self) -> str:
        shown = []
        for name in ("stream", "id", "op", "key", "data", "before", "unchanged", "lsn", "seq", "xid", "ts_ms", "v", "fields"):
            try:
                shown.append(f"{name}={getattr(self, name)!r}")
            except ForeignEntryError:  # (a field that is not JSON: shown as sent, in `fields`)
                shown.append(f"{name}=<not JSON>")
        return "Entry(" + ", ".join(shown) + ")"

    def parsed(self) -> Entry:
        """The entry with every JSON field parsed now: `ForeignEntryError` here, not when a field is read."""
        self.key, self.data, self.before, self.unchanged  # noqa: B018  # (the properties parse and keep them)
        return self

    @property
    def position(self) -> tuple[int, int]:
        """Where the change sits in the source: (commit LSN, seq); duplicates share it."""
        return (self.lsn, self.seq)

    @property
    def id_ms(self) -> int:
        return int(self.id.partition("-")[0])


_slot = Entry.__dict__  # the slots' own descriptors: they set a parsed field past the frozen __setattr__
_set_key = _slot["_key"].__set__
_set_data = _slot["_data"].__set__
_set_before = _slot["_before"].__set__
_set_unchanged = _slot["_unchanged"].__set__


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
    entry the bridge did not write (no ``op``, ``lsn`` or ``seq``, or one of them that does not parse;
    a JSON field that does not parse raises it when it is read)."""
    if isinstance(stream, bytes):
        stream = stream.decode()
    return parse_entries(stream, ((entry_id, fields),))[0]


class _Building:
    """An `Entry` while it is filled in: the same slots, plain attributes (setting each through
    object.__setattr__ was half of a consumer's CPU per entry); its class becomes `Entry` once complete."""

    __slots__ = Entry.__slots__


_loads = orjson.loads


def parse_entries(stream: str, items: Iterable[tuple[str | bytes, dict]]) -> list[Entry]:
    """`parse_entry` over the (ID, fields) items of one stream, in one loop (a consumer's hot path)."""
    out: list[Entry] = []
    append = out.append
    entry_id: str | bytes = ""
    fields: dict = {}
    try:
        for entry_id, fields in items:
            get = fields.get
            e = _Building()
            e.stream = stream  # type: ignore[attr-defined]
            e.id = entry_id.decode() if entry_id.__class__ is bytes else entry_id  # type: ignore[attr-defined,union-attr]
            e.op = fields[b"op"].decode()  # type: ignore[attr-defined]
            e._key = e._data = _UNREAD  # type: ignore[attr-defined]  # parsed when read
            # (most entries have neither: known now for the price of a look)
            e._before = _UNREAD if b"before" in fields else None  # type: ignore[attr-defined]
            e._unchanged = _UNREAD if b"unchanged" in fields else ()  # type: ignore[attr-defined]
            e.lsn = int(fields[b"lsn"])  # type: ignore[attr-defined]
            e.seq = int(fields[b"seq"])  # type: ignore[attr-defined]
            e.xid = int(get(b"xid", b"0"))  # type: ignore[attr-defined]
            e.ts_ms = int(get(b"ts_ms", b"0"))  # type: ignore[attr-defined]
            e.v = int(get(b"v", b"1"))  # type: ignore[attr-defined]
            e.fields = fields  # type: ignore[attr-defined]
            e.__class__ = Entry  # type: ignore[assignment]
            append(e)  # type: ignore[arg-type]
    except (KeyError, ValueError, TypeError, UnicodeDecodeError, AttributeError) as exc:
        missing = [name for name in ("op", "lsn", "seq") if name.encode() not in fields]
        reason = f"no {', '.join(missing)} field" if missing else f"a field that does not parse: {type(exc).__name__}"
        raise foreign_entry(stream, reply_text(entry_id), reason) from None
    return out


def parse_reply(reply: Any, gone: list[tuple[str, str]] | None = None) -> list[Entry]:
    """The entries of an XREADGROUP (or XREAD) reply as Redis sends it, unparsed by the client: RESP2's list of
    ``[stream, [[id, [field, value, ...]], ...]]`` or RESP3's map of stream to the same items, bytes throughout;
    None (nothing read) gives no entries. An entry that comes back without fields (deleted while pending) is
    added to `gone` as (stream, ID) when `gone` is given, and left out either way. `ForeignEntryError` as
    `parse_entries` for an entry the bridge did not write. (The consumer's hot path: `cdc.sink._entries`
    compiles it, with the same results.)"""
    out: list[Entry] = []
    if not reply:
        return out
    for stream, items in (reply.items() if reply.__class__ is dict else reply):
        name = reply_text(stream)
        whole: list[tuple[str | bytes, dict]] = []
        append = whole.append
        for entry_id, flat in items:
            if flat:
                pairs = iter(flat)
                append((entry_id, dict(zip(pairs, pairs))))
            elif gone is not None:
                gone.append((name, reply_text(entry_id)))
        out += parse_entries(name, whole)
    return out


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
