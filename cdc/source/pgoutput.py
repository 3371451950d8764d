"""Decoder for the messages of PostgreSQL's ``pgoutput`` logical decoding plugin.

Bytes in, frozen dataclasses out: this module does no I/O. It covers every
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
from dataclasses import dataclass
from typing import Callable, Literal, TypeAlias, Union

from cdc.source.lsn import Lsn

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


class DecodeError(ValueError):
    """The bytes are not a well-formed pgoutput message."""


class _UnchangedToastType:
    """Type of `UNCHANGED_TOAST`; there is only ever one instance."""

    __slots__ = ()
    _instance: _UnchangedToastType | None = None

    def __new__(cls) -> _UnchangedToastType:
        if cls._instance is None:
            cls._instance = super().__new__(cls)
        return cls._instance

    def __repr__(self) -> str:
        return "UNCHANGED_TOAST"

    # Copies and pickles must stay the singleton, so that ``is`` keeps working.
    def __copy__(self) -> _UnchangedToastType:
        return self

    def __deepcopy__(self, memo: object) -> _UnchangedToastType:
        return self

    def __reduce__(self) -> str:
        return "UNCHANGED_TOAST"


UNCHANGED_TOAST = _UnchangedToastType()
"""Stands for a TOASTed column value that an update left unchanged.

The server does not send such values (kind ``'u'`` in TupleData), so the
consumer must keep the previous value if it needs it. Compare with ``is``.
"""

Value: TypeAlias = Union[str, bytes, None, _UnchangedToastType]
"""One column value in a decoded tuple."""


# -- Messages ---------------------------------------------------------------
#
# ``xid`` on change messages is ``None`` outside a streamed transaction: the
# server only sends it between Stream Start and Stream Stop. It comes last
# with a default so that the common, non-streamed case reads naturally.


@dataclass(frozen=True, slots=True)
class Begin:
    """'B': start of a (non-streamed) transaction."""

    final_lsn: Lsn
    """LSN of the transaction's commit record; equals `Commit.commit_lsn`."""
    commit_ts: int
    xid: int


@dataclass(frozen=True, slots=True)
class Message:
    """'M': a message written with ``pg_logical_emit_message()``.

    Only sent when the ``messages`` option is on. A non-transactional message
    arrives as soon as it is decoded, outside any Begin/Commit.
    """

    transactional: bool
    lsn: Lsn
    prefix: str
    content: bytes
    xid: int | None = None


@dataclass(frozen=True, slots=True)
class Commit:
    """'C': end of a (non-streamed) transaction."""

    flags: int
    """Unused by PostgreSQL 15, always 0."""
    commit_lsn: Lsn
    end_lsn: Lsn
    """LSN just past the commit record: where to resume after this transaction."""
    commit_ts: int


@dataclass(frozen=True, slots=True)
class Origin:
    """'O': the transaction was replayed from another node (replication origin)."""

    origin_lsn: Lsn
    """The commit LSN on the origin server."""
    name: str


@dataclass(frozen=True, slots=True)
class Column:
    """One column of a `Relation`."""

    is_key: bool
    """Part of the replica identity (all columns are, with REPLICA IDENTITY FULL)."""
    name: str
    type_oid: int
    type_modifier: int
    """``atttypmod``: -1 when the type has none, e.g. ``varchar(10)`` gives 14."""


@dataclass(frozen=True, slots=True)
class Relation:
    """'R': describes a table; sent before the first change to it in a session.

    The server sends it again after anything that invalidates the table's
    cache entry (ALTER TABLE, but also TRUNCATE), and inside each streamed
    transaction that touches the table, so a later Relation replaces an
    earlier one with the same relid.
    """

    relid: int
    namespace: str
    """Schema name as sent: the empty string means ``pg_catalog``."""
    name: str
    replica_identity: str
    """``'d'`` default (primary key), ``'n'`` nothing, ``'f'`` full, ``'i'`` index."""
    columns: tuple[Column, ...]
    xid: int | None = None


@dataclass(frozen=True, slots=True)
class Type:
    """'Y': describes a non-built-in data type used by a following Relation."""

    type_oid: int
    namespace: str
    """Schema name as sent: the empty string means ``pg_catalog``."""
    name: str
    xid: int | None = None


@dataclass(frozen=True, slots=True)
class Insert:
    """'I': a row was inserted."""

    relid: int
    new: tuple[Value, ...]
    xid: int | None = None


@dataclass(frozen=True, slots=True)
class Update:
    """'U': a row was updated.

    ``old`` is sent only when the replica identity changed (``old_kind`` 'K',
    key columns filled, the others None) or when the table has REPLICA
    IDENTITY FULL (``old_kind`` 'O', the whole old row).
    """

    relid: int
    old_kind: Literal["K", "O"] | None
    old: tuple[Value, ...] | None
    new: tuple[Value, ...]
    xid: int | None = None


