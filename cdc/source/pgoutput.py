"""Decoder for the messages of PostgreSQL's ``pgoutput`` logical decoding plugin.

Bytes in, frozen dataclasses out (`cdc.source.messages`): this module does no I/O. It covers every
message of protocol versions 1 to 3 as PostgreSQL 15 sends them (see the
"Logical Replication Message Formats" chapter of the PostgreSQL docs).

All integers on the wire are big-endian. LSNs are returned as `Lsn`;
timestamps are kept as PostgreSQL sends them, microseconds since
2000-01-01 00:00 UTC, in fields whose names end in ``_ts``
(`cdc.source.framing.pg_ts_to_unix_ms` converts them). Strings and text values are
decoded as UTF-8, so the database must use the UTF-8 encoding.

Change messages (and Relation, Type and logical decoding messages) carry a
transaction id prefix only when they are part of a streamed transaction,
that is between a Stream Start and a Stream Stop. The wire format does not
say whether the prefix is there, so decoding depends on which messages came
before: `PgOutputDecoder` keeps that state.

A column value in a tuple is one of:

- ``None``: SQL NULL;
- `UNCHANGED_TOAST`: a TOASTed value the update did not change, whose value
  the server does not send;
- ``str``: the value in PostgreSQL's text format;
- ``bytes``: the value in the type's binary format (``binary`` option).
"""

from __future__ import annotations

import struct
from typing import Callable, Literal

from cdc.source.lsn import Lsn
from cdc.source.messages import (  # re-exported: the decoder's public names
    Begin,
    BeginPrepare,
    Column,
    Commit,
    CommitPrepared,
    DecodeError,
    Delete,
    Insert,
    Message,
    Origin,
    PgOutputMessage,
    Prepare,
    Relation,
    RelationCache,
    RollbackPrepared,
    StreamAbort,
    StreamCommit,
    StreamPrepare,
    StreamStart,
    StreamStop,
    Truncate,
    Type,
    UNCHANGED_TOAST,
    UnknownRelationError,
    Update,
    Value,
)
from cdc.source.streamed_decoders import STREAMED_DECODERS
from cdc.source.wire import (
    _BEGIN,
    _COMMIT,
    _COLUMN_TYPE,
    _MESSAGE,
    _NAMES,
    _ORIGIN,
    _RELATION_HEAD,
    _RELATION_TAIL,
    _RELID_ACTION,
    _TRUNCATE,
    _U8,
    _U32,
    _XID_RELID_ACTION,
    _bad_byte,
    _cstring,
    _end,
    _read_tuple,
    _short,
    _trailing,
    _truncated,
    _unpack,
    _unpack_relid_action,
    _unpack_xid_relid_action,
    _xid_prefix,
)

__all__ = [
    "DecodeError",
    "UNCHANGED_TOAST",
    "Value",
    "Begin",
    "Message",
    "Commit",
    "Origin",
    "Column",
    "Relation",
    "Type",
    "Insert",
    "Update",
    "Delete",
    "Truncate",
    "StreamStart",
    "StreamStop",
    "StreamCommit",
    "StreamAbort",
    "BeginPrepare",
    "Prepare",
    "CommitPrepared",
    "RollbackPrepared",
    "StreamPrepare",
    "PgOutputMessage",
    "PgOutputDecoder",
    "decode",
    "RelationCache",
    "UnknownRelationError",
]


# -- One function per message type ----------------------------------------------
#
# Each takes the decoder (for the streaming state) and the whole message.


def _decode_begin(dec: PgOutputDecoder, data: bytes) -> Begin:
    final_lsn, commit_ts, xid = _unpack(_BEGIN, data, 1, "begin")
    _end(data, 21, "begin")
    return Begin(Lsn(final_lsn), commit_ts, xid)


def _decode_message(dec: PgOutputDecoder, data: bytes) -> Message:
    name = "logical decoding"
    xid, off = _xid_prefix(dec, data, name)
    flags, lsn = _unpack(_MESSAGE, data, off, name)
    prefix, off = _cstring(data, off + 9, name, "prefix")
    (size,) = _unpack(_U32, data, off, name)
    off += 4
    end = off + size
    if end > len(data):
        raise _truncated(name, size, off, len(data))
    _end(data, end, name)
    return Message(bool(flags & 1), Lsn(lsn), prefix, data[off:end], xid)


