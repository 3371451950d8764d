"""Wire layouts and reading primitives of the pgoutput decoder (`cdc.source.pgoutput`).

Struct layouts, the error messages that say which field at which offset is
wrong, and `_read_tuple`, the hot path that reads a change's column values.
"""

from __future__ import annotations

import struct
from typing import Protocol

from cdc.source.messages import UNCHANGED_TOAST, DecodeError, Value


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


class StreamState(Protocol):
    """What these decoders read and set of `cdc.source.pgoutput.PgOutputDecoder`: the xid of the streamed
    block open, None outside one."""

    _stream_xid: int | None


def _xid_prefix(dec: StreamState, data: bytes, name: str) -> tuple[int | None, int]:
    if dec._stream_xid is None:
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


