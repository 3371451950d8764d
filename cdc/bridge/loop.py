"""The bridge: committed changes from the slot, projected, batched into Redis, acknowledged.

One thread, one loop (`cdc.bridge.session`). It reads pgoutput messages in commit
order, turns changes to mapped tables into stream entries, and writes them in
batches. The slot is told a transaction is done (standby status ``flush``) only
once Redis has confirmed every entry of it, so the slot never moves past anything
unwritten. Batches are flushed when full, when older than ``max_delay_ms``, or as
soon as the server has nothing more to send, which keeps latency low when quiet
and batches large when busy. A transaction is published in pieces if it is large
(memory stays bounded): pgoutput without streaming only sends committed
transactions, and each entry's position ``(commit LSN, seq)`` is known from the
Begin message, so the per-stream high-water marks make a replay exact.

This module keeps what outlives one replication session: retries, counters, the
acknowledged position, the guardrails' I/O.
"""

from __future__ import annotations

import errno
import gc
import logging
import os
import re
import time
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import replace
from typing import Any, LiteralString

import psycopg
import redis
import tenacity

from .. import keys, speedups
from ..config import Settings
from ..errors import (CdcError, ConfigError, DataLossError, MappingError, SlotError, SlotTaken, SourceError,
                      TransientError)
from ..mapping.judge import InexactFilter, OldRowMissing, changed_while_running, filter_refusal, judge, partition_refusal
from ..mapping.model import Mapping, resync_tables
from ..sink.publisher import Publisher
from ..sink.redisconn import connect_redis
from ..source import pgoutput as pg
from ..mapping.projector import Unjudgeable
from ..source.catalog import load_types, partition_root, table_shape
from ..source.deadline import bounded
from ..sink.claims import BridgeIdentity, claim, unmapped_owned
from ..source.history import ServerHistory, read_history
from ..source.failover import FailoverReadiness, failover_readiness, supports_failover
from ..source.lsn import Lsn
from ..source.pubcolumns import ColumnsNotSent, columns_not_sent
from ..source.replication import SESSION_OPTIONS, ReplicationStream, classify_pg_error
from ..source.shapes import TableShape
from ..source.values import TypeCatalog
from .ack import Acknowledger
from .backfill import BackfillDriver
from .backoff import Backoff
from .batcher import Batcher
from .counters import Counters
from .changes import Target, bind
from .encoding import InvalidText, invalid_text_error, is_invalid_text
from ..mapping.uniqueness import key_uniqueness_problem
from .gate import TableGate, recreated_error
from .standby_watch import StandbyWatch
from .spare_keeper import SpareKeeper
from ..source import spare_slot
from ..source.slot_server import in_recovery, standby_problems
from .guards import (MemoryWatch, SlotHealth, SlotWatch, check_redis_has_flushed, check_source_history, record_stream_loss,
                     redis_record, stop_on_stream_problems)
from ..metrics import Registry, serve
from .held_transactions import StreamedTransactions, spill_dir_error
from .session import Session

__all__ = ["Bridge"]

#: allocations of container objects between two collections of the youngest generation (Python: 700)
GC_YOUNG_THRESHOLD = 20_000
#: how long a bridge tries again to bind a metrics port in use (s): a bridge of this host that released
#: the slot to a standby (`cdc run --standby`, same settings) closes its metrics server last
PORT_WAIT_S = 5.0

#: what to do about a slot another bridge took first (`SlotTaken`)
_TAKEN_HINT = "stop it first, or start this one with cdc run --standby to take over when the slot is free"

log = logging.getLogger("cdc.bridge")


def _value(catalog_conn: psycopg.Connection, query: LiteralString, params: tuple = ()) -> Any:
    """The one value of a query that always answers one row (SHOW, a function, EXISTS)."""
    row = catalog_conn.execute(query, params).fetchone()
    if row is None:  # pragma: no cover - a server that answers no row to these is broken
        raise SourceError(f"postgres answered no row to {query}")
    return row[0]