def _decode_commit(dec: PgOutputDecoder, data: bytes) -> Commit:
    flags, commit_lsn, end_lsn, commit_ts = _unpack(_COMMIT, data, 1, "commit")
    _end(data, 26, "commit")
    return Commit(flags, Lsn(commit_lsn), Lsn(end_lsn), commit_ts)


def _decode_origin(dec: PgOutputDecoder, data: bytes) -> Origin:
    (origin_lsn,) = _unpack(_ORIGIN, data, 1, "origin")
    origin_name, off = _cstring(data, 9, "origin", "origin name")
    _end(data, off, "origin")
    return Origin(Lsn(origin_lsn), origin_name)


def _decode_relation(dec: PgOutputDecoder, data: bytes) -> Relation:
    name = "relation"
    xid, off = _xid_prefix(dec, data, name)
    (relid,) = _unpack(_RELATION_HEAD, data, off, name)
    namespace, off = _cstring(data, off + 4, name, "namespace")
    relname, off = _cstring(data, off, name, "relation name")
    ident, ncols = _unpack(_RELATION_TAIL, data, off, name)
    off += 3
    columns = []
    for _ in range(ncols):
        (flags,) = _unpack(_U8, data, off, name)
        colname, off = _cstring(data, off + 1, name, "column name")
        type_oid, typmod = _unpack(_COLUMN_TYPE, data, off, name)
        off += 8
        columns.append(Column(bool(flags & 1), colname, type_oid, typmod))
    _end(data, off, name)
    return Relation(relid, namespace, relname, chr(ident), tuple(columns), xid)


def _decode_type(dec: PgOutputDecoder, data: bytes) -> Type:
    name = "type"
    xid, off = _xid_prefix(dec, data, name)
    (type_oid,) = _unpack(_U32, data, off, name)
    namespace, off = _cstring(data, off + 4, name, "namespace")
    typname, off = _cstring(data, off, name, "type name")
    _end(data, off, name)
    return Type(type_oid, namespace, typname, xid)


def _decode_insert(dec: PgOutputDecoder, data: bytes) -> Insert:
    # The hot path: written out without helpers.
    have = len(data)
    if dec._stream_xid is not None:
        if have < 10:
            raise _short("insert", _XID_RELID_ACTION, 1, have)
        xid, relid, action = _unpack_xid_relid_action(data, 1)
        off = 10
    else:
        if have < 6:
            raise _short("insert", _RELID_ACTION, 1, have)
        relid, action = _unpack_relid_action(data, 1)
        xid = None
        off = 6
    if action != 0x4E:  # 'N'
        raise _bad_byte("insert", "'N'", off - 1, action)
    new, off = _read_tuple(data, off, have, "insert")
    if off != have:
        raise _trailing("insert", off, have)
    return Insert(relid, new, xid)


def _decode_update(dec: PgOutputDecoder, data: bytes) -> Update:
    have = len(data)
    if dec._stream_xid is not None:
        if have < 10:
            raise _short("update", _XID_RELID_ACTION, 1, have)
        xid, relid, action = _unpack_xid_relid_action(data, 1)
        off = 10
    else:
        if have < 6:
            raise _short("update", _RELID_ACTION, 1, have)
        relid, action = _unpack_relid_action(data, 1)
        xid = None
        off = 6
    old_kind: Literal["K", "O"] | None
    if action == 0x4B or action == 0x4F:  # 'K' key columns, 'O' whole old row
        old_kind = "K" if action == 0x4B else "O"
        old, off = _read_tuple(data, off, have, "update")
        if off >= have:
            raise _truncated("update", 1, off, have)
        action = data[off]
        off += 1
        if action != 0x4E:
            raise _bad_byte("update", "'N'", off - 1, action)
    elif action == 0x4E:
        old_kind = old = None
    else:
        raise _bad_byte("update", "'K', 'O' or 'N'", off - 1, action)
    new, off = _read_tuple(data, off, have, "update")
    if off != have:
        raise _trailing("update", off, have)
    return Update(relid, old_kind, old, new, xid)


