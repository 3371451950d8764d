"""Framing of the streaming replication sub-protocol (inside COPY_BOTH).

After ``START_REPLICATION`` the server and client exchange CopyData
messages whose payload starts with a type byte. This module parses the two
the server sends and builds the one the client must send; it does no I/O.

Server to client:

- ``'w'`` XLogData: Int64 start LSN, Int64 current end of WAL, Int64 server
  clock, then the payload (for logical replication, one pgoutput message).
- ``'k'`` primary keepalive: Int64 end of WAL, Int64 server clock, Byte1 1 if
  the client must answer at once (or risk being disconnected for timeout).

Client to server:

- ``'r'`` Standby Status Update: Int64 written, flushed and applied LSNs,
  Int64 client clock, Byte1 1 to ask the server to reply with a keepalive.
  The flushed LSN is what the server may recycle WAL up to, and where a
  logical slot restarts: report only what is durably handled.

Clocks are PostgreSQL timestamps: microseconds since 2000-01-01 00:00 UTC.
All integers are big-endian.
"""

from __future__ import annotations

import struct
import time
from dataclasses import dataclass
from typing import TypeAlias, Union

from cdc.source.lsn import Lsn

__all__ = [
    "WalProtocolError",
    "XLogData",
    "PrimaryKeepalive",
    "ServerMessage",
    "parse_copy_data",
    "standby_status_update",
    "PG_EPOCH_UNIX_US",
    "pg_now_us",
    "pg_ts_to_unix_ms",
    "unix_ms_to_pg_ts",
]

PG_EPOCH_UNIX_US = 946_684_800_000_000
"""2000-01-01 00:00 UTC, PostgreSQL's timestamp epoch, in Unix microseconds."""

_XLOGDATA = struct.Struct(">QQq")  # after the 'w'
_KEEPALIVE = struct.Struct(">QqB")  # after the 'k'
_STATUS_UPDATE = struct.Struct(">cQQQqB")


class WalProtocolError(ValueError):
    """A CopyData payload is not a well-formed replication message."""


@dataclass(frozen=True, slots=True)
class XLogData:
    """'w': a chunk of WAL; for logical replication, one decoded message."""

    data_start: Lsn
    """LSN of the WAL the payload comes from."""
    wal_end: Lsn
    """End of WAL on the server. A logical walsender sends `data_start` here
    again, so do not read it as the server's progress."""
    send_ts: int
    """Server clock when sent, PostgreSQL microseconds."""
    payload: bytes


@dataclass(frozen=True, slots=True)
class PrimaryKeepalive:
    """'k': the server is alive; answer at once if `reply_requested`."""

    wal_end: Lsn
    send_ts: int
    reply_requested: bool


ServerMessage: TypeAlias = Union[XLogData, PrimaryKeepalive]


def parse_copy_data(buf: bytes | bytearray | memoryview) -> ServerMessage:
    """Parse the payload of one CopyData message sent by the server."""
    if not buf:
        raise WalProtocolError("empty copy data message")
    kind = buf[0]
    if kind == 0x77:  # 'w'
        if len(buf) < 25:
            raise WalProtocolError(
                f"truncated xlogdata message: expected at least 25 bytes, got {len(buf)}"
            )
        start, end, ts = _XLOGDATA.unpack_from(buf, 1)
        return XLogData(Lsn(start), Lsn(end), ts, bytes(buf[25:]))
    if kind == 0x6B:  # 'k'
        if len(buf) != 18:
            raise WalProtocolError(
                f"invalid keepalive message: expected 18 bytes, got {len(buf)}"
            )
        end, ts, reply = _KEEPALIVE.unpack_from(buf, 1)
        return PrimaryKeepalive(Lsn(end), ts, reply != 0)
    raise WalProtocolError(
        f"unknown replication message type {chr(kind)!r} (0x{kind:02x})"
    )


def standby_status_update(
    write_lsn: int,
    flush_lsn: int,
    apply_lsn: int,
    *,
    now_ts: int | None = None,
    reply_requested: bool = False,
) -> bytes:
    """Build the payload of a Standby Status Update ('r') CopyData message.

    `now_ts` is the client clock in PostgreSQL microseconds; it defaults to
    `pg_now_us()`.
    """
    if now_ts is None:
        now_ts = pg_now_us()
    try:
        return _STATUS_UPDATE.pack(
            b"r", write_lsn, flush_lsn, apply_lsn, now_ts, 1 if reply_requested else 0
        )
    except struct.error as exc:
        raise ValueError(f"invalid standby status update field: {exc}") from None


def pg_now_us() -> int:
    """The current time as a PostgreSQL timestamp (microseconds since 2000)."""
    return time.time_ns() // 1000 - PG_EPOCH_UNIX_US


def pg_ts_to_unix_ms(ts: int) -> int:
    """Convert a PostgreSQL timestamp to Unix epoch milliseconds (floored)."""
    return (ts + PG_EPOCH_UNIX_US) // 1000


def unix_ms_to_pg_ts(ms: int) -> int:
    """Convert Unix epoch milliseconds to a PostgreSQL timestamp."""
    return ms * 1000 - PG_EPOCH_UNIX_US
