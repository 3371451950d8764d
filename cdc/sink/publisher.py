"""Writing batches of entries into Redis Streams, exactly once per source change.

Each stream has a high-water mark: the source position ``(commit LSN, seq)`` of
the last entry written, in a key sharing the stream's cluster slot (`cdc.keys`).
A batch appends only the entries past each stream's mark and moves the mark in
the same atomic step, so a crash between any two steps leaves stream and mark in
agreement, and replaying a transaction after a restart appends nothing twice.

That step is a MULTI/EXEC transaction guarded by WATCH on the marks
(`cdc.sink.lane`, the default), or the Lua append script
(`cdc.sink.script`, ``redis.append: script``). Either refuses a whole batch,
before writing anything of it, when a stream key holds another type or a stream
whose mark says it held entries is gone (`cdc.sink.streamkeys`). Both run on lanes: one connection
for every stream on a single server, one per stream on a cluster (a
transaction stays in one hash slot), all sent before any reply is read.

The hot path packs commands itself and reads replies with hiredis: redis-py's
per-command Python overhead is the bottleneck otherwise.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Callable, Iterable, Mapping

import hiredis
import redis

from .. import keys
from ..config import RedisSettings
from ..errors import TransientError
from .node import Node, classify
from .redisconn import connect_redis
from .script import ScriptLane
from .streamkeys import stream_key_error
from .lane import Packed, TransactionLane, command_args, command_ends

__all__ = ["APPEND_MODES", "Publisher", "StreamBatch", "position", "split_position"]

log = logging.getLogger("cdc.publish")

APPEND_MODES = {"transaction": TransactionLane, "script": ScriptLane}


def position(lsn: int, seq: int) -> str:
    """The comparable form of a source position, as stored in marks."""
    return f"{lsn:020d}{seq:010d}"


def split_position(pos: str | bytes) -> tuple[int, int]:
    text = pos.decode() if isinstance(pos, bytes) else pos
    return int(text[:20]), int(text[20:])


class StreamBatch:
    """Entries waiting for one stream: each its field/value list with its position appended.

    ``entries`` is one list for the batch's lifetime (the compiled loop appends to it directly),
    emptied in place by `clear`.

    ``sent`` counts the entries cleared away over the batch's lifetime and ``last`` is the
    position of the last of them, so ``sent + count`` is how many entries were ever queued:
    what the transaction END records (`cdc.bridge.txends`) count from, at no cost per entry.
    """

    __slots__ = ("stream", "mark", "entries", "packed", "sent", "last", "base")

    def __init__(self, stream: str, packer: Callable[[bytes], Packed] | None = None) -> None:
        self.stream = stream
        self.mark = keys.mark_key(stream)
        self.entries: list[list] = []
        #: with a `packer`, the compiled loop packs entries here as it queues them (`cdc.sink.lane.Packed`),
        #: while `entries` is empty: the batch is `packed`'s entries, then those of the list, in that order
        self.packed = packer(stream.encode()) if packer is not None else None
        self.sent = 0
        self.last = ""
        self.base = 0  # entries queued before the transaction being read (`cdc.bridge.txends`)

    @property
    def count(self) -> int:
        packed = self.packed
        return len(self.entries) + (packed.count if packed is not None else 0)

    @property
    def last_position(self) -> str:
        """The position of the last entry queued, or of the last one sent when none is."""
        if self.entries:
            return self.entries[-1][-1]
        packed = self.packed
        return packed.last if packed is not None and packed.count else self.last

    def queued(self) -> list[list]:
        """Every entry queued, in order, as (field, value, ..., position) lists: those `packed` holds as
        the bytes it sends (values included), then those of the list as they are."""
        packed = self.packed
        if packed is None or not packed.count:
            return list(self.entries)
        commands, positions = packed.past("")
        unpacked = [[*args[3:], pos] for args, pos in zip(command_args(commands), positions)]
        return unpacked + self.entries

    def add(self, pos: str, fields: list) -> None:
        """Queue an entry; `fields` (field, value, ...) is taken over, not copied."""
        fields.append(pos)
        self.entries.append(fields)

    def clear(self) -> None:
        """Let the entries go (sent: the lanes packed them), keeping the list: the compiled loop holds it."""
        entries, packed = self.entries, self.packed
        if entries or packed is not None and packed.count:
            self.sent += self.count
            self.last = self.last_position
            entries.clear()
        if packed is not None:
            packed.clear()  # also when empty: its buffers shrink back while the stream is quiet


def _commands(packed: Packed) -> list[bytes]:
    """The `XADD` of each entry `packed` holds, one by one."""
    data, positions = packed.past("")
    ends = command_ends(data, len(positions))
    return [data[start:end] for start, end in zip([0, *ends], ends)]


def _count(entries: list, packed: Packed | None) -> int:
    return len(entries) + (packed.count if packed is not None else 0)


class _Sent:
    """One lane's part of the outstanding send."""

    __slots__ = ("lane", "counts")

    def __init__(self, lane, counts: list[int]) -> None:
        self.lane, self.counts = lane, counts