@dataclass(frozen=True, slots=True)
class Delete:
    """'D': a row was deleted; ``old`` holds its key ('K') or whole row ('O')."""

    relid: int
    old_kind: Literal["K", "O"]
    old: tuple[Value, ...]
    xid: int | None = None


@dataclass(frozen=True, slots=True)
class Truncate:
    """'T': one TRUNCATE statement over one or more tables."""

    cascade: bool
    restart_identity: bool
    relids: tuple[int, ...]
    xid: int | None = None


@dataclass(frozen=True, slots=True)
class StreamStart:
    """'S': a block of changes of a large in-progress transaction follows."""

    xid: int
    first_segment: bool


@dataclass(frozen=True, slots=True)
class StreamStop:
    """'E': end of the current block of streamed changes."""


@dataclass(frozen=True, slots=True)
class StreamCommit:
    """'c': a streamed transaction committed."""

    xid: int
    flags: int
    commit_lsn: Lsn
    end_lsn: Lsn
    commit_ts: int


@dataclass(frozen=True, slots=True)
class StreamAbort:
    """'A': a streamed transaction (xid == subxid) or a subtransaction of it aborted."""

    xid: int
    subxid: int


@dataclass(frozen=True, slots=True)
class BeginPrepare:
    """'b': start of a transaction prepared for two-phase commit."""

    prepare_lsn: Lsn
    end_lsn: Lsn
    prepare_ts: int
    xid: int
    gid: str


@dataclass(frozen=True, slots=True)
class Prepare:
    """'P': end of the changes of a prepared transaction (PREPARE TRANSACTION)."""

    flags: int
    prepare_lsn: Lsn
    end_lsn: Lsn
    prepare_ts: int
    xid: int
    gid: str


@dataclass(frozen=True, slots=True)
class CommitPrepared:
    """'K': COMMIT PREPARED of a transaction sent earlier."""

    flags: int
    commit_lsn: Lsn
    end_lsn: Lsn
    commit_ts: int
    xid: int
    gid: str


@dataclass(frozen=True, slots=True)
class RollbackPrepared:
    """'r': ROLLBACK PREPARED of a transaction sent earlier."""

    flags: int
    prepare_end_lsn: Lsn
    rollback_end_lsn: Lsn
    prepare_ts: int
    rollback_ts: int
    xid: int
    gid: str


@dataclass(frozen=True, slots=True)
class StreamPrepare:
    """'p': a streamed transaction was prepared."""

    flags: int
    prepare_lsn: Lsn
    end_lsn: Lsn
    prepare_ts: int
    xid: int
    gid: str


PgOutputMessage: TypeAlias = Union[
    Begin,
    Message,
    Commit,
    Origin,
    Relation,
    Type,
    Insert,
    Update,
    Delete,
    Truncate,
    StreamStart,
    StreamStop,
    StreamCommit,
    StreamAbort,
    BeginPrepare,
    Prepare,
    CommitPrepared,
    RollbackPrepared,
    StreamPrepare,
]


# -- Wire layouts -------------------------------------------------------------
#
# Offsets below count from the start of the message, whose byte 0 is the type.

_U8 = struct.Struct(">B")
_U16 = struct.Struct(">H")
_U32 = struct.Struct(">I")
_I32 = struct.Struct(">i")
_BEGIN = struct.Struct(">QqI")
_MESSAGE = struct.Struct(">BQ")
_COMMIT = struct.Struct(">BQQq")
_ORIGIN = struct.Struct(">Q")
_RELATION_HEAD = struct.Struct(">I")
_RELATION_TAIL = struct.Struct(">BH")
_COLUMN_TYPE = struct.Struct(">Ii")
_TRUNCATE = struct.Struct(">IB")
_STREAM_START = struct.Struct(">IB")
_STREAM_COMMIT = struct.Struct(">IBQQq")
_STREAM_ABORT = struct.Struct(">II")
_BEGIN_PREPARE = struct.Struct(">QQqI")
_PREPARE = struct.Struct(">BQQqI")  # also Commit Prepared and Stream Prepare
_ROLLBACK_PREPARED = struct.Struct(">BQQqqI")
# Hot path: relid and the tuple marker, with and without the streaming xid.
_RELID_ACTION = struct.Struct(">IB")
_XID_RELID_ACTION = struct.Struct(">IIB")

_unpack_u16 = _U16.unpack_from
_unpack_u32 = _U32.unpack_from
_unpack_relid_action = _RELID_ACTION.unpack_from
_unpack_xid_relid_action = _XID_RELID_ACTION.unpack_from

