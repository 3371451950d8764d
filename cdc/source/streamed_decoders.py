"""Decoders of the messages of streamed and two-phase transactions.

The bridge asks for streamed transactions with `postgres.streaming: true` (see
`cdc.bridge.held_transactions`) and never for two-phase ones; those decoders complete the
decoder for other readers of a pgoutput slot. `cdc.source.pgoutput` registers
them all in its dispatch table.
"""

from __future__ import annotations

from typing import Callable

from cdc.source.lsn import Lsn
from cdc.source.messages import (
    BeginPrepare,
    CommitPrepared,
    PgOutputMessage,
    Prepare,
    RollbackPrepared,
    StreamAbort,
    StreamCommit,
    StreamPrepare,
    StreamStart,
    StreamStop,
)
from cdc.source.wire import (
    StreamState,
    _BEGIN_PREPARE,
    _PREPARE,
    _ROLLBACK_PREPARED,
    _STREAM_ABORT,
    _STREAM_COMMIT,
    _STREAM_START,
    _cstring,
    _end,
    _unpack,
)


def _decode_stream_start(dec: StreamState, data: bytes) -> StreamStart:
    xid, first = _unpack(_STREAM_START, data, 1, "stream start")
    _end(data, 6, "stream start")
    dec._stream_xid = xid
    return StreamStart(xid, first == 1)


_STREAM_STOP = StreamStop()


def _decode_stream_stop(dec: StreamState, data: bytes) -> StreamStop:
    _end(data, 1, "stream stop")
    dec._stream_xid = None
    return _STREAM_STOP


def _decode_stream_commit(dec: StreamState, data: bytes) -> StreamCommit:
    xid, flags, commit_lsn, end_lsn, commit_ts = _unpack(
        _STREAM_COMMIT, data, 1, "stream commit"
    )
    _end(data, 30, "stream commit")
    return StreamCommit(xid, flags, Lsn(commit_lsn), Lsn(end_lsn), commit_ts)


def _decode_stream_abort(dec: StreamState, data: bytes) -> StreamAbort:
    xid, subxid = _unpack(_STREAM_ABORT, data, 1, "stream abort")
    _end(data, 9, "stream abort")
    return StreamAbort(xid, subxid)


def _decode_begin_prepare(dec: StreamState, data: bytes) -> BeginPrepare:
    name = "begin prepare"
    prepare_lsn, end_lsn, prepare_ts, xid = _unpack(_BEGIN_PREPARE, data, 1, name)
    gid, off = _cstring(data, 29, name, "gid")
    _end(data, off, name)
    return BeginPrepare(Lsn(prepare_lsn), Lsn(end_lsn), prepare_ts, xid, gid)


def _prepare_like(
    cls: type[Prepare] | type[CommitPrepared] | type[StreamPrepare], name: str
) -> Callable[[StreamState, bytes], PgOutputMessage]:
    """Prepare, Commit Prepared and Stream Prepare share one layout."""

    def decode(dec: StreamState, data: bytes) -> PgOutputMessage:
        flags, lsn, end_lsn, ts, xid = _unpack(_PREPARE, data, 1, name)
        gid, off = _cstring(data, 30, name, "gid")
        _end(data, off, name)
        return cls(flags, Lsn(lsn), Lsn(end_lsn), ts, xid, gid)

    return decode


def _decode_rollback_prepared(dec: StreamState, data: bytes) -> RollbackPrepared:
    name = "rollback prepared"
    flags, prepare_end, rollback_end, prepare_ts, rollback_ts, xid = _unpack(
        _ROLLBACK_PREPARED, data, 1, name
    )
    gid, off = _cstring(data, 38, name, "gid")
    _end(data, off, name)
    return RollbackPrepared(
        flags, Lsn(prepare_end), Lsn(rollback_end), prepare_ts, rollback_ts, xid, gid
    )


STREAMED_DECODERS: dict[int, Callable[[StreamState, bytes], PgOutputMessage]] = {
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
