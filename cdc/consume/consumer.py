"""Reading the per-entity streams with consumer groups: the consumer library.

A `Consumer` reads a group's entries in batches, re-reading its own pending
entries first after a restart, acknowledges only what its handler finished, moves
entries that keep failing to a dead-letter stream, and (non-exclusive mode)
claims entries left pending by dead consumers.

Exclusive mode (the default) gives each stream to one consumer of the group at a
time through a lease (`cdc.consume.lease`): per-key order then survives any number of
consumers, one per partition stream. A consumer that acquires a stream first
claims every entry the group still has pending there, so nothing a dead holder
left behind is overtaken by newer entries.

Takeover times: a consumer restarted under the same name takes its streams back
at once, and so does a consumer on the same host when a default-named holder's
process is gone (`cdc.consume.lease`); any other consumer takes a dead one's
streams once its lease expires (`lease_ttl_ms`), noticing within `LEASE_POLL_S`. In shared
mode, entries a dead consumer left pending are claimed once idle `claim_idle_ms`.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from datetime import datetime

import orjson
import redis
from redis.exceptions import ResponseError

from .. import keys
from ..sink.entry import Entry, parse_entry, reply_text, stream_id_for
from ..errors import CdcError
from ..loader import check_signature
from .failures import ENTRY, whose
from .lease import Lease
from .metrics import ConsumerMetrics, MetricsServer, serve_metrics

__all__ = ["Consumer", "Fenced", "default_name", "ensure_group", "stream_id_for"]

log = logging.getLogger("cdc.consumer")

#: defaults, chosen so that a group stalls about two seconds when one of its consumers dies
COUNT = 100
BLOCK_MS = 1000
CLAIM_IDLE_MS = 5_000
MAX_DELIVERIES = 5
LEASE_TTL_MS = 2_000
#: how often, at most, leases are renewed and free ones sought (and shared mode reaps)
LEASE_POLL_S = 0.25


class Fenced(CdcError):
    """A newer lease holder has written this stream's state: this consumer must stop using it."""


def default_name() -> str:
    return f"{socket.gethostname()}-{os.getpid()}"


def ensure_group(client: redis.Redis, stream: str, group: str, sid: str) -> bool:
    """Create `group` on `stream` at `sid` (the stream too, if missing); False when the group exists."""
    try:
        client.xgroup_create(stream, group, id=sid, mkstream=True)
        return True
    except ResponseError as exc:
        if "BUSYGROUP" not in str(exc):
            raise
        return False


