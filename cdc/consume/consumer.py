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
from concurrent.futures import Future, ThreadPoolExecutor, wait
from datetime import datetime

import orjson
import redis
from redis.exceptions import ResponseError

from .. import keys, speedups
from ..redact import redact
from ..sink.entry import Entry, parse_entry, parse_reply, reply_text, stream_id_for
from ..sink.publisher import split_position
from ..sink.trim import foreign_removals, removal_reads, removed_unconsumed, unconsumed_loss_error
from ..errors import CdcError
from ..loader import check_signature
from .defaults import BLOCK_MS, CLAIM_IDLE_MS, COUNT, LEASE_POLL_S, LEASE_TTL_MS, MAX_DELIVERIES, TRANSACTION_WAIT_MS
from .failures import ENTRY, whose
from .lease import Lease
from .metrics import ConsumerMetrics, MetricsServer, serve_metrics
from .transactions import IncompleteTransaction, TransactionAssembler, Unit, covered, transactions_in

_compiled = speedups.load("cdc.sink._entries")
#: `parse_reply`, compiled where the extension is built (the same entries, the same errors)
parse_read = _compiled.parse_reply if _compiled is not None else parse_reply

__all__ = ["Consumer", "Fenced", "default_name", "ensure_group", "stream_id_for"]

log = logging.getLogger("cdc.consumer")

#: count a failure of the handler on an entry (KEYS: stream, failures hash; ARGV: group, consumer, entry ID,
#: error) only while the entry is pending for this consumer: the count so far, or 0 if another one claimed it
COUNT_FAILURE = """
if #redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[3], ARGV[3], 1, ARGV[2]) == 0 then return 0 end
local n = redis.call('HINCRBY', KEYS[2], ARGV[3], 1)
redis.call('HSET', KEYS[2], ARGV[3] .. ':error', ARGV[4])
return n
"""
#: move an entry to the dead-letter stream (KEYS: stream, failures hash, dead-letter stream; ARGV: group,
#: consumer, entry ID, the dead letter's fields) and acknowledge it, only while it is pending for this
#: consumer: 1, or 0 if another one claimed it (which handles, counts or dead-letters it itself)
DEAD_LETTER = """
if #redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[3], ARGV[3], 1, ARGV[2]) == 0 then return 0 end
redis.call('XADD', KEYS[3], '*', unpack(ARGV, 4))
redis.call('XACK', KEYS[1], ARGV[1], ARGV[3])
redis.call('HDEL', KEYS[2], ARGV[3], ARGV[3] .. ':error')
return 1
"""
#: on a cluster (the dead-letter stream is in another slot): write a dead letter once per source entry
#: (KEYS: dead-letter stream, its index; ARGV: "<stream> <entry ID>", the dead letter's fields): a letter the
#: index names and the stream still holds is reused (marked reused with a trailing *); returns its ID
DEAD_LETTER_ONCE = """
local seen = redis.call('HMGET', KEYS[2], ARGV[1])[1]
if seen then
  local id = string.gsub(seen, '[*]$', '')
  if #redis.call('XRANGE', KEYS[1], id, id) > 0 then
    redis.call('HSET', KEYS[2], ARGV[1], id .. '*')
    return id
  end
end
local id = redis.call('XADD', KEYS[1], '*', unpack(ARGV, 2))
redis.call('HSET', KEYS[2], ARGV[1], id)
return id
"""
#: on a cluster: take back a dead letter whose entry another consumer claimed meanwhile, unless that one
#: reused it (KEYS: dead-letter stream, its index; ARGV: "<stream> <entry ID>", the letter's ID)
DEAD_LETTER_TAKE_BACK = """
if redis.call('HMGET', KEYS[2], ARGV[1])[1] ~= ARGV[2] then return 0 end
redis.call('XDEL', KEYS[1], ARGV[2])
redis.call('HDEL', KEYS[2], ARGV[1])
return 1
"""
#: on a cluster (the dead-letter stream is in another slot): acknowledge the entry and clear its failures
#: only while it is pending for this consumer (KEYS: stream, failures hash; ARGV: group, consumer, entry ID)
ACK_OWNED = """
if #redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[3], ARGV[3], 1, ARGV[2]) == 0 then return 0 end
redis.call('XACK', KEYS[1], ARGV[1], ARGV[3])
redis.call('HDEL', KEYS[2], ARGV[3], ARGV[3] .. ':error')
return 1
"""


class Fenced(CdcError):
    """A newer lease holder has written this stream's state: this consumer must stop using it."""


