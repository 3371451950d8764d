"""One replication session of the bridge: the main loop and the stages it runs.

The loop reads a message, hands it to its stage, and sends the batch when due:

- `Transaction` (positions.py) assembles Begin/Commit into positions;
- `route_row` and friends (changes.py) project each change and pack its entry;
- `Batcher` (batcher.py) holds the entries and says when they are due;
- `InFlight` (inflight.py) sends one batch while the next is decoded;
- `Acknowledger` (ack.py) decides what the slot may be told, up to what the
  ack gate (gate.py) vouched for on reading the catalog every status interval.

The state of a session lives in those objects and in `Timers`; the bridge that
runs it (`cdc.bridge.loop`) keeps what outlives a session (its counters, the
acknowledged position, the streamed transactions held) and does the guardrails' I/O:
`SessionHost` names exactly what a session asks of it.
"""

from __future__ import annotations

import logging
import struct
import time
from collections.abc import Callable
from typing import Protocol

import orjson
import psycopg

from ..config import Settings
from ..errors import MappingError, SourceError
from ..mapping.model import Mapping
from ..mapping.projector import Projector
from ..ops.rebuild import EMPTY_KEY, REBUILT
from ..sink.lane import packer
from ..sink.publisher import Publisher, position
from ..source import pgoutput as pg
from ..source.catalog import load_types, table_shape
from ..source.deadline import ConnectionSilent, bounded
from ..source.framing import PrimaryKeepalive, parse_copy_data
from ..source.lsn import Lsn
from ..source.pubcolumns import ColumnsNotSent
from ..source.replication import ReplicationStream
from ..source.values import TypeCatalog
from .ack import Acknowledger
from .introductions import Introduction
from .backfill import IDLE_POLL_S, REQUEST_PREFIX, REQUEST_RETRY_S, WATERMARK_PREFIX, BackfillDriver, Windows, parse_request
from .batcher import Batcher
from .changes import DELETE, INSERT, UPDATE, Target, burst_changes, route_change, route_message, route_truncate
from .counters import Counters
from .gate import RESYNC_PREFIX, TableGate
from .held_transactions import StreamedTransactions
from .inflight import InFlight
from .snapshot import queue_chunk
from .positions import Transaction
from .txends import TransactionEnds

__all__ = ["Session", "SessionHost", "ConnectionSilent"]

log = logging.getLogger("cdc.bridge")

_W = 0x77  # XLogData
_XLOG_HEADER = 25
_IGNORED = frozenset(ord(c) for c in "OY")
#: inside a streamed block, held with its changes: relations, truncates, logical messages
_HELD = frozenset(b"RTM")
_RELID = struct.Struct(">I").unpack_from  # a change's relid, read before deciding to decode it
_CAUGHT_UP_POLL_S = 0.1
#: how long the loop waits for the server's next message, when it has sent everything so far, before it
#: sends a batch that is not yet due (never past the batch's `max_delay`): a flow of changes pauses for
#: less, and its batches fill instead of leaving a few entries at a time, each with its round trips
LINGER_S = 0.001
#: while transactions keep coming (their mean gap, `Session.gap`, shorter than what is left of the pending
#: batch's `max_delay`), the loop waits for the next one up to this many mean gaps (at least `LINGER_S`,
#: never past the batch's `max_delay`): a live flow of small transactions then fills a batch for up to
#: `max_delay` instead of sending one per transaction; a pause longer than that sends what is pending
GAPS = 4
#: the weight of the last gap between transactions measured in `Session.gap` (a moving average)
GAP_WEIGHT = 0.5
#: the longest wait for more transactions the loop sleeps through (a longer one wakes at the next message,
#: as the loop must for a stop, its timers and a batch filling up)
NAP_MAX_S = 0.05
#: the longest nap, as a share of `batch.max_delay_ms`: a change that arrives while the loop sleeps waits up to
#: that much before its batch's age counts it
NAP_SHARE = 0.25
_GUARD_INTERVAL_S = 0.5


def _name(t: tuple[str, str]) -> str:
    return f"{t[0]}.{t[1]}"


class Timers:
    """When the loop next does each periodic thing, and when the server was last heard (monotonic s)."""

    __slots__ = ("status", "poll", "guard", "slot_check", "heartbeat", "trim", "heard", "verify", "backfill")

    def __init__(self, now: float, slot_check_s: float, heartbeat_s: float, trim_s: float) -> None:
        self.status = self.heard = now
        self.verify = 0.0
        self.poll = self.guard = 0.0
        self.slot_check = now + slot_check_s
        self.heartbeat = now + heartbeat_s if heartbeat_s else float("inf")
        self.trim = now + trim_s if trim_s else float("inf")
        self.backfill = now + IDLE_POLL_S  # the next look at cdc_backfills not prompted by the stream