_NAMES = {
    ord("B"): "begin",
    ord("M"): "logical decoding",
    ord("C"): "commit",
    ord("O"): "origin",
    ord("R"): "relation",
    ord("Y"): "type",
    ord("I"): "insert",
    ord("U"): "update",
    ord("D"): "delete",
    ord("T"): "truncate",
    ord("S"): "stream start",
    ord("E"): "stream stop",
    ord("c"): "stream commit",
    ord("A"): "stream abort",
    ord("b"): "begin prepare",
    ord("P"): "prepare",
    ord("K"): "commit prepared",
    ord("r"): "rollback prepared",
    ord("p"): "stream prepare",
}


# -- Error helpers (only run once something is wrong) -------------------------


def _truncated(name: str, need: int, off: int, have: int) -> DecodeError:
    got = max(have - off, 0)
    unit = "byte" if need == 1 else "bytes"
    return DecodeError(
        f"truncated {name} message: expected {need} {unit} at offset {off}, got {got}"
    )


def _short(name: str, st: struct.Struct, off: int, have: int) -> DecodeError:
    """Name the first field of `st` (read at `off`) that the data cuts short."""
    for code in st.format.lstrip("<>!=@"):
        size = struct.calcsize(">" + code)
        if off + size > have:
            return _truncated(name, size, off, have)
        off += size
    raise AssertionError("_short() called on data long enough")  # pragma: no cover


def _trailing(name: str, off: int, have: int) -> DecodeError:
    return DecodeError(
        f"{name} message has {have - off} unexpected trailing bytes at offset {off}"
    )


def _bad_byte(name: str, expected: str, off: int, byte: int) -> DecodeError:
    return DecodeError(
        f"invalid {name} message: expected {expected} at offset {off}, got {chr(byte)!r}"
    )


# -- Reading primitives for the less frequent messages --------------------------


def _unpack(st: struct.Struct, data: bytes, off: int, name: str) -> tuple:
    if off + st.size > len(data):
        raise _short(name, st, off, len(data))
    return st.unpack_from(data, off)


def _cstring(data: bytes, off: int, name: str, what: str) -> tuple[str, int]:
    """Read a NUL-terminated string at `off`; return it and the offset past it."""
    end = data.find(b"\x00", off)
    if end < 0:
        raise DecodeError(
            f"truncated {name} message: {what} string at offset {off} has no terminating NUL"
        )
    return data[off:end].decode(), end + 1


def _xid_prefix(dec: PgOutputDecoder, data: bytes, name: str) -> tuple[int | None, int]:
    if not dec._streaming:
        return None, 1
    return _unpack(_U32, data, 1, name)[0], 5


def _end(data: bytes, off: int, name: str) -> None:
    if off != len(data):
        raise _trailing(name, off, len(data))


def _read_tuple(data: bytes, off: int, have: int, name: str) -> tuple[tuple[Value, ...], int]:
    """Read TupleData at `off`; return the values and the offset past them.

    This runs for every column of every change, so it is written out flat:
    bounds are checked with integer comparisons rather than by catching
    exceptions, and text is decoded straight from the slice.
    """
    if off + 2 > have:
        raise _truncated(name, 2, off, have)
    (ncols,) = _unpack_u16(data, off)
    off += 2
    values: list[Value] = []
    append = values.append
    for _ in range(ncols):
        if off >= have:
            raise _truncated(name, 1, off, have)
        kind = data[off]
        if kind == 0x74:  # 't': text
            start = off + 5
            if start > have:
                raise _truncated(name, 4, off + 1, have)
            (size,) = _unpack_u32(data, off + 1)
            off = start + size
            if off > have:
                raise _truncated(name, size, start, have)
            append(data[start:off].decode())
        elif kind == 0x6E:  # 'n': null
            append(None)
            off += 1
        elif kind == 0x75:  # 'u': unchanged toasted value, not sent
            append(UNCHANGED_TOAST)
            off += 1
        elif kind == 0x62:  # 'b': binary
            start = off + 5
            if start > have:
                raise _truncated(name, 4, off + 1, have)
            (size,) = _unpack_u32(data, off + 1)
            off = start + size
            if off > have:
                raise _truncated(name, size, start, have)
            append(data[start:off])
        else:
            raise _bad_byte(name, "a column kind ('n', 'u', 't' or 'b')", off, kind)
    return tuple(values), off


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
    if dec._streaming:
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
    if dec._streaming:
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
    if dec._streaming:
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


def _decode_stream_start(dec: PgOutputDecoder, data: bytes) -> StreamStart:
    xid, first = _unpack(_STREAM_START, data, 1, "stream start")
    _end(data, 6, "stream start")
    dec._streaming = True
    dec._stream_xid = xid
    return StreamStart(xid, first == 1)


