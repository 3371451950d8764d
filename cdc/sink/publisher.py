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
    AskError,
    BusyLoadingError,
    ClusterDownError,
    MovedError,
    TryAgainError,
    ConnectionError as RedisConnectionError,
    NoScriptError,
    OutOfMemoryError,
    ReadOnlyError,
    ResponseError,
    TimeoutError as RedisTimeoutError,
)

from .. import keys
from ..config import RedisSettings
from ..errors import PublishError, TransientError
from .redisconn import connect_redis

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
    if isinstance(exc, (RedisConnectionError, RedisTimeoutError, BusyLoadingError, ReadOnlyError, OSError,
                        MovedError, AskError, TryAgainError, ClusterDownError)):
        return TransientError(f"redis unavailable: {exc}")
    if isinstance(exc, ResponseError):
        text = str(exc)
        if isinstance(exc, OutOfMemoryError) or text.startswith(TRANSIENT_REPLIES) or "maxmemory" in text:
            return TransientError(f"redis refused the write for now: {text}")
        if text.startswith("NOPERM") or "NOPERM" in text:
            return PublishError(f"redis denied a command: {text}", hint="grant the bridge's ACL user EVALSHA, XADD, SET, GET on its keys")
        return PublishError(f"redis rejected the batch: {text}")
    return exc


class _Node:
    """One Redis server and the connection the publisher keeps to it."""

    def __init__(self, name: str, pool: redis.ConnectionPool) -> None:
        self.name = name
        self.pool = pool
        self.conn = None

    def connection(self):
        if self.conn is None:
            try:
                self.conn = self.pool.get_connection()
            except Exception as exc:
                raise _classify(exc) from exc
        return self.conn

    def drop(self) -> None:
        if self.conn is not None:
            self.conn.disconnect()
            self.pool.release(self.conn)
            self.conn = None

    def send(self, commands: list[bytes]) -> None:
        conn = self.connection()
        try:
            conn.send_packed_command([b"".join(commands)], check_health=False)
        except Exception as exc:
            self.drop()
            raise _classify(exc) from exc

    def receive(self, n: int) -> list:
        """Read `n` replies; error replies are returned, not raised."""
        conn = self.connection()
        replies = []
        try:
            for _ in range(n):
                try:
                    replies.append(conn.read_response())
                except ResponseError as exc:
                    replies.append(exc)
            return replies
        except Exception as exc:
            self.drop()
            raise _classify(exc) from exc

    def round_trip(self, commands: list[bytes]) -> list:
        self.send(commands)
        return self.receive(len(commands))

    def close(self) -> None:
        if self.conn is not None:
            self.pool.release(self.conn)
            self.conn = None
        self.pool.disconnect()


class _Sent:
    """What was sent to one node and awaits its replies."""

    __slots__ = ("node", "commands", "counts", "tail", "duplicates")

    def __init__(self, node: _Node, commands: list[bytes], counts: list[int], tail: list[bytes], duplicates: int) -> None:
        self.node, self.commands, self.counts, self.tail, self.duplicates = node, commands, counts, tail, duplicates