class Publisher:
    """Appends batches to streams through lanes; counts what it wrote.

    With ``cluster=True`` each stream has its own lane to the node owning the
    stream's hash slot (its mark shares that slot), all lanes in parallel.
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
        append: str = "transaction",
        entities: Mapping[str, str] | None = None,
        settings: RedisSettings | None = None,
        after_others: str | None = None,
    ) -> None:
        if append not in APPEND_MODES:
            raise ValueError(f"append must be one of {', '.join(APPEND_MODES)}, got {append!r}")
        self.url = url
        self.append = append
        #: stream key -> the entity it belongs to, named in errors about the key
        self.entities = dict(entities or {})
        #: a stream whose entries may be appended only after every other stream's of the same send (the
        #: transaction END records): on a cluster, where each stream has its own lane, it waits for the others
        self.after_others = after_others
        self._lane_kind = APPEND_MODES[append]
        self._lanes: dict[str, ScriptLane | TransactionLane] = {}
        self.flushed_key = flushed_key
        self.wait_replicas = wait_replicas
        self.wait_timeout_ms = wait_timeout_ms
        #: test-only fault: probability of appending a batch a second time, bypassing the marks,
        #: to prove consumers are exact even when a producer without marks sends twice
        self.double_send = double_send
        self._cluster = None
        self._nodes: dict[str, Node] = {}
        try:
            # `settings` (when given) carries the rest of the login: the sentinels' own, with a sentinel url
            client = connect_redis(settings or RedisSettings(url=url, cluster=cluster), socket_timeout=socket_timeout,
                                   socket_connect_timeout=5.0)
        except redis.RedisError as exc:  # a cluster is asked for its nodes right away
            raise classify(exc) from exc
        if cluster:
            self._cluster = client
        else:
            self._nodes[""] = Node("", client.connection_pool)
        self._inflight: tuple[list[_Sent], int | None] | None = None
        self.entries_written = 0
        self.entries_skipped = 0
        self.batches = 0

    def __repr__(self) -> str:
        return f"<Publisher written={self.entries_written} skipped={self.entries_skipped} batches={self.batches}>"

    def _route(self, key: str) -> Node:
        """The node holding `key` (the only node outside a cluster)."""
        if self._cluster is None:
            return self._nodes[""]
        try:
            target = self._cluster.get_node_from_key(key)
        except redis.RedisError as exc:
            raise classify(exc) from exc
        node = self._nodes.get(target.name)
        if node is None:
            pool = self._cluster.get_redis_connection(target).connection_pool
            node = self._nodes[target.name] = Node(target.name, pool)
        return node

    def _judge(self, stream: str, key_type: str, mark: str) -> None:
        """Raise when nothing may be appended to `stream` (`cdc.sink.streamkeys`), naming its entity."""
        error = stream_key_error(stream, key_type, mark, self.entities.get(stream))
        if error is not None:
            raise error

    def _lane(self, key: str):
        """The lane writing `key` (a stream or the flushed record): the one lane on a single server,
        its own on a cluster."""
        if self._cluster is None:
            lane = self._lanes.get("")
            if lane is None:
                lane = self._lanes[""] = self._lane_kind(self._nodes[""], self._judge)
            return lane
        lane = self._lanes.get(key)
        if lane is None:
            node = self._route(key)
            lane = self._lanes[key] = self._lane_kind(Node(key, node.pool), self._judge)
        return lane

    def memory_reserve(self) -> int:
        """Bytes Redis may need, beyond what it uses, to take the next batch (a queued transaction)."""
        return max((lane.reserve() for lane in self._lanes.values()), default=0)

    def close(self) -> None:
        self._inflight = None
        for name, lane in self._lanes.items():
            if name:
                lane.node.drop()
        self._lanes.clear()
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
                raise classify(reply)
        if self.wait_replicas and replies and replies[-1] < self.wait_replicas:
            raise TransientError(
                f"only {replies[-1]} of {self.wait_replicas} redis replicas acknowledged within {self.wait_timeout_ms} ms"
            )

    def record_flushed(self, flushed: int) -> None:
        """Record (and replicate, if asked) that Redis holds every change up to `flushed`; never backwards.

        On a single server the record goes through the streams' lane, whose watches it
        must not disturb; on a cluster its key has its own slot and connection.
        """
        if not self.flushed_key:
            return
        lane = self._lane(self.flushed_key)
        lane.send([], (self.flushed_key, int(flushed)), self._wait())
        self._check_tail(lane.confirm()[1])

    def send(self, batches: Iterable[StreamBatch], flushed: int | None = None) -> None:
        """Send every non-empty batch (one atomic append per lane) without waiting.

        `flushed`, the end LSN of the last whole transaction in the batches, is
        recorded with them: inside the same transaction on a single server, after
        every lane confirmed in a cluster. At most one send is outstanding:
        `confirm()` must be called before the next `send()`. The batches may be
        cleared as soon as this returns.
        """
        if self._inflight is not None:
            raise RuntimeError("confirm() the previous send first")
        by_lane: dict[int, tuple[object, list[tuple[str, str, list, Packed | None]]]] = {}
        later: list[tuple[str, str, list, Packed | None]] = []
        for b in batches:
            if b.count and b.stream == self.after_others and self._cluster is not None:
                # appended after the others confirm: kept
                later.append((b.stream, b.mark, list(b.entries), b.packed.copy() if b.packed is not None and b.packed.count
                              else None))
            elif b.count:
                lane = self._lane(b.stream)
                by_lane.setdefault(id(lane), (lane, []))[1].append((b.stream, b.mark, b.entries, b.packed))
        double = self.double_send and random.random() < self.double_send
        sent: list[_Sent] = []
        for lane, group in by_lane.values():
            record = None
            if flushed is not None and self.flushed_key and self._cluster is None:
                record = (self.flushed_key, int(flushed))
            after = self._wait()
            if double:
                # one command each: the lane reads one reply per command of `after`
                duplicates = [command for stream, _, entries, packed in group for command in
                              (_commands(packed) if packed is not None and packed.count else [])
                              + [hiredis.pack_command((b"XADD", stream, b"*", *e[:-1])) for e in entries]]
                log.warning("fault injection: sending a batch of %d entries twice",
                            sum(_count(entries, packed) for _, _, entries, packed in group))
                after += duplicates
            try:
                lane.send(group, record, after)
            except Exception:  # refused (a stream key judged) or cut: the lanes sent already still answer
                self._drain(sent)
                raise
            sent.append(_Sent(lane, [_count(entries, packed) for _, _, entries, packed in group]))
        self._inflight = (sent, flushed if self._cluster is not None else None, later)

    def _append_after_others(self, group: list[tuple[str, str, list, Packed | None]]) -> int:
        """Append the held-back stream's entries, now that every other lane confirmed its own; the entries
        appended."""
        lane = self._lane(group[0][0])
        lane.send(group, None, self._wait())
        appended, after = lane.confirm()
        self._check_tail(after[: 1 if self.wait_replicas else 0])
        added = sum(appended)
        self.entries_skipped += sum(_count(entries, packed) for _, _, entries, packed in group) - added
        return added

    @staticmethod
    def _drain(sent: list[_Sent]) -> None:
        """Read what lanes sent before a failure answer (each lane's append is whole or nothing), so that
        their connections stay in step; a lane that fails too is reconnected. The record does not move."""
        for s in sent:
            try:
                s.lane.confirm()
            except Exception:
                s.lane.node.drop()

    def confirm(self) -> int:
        """Wait until Redis applied the outstanding send; return the entries appended."""
        if self._inflight is None:
            return 0
        sent, deferred_flushed, later = self._inflight
        self._inflight = None
        if not sent and not later:
            return 0
        added = 0
        for i, s in enumerate(sent):
            try:
                appended, after = s.lane.confirm()
            except Exception:
                self._drain(sent[i + 1:])
                raise
            for count, n in zip(s.counts, appended):
                added += n
                self.entries_skipped += count - n
            self._check_tail(after[: 1 if self.wait_replicas else 0])
        if later:
            added += self._append_after_others(later)
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
                raise classify(reply)
            result[stream] = split_position(reply) if reply else None
        return result

    def replicated(self) -> None:
        """With `wait_replicas`: return once that many replicas hold everything written so far.

        A batch Redis applied but its replicas did not acknowledge leaves the record
        ahead of them; a session starting from the record waits for them first.
        """
        if self.wait_replicas:
            self._check_tail(self._route(self.flushed_key or "cdc").round_trip(self._wait()))

    def ping(self) -> None:
        node = self._route(self.flushed_key or "cdc")
        reply = node.round_trip([hiredis.pack_command((b"PING",))])[0]
        if isinstance(reply, Exception):
            raise classify(reply)