#: read the next batch while one is handled once the handler takes this long on a batch (s): below it, a
#: handler that barely waits (nothing to do, or memory only) gains nothing from a second thread
READ_AHEAD_AFTER_S = 0.002


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
        transactions: str | None = None,
        transaction_wait_ms: int = TRANSACTION_WAIT_MS,
    ) -> None:
        problem = keys.group_problem(group)
        if problem is not None:
            raise ValueError(problem)
        if transactions is not None and not exclusive:
            raise ValueError("transaction mode needs exclusive=True: one consumer assembles each transaction")
        if transactions is not None and transactions in streams:
            raise ValueError(f"the transactions stream {transactions} is also among the streams to read")
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
        self.transactions = transactions
        self.transaction_wait_ms = transaction_wait_ms
        #: what is read: the streams, and in transaction mode the transactions stream too
        self.read_streams = self.streams + ([transactions] if transactions else [])
        instance = uuid.uuid4().hex[:12]  # this process: a restart under the same name takes the leases back
        # in transaction mode one lease, on the transactions stream, gives every stream: a transaction spans them
        leased = [transactions] if transactions else self.streams
        self.leases = {s: Lease(client, s, group, self.name, lease_ttl_ms, instance) for s in leased} if exclusive else {}
        self._lease_check_every = min(lease_ttl_ms / 3000, LEASE_POLL_S)
        self._next_lease_check = 0.0
        self._next_reap = 0.0
        self._count_script = client.register_script(COUNT_FAILURE)
        self._dead_letter_script = client.register_script(DEAD_LETTER)
        self._ack_owned_script = client.register_script(ACK_OWNED)
        self._letter_once_script = client.register_script(DEAD_LETTER_ONCE)
        self._letter_take_back_script = client.register_script(DEAD_LETTER_TAKE_BACK)
        self.dead_letter_index = keys.dead_letter_index_key(group)
        self._pending_phase: set[str] = set(self.read_streams)  # re-read own pending entries first
        self._redelivered: set[str] = set()  # IDs read again from the pending list: they may have failures recorded
        self._retry_one: set[str] = set()  # streams whose first pending entry failed: retry it alone
        self.delivered = 0
        self.acked = 0
        self.failed = 0
        self.dead_lettered = 0
        self.claimed = 0
        #: counters for /metrics (served only when asked: `serve_metrics`)
        self.metrics = ConsumerMetrics(group, transactions=transactions is not None)
        self.transactions_handled = 0
        self._read_pending = False  # the last read() returned entries read again from the pending list
        self._handled_in = float("inf")  # how long the handler took on the last batch (s; none yet: read ahead)
        self._assembly: TransactionAssembler | None = None  # transaction mode: what was read and not yet handled
        self._end_wait_told = ""  # transaction mode: the entry whose wait for its END record was logged

    def __repr__(self) -> str:
        return (
            f"<Consumer {self.group}/{self.name} delivered={self.delivered} acked={self.acked} "
            f"failed={self.failed} dead_lettered={self.dead_lettered} claimed={self.claimed}"
            + (f" transactions={self.transactions_handled}>" if self.transactions else ">")
        )

    def serve_metrics(self, port: int, host: str = "0.0.0.0", **options) -> MetricsServer:
        """Serve this consumer's /metrics, /healthz and /readyz (`cdc.consume.metrics.serve_metrics`)."""
        return serve_metrics(self, port, host, **options)

    # -- groups -----------------------------------------------------------------------

    def create_group(self, start: str | datetime | int = "$") -> None:
        """Create the group on every stream (idempotent; the stream is created if missing)."""
        sid = stream_id_for(start)
        if self.transactions and sid not in ("0", "0-0"):
            for stream, at in group_starts(self.client, self.streams, self.transactions, sid).items():
                ensure_group(self.client, stream, self.group, at)
            return
        for stream in self.read_streams:
            ensure_group(self.client, stream, self.group, sid)

    def epoch(self, stream: str) -> int:
        """The lease epoch this consumer holds on `stream` (0 when not exclusive)."""
        lease = self.leases.get(self.transactions or stream)
        return lease.epoch if lease is not None else 0

    @property
    def active_streams(self) -> list[str]:
        if not self.exclusive:
            return self.streams
        if self.transactions:
            return self.read_streams if self.leases[self.transactions].held else []
        return [s for s in self.streams if self.leases[s].held]

    # -- leases and reaping ----------------------------------------------------------------

    def _refresh_leases(self) -> None:
        for stream, lease in self.leases.items():
            covers = self.read_streams if self.transactions else [stream]
            if lease.epoch:
                if not lease.renew():
                    self._pending_phase.difference_update(covers)
                    self._assembly = None  # a new holder reads it all again
            elif lease.try_acquire():
                for s in covers:
                    self.claimed += self._claim(s, 0)
                self._pending_phase.update(covers)

    def _raw(self, stream: str) -> redis.Redis:
        """A client on the same connections as `client` (the node's, on a cluster) that keeps the replies of
        XAUTOCLAIM ... JUSTID (redis-py drops its cursor otherwise) and XREADGROUP as Redis sent them."""
        if self._cluster:
            node = self.client.get_node_from_key(stream)
            name, pool = node.name, self.client.get_redis_connection(node).connection_pool
        else:
            name, pool = "", self.client.connection_pool
        raw = self._raw_clients.get(name)
        if raw is None:
            raw = self._raw_clients[name] = redis.Redis(connection_pool=pool)
            raw.set_response_callback("XAUTOCLAIM", lambda response, **options: response)
            raw.set_response_callback("XREADGROUP", lambda response, **options: response)
        return raw

    def _xreadgroup_args(self, ids: dict[str, str], count: int, block: int | None) -> list:
        args: list = ["XREADGROUP", "GROUP", self.group, self.name, "COUNT", count]
        if block is not None:
            args += ["BLOCK", block]
        return [*args, "STREAMS", *ids, *ids.values()]

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
        """The entries of a raw XREADGROUP reply (`_xreadgroup`); entries deleted while pending go to `gone`."""
        return parse_read(reply, gone)

    def dead_letter(self, stream: str, entry_id: str, entry: Entry | None, failures: int, error: str) -> bool:
        """Move one entry to the group's dead-letter stream with its error, then acknowledge it; False
        (nothing done) when the entry is no longer pending for this consumer (another one claimed it)."""
        fields: dict = {
            "source_stream": stream, "source_id": entry_id, "group": self.group, "consumer": self.name,
            "deliveries": failures, "error": redact(error)[:2000],
        }
        if entry is not None:
            fields["entry"] = orjson.dumps({k.decode(): v.decode() for k, v in entry.fields.items()})
        owned = [stream, keys.failures_key(stream, self.group)]
        if self._cluster:  # two slots: the dead letter first (a crash then leaves it pending: moved again, once)
            letter = self._letter_once(stream, entry_id, fields)
            moved = self._ack_owned_script(keys=owned, args=[self.group, self.name, entry_id])
            index = [self.dead_letter_stream, self.dead_letter_index]
            if moved:
                self.client.hdel(self.dead_letter_index, f"{stream} {entry_id}")
            else:
                self._letter_take_back_script(keys=index, args=[f"{stream} {entry_id}", letter])
        else:
            flat = [part for pair in fields.items() for part in pair]
            moved = self._dead_letter_script(keys=[*owned, self.dead_letter_stream],
                                             args=[self.group, self.name, entry_id, *flat])
        self._retry_one.discard(stream)
        self._redelivered.discard(entry_id)
        if not moved:
            log.info("%s %s is no longer pending for %s (another consumer claimed it): not dead-lettered here",
                     stream, entry_id, self.name)
            return False
        self.dead_lettered += 1
        self.metrics.dead_letters[stream] += 1
        log.warning("dead-lettered %s %s after %d failed deliveries: %s", stream, entry_id, failures, error)
        return True

    def _letter_once(self, stream: str, entry_id: str, fields: dict) -> str:
        """On a cluster: the dead letter of `stream`'s entry, written unless one written for it is still waiting
        for the entry's acknowledgement (`DEAD_LETTER_ONCE`)."""
        flat = [part for pair in fields.items() for part in pair]
        letter = self._letter_once_script(keys=[self.dead_letter_stream, self.dead_letter_index],
                                          args=[f"{stream} {entry_id}", *flat])
        return reply_text(letter)

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
        """XREADGROUP over several streams, its reply as Redis sent it (`parse_read` parses it in one pass);
        on a cluster, one call per stream (slots differ)."""
        if not self._cluster:
            return self._raw("").execute_command(*self._xreadgroup_args(ids, count, block))
        # on a cluster, through the cluster client (it follows the slots), the entries' fields flattened back
        reply = []
        for stream, sid in ids.items():
            got = self.client.xreadgroup(self.group, self.name, {stream: sid}, count=count,
                                         block=block if len(ids) == 1 else None) or []
            for name, items in (got.items() if isinstance(got, dict) else got):
                for listed in (items if isinstance(got, dict) else [items]):
                    reply.append([name, [(i, [x for pair in f.items() for x in pair] if f else None) for i, f in listed]])
        if len(ids) == 1:
            return reply
        if not reply and block:
            time.sleep(min(block, 100) / 1000)  # nothing anywhere: a short pause instead of a blocking read
        return reply

    def read(self, only: Sequence[str] | None = None) -> list[Entry]:
        """The next batch: own pending entries first (after a restart or a failure), then new ones
        (of the streams in `only`, when given)."""
        now = time.monotonic()
        self.metrics.loop_at = now
        self._housekeeping(now)
        return self._next_batch(only)

    def _housekeeping_due(self, now: float) -> bool:
        return now >= (self._next_lease_check if self.exclusive else self._next_reap)

    def _housekeeping(self, now: float) -> None:
        """Renew or take the leases (exclusive), or claim what dead consumers left (shared), when due."""
        if self.exclusive and now >= self._next_lease_check:
            self._refresh_leases()
            self._next_lease_check = now + self._lease_check_every
        elif not self.exclusive and now >= self._next_reap:
            self.reap()
            self._next_reap = now + min(self.claim_idle_ms / 2000, 1.0)

    def _next_batch(self, only: Sequence[str] | None = None) -> list[Entry]:
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
                start = {s: self._assembly.cursor.get(s, "0") if self._assembly else "0" for s in several}
                entries += self._parse(self._xreadgroup(start, self.count), gone)
            if gone and self.transactions:
                raise_gone(gone)
            for stream, entry_id in gone:  # nothing left to hand over: never blocks the stream
                self.dead_letter(stream, entry_id, None, 0, "deleted from the stream (trimmed) while pending")
            got = {e.stream for e in entries} | {stream for stream, _ in gone}
            if self._assembly is not None:
                for e in entries:
                    self._assembly.cursor[e.stream] = e.id
            else:
                entries = self._finish_dead_letters(entries)
            self._redelivered.update(e.id for e in entries)
            for stream in pending:
                if stream not in got:
                    self._pending_phase.discard(stream)
            if got:  # even if all were dead-lettered: more may be pending behind them
                self.delivered += len(entries)
                self._read_pending = True
                return entries
        block = self.block_ms
        if self.exclusive:  # wake up in time to renew the leases
            block = max(1, min(block, int(max(0.0, self._next_lease_check - time.monotonic()) * 1000)))
        ids = {s: ">" for s in active if only is None or s in only}
        if not self.transactions:
            self._refuse_holes(list(ids or active))
        reply = self._xreadgroup(ids or {s: ">" for s in active}, self.count, block)
        self._read_pending = False
        entries = self._parse(reply)
        self.delivered += len(entries)
        return entries

    def _refuse_holes(self, streams: Sequence[str]) -> None:
        """Before reading new entries of `streams`: stop (exit 6) when entries this group had not been delivered
        were removed by someone other than the bridge (XDEL, XTRIM by hand; `cdc.sink.trim`): a plain read would
        skip them silently. Transaction mode finds them from its END records instead. One round trip; the full
        judgement only for a stream someone else removed entries from."""
        pipe = self.client.pipeline(transaction=False)
        for stream in streams:
            pipe.xinfo_stream(stream)
            removal_reads(pipe, stream)
        replies = pipe.execute(raise_on_error=False)
        for i, stream in enumerate(streams):
            info, account, older = replies[3 * i: 3 * i + 3]
            if isinstance(info, ResponseError) and "no such key" in str(info).lower():
                continue  # no stream yet: nothing to skip
            for reply in (info, account, older):
                if isinstance(reply, Exception):
                    raise reply
            if foreign_removals(info, account, older)[0] <= 0:
                continue
            gone = removed_unconsumed(self.client, stream, info, only=self.group)
            if gone:
                error = unconsumed_loss_error(self.client, gone[0], f"read by consumer group {self.group}")
                log.error("%s", error.message)
                raise error

    def ack(self, entries: Sequence[Entry]) -> None:
        by_stream: dict[str, list[str]] = {}
        for e in entries:
            by_stream.setdefault(e.stream, []).append(e.id)
        if not by_stream:
            return
        pipe = self.client.pipeline(transaction=False)
        for stream, ids in by_stream.items():
            pipe.xack(stream, self.group, *ids)
            # only a redelivered entry can have failures recorded, or in shared mode any entry: another
            # consumer may have claimed it while this one was handling it, and counted a failure
            again = ids if not self.exclusive else [i for i in ids if i in self._redelivered]
            if again:
                pipe.hdel(keys.failures_key(stream, self.group), *again, *(f"{i}:error" for i in again))
                self._redelivered.difference_update(again)
        pipe.execute()
        self._retry_one.difference_update(by_stream)
        self.acked += len(entries)
        for stream, ids in by_stream.items():
            self.metrics.handled[stream] += len(ids)

    def _count_failure(self, stream: str, entry_id: str, text: str) -> int:
        """Count one more failure of the handler on `entry_id` in Redis, with its error (`text`, masked by the
        caller); the count so far,
        or 0 (nothing counted) when the entry is no longer pending for this consumer: another one claimed
        it meanwhile, and may have finished or dead-lettered it (a count now would outlive the entry)."""
        failures = int(self._count_script(keys=[stream, keys.failures_key(stream, self.group)],
                                          args=[self.group, self.name, entry_id, text[:2000]]))
        if failures:
            self.failed += 1
            self.metrics.failures[stream] += 1
        return failures

    def fail(self, entry: Entry, error: BaseException | str) -> None:
        """Record that the handler failed on `entry` (alone): it stays pending and is delivered again,
        until the handler has failed on it `max_deliveries` times; then it is dead-lettered.

        Failures are counted per entry in Redis (`keys.failures_key`), not from the delivery count:
        entries delivered again only because they sat behind a failing one, or in a dead
        consumer's hands, never count, and a consumer that takes over continues the count."""
        text = redact(error if isinstance(error, str) else f"{type(error).__name__}: {error}")
        failures = self._count_failure(entry.stream, entry.id, text)
        self._pending_phase.add(entry.stream)
        if not failures:  # claimed by another consumer meanwhile: its failures are that one's to count
            log.info("%s %s is no longer pending for %s (another consumer claimed it): its failure not counted",
                     entry.stream, entry.id, self.name)
            self._redelivered.discard(entry.id)
            return
        if failures >= self.max_deliveries:
            self.dead_letter(entry.stream, entry.id, entry, failures, text)
            return
        self._redelivered.add(entry.id)
        self._retry_one.add(entry.stream)

    # -- the loop ------------------------------------------------------------------------

    def run(self, handle: Callable[[list[Entry]], None], stop: threading.Event | None = None) -> None:
        """Read, handle, acknowledge until `stop` is set; a failing batch is retried entry by entry.

        While a batch is handled, the next one is read (Redis and the handler's own database work at
        once). On stop the batch in hand is finished and acknowledged before returning; a batch read
        ahead meanwhile stays pending, delivered again at the next start.
        """
        check_signature(handle, ("entries",), f"the handler of consumer {self.name}")
        stop = stop or threading.Event()
        log.info("consumer %s of group %s on %s%s", self.name, self.group, ", ".join(self.streams),
                 f", transactions from {self.transactions}" if self.transactions else "")
        self.metrics.state = "reading"
        ahead = ThreadPoolExecutor(max_workers=1, thread_name_prefix="cdc-read-ahead")
        try:
            entries: list[Entry] | None = None
            while not stop.is_set():
                if self.transactions:
                    self._step_transactions(handle)
                    continue
                if entries is None:
                    entries = self.read()
                entries = self._process_reading_ahead(entries, handle, ahead) if entries else None
        finally:
            ahead.shutdown(wait=True)
            self.metrics.state = "stopped"
            self.metrics.end_wait_since = None
            self._assembly = None  # a run again (after a transient error) reads its pending entries again
            self._pending_phase.update(self.read_streams)
            for lease in self.leases.values():
                lease.release()

    def _process_reading_ahead(self, entries: list[Entry], handle: Callable[[list[Entry]], None],
                               ahead: ThreadPoolExecutor) -> list[Entry] | None:
        """`process` the batch while the next one is read, when the handler took long enough on the last batch
        for that to pay (`READ_AHEAD_AFTER_S`) and nothing must come before that read (a lease check or a reap
        due, own pending entries to read again); the next batch when it may be handled next,
        else None (read again). A batch read ahead and not handled is pending to this consumer: it is read
        again from the pending list, in order (after a failure, a changed lease, or on stop: at the next start)."""
        following: Future | None = None
        epochs: tuple[int, ...] = ()
        if (self._handled_in >= READ_AHEAD_AFTER_S and not self._pending_phase and not self._retry_one
                and not self._housekeeping_due(time.monotonic())):
            epochs = tuple(lease.epoch for lease in self.leases.values())
            following = ahead.submit(self._next_batch)
        try:
            clean = self.process(entries, handle)
        finally:
            if following is not None and not following.done():
                wait([following])  # (an error of the batch in hand is raised, the one read ahead dropped)
        if following is None:
            return None
        after = following.result()
        now = time.monotonic()
        self.metrics.loop_at = now
        if not after:
            return None
        self._housekeeping(now)
        if clean and not self._pending_phase and not self._retry_one and epochs == tuple(
                lease.epoch for lease in self.leases.values()):
            return after
        self._pending_phase.update(e.stream for e in after)
        return None

    def process(self, entries: list[Entry], handle: Callable[[list[Entry]], None]) -> bool:
        """Handle and acknowledge a batch; on failure, go entry by entry. True when the batch was handled
        and acknowledged whole at once.

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
            return False
        except Exception as exc:
            if whose(exc) != ENTRY:  # a server away or a broken setup is no failure of the entries
                self._pending_phase.update(e.stream for e in entries)  # read them again after the retry
                raise
            if len(entries) == 1:
                self.fail(entries[0], exc)
                log.warning("handler failed on %s %s: %s", entries[0].stream, entries[0].id, exc)
                return False
        else:
            self.ack(entries)
            return True
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
        return False

    def _timed(self, handle: Callable[[list[Entry]], None], entries: list[Entry]) -> None:
        started = time.monotonic()
        try:
            handle(entries)
        finally:
            self._handled_in = time.monotonic() - started
            self.metrics.handler_seconds.observe(self._handled_in)

    def _fenced(self, entries: Sequence[Entry], exc: Fenced) -> None:
        log.warning("fenced off: %s", exc)
        if self.transactions:
            self.leases[self.transactions].epoch = 0
            self._assembly = None
            return
        for e in entries:
            lease = self.leases.get(e.stream)
            if lease is not None:
                lease.epoch = 0

    # -- transaction mode ----------------------------------------------------------------

    def _step_transactions(self, handle: Callable[[list[Entry]], None]) -> None:
        """Hand over the units ready (at most about `count` entries at once), else read more."""
        self.metrics.loop_at = time.monotonic()  # the loop comes round while it works through ready units too
        if self._assembly is None:
            self._assembly = TransactionAssembler(self.streams, self.transactions, self.transaction_wait_ms / 1000)
        assembly = self._assembly
        if assembly.ready and time.monotonic() >= self._next_lease_check:  # busy: renew the lease between batches
            self._refresh_leases()
            self._next_lease_check = time.monotonic() + self._lease_check_every
            if self._assembly is not assembly:
                return
        if not assembly.ready:
            mark, marked = None, False
            if self.transactions not in self._pending_phase and assembly.waiting_for_end(time.monotonic(), 0.5):
                mark = self.client.get(keys.mark_key(self.transactions))  # before the read: the END up to it are read then
                marked = True
            entries = self.read(assembly.wanted(self.count))
            if self._assembly is not assembly:  # the lease was lost while reading
                return
            assembly.add(entries, redelivered=self._read_pending)
            marked = marked and not self._read_pending and not assembly.ends
            if marked and mark is not None:
                assembly.ends_written = split_position(mark)[0]
            superseded = assembly.superseded
            assembly.ready.extend(assembly.take(time.monotonic()))
            if assembly.superseded > superseded:
                log.warning("%d incomplete transaction(s) before a cdc recover marker in %s acknowledged: the "
                            "rebuild replaced entries they counted", assembly.superseded - superseded, self.transactions)
            self._watch_end_wait(assembly, mark if marked else b"")
            return
        batch, size = [], 0
        for unit in assembly.ready:
            if batch and size + len(unit.entries) > self.count:
                break
            batch.append(unit)
            size += len(unit.entries)
        self._process_units(batch, handle)

    def _watch_end_wait(self, assembly: TransactionAssembler, mark: bytes | None) -> None:
        """Entries waiting for an END record the bridge has not written yet (the transactions stream's
        high-water mark `mark`, read before this step's read, is below them: else they went alone) are no
        loss: the END comes with the bridge's next batch, maybe after a restart. Shown in the metrics,
        and logged once per wait past `transaction_wait_ms`. `mark` b"": not read in this step."""
        head = assembly.unended
        self.metrics.end_wait_since = assembly.since if head is not None else None
        waiting = f"{head.stream} {head.id}" if head is not None else ""
        if self._end_wait_told and waiting != self._end_wait_told:
            log.info("%s waits no more: the bridge wrote past it", self._end_wait_told)
            self._end_wait_told = ""
        if head is None or mark == b"" or waiting == self._end_wait_told:
            return
        if time.monotonic() - (assembly.since or 0.0) <= self.transaction_wait_ms / 1000:
            return
        self._end_wait_told = waiting
        written = (f"it has written no END record to {self.transactions} yet: check that its config sets "
                   f"transactions: {{stream: {self.transactions}}}" if mark is None else
                   f"its last END record in {self.transactions} is at commit LSN {split_position(mark)[0]}")
        log.warning("transaction %d (commit LSN %d) of %s %s waits for its END record, which the bridge has not "
                    "written yet (%s); waiting: it is handed over whole once the bridge writes it, when it runs again "
                    "if it is stopped", head.xid, head.lsn, head.stream, head.id, written)

    def _process_units(self, batch: list[Unit], handle: Callable[[list[Entry]], None]) -> None:
        """Handle units together, then acknowledge them together; on an entry's failure, unit by unit,
        stopping at the first that fails (it is retried alone: nothing overtakes it)."""
        batch = self._without_spent(batch)
        if not batch:
            return
        try:
            entries = [e for unit in batch for e in unit.entries]
            if entries:
                self._timed(handle, entries)
        except Fenced as exc:
            self._fenced(entries, exc)
            return
        except Exception as exc:
            if whose(exc) != ENTRY:
                raise
            if len(batch) == 1:
                self._fail_unit(batch[0], exc)
                return
        else:
            self._ack_units(batch)
            return
        for unit in batch:
            try:
                if unit.entries:
                    self._timed(handle, unit.entries)
            except Fenced as exc:
                self._fenced(unit.entries, exc)
                return
            except Exception as exc:
                if whose(exc) != ENTRY:
                    raise
                self._fail_unit(unit, exc)
                return
            self._ack_units([unit])

    def _without_spent(self, batch: list[Unit]) -> list[Unit]:
        """Dead-letter the units read again whose failures already reached `max_deliveries` (a consumer
        stopped between counting the last failure and dead-lettering); the batch up to the first other."""
        redelivered = self._assembly.redelivered
        if not redelivered:
            return batch
        again = [u for u in batch if u.head is not None and u.head.id in redelivered]
        if not again:
            return batch
        pipe = self.client.pipeline(transaction=False)
        for u in again:
            pipe.hmget(keys.failures_key(u.head.stream, self.group), u.head.id, f"{u.head.id}:error")
        spent = {}
        for u, (failures, error) in zip(again, pipe.execute()):
            if failures is not None and int(failures) >= self.max_deliveries:
                spent[id(u)] = (int(failures), error.decode() if isinstance(error, bytes) else str(error or ""))
        if not spent:
            return batch
        if id(batch[0]) not in spent:
            return batch[:next(i for i, u in enumerate(batch) if id(u) in spent)]
        for u in batch:
            if id(u) not in spent:
                break
            self._dead_letter_unit(u, *spent[id(u)])
        return []  # the next step takes what is left

    def _ack_units(self, units: Sequence[Unit]) -> None:
        """Acknowledge units together: every entry and END, one MULTI/EXEC on one Redis; on a cluster,
        the ENDs first (an entry left pending behind its acknowledged END is handed over alone and
        skipped by the checkpoint)."""
        by_stream: dict[str, list[str]] = {}  # the IDs to acknowledge, the handler's entries first
        handled: list[tuple[str, int]] = []  # stream -> how many of the handler's entries (metrics)
        for u in units:
            for e in u.entries:
                ids = by_stream.get(e.stream)
                if ids is None:
                    ids = by_stream[e.stream] = []
                ids.append(e.id)
        for stream, ids in by_stream.items():
            handled.append((stream, len(ids)))
        ends = by_stream.setdefault(self.transactions, [])
        for u in units:
            if u.end is not None:
                ends.append(u.end.id)
            for e in u.extra:
                by_stream.setdefault(e.stream, []).append(e.id)
        redelivered = self._assembly.redelivered
        cleared: dict[str, list[str]] = {}
        if redelivered:
            for stream, ids in by_stream.items():
                again = [i for i in ids if i in redelivered]
                if again:
                    cleared[stream] = again
        if self._cluster and ends:  # on its own node: acknowledged before the entries
            self.client.xack(self.transactions, self.group, *ends)
        pipe = self.client.pipeline(transaction=not self._cluster)
        for stream, ids in by_stream.items():
            if ids and not (self._cluster and stream == self.transactions):
                pipe.xack(stream, self.group, *ids)
        for stream, ids in cleared.items():
            pipe.hdel(keys.failures_key(stream, self.group), *ids, *(f"{i}:error" for i in ids))
        pipe.execute()
        for ids in cleared.values():
            redelivered.difference_update(ids)
        ready = self._assembly.ready
        for _ in range(len(units)):
            ready.popleft()
        self.acked += sum(len(ids) for ids in by_stream.values())
        self.transactions_handled += sum(transactions_in(u.end) for u in units if u.end is not None)
        for stream, n in handled:  # what the handler finished; the END records are not handed over
            self.metrics.handled[stream] += n

    def _fail_unit(self, unit: Unit, error: BaseException) -> None:
        """Count the handler's failure on a unit (on its END, or its entry); past `max_deliveries`
        the whole unit is dead-lettered. Otherwise it stays first in line, retried alone."""
        text = redact(f"{type(error).__name__}: {error}")
        head = unit.head
        failures = self._count_failure(head.stream, head.id, text)
        self._assembly.redelivered.add(head.id)  # a failure count to clear once it is done
        log.warning("handler failed on %s %s%s: %s", head.stream, head.id, _of(unit), error)
        if failures >= self.max_deliveries:
            self._dead_letter_unit(unit, failures, text)

    def _dead_letter_unit(self, unit: Unit, failures: int, error: str) -> None:
        """Move a whole unit to the dead-letter stream (each entry, then the END, each naming the END
        in `transaction`), acknowledge all of it and clear its failure count: none of it is applied."""
        pipe = self.client.pipeline(transaction=not self._cluster)
        moved = unit.entries + ([unit.end] if unit.end is not None else [])
        for e in moved:
            fields = {"source_stream": e.stream, "source_id": e.id, "group": self.group, "consumer": self.name,
                      "deliveries": failures, "error": redact(error)[:2000],
                      "entry": orjson.dumps({k.decode(): v.decode() for k, v in e.fields.items()})}
            if unit.end is not None:
                fields["transaction"] = unit.end.id
            if self._cluster:  # letters first, each once (a crash before the acknowledgements redoes them)
                self._letter_once(e.stream, e.id, fields)
            else:
                pipe.xadd(self.dead_letter_stream, fields)
        for e in unit.records:
            pipe.xack(e.stream, self.group, e.id)
        head = unit.head
        pipe.hdel(keys.failures_key(head.stream, self.group), head.id, f"{head.id}:error")
        pipe.execute()
        if self._cluster:  # acknowledged: the index has done its part
            self.client.hdel(self.dead_letter_index, *(f"{e.stream} {e.id}" for e in moved))
        self._assembly.redelivered.discard(head.id)
        self._assembly.ready.popleft()
        self.dead_lettered += len(unit.entries) + (unit.end is not None)
        for e in unit.entries + ([unit.end] if unit.end is not None else []):
            self.metrics.dead_letters[e.stream] += 1
        log.warning("dead-lettered %s %s with its %d entries after %d failed deliveries: %s",
                    head.stream, head.id, len(unit.entries), failures, error)


def _of(unit: Unit) -> str:
    """What a unit with an END holds, in words."""
    if unit.end is None:
        return ""
    n = transactions_in(unit.end)
    return (f" (a transaction of {len(unit.entries)} entries)" if n == 1 else
            f" ({n} transactions of {len(unit.entries)} entries, one END record)")


def raise_gone(gone: list[tuple[str, str]]) -> None:
    """Transaction mode: an entry deleted while pending leaves its transaction incomplete: stop."""
    stream, entry_id = gone[0]
    raise IncompleteTransaction(
        f"entry {entry_id} of {stream} was deleted (trimmed) while pending"
        + (f", and {len(gone) - 1} more" if len(gone) > 1 else ""),
        hint="the transaction it belongs to cannot be handed over whole: restore it, or skip the transaction "
             "knowingly by acknowledging its END record and its entries for this group (XACK)")


def group_starts(client: redis.Redis, streams: Sequence[str], transactions: str, sid: str) -> dict[str, str]:
    """Where a transaction-mode group starts on each stream so that no transaction is cut in two:
    on the transactions stream at `sid` ("$": after its last END); on each stream, after the last entry
    of a transaction whose END is before that point (the transactions stream is in commit order and an
    END is written after its entries, so every later entry belongs to a transaction whose END is read)."""
    upper = "+" if sid == "$" else sid
    last = client.xrevrange(transactions, max=upper, min="-", count=1)
    if not last:
        return {transactions: "0" if sid == "$" else sid, **{s: sid for s in streams}}
    end_id, fields = last[0]
    end = parse_entry(transactions, end_id, fields)
    starts = {transactions: end.id}
    for stream in streams:
        starts[stream] = _after_lsn(client, stream, upper, end.lsn)
    return starts


def _after_lsn(client: redis.Redis, stream: str, upper: str, lsn: int) -> str:
    """The ID of the newest entry at or before `upper` of a transaction committed at or before `lsn`
    ("0" when there is none): the group starts right after it."""
    while True:
        page = client.xrevrange(stream, max=upper, min="-", count=200)
        for entry_id, fields in page:
            e = parse_entry(stream, entry_id, fields)
            if covered(e) and e.lsn <= lsn:
                return e.id
        if len(page) < 200:
            return "0"
        upper = "(" + reply_text(page[-1][0])
