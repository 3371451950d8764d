"""Writing batches of entries into Redis Streams, exactly once per source change.

Each stream has a high-water mark: the source position ``(commit LSN, seq)`` of
the last entry written, in a key sharing the stream's cluster slot (`cdc.keys`).
One Lua script per stream and batch appends only the entries past the mark and
moves the mark, atomically. A crash between any two steps leaves stream and mark
in agreement, so replaying a transaction after a restart appends nothing twice.

Positions are fixed-width decimal strings (20 digits of LSN, 10 of seq) so the
script compares them as strings: Lua numbers are doubles and cannot hold an LSN.

The hot path packs commands with hiredis and pipelines every stream's script
call in one round trip: redis-py's per-command Python overhead is the bottleneck
otherwise.
"""

from __future__ import annotations

import hashlib
import logging
import random
from collections.abc import Iterable, Mapping

import hiredis
import msgpack
import redis
from redis.exceptions import (
    BusyLoadingError,
    ConnectionError as RedisConnectionError,
    NoScriptError,
    OutOfMemoryError,
    ReadOnlyError,
    ResponseError,
    TimeoutError as RedisTimeoutError,
)

from . import keys
from .errors import PublishError, TransientError

__all__ = ["Publisher", "StreamBatch", "position", "split_position"]

log = logging.getLogger("cdc.publish")

# ARGV[1]: a MessagePack array of entries; each entry is its field/value list
# followed by its position. One packed argument per stream keeps the client's
# per-argument packing cost off the hot path.
APPEND_SCRIPT = b"""
local mark = redis.call('GET', KEYS[2])
local entries = cmsgpack.unpack(ARGV[1])
local last = false
local added = 0
for i = 1, #entries do
  local e = entries[i]
  local n = #e
  local pos = e[n]
  if (not mark) or pos > mark then
    redis.call('XADD', KEYS[1], '*', unpack(e, 1, n - 1))
    last = pos
    added = added + 1
  end
end
if last then
  redis.call('SET', KEYS[2], last)
end
return added
"""
APPEND_SHA = hashlib.sha1(APPEND_SCRIPT).hexdigest()

_packb = msgpack.Packer(use_bin_type=False).pack  # the old spec: what Redis' cmsgpack reads

TRANSIENT_REPLIES = ("OOM", "LOADING", "BUSY", "READONLY", "TRYAGAIN", "CLUSTERDOWN", "MASTERDOWN", "NOREPLICAS")


def position(lsn: int, seq: int) -> str:
    """The comparable form of a source position, as stored in marks."""
    return f"{lsn:020d}{seq:010d}"


def split_position(pos: str | bytes) -> tuple[int, int]:
    text = pos.decode() if isinstance(pos, bytes) else pos
    return int(text[:20]), int(text[20:])


class StreamBatch:
    """Entries waiting for one stream: each its field/value list with its position appended."""

    __slots__ = ("stream", "mark", "entries")

    def __init__(self, stream: str) -> None:
        self.stream = stream
        self.mark = keys.mark_key(stream)
        self.entries: list[list] = []

    @property
    def count(self) -> int:
        return len(self.entries)

    def add(self, pos: str, fields: list) -> None:
        """Queue an entry; `fields` (field, value, ...) is taken over, not copied."""
        fields.append(pos)
        self.entries.append(fields)

    def clear(self) -> None:
        self.entries = []


def _classify(exc: Exception) -> Exception:
    if isinstance(exc, (RedisConnectionError, RedisTimeoutError, BusyLoadingError, ReadOnlyError, OSError)):
        return TransientError(f"redis unavailable: {exc}")
    if isinstance(exc, ResponseError):
        text = str(exc)
        if isinstance(exc, OutOfMemoryError) or text.startswith(TRANSIENT_REPLIES) or "maxmemory" in text:
            return TransientError(f"redis refused the write for now: {text}")
        if text.startswith("NOPERM") or "NOPERM" in text:
            return PublishError(f"redis denied a command: {text}", hint="grant the bridge's ACL user EVALSHA, XADD, SET, GET on its keys")
        return PublishError(f"redis rejected the batch: {text}")
    return exc