def _decode_delete(dec: PgOutputDecoder, data: bytes) -> Delete:
    have = len(data)
    if dec._stream_xid is not None:
        if have < 10:
            raise _short("delete", _XID_RELID_ACTION, 1, have)
        xid, relid, action = _unpack_xid_relid_action(data, 1)
        off = 10
    else:
        if have < 6:
            raise _short("delete", _RELID_ACTION, 1, have)
        relid, action = _unpack_relid_action(data, 1)
        xid = None
        off = 6
    if action == 0x4B:
        old_kind: Literal["K", "O"] = "K"
    elif action == 0x4F:
        old_kind = "O"
    else:
        raise _bad_byte("delete", "'K' or 'O'", off - 1, action)
    old, off = _read_tuple(data, off, have, "delete")
    if off != have:
        raise _trailing("delete", off, have)
    return Delete(relid, old_kind, old, xid)


def _decode_truncate(dec: PgOutputDecoder, data: bytes) -> Truncate:
    name = "truncate"
    xid, off = _xid_prefix(dec, data, name)
    count, options = _unpack(_TRUNCATE, data, off, name)
    off += 5
    end = off + 4 * count
    if end > len(data):
        raise _truncated(name, 4 * count, off, len(data))
    _end(data, end, name)
    relids = struct.unpack_from(f">{count}I", data, off)
    return Truncate(bool(options & 1), bool(options & 2), relids, xid)


_DECODERS: dict[int, Callable[[PgOutputDecoder, bytes], PgOutputMessage]] = {
    ord("B"): _decode_begin,
    ord("M"): _decode_message,
    ord("C"): _decode_commit,
    ord("O"): _decode_origin,
    ord("R"): _decode_relation,
    ord("Y"): _decode_type,
    ord("I"): _decode_insert,
    ord("U"): _decode_update,
    ord("D"): _decode_delete,
    ord("T"): _decode_truncate,
    **STREAMED_DECODERS,
}


class PgOutputDecoder:
    """Decodes one replication session's pgoutput messages, in order.

    Whether a change message starts with a transaction id depends on whether
    it falls inside a streamed block, so the decoder remembers the last
    Stream Start / Stream Stop. Use one decoder per replication connection
    and feed it every message.
    """

    __slots__ = ("_stream_xid",)

    def __init__(self) -> None:
        self._stream_xid: int | None = None  # the one record of whether a streamed block is open

    @property
    def streaming(self) -> bool:
        """True between a Stream Start and its Stream Stop."""
        return self._stream_xid is not None

    @property
    def stream_xid(self) -> int | None:
        """The xid of the transaction being streamed, or None."""
        return self._stream_xid

    def decode(self, data: bytes | bytearray | memoryview) -> PgOutputMessage:
        """Decode one message; raise `DecodeError` if it is malformed."""
        if type(data) is not bytes:
            data = bytes(data)
        try:
            decoder = _DECODERS[data[0]]
        except IndexError:
            raise DecodeError("empty pgoutput message") from None
        except KeyError:
            raise DecodeError(
                f"unknown pgoutput message type {chr(data[0])!r} (0x{data[0]:02x})"
            ) from None
        try:
            return decoder(self, data)
        except UnicodeDecodeError as exc:
            raise DecodeError(
                f"invalid {_NAMES[data[0]]} message: {exc.reason} in utf-8 string"
                f" (byte 0x{exc.object[exc.start]:02x})"
            ) from None
        except (IndexError, struct.error) as exc:  # pragma: no cover - a bug if reached
            raise DecodeError(f"malformed {_NAMES[data[0]]} message: {exc}") from exc


def decode(data: bytes | bytearray | memoryview) -> PgOutputMessage:
    """Decode one message that is not part of a streamed transaction.

    For a whole replication session use a `PgOutputDecoder`, which tracks
    streamed blocks.
    """
    return PgOutputDecoder().decode(data)