class Publisher:
    """Appends batches to streams, one connection per Redis server; counts what it wrote.

    With ``cluster=True`` each stream's script goes to the node owning the
    stream's hash slot (its mark shares that slot), all nodes in parallel.
    """

    def __init__(
        self,
        url: str,
        *,
        cluster: bool = False,
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
        self._cluster = None
        self._nodes: dict[str, _Node] = {}
        try:
            client = connect_redis(RedisSettings(url=url, cluster=cluster), socket_timeout=socket_timeout,
                                   socket_connect_timeout=5.0)
        except redis.RedisError as exc:  # a cluster is asked for its nodes right away
            raise _classify(exc) from exc
        if cluster:
            self._cluster = client
        else:
            self._nodes[""] = _Node("", client.connection_pool)
        self._inflight: tuple[list[_Sent], int | None] | None = None
        self.entries_written = 0
        self.entries_skipped = 0
        self.batches = 0

    def __repr__(self) -> str:
        return f"<Publisher written={self.entries_written} skipped={self.entries_skipped} batches={self.batches}>"

    def _route(self, key: str) -> _Node:
        """The node holding `key` (the only node outside a cluster)."""
        if self._cluster is None:
            return self._nodes[""]
        try:
            target = self._cluster.get_node_from_key(key)
        except redis.RedisError as exc:
            raise _classify(exc) from exc
        node = self._nodes.get(target.name)
        if node is None:
            pool = self._cluster.get_redis_connection(target).connection_pool
            node = self._nodes[target.name] = _Node(target.name, pool)
        return node

    def close(self) -> None:
        self._inflight = None
        for node in self._nodes.values():
            node.close()
        self._nodes.clear()
        if self._cluster is not None:
            self._cluster.close()

    # -- batches: send now, confirm later ------------------------------------------

    def _wait(self) -> list[bytes]:
        if self.wait_replicas:
            return [hiredis.pack_command((b"WAIT", self.wait_replicas, self.wait_timeout_ms))]
        return []

    def _check_tail(self, replies: list) -> None:
        for reply in replies:
            if isinstance(reply, Exception):
                raise _classify(reply)
        if self.wait_replicas and replies and replies[-1] < self.wait_replicas:
            raise TransientError(
                f"only {replies[-1]} of {self.wait_replicas} redis replicas acknowledged within {self.wait_timeout_ms} ms"
            )

    def _flushed_command(self, flushed: int) -> bytes:
        return hiredis.pack_command((b"SET", self.flushed_key, str(int(flushed))))

    def record_flushed(self, flushed: int) -> None:
        """Record (and replicate, if asked) that Redis holds every change up to `flushed`."""
        if self.flushed_key:
            self._check_tail(self._route(self.flushed_key).round_trip([self._flushed_command(flushed), *self._wait()]))

    def send(self, batches: Iterable[StreamBatch], flushed: int | None = None) -> None:
        """Send every non-empty batch (one script call per stream) without waiting.

        `flushed`, the end LSN of the last whole transaction in the batches, is
        recorded after them: in the same pipeline on a single server (commands run
        in order), after every node confirmed in a cluster. At most one send is
        outstanding: `confirm()` must be called before the next `send()`. The
        batches may be cleared as soon as this returns.
        """
        if self._inflight is not None:
            raise RuntimeError("confirm() the previous send first")
        by_node: dict[str, tuple[_Node, list[StreamBatch]]] = {}
        for b in batches:
            if b.count:
                node = self._route(b.stream)
                by_node.setdefault(node.name, (node, []))[1].append(b)
        double = self.double_send and random.random() < self.double_send
        sent: list[_Sent] = []
        for node, group in by_node.values():
            commands = [
                hiredis.pack_command((b"EVALSHA", APPEND_SHA, 2, b.stream, b.mark, _packb(b.entries))) for b in group
            ]
            tail = self._wait()
            if flushed is not None and self.flushed_key and self._cluster is None:
                tail.insert(0, self._flushed_command(flushed))
            duplicates = []
            if double:
                duplicates = [hiredis.pack_command((b"XADD", b.stream, b"*", *e[:-1])) for b in group for e in b.entries]
                log.warning("fault injection: sending a batch of %d entries twice", len(duplicates))
            node.send(commands + tail + duplicates)
            sent.append(_Sent(node, commands, [b.count for b in group], tail, len(duplicates)))
        self._inflight = (sent, flushed if self._cluster is not None else None)

    def confirm(self) -> int:
        """Wait until Redis applied the outstanding send; return the entries appended."""
        if self._inflight is None:
            return 0
        sent, deferred_flushed = self._inflight
        self._inflight = None
        if not sent:
            return 0
        added = 0
        for s in sent:
            n = len(s.commands)
            everything = s.node.receive(n + len(s.tail) + s.duplicates)
            replies, tail = everything[:n], everything[n : n + len(s.tail)]
            if any(isinstance(r, NoScriptError) for r in replies):
                # Redis restarted or flushed its script cache: load and resend; the marks make it safe.
                s.node.round_trip([hiredis.pack_command((b"SCRIPT", b"LOAD", APPEND_SCRIPT))])
                everything = s.node.round_trip(s.commands + s.tail)
                replies, tail = everything[:n], everything[n:]
            for count, reply in zip(s.counts, replies):
                if isinstance(reply, Exception):
                    raise _classify(reply)
                added += reply
                self.entries_skipped += count - reply
            self._check_tail(tail)
        if deferred_flushed is not None:
            self.record_flushed(deferred_flushed)
        self.entries_written += added
        self.batches += 1
        return added

    def publish(self, batches: Iterable[StreamBatch]) -> int:
        """Write every batch and wait for Redis to confirm; return entries appended."""
        self.send(batches)
        return self.confirm()

    def marks(self, streams: Iterable[str]) -> Mapping[str, tuple[int, int] | None]:
        """The high-water mark of each stream, as (commit LSN, seq), or None if never written."""
        result = {}
        for stream in streams:
            reply = self._route(stream).round_trip([hiredis.pack_command((b"GET", keys.mark_key(stream)))])[0]
            if isinstance(reply, Exception):
                raise _classify(reply)
            result[stream] = split_position(reply) if reply else None
        return result

    def ping(self) -> None:
        node = self._route(self.flushed_key or "cdc")
        reply = node.round_trip([hiredis.pack_command((b"PING",))])[0]
        if isinstance(reply, Exception):
            raise _classify(reply)