class Publisher:
    """Appends batches to streams over one connection; counts what it wrote."""

    def __init__(
        self,
        url: str,
        *,
        socket_timeout: float = 30.0,
        flushed_key: str | None = None,
        wait_replicas: int = 0,
        wait_timeout_ms: int = 1000,
        double_send: float = 0.0,
    ) -> None:
        self.url = url
        self.flushed_key = flushed_key
        self.wait_replicas = wait_replicas
        self.wait_timeout_ms = wait_timeout_ms
        #: test-only fault: probability of appending a batch a second time, bypassing the marks,
        #: to prove consumers are exact even when a producer without marks sends twice
        self.double_send = double_send
        try:
            self._pool = redis.ConnectionPool.from_url(url, socket_timeout=socket_timeout, socket_connect_timeout=5.0)
        except ValueError as exc:
            from .errors import ConfigError

            raise ConfigError(f"invalid redis url: {exc}", hint="use redis://host:port/db or rediss:// for TLS") from None
        self._conn = None
        self._inflight: tuple[list[bytes], list[int], list[bytes], int] | None = None
        self.entries_written = 0
        self.entries_skipped = 0
        self.batches = 0

    def __repr__(self) -> str:
        return f"<Publisher written={self.entries_written} skipped={self.entries_skipped} batches={self.batches}>"

    def _connection(self):
        if self._conn is None:
            try:
                self._conn = self._pool.get_connection()
            except Exception as exc:
                raise _classify(exc) from exc
        return self._conn

    def close(self) -> None:
        self._inflight = None
        if self._conn is not None:
            self._pool.release(self._conn)
            self._conn = None
        self._pool.disconnect()

    def _drop_connection(self, conn) -> None:
        conn.disconnect()
        self._pool.release(conn)
        self._conn = None

    def _send(self, commands: list[bytes]) -> None:
        conn = self._connection()
        try:
            conn.send_packed_command([b"".join(commands)], check_health=False)
        except Exception as exc:
            self._drop_connection(conn)
            raise _classify(exc) from exc

    def _receive(self, n: int) -> list:
        """Read `n` replies; error replies are returned, not raised."""
        conn = self._connection()
        replies = []
        try:
            for _ in range(n):
                try:
                    replies.append(conn.read_response())
                except ResponseError as exc:
                    replies.append(exc)
            return replies
        except Exception as exc:
            self._drop_connection(conn)
            raise _classify(exc) from exc

    def _round_trip(self, commands: list[bytes]) -> list:
        self._send(commands)
        return self._receive(len(commands))

    # -- batches: send now, confirm later ------------------------------------------

    def _tail(self, flushed: int | None) -> list[bytes]:
        """After the batch: record how far Redis holds the source, then wait for replicas."""
        tail = []
        if flushed is not None and self.flushed_key:
            tail.append(hiredis.pack_command((b"SET", self.flushed_key, str(int(flushed)))))
        if self.wait_replicas:
            tail.append(hiredis.pack_command((b"WAIT", self.wait_replicas, self.wait_timeout_ms)))
        return tail

    def _check_tail(self, replies: list) -> None:
        for reply in replies:
            if isinstance(reply, Exception):
                raise _classify(reply)
        if self.wait_replicas and replies and replies[-1] < self.wait_replicas:
            raise TransientError(
                f"only {replies[-1]} of {self.wait_replicas} redis replicas acknowledged within {self.wait_timeout_ms} ms"
            )

    def record_flushed(self, flushed: int) -> None:
        """Record (and replicate, if asked) that Redis holds every change up to `flushed`."""
        tail = self._tail(flushed)
        if tail:
            self._check_tail(self._round_trip(tail))

    def send(self, batches: Iterable[StreamBatch], flushed: int | None = None) -> None:
        """Send every non-empty batch (one script call per stream) without waiting.

        `flushed`, the end LSN of the last whole transaction in the batches, is
        recorded after them. At most one send is outstanding: `confirm()` must be
        called before the next `send()`. The batches may be cleared as soon as this
        returns.
        """
        if self._inflight is not None:
            raise RuntimeError("confirm() the previous send first")
        pending = [b for b in batches if b.count]
        commands = [
            hiredis.pack_command((b"EVALSHA", APPEND_SHA, 2, b.stream, b.mark, _packb(b.entries))) for b in pending
        ]
        duplicates = []
        if self.double_send and random.random() < self.double_send:
            duplicates = [hiredis.pack_command((b"XADD", b.stream, b"*", *e[:-1])) for b in pending for e in b.entries]
            log.warning("fault injection: sending a batch of %d entries twice", len(duplicates))
        tail = self._tail(flushed) if commands else []
        self._inflight = (commands, [b.count for b in pending], tail, len(duplicates))
        if commands:
            self._send(commands + tail + duplicates)

    def confirm(self) -> int:
        """Wait until Redis applied the outstanding send; return the entries appended."""
        if self._inflight is None:
            return 0
        commands, counts, tail_commands, duplicates = self._inflight
        self._inflight = None
        if not commands:
            return 0
        n = len(commands)
        everything = self._receive(n + len(tail_commands) + duplicates)
        replies, tail = everything[:n], everything[n : n + len(tail_commands)]
        if any(isinstance(r, NoScriptError) for r in replies):
            # Redis restarted or flushed its script cache: load and resend; the marks make it safe.
            self._round_trip([hiredis.pack_command((b"SCRIPT", b"LOAD", APPEND_SCRIPT))])
            everything = self._round_trip(commands + tail_commands)
            replies, tail = everything[:n], everything[n:]
        added = 0
        for count, reply in zip(counts, replies):
            if isinstance(reply, Exception):
                raise _classify(reply)
            added += reply
            self.entries_skipped += count - reply
        self._check_tail(tail)
        self.entries_written += added
        self.batches += 1
        return added

    def publish(self, batches: Iterable[StreamBatch]) -> int:
        """Write every batch and wait for Redis to confirm; return entries appended."""
        self.send(batches)
        return self.confirm()

    def marks(self, streams: Iterable[str]) -> Mapping[str, tuple[int, int] | None]:
        """The high-water mark of each stream, as (commit LSN, seq), or None if never written."""
        streams = list(streams)
        if not streams:
            return {}
        replies = self._round_trip([hiredis.pack_command((b"GET", keys.mark_key(s))) for s in streams])
        result = {}
        for stream, reply in zip(streams, replies):
            if isinstance(reply, Exception):
                raise _classify(reply)
            result[stream] = split_position(reply) if reply else None
        return result

    def ping(self) -> None:
        reply = self._round_trip([hiredis.pack_command((b"PING",))])[0]
        if isinstance(reply, Exception):
            raise _classify(reply)