class SessionHost(Protocol):
    """What a session needs from the bridge that runs it (`cdc.bridge.loop.Bridge`), and nothing more.

    State that outlives a session: the settings and mappings, the counters, the acknowledger,
    the ack gate, the type catalog, the streamed transactions held. Whether to stop, or to
    return once caught up (with `target_lsn`, the position to reach). And the guardrails'
    I/O, each method raising what stops or restarts the session (`cdc.errors`).
    """

    settings: Settings
    mappings: list[Mapping]
    message_mappings: list[Mapping]
    counters: Counters
    ack: Acknowledger
    gate: TableGate
    catalog: TypeCatalog
    streams: StreamedTransactions
    stopping: bool
    until_caught_up: bool
    target_lsn: Lsn | None
    last_heard: float  # when the server was last heard (monotonic s), for readiness

    def bind(self, relation: pg.Relation, catalog_conn: psycopg.Connection, batcher: Batcher) -> list[Target]: ...

    def progressed(self) -> None: ...

    def verify_tables(self, catalog_conn: psycopg.Connection) -> None: ...

    def memory_limited(self) -> bool: ...

    def memory_paused(self) -> bool: ...

    def pause_while_memory_full(self, report: Callable[..., None], status_interval: float) -> None: ...

    def check_slot(self, catalog_conn: psycopg.Connection) -> object: ...

    def check_streams(self) -> None: ...

    def heartbeat(self, catalog_conn: psycopg.Connection) -> bool: ...

    def trim_streams(self) -> None: ...

    def drive_backfill(self, backfill: BackfillDriver, catalog_conn: psycopg.Connection) -> None: ...

    def since_marker(self, stream: str) -> tuple[int, list[tuple[bytes, bytes, bool]]] | None: ...


def introduction(m: Mapping) -> Introduction:
    """What `m`'s stream has brought since its resync marker: nothing yet."""
    return Introduction(len(m.key) > 1, "c" in m.ops)