_STREAM_STOP = StreamStop()


def _decode_stream_stop(dec: PgOutputDecoder, data: bytes) -> StreamStop:
    _end(data, 1, "stream stop")
    dec._streaming = False
    dec._stream_xid = None
    return _STREAM_STOP


def _decode_stream_commit(dec: PgOutputDecoder, data: bytes) -> StreamCommit:
    xid, flags, commit_lsn, end_lsn, commit_ts = _unpack(
        _STREAM_COMMIT, data, 1, "stream commit"
    )
    _end(data, 30, "stream commit")
    return StreamCommit(xid, flags, Lsn(commit_lsn), Lsn(end_lsn), commit_ts)


def _decode_stream_abort(dec: PgOutputDecoder, data: bytes) -> StreamAbort:
    xid, subxid = _unpack(_STREAM_ABORT, data, 1, "stream abort")
    _end(data, 9, "stream abort")
    return StreamAbort(xid, subxid)


def _decode_begin_prepare(dec: PgOutputDecoder, data: bytes) -> BeginPrepare:
    name = "begin prepare"
    prepare_lsn, end_lsn, prepare_ts, xid = _unpack(_BEGIN_PREPARE, data, 1, name)
    gid, off = _cstring(data, 29, name, "gid")
    _end(data, off, name)
    return BeginPrepare(Lsn(prepare_lsn), Lsn(end_lsn), prepare_ts, xid, gid)


def _prepare_like(
    cls: type[Prepare] | type[CommitPrepared] | type[StreamPrepare], name: str
) -> Callable[[PgOutputDecoder, bytes], PgOutputMessage]:
    """Prepare, Commit Prepared and Stream Prepare share one layout."""

    def decode(dec: PgOutputDecoder, data: bytes) -> PgOutputMessage:
        flags, lsn, end_lsn, ts, xid = _unpack(_PREPARE, data, 1, name)
        gid, off = _cstring(data, 30, name, "gid")
        _end(data, off, name)
        return cls(flags, Lsn(lsn), Lsn(end_lsn), ts, xid, gid)

    return decode


def _decode_rollback_prepared(dec: PgOutputDecoder, data: bytes) -> RollbackPrepared:
    name = "rollback prepared"
    flags, prepare_end, rollback_end, prepare_ts, rollback_ts, xid = _unpack(
        _ROLLBACK_PREPARED, data, 1, name
    )
    gid, off = _cstring(data, 38, name, "gid")
    _end(data, off, name)
    return RollbackPrepared(
        flags, Lsn(prepare_end), Lsn(rollback_end), prepare_ts, rollback_ts, xid, gid
    )


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
    ord("S"): _decode_stream_start,
    ord("E"): _decode_stream_stop,
    ord("c"): _decode_stream_commit,
    ord("A"): _decode_stream_abort,
    ord("b"): _decode_begin_prepare,
    ord("P"): _prepare_like(Prepare, "prepare"),
    ord("K"): _prepare_like(CommitPrepared, "commit prepared"),
    ord("r"): _decode_rollback_prepared,
    ord("p"): _prepare_like(StreamPrepare, "stream prepare"),
}


class PgOutputDecoder:
    """Decodes one replication session's pgoutput messages, in order.

    Whether a change message starts with a transaction id depends on whether
    it falls inside a streamed block, so the decoder remembers the last
    Stream Start / Stream Stop. Use one decoder per replication connection
    and feed it every message.
    """

    __slots__ = ("_streaming", "_stream_xid")

    def __init__(self) -> None:
        self._streaming = False
        self._stream_xid: int | None = None

    @property
    def streaming(self) -> bool:
        """True between a Stream Start and its Stream Stop."""
        return self._streaming

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


class UnknownRelationError(LookupError):
    """A change refers to a relid for which no Relation message was seen."""


class RelationCache:
    """The latest Relation (and Type) seen for each oid.

    Change messages only carry a relid; the server sends the table's
    Relation before the first change to it in each session, and again when
    the table's definition changes, so keep the newest one.
    """

    __slots__ = ("relations", "types")

    def __init__(self) -> None:
        self.relations: dict[int, Relation] = {}
        self.types: dict[int, Type] = {}

    def update(self, message: Relation | Type) -> None:
        if type(message) is Relation:
            self.relations[message.relid] = message
        elif type(message) is Type:
            self.types[message.type_oid] = message
        else:
            raise TypeError(f"expected a Relation or Type message, got {type(message).__name__}")

    def get(self, relid: int) -> Relation:
        try:
            return self.relations[relid]
        except KeyError:
            raise UnknownRelationError(
                f"no relation message seen for relid {relid}"
            ) from None

    def __len__(self) -> int:
        return len(self.relations)