class Bridge:
    """Streams the slot into Redis until stopped (or caught up, if asked)."""

    def __init__(self, settings: Settings, mappings: Sequence[Mapping], *, until_caught_up: bool = False) -> None:
        self.settings = settings
        self.mappings = list(mappings)
        self.until_caught_up = until_caught_up
        self.stopping = False
        self.target_lsn: Lsn | None = None
        self._by_table: dict[tuple[str, str], list[Mapping]] = defaultdict(list)
        self.message_mappings = [m for m in self.mappings if m.message_prefix is not None]
        for m in self.mappings:
            if m.table is not None:
                self._by_table[m.table].append(m)
        #: a mapping publishes updates or deletes: a partition's own Relation, not FULL, is judged (`_judge_partition`)
        self._updates_or_deletes = any(m.ops & {"u", "d"} for m in self.mappings if m.table is not None)
        #: per partitioned table, the identity columns common to its partitions not FULL judged so far
        #: (`Projector.carried`, shared by its projectors)
        self._carried: dict[tuple[str, str], list[frozenset[str] | None]] = {}
        batch = settings.batch
        self.ack = Acknowledger()
        self.gate = TableGate(settings.postgres.slot, settings.postgres.publication, self.mappings)
        self.backoff = Backoff()
        self._stale_pid = 0  # backend of a failed session's replication connection, maybe still holding the slot
        self.catalog = TypeCatalog()
        #: what the sessions count (changes, transactions, entries, batches, backfill rows), served as metrics
        self.counters = Counters(m.entity for m in self.mappings)
        self.sessions = 0
        #: a session of this run started streaming: the slot is ours to take back after a reconnect (a slot
        #: in use before that is another bridge's, `SlotTaken`)
        self.streamed = False
        self.entries_trimmed = 0
        self.entries_force_trimmed = 0
        self.state = "starting"
        self.last_heard = 0.0
        self.failures: dict[str, int] = defaultdict(int)
        pgs = settings.postgres
        self.slot_watch = SlotWatch(pgs.slot, pgs.retained_wal_warn_bytes, pgs.retained_wal_critical_bytes)
        #: whether the slot would survive a failover to a standby, as of the last slot check (None: not checked yet)
        self.failover: FailoverReadiness | None = None
        #: reads the standbys' own copies of the slot, off the streaming thread
        self.standby_watch = StandbyWatch(pgs.dsn, pgs.standbys, pgs.slot, pgs.slot_check_interval_s,
                                          lambda: self.durable_lsn)
        #: keeps the spare slot (postgres.spare_slot_dsn) behind what the slot was told, off the streaming thread
        self.spare = SpareKeeper(pgs.slot, pgs.slot_check_interval_s, lambda: self.settings.postgres.spare_slot_dsn,
                                 lambda: self.ack.acked, lambda: self.durable_lsn) if pgs.spare_slot_dsn else None
        #: since when the server holding the slot has not answered (None: it answers)
        self._slot_server_down_since: float | None = None
        #: times this run carried on from the spare slot
        self.spare_switches = 0
        self.memory: MemoryWatch | None = None
        # transactions the server streams while they run, held until they end (emptied by each session's end)
        self.streams = StreamedTransactions(batch.stream_buffer_mb << 20, batch.spill_dir)
        self.registry = self._metrics()

    def __repr__(self) -> str:
        counters = self.counters
        return (
            f"<Bridge changes_read={counters.changes_read} entries_published={counters.entries_published} "
            f"transactions={counters.transactions} durable_lsn={self.durable_lsn} sessions={self.sessions}>"
        )

    def stop(self) -> None:
        """Ask the loop to finish its batch, acknowledge and return (signal-safe)."""
        self.stopping = True

    @property
    def durable_lsn(self) -> Lsn:
        """How far Redis confirmed holding the source (the slot is told no further)."""
        return self.ack.durable

    def progressed(self) -> None:
        """Redis confirmed or recorded something: the next failure starts its backoff afresh."""
        self.backoff.progressed()

    # -- retrying sessions -------------------------------------------------------------

    def run(self) -> None:
        """Run sessions, retrying transient failures with jittered exponential backoff."""
        retrying = tenacity.Retrying(
            retry=tenacity.retry_if_exception(lambda exc: isinstance(exc, TransientError) and not isinstance(exc, SlotTaken)),
            wait=lambda state: self.backoff.next(time.monotonic()),
            stop=lambda state: self.stopping,
            sleep=self._sleep,
            before_sleep=self._before_retry,
            reraise=True,
        )
        if self.settings.postgres.streaming:
            error = spill_dir_error(self.settings.batch.spill_dir, self.settings.source)
            if error is not None:
                raise error
        log.info("%s", speedups.describe())
        if self.settings.redis.append == "script":
            from ..sink.script import SCRIPT_MODE_BLIND

            log.warning("%s", SCRIPT_MODE_BLIND)
        # Every change makes short-lived containers (its entry) and none makes a cycle: keep the
        # objects of the start-up out of the collector's sight and collect the young ones less often,
        # or full collections walk everything alive every few thousand changes.
        gc.freeze()
        gc.set_threshold(GC_YOUNG_THRESHOLD, 20, 20)
        server = self._serve_metrics() if self.settings.http.port else None
        if self.spare is not None:
            self.spare.start()
        try:
            retrying(self._attempt)
        except TransientError:
            if not self.stopping:
                raise
        finally:
            self.state = "stopped"
            self.standby_watch.close()
            if self.spare is not None:
                self.spare.close()
            if server is not None:
                server.shutdown()
                server.server_close()

    # -- the spare slot ------------------------------------------------------------------

    def _attempt(self) -> None:
        """One session; when it fails because the server holding the slot is gone (unreachable for
        postgres.spare_slot_dsn's `spare_after_s`, or its slot lost), the next one carries on from the spare."""
        try:
            self._session()
        except CdcError as exc:
            if self.stopping or not self.settings.postgres.spare_slot_dsn:
                raise
            switched = self._carry_on_from_spare(exc)
            if not switched:
                raise
            raise TransientError(switched) from exc

    def _carry_on_from_spare(self, exc: CdcError) -> str | None:
        """Swap the slot's server and the spare's when the first is gone and the spare can stand in for it (no
        further than what Redis holds); returns what was done, or None (raising the error with the spare's
        reason when the slot is lost and the spare cannot help)."""
        pgs = self.settings.postgres
        gone = self._slot_server_gone()
        if gone is None:
            self._slot_server_down_since = None
            return None
        lost, why_gone = gone
        now = time.monotonic()
        if not lost:
            if self._slot_server_down_since is None:
                self._slot_server_down_since = now
            if now - self._slot_server_down_since < pgs.spare_after_s:
                return None
        why: str | None
        held: Lsn | None | bool = None
        try:
            with psycopg.connect(pgs.spare_slot_dsn, autocommit=True, options=SESSION_OPTIONS, connect_timeout=10) as conn:
                reading = spare_slot.read(conn, pgs.slot)
            client = connect_redis(self.settings.redis, socket_timeout=self.redis_timeout)
            try:
                held = redis_record(client, pgs.slot)
            finally:
                client.close()
        except psycopg.Error as spare_exc:
            why = f"its server did not answer: {str(spare_exc).strip().splitlines()[0]}"
        except (redis.RedisError, CdcError):
            why = "Redis did not answer"
        else:
            why = spare_slot.judge(reading, held) if not isinstance(held, bool) else "Redis did not answer"
        if why is not None:
            log.error("the server holding slot %s %s; the spare slot of postgres.spare_slot_dsn cannot stand in: %s",
                      pgs.slot, why_gone, why)
            if lost and not isinstance(exc, TransientError):
                raise type(exc)(f"{exc.message}; the spare slot of postgres.spare_slot_dsn cannot stand in: {why}",
                                hint=exc.hint) from exc
            return None
        where = "the primary" if reading.on_primary else "a standby"
        behind = int(held) - int(reading.confirmed) if isinstance(held, Lsn) and reading.confirmed is not None else 0
        said = (f"the server holding slot {pgs.slot} {why_gone}: carrying on from the spare slot on {where} "
                f"(postgres.spare_slot_dsn) at {reading.confirmed}, {behind} bytes behind what Redis holds (decoded "
                "again and skipped by position); make it postgres.slot_dsn and name a new spare")
        log.warning("%s", said)
        self.settings = replace(self.settings, postgres=replace(pgs, slot_dsn=pgs.spare_slot_dsn,
                                                                spare_slot_dsn=pgs.slot_dsn))
        self._slot_server_down_since = None
        self._stale_pid = 0  # a backend of the other server
        self.spare_switches += 1
        self.backoff.progressed()
        return said

    def _slot_server_gone(self) -> tuple[bool, str] | None:
        """Whether the server holding the slot is gone: (True: its slot lost, False: it does not answer, what);
        None while it answers with the slot usable."""
        pgs = self.settings.postgres
        try:
            with psycopg.connect(pgs.slot_server, autocommit=True, options=SESSION_OPTIONS, connect_timeout=10) as conn:
                reading = spare_slot.read(conn, pgs.slot)
        except psycopg.OperationalError as exc:
            return False, f"does not answer ({str(exc).strip().splitlines()[0]})"
        except psycopg.Error:
            return None
        if not reading.exists:
            return True, "lost the slot"
        if reading.wal_status == "lost" or reading.conflicting:
            return True, "invalidated the slot"
        return None

    def _before_retry(self, state: tenacity.RetryCallState) -> None:
        # tenacity calls this after a failed attempt (an outcome) for which it chose to wait (a next action)
        exc = state.outcome.exception() if state.outcome is not None else None
        self.failures["redis" if "redis" in str(exc) else "postgres"] += 1
        self.state = "retrying"
        log.warning("transient failure, retrying in %.1fs: %s", state.next_action.sleep if state.next_action else 0.0, exc)

    def readiness(self) -> tuple[bool, str]:
        """Ready: streaming with both ends connected, recently heard from, not paused."""
        if self.state != "streaming":
            return False, f"not ready: {self.state}"
        silent = time.monotonic() - self.last_heard
        if silent > self.settings.postgres.receive_timeout_s:
            return False, f"not ready: nothing from postgres for {silent:.0f}s"
        return True, f"ready: streaming, durable at {self.durable_lsn}"

    def _metrics(self) -> Registry:
        r, c = Registry(), self.counters
        r.counter("cdc_changes_read_total", "changes to mapped tables decoded, by entity",
                  lambda: {(("entity", e),): n[0] for e, n in c.read_by_entity.items()})
        r.counter("cdc_entries_published_total", "entries Redis confirmed, by stream",
                  lambda: {(("stream", s),): n for s, n in c.published_by_stream.items()})
        r.counter("cdc_transactions_total", "source transactions seen", lambda: c.transactions)
        r.histogram("cdc_batch_entries", "entries per batch sent to Redis", c.batch_sizes)
        r.histogram("cdc_publish_seconds", "time from sending a batch to Redis confirming it", c.publish_seconds)
        r.histogram("cdc_commit_to_publish_seconds", "time from a transaction's commit to Redis confirming it",
                    c.commit_lag_seconds)
        r.gauge("cdc_confirmed_flush_lsn", "position acknowledged to the slot (bytes): Redis holds it and the ack gate vouched for it",
                lambda: int(self.ack.acked))
        r.gauge("cdc_slot_lag_bytes", "WAL between the server's current position and the slot's confirmed one (current WAL - confirmed)",
                lambda: self.slot_watch.health.lag_bytes)
        r.gauge("cdc_retained_wal_bytes", "WAL the slot keeps on the server's disk (current WAL - restart LSN)",
                lambda: self.slot_watch.health.retained_bytes)
        r.gauge("cdc_retained_wal_alarm", "retained WAL alarm level: 0 ok, 1 warning, 2 critical",
                lambda: ("ok", "warning", "critical").index(self.slot_watch.health.level))
        r.gauge("cdc_retained_wal_alarm_bytes", "retained WAL at which the alarm turns warning or critical",
                self._alarm_levels)
        r.gauge("cdc_slot_wal_keep_size_bytes", "the server's max_slot_wal_keep_size: retained WAL past it invalidates the slot "
                "(left out when unlimited)", lambda: self.slot_watch.health.max_keep_bytes if self.slot_watch.health.max_keep_bytes >= 0 else None)
        r.gauge("cdc_slot_failover_ready", "1 when a failover now would lose nothing: a failover slot, "
                "synchronized_standby_slots naming an active standby slot, and every standby holding a persisted copy "
                "of the slot and the WAL of what Redis holds (PostgreSQL 17+); 0 when not, or when a standby "
                "cannot be read; left out while no standby is in sight (no physical slot, none named)",
                lambda: None if self.failover is None or not self.failover.standby_in_evidence else int(self.failover.ready))
        r.gauge("cdc_spare_slot_ready", "1 when the spare slot (postgres.spare_slot_dsn) could stand in for the slot now: "
                "it exists and is no further than what Redis holds; 0 when not or its server does not answer; left out "
                "without a spare", lambda: None if self.spare is None or self.spare.state is None else int(self.spare.state.ready))
        r.counter("cdc_spare_slot_switches_total", "times the bridge carried on from the spare slot, its slot's server gone",
                  lambda: self.spare_switches)
        r.counter("cdc_transient_failures_total", "failures retried, by side (redis or postgres)",
                  lambda: {(("side", k),): v for k, v in self.failures.items()})
        r.counter("cdc_sessions_total", "replication sessions started (1 + reconnections)", lambda: self.sessions)
        r.counter("cdc_entries_trimmed_total", "stream entries trimmed after every group consumed them", lambda: self.entries_trimmed)
        r.counter("cdc_entries_force_trimmed_total", "unconsumed entries dropped by the trim hard cap",
                  lambda: self.entries_force_trimmed)
        r.counter("cdc_backfill_rows_total", "rows published by snapshots and backfills (op r), by entity",
                  lambda: {(("entity", e),): n for e, n in c.backfill_rows.items()})
        r.counter("cdc_backfill_rows_dropped_total", "snapshot rows dropped because the stream changed them meanwhile",
                  lambda: c.backfill_skipped)
        r.counter("cdc_streamed_transactions_total", "transactions the server streamed while they ran, by how they ended",
                  lambda: {(("outcome", "committed"),): self.streams.committed, (("outcome", "aborted"),): self.streams.aborted})
        r.gauge("cdc_streamed_held_bytes", "memory holding streamed transactions until they end", lambda: self.streams.size)
        r.counter("cdc_streamed_spilled_bytes_total", "bytes of streamed transactions spilled to batch.spill_dir",
                  lambda: self.streams.spilled_bytes)
        r.gauge("cdc_mapping_state", "each table mapping's state: 0 streaming, 1 resyncing (on_unaccountable: resync; "
                "cdc status names the cause and the fix)",
                lambda: {(("entity", m.entity),): int(m.table in self.gate.resyncing) for m in self.mappings
                         if m.table is not None})
        r.gauge("cdc_dead_letters", "entries in dead-letter streams", self._dead_letters)
        r.gauge("cdc_redis_memory_ratio", "Redis used memory / maxmemory", lambda: self.memory.ratio if self.memory else None)
        r.gauge("cdc_paused", "1 while reading is paused for Redis memory", lambda: int(self.state == "paused"))
        r.gauge("cdc_up", "1 while streaming", lambda: int(self.state in ("streaming", "paused")))
        r.gauge("cdc_ready", "1 while /readyz answers 200", lambda: int(self.readiness()[0]))
        return r

    def _alarm_levels(self) -> dict | None:
        health = self.slot_watch.health
        if health.wal_status == "unknown":  # the slot was not checked yet: its server's limit is not known
            return None
        warn, critical = self.slot_watch.thresholds(health.max_keep_bytes)
        return {(("level", "warning"),): warn, (("level", "critical"),): critical}

    def _dead_letters(self) -> float:
        client = connect_redis(self.settings.redis, socket_timeout=2)
        try:
            return sum(client.xlen(k) for k in client.scan_iter(match=keys.dead_letter_key("*"), count=100))
        finally:
            client.close()

    def _sleep(self, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while not self.stopping and time.monotonic() < deadline:
            time.sleep(min(0.05, max(0.0, deadline - time.monotonic())))

    def _serve_metrics(self):
        """Bind the metrics port; while it is in use, try again for `PORT_WAIT_S`: a bridge of this host
        that just released the slot (to a standby with the same settings) closes its server last."""
        http = self.settings.http
        deadline = time.monotonic() + PORT_WAIT_S
        said = False
        while True:
            try:
                return serve(self.registry, self.readiness, http.host, http.port)
            except OSError as exc:
                if exc.errno == errno.EADDRINUSE and time.monotonic() >= deadline and not self.stopping:
                    self._raise_if_slot_taken()
                if exc.errno != errno.EADDRINUSE or time.monotonic() >= deadline or self.stopping:
                    raise ConfigError(f"cannot serve metrics on {http.host}:{http.port}: {exc.strerror}",
                                      hint="set http.port to a free port, or 0") from None
            if not said:
                log.info("metrics port %s:%d is in use; trying again for %.0fs", http.host, http.port, PORT_WAIT_S)
                said = True
            time.sleep(0.1)  # the other server's shutdown takes up to its poll interval (0.5 s)

    def _raise_if_slot_taken(self) -> None:
        """The metrics port stayed in use: if another bridge holds the slot (started with the same settings at
        the same moment, and first), that is `SlotTaken` (exit 75), not a port to change."""
        from .slot_holder import slot_holder

        pgs = self.settings.postgres
        try:
            with psycopg.connect(pgs.slot_server, autocommit=True, connect_timeout=10) as conn:
                holder = slot_holder(conn, pgs.slot)
        except psycopg.Error:
            return
        if holder is not None:
            raise SlotTaken(
                f"a bridge is already running on slot {pgs.slot}, {holder}, and serves metrics on "
                f"{self.settings.http.host}:{self.settings.http.port}", hint=_TAKEN_HINT)

    # -- one session ---------------------------------------------------------------------

    def _connect_catalog(self, dsn: str | None = None) -> psycopg.Connection:
        """The slot's server (types, slot health, the ack gate), or `dsn`."""
        try:
            return psycopg.connect(dsn or self.settings.postgres.slot_server, autocommit=True, options=SESSION_OPTIONS,
                                   connect_timeout=10)
        except Exception as exc:
            raise classify_pg_error(exc) from exc

    def _session(self) -> None:
        if self.stopping:
            return
        self.sessions += 1
        pgs = self.settings.postgres
        catalog_conn = self._connect_catalog()
        try:
            # what the bridge writes goes to the primary, whose WAL a standby holding the slot decodes in order
            writer = self._connect_catalog(pgs.dsn) if pgs.slot_dsn else catalog_conn
        except BaseException:
            catalog_conn.close()
            raise
        rs = self.settings.redis
        publisher = Publisher(
            rs.url, cluster=rs.cluster, flushed_key=keys.flushed_key(pgs.slot), wait_replicas=rs.wait_replicas,
            wait_timeout_ms=rs.wait_timeout_ms, double_send=float(os.environ.get("CDC_FAULT_DOUBLE_SEND", 0)),
            append=rs.append, socket_timeout=self.redis_timeout, entities=self.stream_entities, settings=rs,
            after_others=self.settings.transactions.stream or None,
        )
        client = connect_redis(rs, socket_timeout=self.redis_timeout)
        self._streams_client = client
        stream = ReplicationStream(pgs.slot_server, pgs.slot, pgs.publication, timeout=pgs.receive_timeout_s)
        try:
            self._check_server(catalog_conn, writer)
            self._judge_mappings(catalog_conn)
            publisher.ping()
            self.slot_watch.redis_held = lambda: redis_record(client, pgs.slot)  # for a missing slot's error
            health = self.check_slot(catalog_conn)
            server = read_history(pgs.slot_server)  # once per session: whose history Redis' positions belong to
            try:
                self.claim(client, server)  # nothing another bridge on this Redis writes or reads
                check_source_history(client, pgs.slot, server, reread=lambda: read_history(pgs.slot_server),
                                     decoded_here=health.confirmed_lsn if pgs.slot_dsn else None)
                held = check_redis_has_flushed(client, pgs.slot, health.confirmed_lsn, self.stream_entities)
                self.memory = MemoryWatch(client, rs.pause_at_memory_fraction, rs.resume_at_memory_fraction, pgs.slot,
                                          reserve=publisher.memory_reserve)
            except redis.RedisError as exc:
                raise TransientError(f"redis unavailable: {exc}") from exc
            publisher.replicated()  # the record a session starts from must be on the replicas too
            self.gate.writer, self.gate.vouched = writer, None  # resync markers and backfills go to the primary
            self.start_gate(catalog_conn, client, health.confirmed_lsn)
            self._release_stale_walsender(catalog_conn)
            try:
                # logical messages carry backfill watermarks too
                try:
                    stream.start(0, messages=True, streaming=pgs.streaming)
                except TransientError as exc:
                    if not self.streamed and isinstance(exc.__cause__, psycopg.errors.ObjectInUse):
                        raise SlotTaken(f"another bridge started streaming slot {pgs.slot} first ({exc})",
                                        hint=_TAKEN_HINT) from exc
                    raise
                self.streamed = True
                self._slot_server_down_since = None
                self.state = "streaming"
                self.backoff.streaming(time.monotonic())
                self._stream(Session(self, stream, publisher, catalog_conn, held, health.confirmed_lsn, writer))
            except DataLossError as exc:  # a stream's history vanished while streaming: cdc status shows it
                self._stale_pid = stream.backend_pid
                record_stream_loss(client, pgs.slot, exc)
                raise
            except Exception as exc:
                # over a connection that went silent, the server still sees our walsender holding the
                # slot (until its wal_sender_timeout); the next session ends it
                self._stale_pid = stream.backend_pid
                if isinstance(exc, SlotError):
                    recreated = publication_recreated(catalog_conn, pgs.slot, pgs.publication, exc)
                    if recreated is not None:
                        raise recreated from exc
                raise
        finally:
            stream.close()
            publisher.close()
            client.close()
            catalog_conn.close()
            if writer is not catalog_conn:
                writer.close()

    def _check_server(self, catalog_conn: psycopg.Connection, writer: psycopg.Connection) -> None:
        """wal_level is logical; with --until-caught-up, the position to catch up to (once), the primary's. One
        round trip: the position is read only once wal_level passed (CASE evaluates its branch only then)."""
        catching_up = self.until_caught_up and self.target_lsn is None
        if writer is not catalog_conn:
            self._check_standby(catalog_conn, writer)
            catalog_conn = writer  # the primary's wal_level, and the position its writes reached
        try:
            with self._bounded(catalog_conn, "checking settings"):
                row = catalog_conn.execute(
                    "SELECT current_setting('wal_level'), CASE WHEN current_setting('wal_level') = 'logical' "
                    "THEN pg_current_wal_lsn()::text END" if catching_up else "SELECT current_setting('wal_level'), NULL"
                ).fetchone()
                if row is None:  # pragma: no cover - a server that answers no row to this is broken
                    raise SourceError("postgres answered no row to a settings query")
                level, position = row
                if level != "logical":
                    raise SourceError(
                        f"postgres wal_level is {level!r}, logical decoding needs 'logical'",
                        hint="set wal_level = logical in postgresql.conf and restart PostgreSQL",
                    )
                if catching_up:
                    self.target_lsn = Lsn.parse(position)
                    log.info("catching up to %s", self.target_lsn)
        except psycopg.Error as exc:
            raise classify_pg_error(exc) from exc

    def _check_standby(self, catalog_conn: psycopg.Connection, writer: psycopg.Connection) -> None:
        """The server of postgres.slot_dsn can decode: a standby of PostgreSQL 16+ with what it needs
        (`cdc.source.slot_server`), or a server that accepts writes (a promoted standby)."""
        try:
            with self._bounded(catalog_conn, "checking the standby"):
                if in_recovery(catalog_conn):
                    for what, fix in standby_problems(catalog_conn, writer):
                        raise SourceError(what, hint=fix)
        except psycopg.Error as exc:
            raise classify_pg_error(exc) from exc

    def _judge_mappings(self, catalog_conn: psycopg.Connection) -> None:
        """Every table mapping against its table now, by the judge cdc init and cdc check use
        (`cdc.mapping.judge`): what they refuse, cdc run refuses before streaming, with the same line."""
        catalog = TypeCatalog()
        resync = resync_tables(self.mappings)
        try:
            with self._bounded(catalog_conn, "checking the mappings"):
                for m in self.mappings:
                    shape = table_shape(catalog_conn, *m.table) if m.table is not None else None
                    if shape is not None:  # a table missing now: the ack gate's reading names it and the fix
                        load_types(catalog_conn, catalog, [c.type_oid for c in shape.columns])
                        try:
                            judge(m, shape, catalog)
                        except MappingError as exc:
                            if m.table not in resync:
                                raise
                            # its stream gives up what it cannot bind and waits, the fix in its resync record
                            log.warning("%s (on_unaccountable: resync: its stream is resynced once fixed: %s)",
                                        exc.message, exc.hint)
        except psycopg.Error as exc:
            raise classify_pg_error(exc) from exc

    def since_marker(self, stream: str) -> tuple[int, list[tuple[bytes, bytes, bool]]] | None:
        """The latest rebuild marker of a stream (its lsn) and the entries after it, in order, as (op, key JSON,
        whether it lists unchanged fields); None when the stream holds none (`cdc.bridge.introductions`)."""
        client: Any = self._streams_client
        after: list[tuple[bytes, bytes, bool]] = []
        end = "+"
        try:
            while True:
                page = client.xrevrange(stream, max=end, min="-", count=10_000)
                if not page:
                    return None
                for entry_id, fields in page:
                    op = fields.get(b"op", b"")
                    if op == b"x":
                        after.reverse()
                        return int(fields.get(b"lsn", b"0")), after
                    after.append((op, fields.get(b"key", b"{}"), b"unchanged" in fields))
                end = "(" + page[-1][0].decode()
        except redis.RedisError as exc:
            raise TransientError(f"redis unavailable: {exc}") from exc

    def claim(self, client, server: ServerHistory) -> None:
        """Register the slot and claim the mapped streams on Redis (`cdc.sink.claims`), once per session."""
        pgs = self.settings.postgres
        claim(client, BridgeIdentity(pgs.slot, server.system_id, server.database, pgs.publication), self.stream_entities)
        for stream in unmapped_owned(client, pgs.slot, self.stream_entities):
            log.warning("stream %s is claimed by slot %s, but no mapping of this config writes it: if another config "
                        "names the same slot, give it its own postgres.slot and postgres.publication (its changes are "
                        "acknowledged here without an entry); if the mapping was removed, release it: redis-cli HDEL %s %s",
                        stream, pgs.slot, keys.STREAM_OWNERS, stream)

    @property
    def stream_entities(self) -> dict[str, str]:
        """Every stream key the bridge writes -> its entity (the transactions stream's: `keys.TRANSACTIONS_OWNER`)."""
        streams = {s: m.entity for m in self.mappings for s in m.stream_keys()}
        if self.settings.transactions.stream:
            streams[self.settings.transactions.stream] = keys.TRANSACTIONS_OWNER
        return streams

    @property
    def redis_timeout(self) -> float:
        """How long a Redis reply may take before the connection is deemed dead (a WAIT may take its own timeout)."""
        rs = self.settings.redis
        wait = rs.wait_timeout_ms / 1000 + 1 if rs.wait_replicas else 0
        return max(self.settings.postgres.receive_timeout_s, wait)

    def _bounded(self, catalog_conn: psycopg.Connection, what: str):
        """A call on the catalog connection, cut after `receive_timeout_s` without an answer."""
        return bounded(catalog_conn, self.settings.postgres.receive_timeout_s, what)

    def drive_backfill(self, backfill: BackfillDriver, catalog_conn: psycopg.Connection) -> None:
        """Write the next snapshot chunk into the WAL if a backfill is waiting (see `cdc.bridge.backfill`)."""
        if backfill.disabled:
            return
        try:
            with self._bounded(catalog_conn, "a backfill chunk"):
                backfill.tick(catalog_conn)
        except psycopg.OperationalError as exc:
            raise classify_pg_error(exc) from exc
        except psycopg.errors.InsufficientPrivilege as exc:
            # snapshots and backfills must not silently stop: the operator grants, then runs again
            raise classify_pg_error(exc, role=catalog_conn.info.user, need="SELECT, UPDATE") from exc
        except psycopg.Error as exc:
            if backfill.waiting_for is not None:
                # a window is open and its closing watermark could not be written: a new session
                # (whose resume watermark closes it) rather than a slot held until a restart
                raise TransientError(f"backfill chunk {backfill.waiting_for}: {str(exc).strip()}") from exc
            log.warning("backfill paused: %s", str(exc).strip())
            backfill.disabled = True

    def memory_limited(self) -> bool:
        """Whether Redis has a memory limit (maxmemory), as of the last look at its memory."""
        return self.memory is not None and self.memory.ratio is not None

    def memory_paused(self) -> bool:
        """Whether Redis is too full to take more (False before a session watches its memory)."""
        if self.memory is None:
            return False
        try:
            return self.memory.check()
        except redis.RedisError as exc:
            raise TransientError(f"redis unavailable: {exc}") from exc

    def pause_while_memory_full(self, report, status_interval: float) -> None:
        """Read nothing (the server's data waits in the socket) until Redis has room again."""
        self.state = "paused"
        while not self.stopping and self.memory_paused():
            report(reply=True)  # keeps the replication connection alive
            self._sleep(min(0.5, status_interval))
        self.state = "streaming"

    def start_gate(self, catalog_conn: psycopg.Connection, client, confirmed: Lsn) -> None:
        """The ack gate's first reading, before streaming: tables re-created, renamed or unpublished while
        the bridge was stopped stop it here (see `cdc.bridge.gate`)."""
        self._read_catalog(catalog_conn, lambda: self.gate.start(catalog_conn, client, confirmed))
        self._read_catalog(catalog_conn, lambda: self._refuse_ambiguous_keys(catalog_conn))

    def _refuse_ambiguous_keys(self, catalog_conn: psycopg.Connection) -> None:
        """A mapping whose key may name several rows stops the bridge before it streams (exit 3)."""
        for m in self.mappings:
            problem = key_uniqueness_problem(catalog_conn, m)
            if problem is not None:
                raise problem

    def verify_tables(self, catalog_conn: psycopg.Connection) -> None:
        """One reading of the ack gate; raises what stops the bridge (exit 4) when it does not vouch."""
        self._read_catalog(catalog_conn, lambda: self.gate.verify(catalog_conn))

    def _read_catalog(self, catalog_conn: psycopg.Connection, reading) -> None:
        try:
            with self._bounded(catalog_conn, "checking the mapped tables"):
                reading()
        except psycopg.Error as exc:
            raise classify_pg_error(exc, role=catalog_conn.info.user) from exc
        except redis.RedisError as exc:
            raise TransientError(f"redis unavailable: {exc}") from exc

    def check_slot(self, catalog_conn: psycopg.Connection) -> SlotHealth:
        try:
            with self._bounded(catalog_conn, "checking the slot"):
                health = self.slot_watch.check(catalog_conn)
                self._check_failover(catalog_conn)
                return health
        except psycopg.Error as exc:
            raise classify_pg_error(exc) from exc

    def check_streams(self) -> None:
        """Stop when a mapped stream's history vanished, or a key of another type took its place, even
        while no change is written to it (the append itself refuses too); a loss is recorded for status."""
        try:
            stop_on_stream_problems(self._streams_client, self.settings.postgres.slot, self.stream_entities)
        except redis.RedisError as exc:  # a connection cut: the next session looks again
            raise TransientError(f"redis unavailable: {exc}") from exc

    def _check_failover(self, catalog_conn: psycopg.Connection) -> None:
        """Log when the slot's failover readiness or its reason changes, positions and counts aside
        (cdc_slot_failover_ready shows it)."""
        copies, held = None, None
        if supports_failover(catalog_conn) and not self.settings.postgres.slot_dsn:  # a standby's slot: see failover
            copies, held = self.standby_watch.reading(catalog_conn.info.host, str(catalog_conn.info.port))
        try:
            readiness = failover_readiness(catalog_conn, self.settings.postgres.slot, copies, held)
        except psycopg.errors.InsufficientPrivilege as exc:  # a report, never a reason to stop
            log.warning("failover readiness unknown: %s", str(exc).strip())
            return
        if self.failover is None or _shape(readiness.reason) != _shape(self.failover.reason):
            (log.info if readiness.ready else log.warning)("failover-ready %s: %s", readiness.state, readiness.reason)
        self.failover = readiness

    def heartbeat(self, catalog_conn: psycopg.Connection) -> bool:
        """Emit a heartbeat message; False (and stop trying) when not permitted."""
        try:
            with self._bounded(catalog_conn, "a heartbeat"):
                SlotWatch.heartbeat(catalog_conn)
            return True
        except psycopg.errors.InsufficientPrivilege as exc:
            log.warning("heartbeats disabled: %s", str(exc).strip())
            return False
        except psycopg.Error as exc:
            raise classify_pg_error(exc) from exc

    def trim_streams(self) -> None:
        """Consumer-aware trim of every mapped stream (see `cdc.sink.trim`); failures only logged."""
        from ..sink.trim import TrimPolicy, trim_mapped

        policy = TrimPolicy(max_len=self.settings.trim.max_len, max_age_s=self.settings.trim.max_age_s)
        client = connect_redis(self.settings.redis, socket_timeout=self.redis_timeout)
        try:
            for result in trim_mapped(client, self.mappings, policy, also=[self.settings.transactions.stream]):
                self.entries_trimmed += result.trimmed
                self.entries_force_trimmed += result.forced
        except redis.RedisError as exc:
            log.warning("trimming skipped: %s", exc)
        finally:
            client.close()

    def _release_stale_walsender(self, catalog_conn: psycopg.Connection) -> None:
        """End our own previous walsender if it still holds the slot.

        A connection that died silently keeps the slot active on the server until
        its wal_sender_timeout; only the backend we ourselves abandoned is ended,
        never another bridge's.
        """
        if not self._stale_pid:
            return
        pid, self._stale_pid = self._stale_pid, 0
        try:
            with self._bounded(catalog_conn, "ending the stale walsender"):
                row = catalog_conn.execute(
                    "SELECT pg_terminate_backend(active_pid) FROM pg_replication_slots WHERE slot_name = %s AND active_pid = %s",
                    (self.settings.postgres.slot, pid),
                ).fetchone()
        except psycopg.Error as exc:
            log.warning("could not end the stale walsender %d: %s", pid, exc)
            return
        if row and row[0]:
            log.info("ended our stale walsender %d holding slot %s", pid, self.settings.postgres.slot)
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline and _value(
                catalog_conn, "SELECT EXISTS (SELECT FROM pg_replication_slots WHERE slot_name = %s AND active)",
                (self.settings.postgres.slot,),
            ):
                time.sleep(0.05)  # the backend is exiting; START_REPLICATION retries anyway

    def bind(self, relation: pg.Relation, catalog_conn: psycopg.Connection, batcher: Batcher) -> list[Target]:
        mappings = self._by_table.get((relation.namespace, relation.name))
        if not mappings:
            if relation.replica_identity != "f" and self._updates_or_deletes:
                self._judge_partition(relation, catalog_conn)
            return []
        try:
            with self._bounded(catalog_conn, "loading types"):
                load_types(catalog_conn, self.catalog, [c.type_oid for c in relation.columns])
        except psycopg.Error as exc:
            raise classify_pg_error(exc) from exc
        self._all_sent(relation, mappings, catalog_conn)
        try:
            targets = bind(relation, mappings, self.catalog, batcher, self.counters.read_by_entity)
        except InexactFilter as exc:
            # judged at start on the catalog: the table's replica identity changed since, and the changes
            # written meanwhile carry no old row to judge the filter on
            raise changed_while_running(exc, self.settings.postgres.slot) from None
        except MappingError as exc:
            raise self._bindable_now(relation, mappings, catalog_conn, exc) from exc
        carried = self._carried.setdefault((relation.namespace, relation.name), [None])
        for t in targets:
            t.projector.carried = carried
        log.info("bound %s to %s", relation.namespace + "." + relation.name, ", ".join(m.entity for m in mappings))
        return targets

    def _judge_partition(self, relation: pg.Relation, catalog_conn: psycopg.Connection) -> None:
        """A partition's own Relation, not full, under a mapped partitioned table: with publish_via_partition_root
        its changes come under its root's Relation (REPLICA IDENTITY FULL, which the judge accepted), but pgoutput
        describes the partition itself too, before its first change after any change of its schema, and its old
        rows carry only its own identity's columns: a filter, a key or a before-image they do not carry stops the
        bridge here, before that change is projected, slot held (`partition_refusal`)."""
        try:
            with self._bounded(catalog_conn, "reading a partition's root"):
                root = partition_root(catalog_conn, relation.relid)
        except psycopg.Error as exc:
            raise classify_pg_error(exc) from exc
        if root is None or root[2] != "f" or (root[0], root[1]) not in self._by_table:
            return  # not a partition of a mapped FULL table: its root's own Relation is what the judge reads
        leaf = TableShape(schema=root[0], name=root[1], columns=(), replica_identity="f",
                          partial_leaf=f"{relation.namespace}.{relation.name}",
                          leaf_identity=tuple(c.name for c in relation.columns if c.is_key))
        for m in self._by_table.get((root[0], root[1]), ()):
            problem = partition_refusal(m, leaf)
            if problem is not None:
                raise changed_while_running(problem, self.settings.postgres.slot)
        # its updates without an old row keep these columns (`Projector.update`)
        carried = self._carried.setdefault((root[0], root[1]), [None])
        identity = frozenset(leaf.leaf_identity)
        carried[0] = identity if carried[0] is None else carried[0] & identity

    def _old_row_missing(self, catalog_conn: psycopg.Connection, exc: OldRowMissing) -> InexactFilter:
        """The stop of an update that came without its old row under a FULL Relation, naming the partition to fix
        where the catalog still shows one not full (the gate's reading, `TableGate._partition_identities`)."""
        schema, _, name = exc.table.partition(".")
        try:
            with self._bounded(catalog_conn, "reading a table's shape"):
                shape = table_shape(catalog_conn, schema, name)
        except psycopg.Error:
            shape = None
        if shape is not None and shape.partial_leaf:
            for m in self._by_table.get((schema, name), ()):
                problem = filter_refusal(m, shape)
                if problem is not None:
                    return changed_while_running(problem, self.settings.postgres.slot)
        return changed_while_running(exc, self.settings.postgres.slot)

    def _bindable_now(self, relation: pg.Relation, mappings: list[Mapping], catalog_conn: psycopg.Connection,
                      exc: MappingError) -> MappingError:
        """A Relation the mappings cannot bind (a key out of the replica identity, a column gone) may describe the
        table as it was when its changes were written, not as it is now: then fixing the table changes nothing
        for those changes (the slot decodes them as written), and the error says so and how to get past them."""
        try:
            with self._bounded(catalog_conn, "reading a table's shape"):
                shape = table_shape(catalog_conn, relation.namespace, relation.name)
        except psycopg.Error:
            return exc
        if shape is None:
            return exc
        try:
            for m in mappings:
                judge(m, shape, self.catalog)
        except MappingError:
            return exc  # the table as it is now is refused too: the fix the error names applies
        return MappingError(
            f"{exc.message} when its changes still to stream were written; the table has changed since and its "
            "mappings bind to it as it is now, but the changes written before cannot be published as written",
            hint="run cdc recover (rebuilds the streams from the tables and moves past those changes), then cdc run")

    def _all_sent(self, relation: pg.Relation, mappings: list[Mapping], catalog_conn: psycopg.Connection) -> None:
        """A mapped column the Relation lacks while the table has it: the publication did not send it. Stops the
        bridge (never entries without the field); one the table lacks too is the projector's error (dropped or
        renamed)."""
        sent = [c.name for c in relation.columns]
        for m in mappings:
            missing = [c for c in m.columns if c not in sent]
            if not missing:
                continue
            try:
                with self._bounded(catalog_conn, "reading a table's shape"):
                    shape = table_shape(catalog_conn, relation.namespace, relation.name)
            except psycopg.Error as exc:
                raise classify_pg_error(exc) from exc
            present = [c for c in missing if shape is not None and c in {col.name for col in shape.columns}]
            if present:
                raise columns_not_sent(relation.namespace, relation.name, m.entity, present, sent,
                                       self.settings.postgres.publication)

    def _stream(self, session: Session) -> None:
        try:
            try:
                session.run()
            except SourceError as exc:
                if not is_invalid_text(exc):
                    raise
                tx = session.tx
                raise invalid_text_error(exc, session.conn.info.dbname, self.settings.postgres.slot, self.mappings,
                                         tx.xid if tx.open else None, int(tx.lsn) if tx.open else None) from exc
        except (MappingError, ColumnsNotSent, pg.DecodeError, InvalidText) as exc:
            # Publish what came before the failure so a fixed restart resumes right there.
            try:
                session.flush(wait=True)
                session.verify()
                session.report()
            except CdcError:
                pass
            if isinstance(exc, pg.DecodeError):
                raise SourceError(f"cannot decode a pgoutput message: {exc}") from exc
            if isinstance(exc, OldRowMissing):
                raise self._old_row_missing(session.conn, exc) from None
            if isinstance(exc, Unjudgeable):
                slot = self.settings.postgres.slot
                raise Unjudgeable(
                    f"{exc.message}, slot {slot} held before it", exc.table,
                    hint=f"run: ALTER TABLE {exc.table} REPLICA IDENTITY FULL (the old row then carries every value); "
                         f"then, as this change cannot be judged, SELECT pg_drop_replication_slot('{slot}'), cdc init "
                         "and cdc recover (which rebuilds the streams from the tables) before cdc run") from None
            raise


def publication_recreated(conn: psycopg.Connection, slot: str, publication: str, exc: SlotError) -> SlotError | None:
    """The server says the publication is missing while decoding though it exists now: it was dropped and
    re-created after the slot's position (PostgreSQL 15 to 17 decode each change with the catalog of its time,
    and fail on every restart), the case the gate knows by the publication's OID (`recreated_error`) when it
    recorded one. None when the publication is really missing, or the catalog cannot be asked."""
    if "publication" not in exc.message or "does not exist" not in exc.message:
        return None
    try:
        row = conn.execute("SELECT 1 FROM pg_publication WHERE pubname = %s", (publication,)).fetchone()
    except psycopg.Error:
        return None
    return None if row is None else recreated_error(publication, slot, None, None)


def _shape(reason: str) -> str:
    """A readiness reason without its positions and counts, which move while nothing else changes."""
    return re.sub(r"[0-9A-F]+/[0-9A-F]+|\d+", "#", reason)
