"""Encode `cdc.source.pgoutput` messages back to pgoutput wire bytes, for tests.

Written independently of the decoder, field by field from the protocol
description, so that round trips exercise the decoder's offsets. A change
message with an ``xid`` is written with the streaming xid prefix.
"""

from __future__ import annotations

import struct

from cdc.source import pgoutput as po


def _u8(v: int) -> bytes:
    return struct.pack(">B", v)


def _u16(v: int) -> bytes:
    return struct.pack(">H", v)


def _u32(v: int) -> bytes:
    return struct.pack(">I", v)


def _i32(v: int) -> bytes:
    return struct.pack(">i", v)


def _u64(v: int) -> bytes:
    return struct.pack(">Q", v)


def _i64(v: int) -> bytes:
    return struct.pack(">q", v)


def _str(s: str) -> bytes:
    return s.encode() + b"\x00"


def _xid(xid: int | None) -> bytes:
    return b"" if xid is None else _u32(xid)


def encode_tuple(values: tuple) -> bytes:
    out = [_u16(len(values))]
    for v in values:
        if v is None:
            out.append(b"n")
        elif v is po.UNCHANGED_TOAST:
            out.append(b"u")
        elif isinstance(v, str):
            raw = v.encode()
            out.append(b"t" + _i32(len(raw)) + raw)
        elif isinstance(v, bytes):
            out.append(b"b" + _i32(len(v)) + v)
        else:
            raise TypeError(f"cannot encode tuple value {v!r}")
    return b"".join(out)


def encode(m: po.PgOutputMessage) -> bytes:
    if isinstance(m, po.Begin):
        return b"B" + _u64(m.final_lsn) + _i64(m.commit_ts) + _u32(m.xid)
    if isinstance(m, po.Message):
        content = bytes(m.content)
        return (
            b"M"
            + _xid(m.xid)
            + _u8(1 if m.transactional else 0)
            + _u64(m.lsn)
            + _str(m.prefix)
            + _i32(len(content))
            + content
        )
    if isinstance(m, po.Commit):
        return b"C" + _u8(m.flags) + _u64(m.commit_lsn) + _u64(m.end_lsn) + _i64(m.commit_ts)
    if isinstance(m, po.Origin):
        return b"O" + _u64(m.origin_lsn) + _str(m.name)
    if isinstance(m, po.Relation):
        out = [
            b"R",
            _xid(m.xid),
            _u32(m.relid),
            _str(m.namespace),
            _str(m.name),
            m.replica_identity.encode("ascii"),
            _u16(len(m.columns)),
        ]
        for c in m.columns:
            out += [_u8(1 if c.is_key else 0), _str(c.name), _u32(c.type_oid), _i32(c.type_modifier)]
        return b"".join(out)
    if isinstance(m, po.Type):
        return b"Y" + _xid(m.xid) + _u32(m.type_oid) + _str(m.namespace) + _str(m.name)
    if isinstance(m, po.Insert):
        return b"I" + _xid(m.xid) + _u32(m.relid) + b"N" + encode_tuple(m.new)
    if isinstance(m, po.Update):
        old = b""
        if m.old is not None:
            assert m.old_kind in ("K", "O")
            old = m.old_kind.encode() + encode_tuple(m.old)
        return b"U" + _xid(m.xid) + _u32(m.relid) + old + b"N" + encode_tuple(m.new)
    if isinstance(m, po.Delete):
        return b"D" + _xid(m.xid) + _u32(m.relid) + m.old_kind.encode() + encode_tuple(m.old)
    if isinstance(m, po.Truncate):
        options = (1 if m.cascade else 0) | (2 if m.restart_identity else 0)
        return (
            b"T"
            + _xid(m.xid)
            + _u32(len(m.relids))
            + _u8(options)
            + b"".join(_u32(r) for r in m.relids)
        )
    if isinstance(m, po.StreamStart):
        return b"S" + _u32(m.xid) + _u8(1 if m.first_segment else 0)
    if isinstance(m, po.StreamStop):
        return b"E"
    if isinstance(m, po.StreamCommit):
        return (
            b"c"
            + _u32(m.xid)
            + _u8(m.flags)
            + _u64(m.commit_lsn)
            + _u64(m.end_lsn)
            + _i64(m.commit_ts)
        )
    if isinstance(m, po.StreamAbort):
        return b"A" + _u32(m.xid) + _u32(m.subxid)
    if isinstance(m, po.BeginPrepare):
        return (
            b"b"
            + _u64(m.prepare_lsn)
            + _u64(m.end_lsn)
            + _i64(m.prepare_ts)
            + _u32(m.xid)
            + _str(m.gid)
        )
    if isinstance(m, (po.Prepare, po.StreamPrepare)):
        code = b"P" if isinstance(m, po.Prepare) else b"p"
        return (
            code
            + _u8(m.flags)
            + _u64(m.prepare_lsn)
            + _u64(m.end_lsn)
            + _i64(m.prepare_ts)
            + _u32(m.xid)
            + _str(m.gid)
        )
    if isinstance(m, po.CommitPrepared):
        return (
            b"K"
            + _u8(m.flags)
            + _u64(m.commit_lsn)
            + _u64(m.end_lsn)
            + _i64(m.commit_ts)
            + _u32(m.xid)
            + _str(m.gid)
        )
    if isinstance(m, po.RollbackPrepared):
        return (
            b"r"
            + _u8(m.flags)
            + _u64(m.prepare_end_lsn)
            + _u64(m.rollback_end_lsn)
            + _i64(m.prepare_ts)
            + _i64(m.rollback_ts)
            + _u32(m.xid)
            + _str(m.gid)
        )
    raise TypeError(f"not a pgoutput message: {m!r}")


def is_streamed(m: po.PgOutputMessage) -> bool:
    """True for a message that only decodes inside a Stream Start/Stop block."""
    return getattr(m, "xid", None) is not None and isinstance(
        m, (po.Message, po.Relation, po.Type, po.Insert, po.Update, po.Delete, po.Truncate)
    )