class Session:
    """Streams one replication connection into Redis until stopped, caught up or failed."""

    def __init__(self, host: SessionHost, stream: ReplicationStream, publisher: Publisher, conn: psycopg.Connection,
                 held: Lsn, confirmed: Lsn | None = None, writer: psycopg.Connection | None = None) -> None:
        settings = host.settings
        self.host = host
        self.counters = host.counters
        self.stream = stream
        self.publisher = publisher
        self.conn = conn  # the catalog connection, on the slot's server: types, slot health, the ack gate
        #: the primary: heartbeats, backfill chunks and their watermarks (`conn` unless the slot is on a standby)
        self.writer = writer or conn
        self.status_interval = settings.batch.status_interval_s
        self.receive_timeout = settings.postgres.receive_timeout_s
        self.decoder = pg.PgOutputDecoder()
        self.decode = self.decoder.decode
        self.targets: dict[int, list[Target]] = {}
        batch = settings.batch
        # the compiled loop packs entries as it queues them for a transaction lane (the script lane
        # sends entry lists)
        self.batcher = Batcher(batch.max_entries, batch.max_delay_ms / 1000.0,
                               packer=packer if settings.redis.append == "transaction" else None)
        self.messages = [(m.message_prefix, m.version, self.batcher.batch(m.stream_key()))
                         for m in host.message_mappings if m.message_prefix is not None]
        self.tx = Transaction()
        tx_stream = settings.transactions.stream
        #: the END records of source transactions, when a transactions stream is set
        self.ends = TransactionEnds(self.batcher, tx_stream, *self._grouping(publisher, settings)) if tx_stream else None
        self.inflight = InFlight(publisher)
        self.ack = host.ack
        self.ack.resume(held, confirmed)  # what Redis records now, not what an earlier session remembered
        self.gate = host.gate
        self.gate.vouched = lambda: self.ack.verified
        #: Relations of resyncing tables decoded before their resync marker: bound when it comes
        self.held_relations: dict[tuple[str, str], list[tuple[pg.Relation, int]]] = {}  # each with its position
        self.windows = Windows()  # open backfill watermark windows
        self.read_back_introductions()
        self.streams = host.streams  # transactions the server streams while they run, held until they end
        self.backfill = BackfillDriver(settings.postgres.slot, host.mappings, batch.backfill_chunk_rows)
        self.snapshot_projectors: dict[str, Projector] = {}
        pgs = settings.postgres
        self.timers = Timers(time.monotonic(), pgs.slot_check_interval_s, pgs.heartbeat_interval_s, settings.trim.interval_s)
        #: the mean time between two source transactions lately (s; a moving average, measured where the loop
        #: has read everything the server sent: `linger`), and where that measure last stood
        self.gap = float("inf")
        self.gap_at: float | None = None
        self.gap_count = self.counters.transactions
        #: the position the slot was last told (a status message that would tell it again waits for its time)
        self.told: Lsn | None = None

    @staticmethod
    def _grouping(publisher: Publisher, settings: Settings) -> tuple[int, str]:
        """How many transactions an END record may cover, and (when more than one) the transactions stream's
        high-water mark now, which no END straddles (`cdc.bridge.txends`)."""
        per_end = settings.transactions.max_per_end
        if per_end <= 1:
            return per_end, ""
        mark = publisher.marks([settings.transactions.stream])[settings.transactions.stream]
        return per_end, position(*mark) if mark is not None else ""

    # -- the loop ---------------------------------------------------------------------

    def run(self) -> None:
        try:
            self._run()
        finally:
            streams = self.streams
            if streams.committed or streams.aborted or streams.held:
                log.info("streamed transactions since start: %d committed, %d aborted, %d left open; "
                         "%d bytes spilled to disk",
                         streams.committed, streams.aborted, len(streams.held), streams.spilled_bytes)
            streams.close()  # a new session (and decoder) receives what was held again, from the server

    def _run(self) -> None:
        host, counters, t, batcher, tx, windows, targets = self.host, self.counters, self.timers, self.batcher, self.tx, self.windows, self.targets
        stream, read, decoder, monotonic = self.stream, self.stream.read, self.decoder, time.monotonic
        streams = self.streams
        burst = burst_changes  # the changes already received, routed in one call (compiled or pure: `cdc.speedups`)
        max_entries, max_delay = batcher.max_entries, batcher.max_delay
        xlog, header = _W, _XLOG_HEADER
        self.drive_backfill()  # resume what a previous session left unfinished
        now = monotonic()
        while not host.stopping:
            # `now`: taken after the previous read, a message's work ago
            if now >= t.guard:
                self.guard(now)
            count, raw = burst(stream, targets, tx, batcher, windows, decoder, self.committed, streams)
            counters.changes_read += count
            if count or raw is not None:  # the server was heard, as after a read
                t.heard = now = monotonic()
            else:
                if batcher.pending:
                    wait = self.linger(monotonic())
                    if LINGER_S < wait <= NAP_MAX_S:
                        # transactions keep coming: once the connection has nothing more, sleep through the
                        # wait and read what came meanwhile at once, rather than wake for each transaction
                        # and its keepalive (CPU, not latency: the batch waits that long either way, and a
                        # pause with nothing sends it); a connection with more to read is read on at once
                        raw = read(0.0)
                        if raw is None:
                            # a nap of a quarter of the delay at most: what arrives meanwhile is read that much
                            # later, and is pending that much longer than its batch's age says
                            nap = min(wait, max(LINGER_S, NAP_SHARE * max_delay))
                            time.sleep(nap)
                            raw = read(0.0)
                            if raw is None and nap < wait:
                                now = monotonic()
                                continue  # nothing yet: wait on (`linger` again)
                    else:
                        raw = read(wait)
                elif self.inflight.busy:
                    raw = read(LINGER_S)  # a pause: confirm the batch in flight soon (`idle`), the slot may move
                else:
                    # wake up for the status update, the caught-up poll, or the silence limit
                    raw = read(max(0.0, min(t.status, t.poll or t.status, t.heard + self.receive_timeout, t.backfill)
                                       - monotonic()))
                now = monotonic()
                if raw is None:
                    if self.idle(now):
                        return
                    continue
                t.heard = now
            if raw is None:
                pass  # the burst stopped at a due batch or at the end of what had arrived
            elif raw[0] != xlog:
                self.keepalive(raw)
                if batcher.pending and self.linger(now) > 0.0:
                    # a walsender that has sent everything so far says so with a keepalive, after every
                    # transaction while the slot has not confirmed all it sent: on live traffic the pending
                    # batch waits for more as after a silence (`linger`: never past its `max_delay`)
                    continue
                # the server has nothing to send right now: do what waits for that (confirm the batch in
                # flight, tell the slot, see whether caught up), or keepalives in a row (while other
                # databases write, or on polls) would hold it back as long as they come
                if self.idle(now):
                    return
                continue
            else:
                kind = raw[header]
                if kind == INSERT or kind == UPDATE or kind == DELETE:
                    self.row_change(kind, raw)
                elif kind in _HELD and decoder.streaming:
                    streams.add(decoder.stream_xid, raw[header:])
                else:
                    self.dispatch(kind, raw[header:])
            pending = batcher.pending
            if pending and (pending >= max_entries or now - batcher.first_at >= max_delay):
                self.flush(wait=False)  # the rule of `Batcher.due`, inline on the hot path
                self.report()
            elif now >= t.status:
                self.report()
        # stopping: finish the batch, acknowledge
        self.flush(wait=True)
        self.verify()
        self.report()
        log.info("stopped at %s", self.ack.durable)

    def linger(self, now: float) -> float:
        """How long to wait for the server's next message before sending the pending batch (not yet due).

        The batch waits while it is younger than `batch.max_delay_ms` and more is expected before then:
        the mean gap between transactions lately (measured here, each time the loop has read all there
        was) is shorter than what is left of that delay; it waits up to `GAPS` mean gaps (at least
        `LINGER_S`), so that the end of a flow does not hold the last batch for the whole delay. A
        trickle, transactions further apart than the delay, waits `LINGER_S` as a flow in full spate
        does, then goes: its latency is not traded for nothing.
        """
        batcher = self.batcher
        left = batcher.first_at + batcher.max_delay - now
        if left <= 0.0:
            return 0.0
        count, at = self.counters.transactions, self.gap_at
        if count != self.gap_count:
            if at is not None:  # the first transaction seen starts the measure
                gap = (now - at) / (count - self.gap_count)
                self.gap = gap if self.gap == float("inf") else GAP_WEIGHT * gap + (1.0 - GAP_WEIGHT) * self.gap
            self.gap_at, self.gap_count = now, count
        elif at is not None and now - at > self.gap:  # no transaction for longer than the mean gap: it grows
            self.gap = now - at
        if self.gap < left:
            return min(left, max(LINGER_S, GAPS * self.gap))
        return min(LINGER_S, left)

    def row_change(self, kind: int, raw: bytes) -> None:
        """A change read by the loop itself (after a wait), or one `burst` handed back (too short to
        hold its relid: decoding it names what is malformed)."""
        self.counters.changes_read += 1
        decoder = self.decoder
        if decoder.streaming:  # a change of a transaction still running: held
            self.streams.add(decoder.stream_xid, raw[_XLOG_HEADER:])
            return
        if len(raw) < _XLOG_HEADER + 5:
            self.decode(raw[_XLOG_HEADER:])
        tlist = self.targets.get(_RELID(raw, _XLOG_HEADER + 1)[0])
        if tlist:
            route_change(kind, raw, _XLOG_HEADER, tlist, self.tx, self.batcher, self.windows, self.decoder)
        self.tx.seq += 1

    def dispatch(self, kind: int, body: bytes) -> None:
        """Every message but a row change (`body`, without its XLogData header): transaction bounds,
        relations, truncates, logical messages, and the bounds of streamed transactions."""
        if kind in _IGNORED:
            return
        msg = self.decode(body)
        if isinstance(msg, pg.Begin):
            self.tx.begin(msg)
        elif isinstance(msg, pg.Commit):
            self.committed(self.tx.commit(msg))
        elif isinstance(msg, pg.Relation):
            tx = self.tx
            at = int(tx.lsn) if tx.open else int(self.ack.ackable)
            if self.gate.relation(msg.relid, msg.namespace, msg.name, at):
                t = (msg.namespace or "pg_catalog", msg.name)
                if self.gate.by_oid.get(msg.relid, t) != t:
                    self.targets[msg.relid] = []  # a resyncing table renamed away: described anew once it is back
                else:
                    self.hold(t, msg, at)  # superseded by the resync after its marker
                return
            try:
                self.targets[msg.relid] = self.host.bind(msg, self.conn, self.batcher)
            except (MappingError, ColumnsNotSent) as exc:
                if not self.hold_unbindable(msg, exc, at):
                    self.unbound(msg, at, exc)
            else:
                t = (msg.namespace or "pg_catalog", msg.name)
                if t in self.held_relations:  # described anew: an older description held is stale
                    self.held_relations[t] = [h for h in self.held_relations[t] if h[0].relid != msg.relid]
        elif isinstance(msg, pg.Truncate):
            self.counters.changes_read += 1
            route_truncate(msg, self.targets, self.tx, self.batcher, self.windows)
            self.tx.seq += 1
        elif isinstance(msg, pg.Message):
            self.message(msg)
        elif isinstance(msg, pg.StreamStart):
            self.streams.start(msg.xid, msg.first_segment)
        elif isinstance(msg, pg.StreamStop):
            pass  # the block ended: the decoder, which keeps its bounds, knows
        elif isinstance(msg, pg.StreamCommit):
            self.stream_commit(msg)
        elif isinstance(msg, pg.StreamAbort):
            self.streams.abort(msg.xid, msg.subxid)
        else:
            raise SourceError(f"unexpected pgoutput message {type(msg).__name__} (two-phase is not enabled)")

    def stream_commit(self, msg: pg.StreamCommit) -> None:
        """A streamed transaction committed: route what was held, as the same transaction unstreamed.

        Each message takes its place in a transaction that begins at the commit's LSN, so
        every entry gets the position it would have had without streaming.
        """
        tx, targets, batcher, windows, decoder = self.tx, self.targets, self.batcher, self.windows, self.decoder
        route, relid, now, t = route_change, _RELID, time.monotonic, self.timers
        tx.begin_at(int(msg.commit_lsn), msg.commit_ts, msg.xid)
        for body in self.streams.commit(msg.xid):
            kind = body[0]
            if kind == INSERT or kind == UPDATE or kind == DELETE:
                tlist = targets.get(relid(body, 1)[0])
                if tlist:
                    route(kind, body, 0, tlist, tx, batcher, windows, decoder)
                tx.seq += 1
            else:
                self.dispatch(kind, body)
            # what the loop does between messages: send due batches, tell the slot, watch Redis' memory
            at = now()
            if batcher.due(at):
                self.flush(wait=False)
                self.report()
            elif at >= t.status:
                self.report()
            if at >= t.guard:
                self.guard(at)
        self.committed(tx.commit_at(int(msg.end_lsn)))
        t.heard = now()  # the connection was not read meanwhile: its silence starts now

    def unbound(self, msg: pg.Relation, at: int, exc: MappingError | ColumnsNotSent) -> None:
        """A Relation the mappings cannot bind, in a transaction before a rebuild of its table (`cdc recover`, or
        a resync binding the table again, recorded it in the gate's binding, `since`): the rebuild holds what its
        changes did, so they are skipped, until a Relation that binds (a column the publication did not send: for
        a `resync` table only; any other stops). None can be in force from `since` on: pgoutput describes a
        relation again before its first change after any change of its schema, and `cdc recover` refuses a
        table its mappings cannot bind when it rebuilds. Any other is the error now."""
        t = (msg.namespace or "pg_catalog", msg.name)
        bound = self.gate.bound.get(t)
        if bound is None or at >= bound.since or (isinstance(exc, ColumnsNotSent) and t not in self.gate.resync):
            raise exc
        log.info("%s.%s as its changes at %s were written cannot be bound (%s); the rebuild at %s holds them: "
                 "skipped", msg.namespace, msg.name, Lsn(at), exc.message, bound.since)
        self.targets[msg.relid] = []

    def committed(self, end: Lsn) -> None:
        """A transaction ended at `end` (its Commit's end LSN): its END record queued after its entries."""
        self.counters.transactions += 1
        if self.ends is not None:
            self.ends.commit(self.tx)
        # while a window is open, a replay must start before its low watermark (`inflight.sent`, not
        # the `busy` property: this runs once per source transaction)
        self.ack.committed(end, bool(self.windows.open), not self.batcher.pending and self.inflight.sent is None)

    def message(self, msg: pg.Message) -> None:
        if msg.prefix == WATERMARK_PREFIX:
            self.watermark(msg)
        elif msg.prefix == RESYNC_PREFIX:
            self.resync_marker(msg)
        elif msg.prefix == REQUEST_PREFIX:  # `cdc backfill` queued one
            self.tx.seq += 1
            slot, backfill_id = parse_request(msg.content)
            if slot in (None, self.backfill.slot):
                # its row is committed, but may not be visible yet: the driver looks until it is
                self.backfill.request(backfill_id)
                self.drive_backfill()
                self.next_backfill_look(time.monotonic())
        elif msg.transactional or self.ends is None:
            route_message(msg, self.messages, self.tx, self.batcher)
        else:
            with self.ends.uncounted():  # a message of no transaction: no END counts it
                route_message(msg, self.messages, self.tx, self.batcher)

    def keepalive(self, raw: bytes) -> None:
        """A message of the replication protocol other than XLogData: a keepalive (else malformed, raised)."""
        keepalive = parse_copy_data(raw)
        if not isinstance(keepalive, PrimaryKeepalive):  # cannot happen: the loop hands XLogData to the stages
            raise SourceError(f"expected a keepalive, got {type(keepalive).__name__}")
        # a streamed transaction still held does not count: the keepalive's position lies before its
        # commit, and the server sends again, whole, every transaction committing past what it was told
        quiet = not self.tx.open and not self.batcher.pending and not self.inflight.busy and not self.windows.open
        self.ack.keepalive(keepalive.wal_end, quiet)
        if keepalive.reply_requested:
            self.report(force=True)

    def idle(self, now: float) -> bool:
        """The server has nothing to send: send what waits, keep the connection alive; True when caught up."""
        t = self.timers
        if self.batcher.pending or self.inflight.busy:
            self.flush(wait=True)
            self.report()
        elif now >= t.status:
            # ask for an answer when the server has been silent: a dead peer shows up
            self.report(reply=now - t.heard > self.status_interval)
        if now - t.heard > self.receive_timeout:
            raise ConnectionSilent(f"no message from postgres in {self.receive_timeout:.0f}s; reconnecting")
        host = self.host
        if host.until_caught_up and host.target_lsn is not None and not self.tx.open:
            backfill = self.backfill
            if self.ack.durable >= host.target_lsn and (backfill.idle or backfill.disabled) \
                    and backfill.waiting_for is None and not self.windows.open:
                self.verify()
                self.report()
                log.info("caught up at %s", self.ack.durable)
                return True
            if now >= t.poll:
                self.report(reply=True)  # the answer tells how far the server has sent
                t.poll = now + _CAUGHT_UP_POLL_S
        return False

    # -- sending and acknowledging -------------------------------------------------------

    def settle(self) -> None:
        """Wait for Redis to confirm the batch in flight; the slot may then move to it."""
        sent = self.inflight.settle()
        if sent is not None:
            self.counters.confirmed(sent, time.monotonic(), time.time())
            self.ack.confirmed(sent.ack)
            self.host.progressed()

    def flush(self, wait: bool) -> None:
        """Confirm the batch in flight, send the pending one; with `wait`, confirm that too.

        Redis appends one batch while the next is decoded: at most one is in flight,
        and the slot position moves only to what Redis confirmed.
        """
        self.settle()
        batcher = self.batcher
        if not batcher.pending:
            self.ack.drained()
            return
        self.counters.batch_sizes.observe(batcher.pending)
        if self.ends is not None:
            self.ends.seal()
        self.inflight.send(batcher, self.ack.ackable, int(self.tx.ts or 0), time.monotonic())
        if self.host.memory_limited():
            # Redis has a memory limit: look again before the next batch, not in half a
            # second (a fast stream would overshoot the pause mark into refused writes)
            self.timers.guard = 0.0
        if wait:
            self.settle()

    def report(self, reply: bool = False, force: bool = False) -> None:
        """Tell the slot how far Redis holds the source, once Redis has recorded that itself.

        A position the slot was told already is told again only once the status interval has passed,
        `reply` (the server is asked to answer) or `force` (it asked for an answer): on live traffic the
        ack gate moves the position once per interval, and a status message per batch would wake the
        walsender for nothing.
        """
        lsn = self.ack.to_record(self.inflight.busy)
        if lsn is not None:
            self.publisher.record_flushed(lsn)
            self.ack.record(lsn)
            self.host.progressed()
        acked = self.ack.acked
        now = time.monotonic()
        if acked == self.told and not (reply or force) and now < self.timers.status:
            return  # the slot knows: a status message telling it again waits for its interval
        self.stream.send_status(acked, acked, acked, reply)
        self.told = acked
        self.timers.status = now + self.status_interval

    def verify(self) -> None:
        """The ack gate: read the catalog; if it vouches for every mapped table, the slot may move up to
        what was received before the reading started (see `cdc.bridge.gate`); else the bridge stops."""
        received = self.ack.received()
        self.host.verify_tables(self.conn)
        for t in [t for t in self.held_relations if not self.gate.holding(t)]:  # bound again by this reading
            self.bind_held(t)
        if self.windows.introducing:
            self.end_introductions()
        self.ack.vouched(received)
        self.timers.verify = time.monotonic() + self.status_interval

    # -- guardrails and backfills -----------------------------------------------------------

    def guard(self, now: float) -> None:
        """Between messages: the ack gate, Redis memory, slot health, heartbeats, trimming, each when due."""
        host, t, pgs = self.host, self.timers, self.host.settings.postgres
        t.guard = now + _GUARD_INTERVAL_S
        host.last_heard = t.heard
        if now >= t.verify:
            self.verify()
            self.report()  # what the gate just vouched for, at once (a position told already waits its interval)
        if host.memory_paused():
            # hold what is queued (a batch at most); send nothing more until Redis has room
            self.settle()
            self.report()
            host.pause_while_memory_full(self.report, self.status_interval)
            t.heard = time.monotonic()
        if now >= t.slot_check:
            t.slot_check = now + pgs.slot_check_interval_s
            host.check_slot(self.conn)
            host.check_streams()
        if now >= t.heartbeat:
            heartbeat = pgs.heartbeat_interval_s
            t.heartbeat = now + heartbeat
            if now - t.heard >= heartbeat and not host.heartbeat(self.writer):
                t.heartbeat = float("inf")
        if now >= t.trim:
            host.trim_streams()
            t.trim = time.monotonic() + host.settings.trim.interval_s
        if now >= t.backfill:
            self.drive_backfill()
            self.next_backfill_look(now)

    def next_backfill_look(self, now: float) -> None:
        """When to look at `cdc_backfills` again unprompted: soon while a requested row is not visible
        yet, slowly otherwise (a busy driver is moved on by its watermarks, an idle one by requests)."""
        t = self.timers
        t.backfill = now + (REQUEST_RETRY_S if self.backfill.requested else IDLE_POLL_S)
        t.guard = min(t.guard, t.backfill)

    def drive_backfill(self) -> None:
        self.host.drive_backfill(self.backfill, self.writer)

    def watermark(self, msg: pg.Message) -> None:
        """Open or close a backfill window; at the high watermark queue the chunk's unchanged rows.

        The message takes the transaction's next seq, each queued row another. A watermark
        of another slot's bridge is none of ours: ignored, it holds nothing.
        """
        info = orjson.loads(msg.content)
        self.tx.seq += 1
        if info.get("slot", self.backfill.slot) != self.backfill.slot:
            return
        kind = info["kind"]
        if kind == "resume":
            # every window still open was opened by a writer that is gone: it never sends its high
            for chunk in self.windows.close_all():
                log.warning("backfill chunk %s: its writer is gone; window closed without rows (its backfill "
                            "goes on from its recorded progress)", chunk)
            return
        chunk = info["chunk"]
        if kind == "low":
            self.windows.low(chunk, (info["schema"], info["table"]))
            return
        changed = self.windows.close(chunk)
        if kind == "high" and changed is None and ":" in chunk.partition(":")[2]:
            # a high whose window a resume watermark closed: its writer had lost the slot, and its
            # rows cannot be checked against the changes since its low; never published unfiltered
            self.abandoned_high(chunk, info["entity"])
        elif kind == "high":
            if changed is None:  # a chunk written before watermarks named their writer
                log.warning("backfill chunk %s: its low watermark was not seen; publishing it unfiltered", chunk)
                changed = set()
            projector = self.snapshot_projector(info["entity"])
            if projector is None:
                log.error("backfill chunk %s: entity %s is not mapped to an existing table; skipped", chunk, info["entity"])
            else:
                queued, skipped = self.queue_chunk(info, projector, changed,
                                                   self.windows.introducing.get(info["entity"]))
                if queued:
                    self.counters.backfill_rows[info["entity"]] += queued
                self.counters.backfill_skipped += skipped
            if info["last"]:
                log.info("backfill of %s complete at chunk %s", info["entity"], chunk)
                if chunk.partition(":")[0].isdigit():
                    self.gate.backfill_done(int(chunk.partition(":")[0]))
                    if self.windows.introducing:
                        self.end_introductions()
        elif kind == "failed":
            log.error("backfill chunk %s failed: %s; its window is closed and streaming goes on", chunk, info.get("error"))
        self.backfill.seen(chunk)
        self.drive_backfill()

    def resync_marker(self, msg: pg.Message) -> None:
        """A `resync` table's stream gave up its changes here: each of its mappings' streams gets the rebuild
        marker (op x: what follows is the whole table), counted by no END record; the Relations held until now
        are bound."""
        info = orjson.loads(msg.content)
        self.tx.seq += 1
        if info.get("slot") != self.backfill.slot:
            return
        schema, _, name = info["table"].partition(".")
        t = (schema, name)
        # a table resynced already (the marker decoded again after a restart) gets it again all the same: the
        # stream holds it at this position (its high-water mark drops it), or lost it with the crash
        self.gate.marked(t, int(self.tx.lsn) if self.tx.open else int(self.ack.ackable))
        data = orjson.dumps({"resync": True, "cause": info["cause"], "vouched": info["vouched"]})
        for m in self.host.mappings:
            if m.table != t:
                continue
            self.windows.introducing[m.entity] = introduction(m)  # nothing brought after the marker
            for stream in m.stream_keys():
                fields = [b"op", REBUILT, b"key", EMPTY_KEY, b"data", data]
                if self.ends is None:
                    self.batcher.add(self.batcher.batch(stream), fields, m.version, self.tx)
                else:
                    with self.ends.uncounted():
                        self.batcher.add(self.batcher.batch(stream), fields, m.version, self.tx)
                self.tx.seq += 1
        log.info("resync marker of %s at %s: %s", info["table"], self.tx.lsn, info["cause"])
        self.bind_held(t)

    def bind_held(self, t: tuple[str, str]) -> None:
        """Bind the Relations of `t` held while its changes were not published. One that cannot bind is judged at
        its own position: from before the table was bound anew (a description the fix made stale, which pgoutput
        replaces before the next change), it is skipped; else the table waits again."""
        for held, at in self.held_relations.pop(t, []):
            try:
                self.targets[held.relid] = self.host.bind(held, self.conn, self.batcher)
            except (MappingError, ColumnsNotSent) as exc:
                if not self.hold_unbindable(held, exc, at):
                    self.unbound(held, at, exc)

    def hold_unbindable(self, msg: pg.Relation, exc: MappingError | ColumnsNotSent, at: int) -> bool:
        """A Relation of a `resync` table its mappings cannot bind (a re-created table lacking its key, a column a
        mapping reads dropped or not sent, say): its resync starts if it is not waiting already, and the Relation
        is held, its changes left out, until the ack gate finds the table as they need it (`TableGate._resume`),
        whose backfill, queued then, holds them. False: not a `resync` table (the error stands), or a description
        from before its binding (`unbound` judges it)."""
        t = (msg.namespace or "pg_catalog", msg.name)
        if not self.gate.waiting(t):
            bound = self.gate.bound.get(t)
            if t not in self.gate.resync or bound is None or at < bound.since:
                return False
            self.gate.give_up(t, f"table {_name(t)} as the stream describes it cannot be streamed: {exc.message}",
                              f"waiting for the table to be as its mappings need it ({exc.hint})")
        log.info("%s cannot be bound while it waits to be resynced (%s): its changes are left out until then",
                 _name(t), exc.message)
        self.hold(t, msg, at)
        return True

    def hold(self, t: tuple[str, str], msg: pg.Relation, at: int) -> None:
        """Leave out the changes of `msg`'s relation (table `t`, described at `at`) and keep its latest description
        to bind later."""
        self.targets[msg.relid] = []
        held = self.held_relations.setdefault(t, [])
        held[:] = [h for h in held if h[0].relid != msg.relid] + [(msg, at)]

    def queue_chunk(self, info: dict, projector: Projector, changed: set,
                    intro: Introduction | None = None) -> tuple[int, int]:
        """A chunk's ``r`` rows: they belong to no source transaction, no END record counts them."""
        if self.ends is None:
            return queue_chunk(info, projector, changed, self.batcher, self.tx, intro)
        with self.ends.uncounted():
            return queue_chunk(info, projector, changed, self.batcher, self.tx, intro)

    def end_introductions(self) -> None:
        """The streams of tables no longer resyncing bring their rows as they change again."""
        for m in self.host.mappings:
            intro = self.windows.introducing.get(m.entity)
            if intro is not None and m.table not in self.gate.resyncing:
                del self.windows.introducing[m.entity]
                log.info("%s: its resync brought %d rows (%d live updates as c, %d changes and chunk rows left out "
                         "as brought already or never had)", m.entity, len(intro.keys), intro.converted, intro.left_out)

    def read_back_introductions(self) -> None:
        """A session starting in the middle of a resync: each of its mappings' streams tells what it brought since
        its marker (`Introduction.from_entries`). A marker not in the stream yet is decoded again, and starts it."""
        for t, record in self.gate.resyncing.items():
            if record.get("marked_at") is None:
                continue
            for m in self.host.mappings:
                if m.table != t:
                    continue
                intro = introduction(m)
                for stream in m.stream_keys():
                    found = self.host.since_marker(stream)
                    if found is None or found[0] != record["marked_at"]:
                        if found is None:
                            log.warning("%s: no resync marker in %s (trimmed?): its rows are published as they come "
                                        "until its resync ends; a consumer summing changes needs a reconciliation "
                                        "after it", m.entity, stream)
                        break
                    intro.keys |= Introduction.from_entries(found[1], intro.several, intro.creates).keys
                else:
                    self.windows.introducing[m.entity] = intro
                    log.info("%s: resuming its resync with %d rows brought since its marker", m.entity, len(intro.keys))

    def abandoned_high(self, chunk: str, entity: str) -> None:
        """Drop a late chunk's rows and mark its backfill failed, so that its gap is visible."""
        log.error("backfill chunk %s of %s arrived after its writer lost the slot; its rows are dropped", chunk, entity)
        if self.backfill.ours(chunk):
            return  # cannot happen: this session's windows close only with its own watermarks
        backfill_id = int(chunk.partition(":")[0])
        try:
            with bounded(self.writer, self.receive_timeout, "marking a backfill failed"):
                self.backfill.fail(self.writer, backfill_id, entity, None,
                                   f"chunk {chunk} was read by a writer that had lost the slot; run cdc backfill again")
        except psycopg.Error as exc:
            log.error("could not mark backfill %d failed: %s", backfill_id, exc)

    def snapshot_projector(self, entity: str) -> Projector | None:
        projector = self.snapshot_projectors.get(entity)
        if projector is None:
            mapping = next((m for m in self.host.mappings if m.entity == entity), None)
            if mapping is None or mapping.table is None:
                return None
            with bounded(self.conn, self.receive_timeout, "reading a table's shape"):
                shape = table_shape(self.conn, *mapping.table)
                if shape is None:
                    return None
                load_types(self.conn, self.host.catalog, [c.type_oid for c in shape.columns])
            projector = self.snapshot_projectors[entity] = Projector(mapping, shape, self.host.catalog)
        return projector