class Consumer:
    """One member of a consumer group over one or more streams."""

    def __init__(
        self,
        client: redis.Redis,
        streams: Sequence[str],
        group: str,
        name: str | None = None,
        *,
        exclusive: bool = True,
        count: int = COUNT,
        block_ms: int = BLOCK_MS,
        claim_idle_ms: int = CLAIM_IDLE_MS,
        max_deliveries: int = MAX_DELIVERIES,
        lease_ttl_ms: int = LEASE_TTL_MS,
    ) -> None:
        self.client = client
        self._cluster = not hasattr(client, "connection_pool")  # a RedisCluster has one pool per node
        self._raw_clients: dict[str, redis.Redis] = {}
        self.streams = list(streams)
        self.group = group
        self.name = name or default_name()
        self.exclusive = exclusive
        self.count = count
        self.block_ms = block_ms
        self.claim_idle_ms = claim_idle_ms
        self.max_deliveries = max_deliveries
        self.dead_letter_stream = keys.dead_letter_key(group)
        instance = uuid.uuid4().hex[:12]  # this process: a restart under the same name takes the leases back
        self.leases = {s: Lease(client, s, group, self.name, lease_ttl_ms, instance) for s in self.streams} if exclusive else {}
        self._lease_check_every = min(lease_ttl_ms / 3000, LEASE_POLL_S)
        self._next_lease_check = 0.0
        self._next_reap = 0.0
        self._pending_phase: set[str] = set(self.streams)  # re-read own pending entries first
        self._redelivered: set[str] = set()  # IDs read again from the pending list: they may have failures recorded
        self._retry_one: set[str] = set()  # streams whose first pending entry failed: retry it alone
        self.delivered = 0
        self.acked = 0
        self.failed = 0
        self.dead_lettered = 0
        self.claimed = 0
        #: counters for /metrics (served only when asked: `serve_metrics`)
        self.metrics = ConsumerMetrics(group)

    def __repr__(self) -> str:
        return (
            f"<Consumer {self.group}/{self.name} delivered={self.delivered} acked={self.acked} "
            f"failed={self.failed} dead_lettered={self.dead_lettered} claimed={self.claimed}>"
        )

    def serve_metrics(self, port: int, host: str = "0.0.0.0", **options) -> MetricsServer:
        """Serve this consumer's /metrics, /healthz and /readyz (`cdc.consume.metrics.serve_metrics`)."""
        return serve_metrics(self, port, host, **options)

    # -- groups -----------------------------------------------------------------------

    def create_group(self, start: str | datetime | int = "$") -> None:
        """Create the group on every stream (idempotent; the stream is created if missing)."""
        sid = stream_id_for(start)
        for stream in self.streams:
            ensure_group(self.client, stream, self.group, sid)

    def epoch(self, stream: str) -> int:
        """The lease epoch this consumer holds on `stream` (0 when not exclusive)."""
        lease = self.leases.get(stream)
        return lease.epoch if lease is not None else 0

    @property
    def active_streams(self) -> list[str]:
        if not self.exclusive:
            return self.streams
        return [s for s in self.streams if self.leases[s].held]

    # -- leases and reaping ----------------------------------------------------------------

    def _refresh_leases(self) -> None:
        for stream, lease in self.leases.items():
            if lease.epoch:
                if not lease.renew():
                    self._pending_phase.discard(stream)
            elif lease.try_acquire():
                self.claimed += self._claim(stream, 0)
                self._pending_phase.add(stream)

    def _raw(self, stream: str) -> redis.Redis:
        """A client on the same connections as `client` (the node's, on a cluster) that keeps
        the reply of XAUTOCLAIM ... JUSTID whole: redis-py drops its cursor otherwise."""
        if self._cluster:
            node = self.client.get_node_from_key(stream)
            name, pool = node.name, self.client.get_redis_connection(node).connection_pool
        else:
            name, pool = "", self.client.connection_pool
        raw = self._raw_clients.get(name)
        if raw is None:
            raw = self._raw_clients[name] = redis.Redis(connection_pool=pool)
            raw.set_response_callback("XAUTOCLAIM", lambda response, **options: response)
        return raw

    def _claim(self, stream: str, min_idle_ms: int) -> int:
        """Take over the group's pending entries on `stream` idle at least `min_idle_ms`."""
        cursor, total = "0-0", 0
        while True:
            cursor, ids = self._raw(stream).execute_command(
                "XAUTOCLAIM", stream, self.group, self.name, min_idle_ms, cursor, "COUNT", 500, "JUSTID"
            )[:2]
            total += len(ids)
            if cursor in (b"0-0", "0-0"):
                return total

    def reap(self) -> int:
        """Claim entries left pending by dead consumers (idle longer than `claim_idle_ms`)."""
        claimed = 0
        for stream in self.active_streams:
            n = self._claim(stream, self.claim_idle_ms)
            if n:
                log.info("claimed %d idle entries of %s for %s", n, stream, self.name)
                self._pending_phase.add(stream)
                claimed += n
        self.claimed += claimed
        return claimed

    # -- reading -------------------------------------------------------------------------

    def _parse(self, reply, gone: list[tuple[str, str]] | None = None) -> list[Entry]:
        entries = []
        for stream, items in reply or []:
            for entry_id, fields in items:
                if fields:
                    entries.append(parse_entry(stream, entry_id, fields))
                elif gone is not None:  # an entry deleted (trimmed) while pending comes back empty
                    gone.append((reply_text(stream), reply_text(entry_id)))
        return entries

    def dead_letter(self, stream: str, entry_id: str, entry: Entry | None, failures: int, error: str) -> None:
        """Move one entry to the group's dead-letter stream with its error, then acknowledge it."""
        fields: dict = {
            "source_stream": stream, "source_id": entry_id, "group": self.group, "consumer": self.name,
            "deliveries": failures, "error": error[:2000],
        }
        if entry is not None:
            fields["entry"] = orjson.dumps({k.decode(): v.decode() for k, v in entry.fields.items()})
        pipe = self.client.pipeline(transaction=True)
        pipe.xadd(self.dead_letter_stream, fields)
        pipe.xack(stream, self.group, entry_id)
        pipe.hdel(keys.failures_key(stream, self.group), entry_id, f"{entry_id}:error")
        pipe.execute()
        self._retry_one.discard(stream)
        self._redelivered.discard(entry_id)
        self.dead_lettered += 1
        self.metrics.dead_letters[stream] += 1
        log.warning("dead-lettered %s %s after %d failed deliveries: %s", stream, entry_id, failures, error)

    def _finish_dead_letters(self, entries: list[Entry]) -> list[Entry]:
        """Of entries read again from the pending list, dead-letter those whose recorded failures
        already reached `max_deliveries` (a consumer stopped between counting the last failure and
        dead-lettering) without handing them to the handler again; return the others."""
        if not entries:
            return entries
        pipe = self.client.pipeline(transaction=False)
        for e in entries:
            pipe.hmget(keys.failures_key(e.stream, self.group), e.id, f"{e.id}:error")
        left = []
        for e, (failures, error) in zip(entries, pipe.execute()):
            if failures is not None and int(failures) >= self.max_deliveries:
                text = error.decode() if isinstance(error, bytes) else str(error or "")
                self.dead_letter(e.stream, e.id, e, int(failures), text)
            else:
                left.append(e)
        return left

    def _xreadgroup(self, ids: dict[str, str], count: int, block: int | None = None):
        """XREADGROUP over several streams; on a cluster, one call per stream (slots differ)."""
        if not self._cluster or len(ids) == 1:
            return self.client.xreadgroup(self.group, self.name, ids, count=count, block=block)
        reply = []
        for stream, sid in ids.items():
            reply += self.client.xreadgroup(self.group, self.name, {stream: sid}, count=count) or []
        if not reply and block:
            time.sleep(min(block, 100) / 1000)  # nothing anywhere: a short pause instead of a blocking read
        return reply

    def read(self) -> list[Entry]:
        """The next batch: own pending entries first (after a restart or a failure), then new ones."""
        now = time.monotonic()
        self.metrics.loop_at = now
        if self.exclusive and now >= self._next_lease_check:
            self._refresh_leases()
            self._next_lease_check = now + self._lease_check_every
        elif not self.exclusive and now >= self._next_reap:
            self.reap()
            self._next_reap = now + min(self.claim_idle_ms / 2000, 1.0)
        active = self.active_streams
        if not active:
            time.sleep(min(self.block_ms / 1000, self._lease_check_every))
            return []
        pending = [s for s in active if s in self._pending_phase]
        if pending:
            single = [s for s in pending if s in self._retry_one]
            several = [s for s in pending if s not in self._retry_one]
            entries, gone = [], []
            if single:
                entries += self._parse(self._xreadgroup({s: "0" for s in single}, 1), gone)
            if several:
                entries += self._parse(self._xreadgroup({s: "0" for s in several}, self.count), gone)
            for stream, entry_id in gone:  # nothing left to hand over: never blocks the stream
                self.dead_letter(stream, entry_id, None, 0, "deleted from the stream (trimmed) while pending")
            got = {e.stream for e in entries} | {stream for stream, _ in gone}
            entries = self._finish_dead_letters(entries)
            self._redelivered.update(e.id for e in entries)
            for stream in pending:
                if stream not in got:
                    self._pending_phase.discard(stream)
            if got:  # even if all were dead-lettered: more may be pending behind them
                self.delivered += len(entries)
                return entries
        block = self.block_ms
        if self.exclusive:  # wake up in time to renew the leases
            block = max(1, min(block, int(max(0.0, self._next_lease_check - time.monotonic()) * 1000)))
        reply = self._xreadgroup({s: ">" for s in active}, self.count, block)
        entries = self._parse(reply)
        self.delivered += len(entries)
        return entries

    def ack(self, entries: Sequence[Entry]) -> None:
        by_stream: dict[str, list[str]] = {}
        for e in entries:
            by_stream.setdefault(e.stream, []).append(e.id)
        if not by_stream:
            return
        pipe = self.client.pipeline(transaction=False)
        for stream, ids in by_stream.items():
            pipe.xack(stream, self.group, *ids)
            again = [i for i in ids if i in self._redelivered]  # only a redelivered entry can have failures recorded
            if again:
                pipe.hdel(keys.failures_key(stream, self.group), *again, *(f"{i}:error" for i in again))
                self._redelivered.difference_update(again)
        pipe.execute()
        self._retry_one.difference_update(by_stream)
        self.acked += len(entries)
        for stream, ids in by_stream.items():
            self.metrics.handled[stream] += len(ids)

    def fail(self, entry: Entry, error: BaseException | str) -> None:
        """Record that the handler failed on `entry` (alone): it stays pending and is delivered again,
        until the handler has failed on it `max_deliveries` times; then it is dead-lettered.

        Failures are counted per entry in Redis (`keys.failures_key`), not from the delivery count:
        entries delivered again only because they sat behind a failing one, or in a dead
        consumer's hands, never count, and a consumer that takes over continues the count."""
        text = error if isinstance(error, str) else f"{type(error).__name__}: {error}"
        failures_key = keys.failures_key(entry.stream, self.group)
        pipe = self.client.pipeline(transaction=True)
        pipe.hincrby(failures_key, entry.id, 1)
        pipe.hset(failures_key, f"{entry.id}:error", text[:2000])
        failures = int(pipe.execute()[0])
        self.failed += 1
        self.metrics.failures[entry.stream] += 1
        self._pending_phase.add(entry.stream)
        if failures >= self.max_deliveries:
            self.dead_letter(entry.stream, entry.id, entry, failures, text)
            return
        self._redelivered.add(entry.id)
        self._retry_one.add(entry.stream)

    # -- the loop ------------------------------------------------------------------------

    def run(self, handle: Callable[[list[Entry]], None], stop: threading.Event | None = None) -> None:
        """Read, handle, acknowledge until `stop` is set; a failing batch is retried entry by entry.

        On stop the batch in hand is finished and acknowledged before returning.
        """
        check_signature(handle, ("entries",), f"the handler of consumer {self.name}")
        stop = stop or threading.Event()
        log.info("consumer %s of group %s on %s", self.name, self.group, ", ".join(self.streams))
        self.metrics.state = "reading"
        try:
            while not stop.is_set():
                entries = self.read()
                if entries:
                    self.process(entries, handle)
        finally:
            self.metrics.state = "stopped"
            for lease in self.leases.values():
                lease.release()

    def process(self, entries: list[Entry], handle: Callable[[list[Entry]], None]) -> None:
        """Handle and acknowledge a batch; on failure, go entry by entry.

        In exclusive mode a stream stops at its first failing entry, which is
        retried alone until it succeeds or is dead-lettered: later entries never
        overtake it, so ordered state and checkpoints stay exact.

        Only a failure that is the entry's (`cdc.consume.failures.whose`) is counted; any
        other error is raised to the caller with the batch left pending, to retry or stop.
        """
        try:
            self._timed(handle, entries)
        except Fenced as exc:
            self._fenced(entries, exc)
            return
        except Exception as exc:
            if whose(exc) != ENTRY:  # a server away or a broken setup is no failure of the entries
                self._pending_phase.update(e.stream for e in entries)  # read them again after the retry
                raise
            if len(entries) == 1:
                self.fail(entries[0], exc)
                log.warning("handler failed on %s %s: %s", entries[0].stream, entries[0].id, exc)
                return
        else:
            self.ack(entries)
            return
        blocked: set[str] = set()
        for e in entries:
            if e.stream in blocked:
                continue
            try:
                self._timed(handle, [e])
            except Fenced as exc:
                self._fenced([e], exc)
                blocked.add(e.stream)
            except Exception as exc:
                if whose(exc) != ENTRY:
                    self._pending_phase.update(x.stream for x in entries)
                    raise
                self.fail(e, exc)
                log.warning("handler failed on %s %s: %s", e.stream, e.id, exc)
                if self.exclusive:
                    blocked.add(e.stream)
            else:
                self.ack([e])

    def _timed(self, handle: Callable[[list[Entry]], None], entries: list[Entry]) -> None:
        started = time.monotonic()
        try:
            handle(entries)
        finally:
            self.metrics.handler_seconds.observe(time.monotonic() - started)

    def _fenced(self, entries: Sequence[Entry], exc: Fenced) -> None:
        log.warning("fenced off: %s", exc)
        for e in entries:
            lease = self.leases.get(e.stream)
            if lease is not None:
                lease.epoch = 0
