"""The bridge: committed changes from the slot, projected, batched into Redis, acknowledged.

One thread, one loop. It reads pgoutput messages in commit order, turns changes
to mapped tables into stream entries, and writes them in batches. The slot is
told a transaction is done (standby status ``flush``) only once Redis has
confirmed every entry of it, so the slot never moves past anything unwritten.
Batches are flushed when full, when older than ``max_delay_ms``, or as soon as
the server has nothing more to send, which keeps latency low when quiet and
batches large when busy. A transaction is published in pieces if it is large
(memory stays bounded): pgoutput without streaming only sends committed
transactions, and each entry's position ``(commit LSN, seq)`` is known from the
Begin message, so the per-stream high-water marks make a replay exact.
"""

from __future__ import annotations

import logging
import os
import struct
import time
from collections import defaultdict
from collections.abc import Sequence

import orjson
import psycopg
import redis
import tenacity

from ..source import pgoutput as pg
from .backfill import REQUEST_PREFIX, TRUNCATED, WATERMARK_PREFIX, BackfillDriver, Windows
from ..source.catalog import load_types, table_shape
from ..config import Settings
from .. import keys
from ..errors import CdcError, MappingError, SourceError, TransientError
from .guards import MemoryWatch, SlotHealth, SlotWatch, check_redis_has_flushed
from .metrics import Histogram, Registry, serve
from ..source.lsn import Lsn
from ..mapping.model import Mapping
from ..mapping.projector import Projector, message_entry
from ..source.shapes import ColumnShape, TableShape
from ..sink.publisher import Publisher, StreamBatch, position
from ..sink.redisconn import connect_redis
from ..source.replication import SESSION_OPTIONS, ReplicationStream, classify_pg_error
from ..source.values import TypeCatalog
from ..source.framing import parse_copy_data, pg_now_us, pg_ts_to_unix_ms

__all__ = ["Bridge"]

log = logging.getLogger("cdc.bridge")

_W = 0x77  # XLogData
_XLOG_HEADER = 25
_BEGIN, _COMMIT, _RELATION, _INSERT, _UPDATE, _DELETE, _TRUNCATE, _MESSAGE = (ord(c) for c in "BCRIUDTM")
_IGNORED = frozenset(ord(c) for c in "OY")
_RELID = struct.Struct(">I").unpack_from  # a change's relid, read before deciding to decode it
_CAUGHT_UP_POLL_S = 0.1


class _ConnectionSilent(TransientError):
    """The replication connection went quiet past the receive timeout: deemed dead."""


class _Target:
    """Where a bound projector writes: its mapping and one batch per partition stream."""

    __slots__ = ("projector", "batches", "version", "read")

    def __init__(self, projector: Projector, batches: list[StreamBatch], read: list[int]) -> None:
        self.projector = projector
        self.batches = batches
        self.version = projector.mapping.version
        self.read = read  # [changes of this entity read], shared across rebinds


class Bridge:
    """Streams the slot into Redis until stopped (or caught up, if asked)."""

    def __init__(self, settings: Settings, mappings: Sequence[Mapping], *, until_caught_up: bool = False) -> None:
        self.settings = settings
        self.mappings = list(mappings)
        self.until_caught_up = until_caught_up
        self.stopping = False
        self.target_lsn: Lsn | None = None
        self._by_table: dict[tuple[str, str], list[Mapping]] = defaultdict(list)
        self._message_mappings = [m for m in self.mappings if m.message_prefix is not None]
        for m in self.mappings:
            if m.table is not None:
                self._by_table[m.table].append(m)
        self._batches: dict[str, StreamBatch] = {}
        self._stale_pid = 0  # backend of our own replication connection that went silent
        self.catalog = TypeCatalog()
        # counters, readable in repr and by status reporting
        self.changes_read = 0
        self.entries_published = 0
        self.transactions = 0
        self.sessions = 0
        self.durable_lsn = Lsn(0)
        self.entries_trimmed = 0
        self.entries_force_trimmed = 0
        self.state = "starting"
        self.last_heard = 0.0
        self.read_by_entity: dict[str, list[int]] = {m.entity: [0] for m in self.mappings}
        self.published_by_stream: dict[str, int] = defaultdict(int)
        self.failures: dict[str, int] = defaultdict(int)
        self.batch_sizes = Histogram([1, 10, 50, 100, 500, 1000, 2000, 5000])
        self.publish_seconds = Histogram([0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1, 5])
        self.commit_lag_seconds = Histogram([0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 5, 30])
        pgs = settings.postgres
        self.slot_watch = SlotWatch(pgs.slot, pgs.retained_wal_warn_bytes, pgs.retained_wal_critical_bytes)
        self.memory: MemoryWatch | None = None
        self.backfill_rows: dict[str, int] = defaultdict(int)
        self.backfill_skipped = 0
        self._snapshot_projectors: dict[str, Projector] = {}
        self.registry = self._metrics()

    def __repr__(self) -> str:
        return (
            f"<Bridge changes_read={self.changes_read} entries_published={self.entries_published} "
            f"transactions={self.transactions} durable_lsn={self.durable_lsn} sessions={self.sessions}>"
        )

    def stop(self) -> None:
        """Ask the loop to finish its batch, acknowledge and return (signal-safe)."""
        self.stopping = True

    def _batch(self, stream: str) -> StreamBatch:
        batch = self._batches.get(stream)
        if batch is None:
            batch = self._batches[stream] = StreamBatch(stream)
        return batch

    # -- retrying sessions -------------------------------------------------------------

    def run(self) -> None:
        """Run sessions, retrying transient failures with jittered exponential backoff."""
        retrying = tenacity.Retrying(
            retry=tenacity.retry_if_exception_type(TransientError),
            wait=tenacity.wait_exponential_jitter(initial=0.2, max=5.0),
            stop=lambda state: self.stopping,
            sleep=self._sleep,
            before_sleep=self._before_retry,
            reraise=True,
        )
        http = self.settings.http
        server = None
        if http.port:
            try:
                server = serve(self.registry, self.readiness, http.host, http.port)
            except OSError as exc:
                from ..errors import ConfigError

                raise ConfigError(f"cannot serve metrics on {http.host}:{http.port}: {exc.strerror}", hint="set http.port to a free port, or 0") from None
        try:
            retrying(self._session)
        except TransientError:
            if not self.stopping:
                raise
        finally:
            self.state = "stopped"
            if server is not None:
                server.shutdown()
                server.server_close()

    def _before_retry(self, state: tenacity.RetryCallState) -> None:
        exc = state.outcome.exception()
        self.failures["redis" if "redis" in str(exc) else "postgres"] += 1
        self.state = "retrying"
        log.warning("transient failure, retrying in %.1fs: %s", state.next_action.sleep, exc)

    def readiness(self) -> tuple[bool, str]:
        """Ready: streaming with both ends connected, recently heard from, not paused."""
        if self.state != "streaming":
            return False, f"not ready: {self.state}"
        silent = time.monotonic() - self.last_heard
        if silent > self.settings.postgres.receive_timeout_s:
            return False, f"not ready: nothing from postgres for {silent:.0f}s"
        return True, f"ready: streaming, durable at {self.durable_lsn}"

    def _metrics(self) -> Registry:
        r = Registry()
        r.counter("cdc_changes_read_total", "changes to mapped tables decoded, by entity",
                  lambda: {(("entity", e),): n[0] for e, n in self.read_by_entity.items()})
        r.counter("cdc_entries_published_total", "entries Redis confirmed, by stream",
                  lambda: {(("stream", s),): n for s, n in self.published_by_stream.items()})
        r.counter("cdc_transactions_total", "source transactions seen", lambda: self.transactions)
        r.histogram("cdc_batch_entries", "entries per batch sent to Redis", self.batch_sizes)
        r.histogram("cdc_publish_seconds", "time from sending a batch to Redis confirming it", self.publish_seconds)
        r.histogram("cdc_commit_to_publish_seconds", "time from a transaction's commit to Redis confirming it",
                    self.commit_lag_seconds)
        r.gauge("cdc_confirmed_flush_lsn", "position acknowledged to the slot (bytes)", lambda: int(self.durable_lsn))
        r.gauge("cdc_slot_lag_bytes", "WAL between the server's current position and the slot's confirmed one",
                lambda: self.slot_watch.health.lag_bytes)
        r.gauge("cdc_retained_wal_bytes", "WAL the slot keeps on the server's disk",
                lambda: self.slot_watch.health.retained_bytes)
        r.gauge("cdc_retained_wal_alarm", "retained WAL alarm level: 0 ok, 1 warning, 2 critical",
                lambda: ("ok", "warning", "critical").index(self.slot_watch.health.level))
        r.counter("cdc_transient_failures_total", "failures retried, by side", lambda: {(("side", k),): v for k, v in self.failures.items()})
        r.counter("cdc_sessions_total", "replication sessions started (1 + reconnections)", lambda: self.sessions)
        r.counter("cdc_entries_trimmed_total", "stream entries trimmed after every group consumed them", lambda: self.entries_trimmed)
        r.counter("cdc_entries_force_trimmed_total", "unconsumed entries dropped by the trim hard cap",
                  lambda: self.entries_force_trimmed)
        r.counter("cdc_backfill_rows_total", "rows published by snapshots and backfills (op r), by entity",
                  lambda: {(("entity", e),): n for e, n in self.backfill_rows.items()})
        r.counter("cdc_backfill_rows_dropped_total", "snapshot rows dropped because the stream changed them meanwhile",
                  lambda: self.backfill_skipped)
        r.gauge("cdc_dead_letters", "entries in dead-letter streams", self._dead_letters)
        r.gauge("cdc_redis_memory_ratio", "Redis used memory / maxmemory", lambda: self.memory.ratio if self.memory else None)
        r.gauge("cdc_paused", "1 while reading is paused for Redis memory", lambda: int(self.state == "paused"))
        r.gauge("cdc_up", "1 while streaming", lambda: int(self.state in ("streaming", "paused")))
        return r

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

    # -- one session ---------------------------------------------------------------------

    def _connect_catalog(self) -> psycopg.Connection:
        try:
            return psycopg.connect(self.settings.postgres.dsn, autocommit=True, options=SESSION_OPTIONS, connect_timeout=10)
        except Exception as exc:
            raise classify_pg_error(exc) from exc

    def _session(self) -> None:
        if self.stopping:
            return
        self.sessions += 1
        pgs = self.settings.postgres
        catalog_conn = self._connect_catalog()
        rs = self.settings.redis
        publisher = Publisher(
            rs.url, cluster=rs.cluster, flushed_key=keys.flushed_key(pgs.slot), wait_replicas=rs.wait_replicas,
            wait_timeout_ms=rs.wait_timeout_ms, double_send=float(os.environ.get("CDC_FAULT_DOUBLE_SEND", 0)),
        )
        client = connect_redis(rs)
        stream = ReplicationStream(pgs.dsn, pgs.slot, pgs.publication)
        try:
            try:
                level = catalog_conn.execute("SHOW wal_level").fetchone()[0]
                if level != "logical":
                    raise SourceError(
                        f"postgres wal_level is {level!r}, logical decoding needs 'logical'",
                        hint="set wal_level = logical in postgresql.conf and restart PostgreSQL",
                    )
                if self.until_caught_up and self.target_lsn is None:
                    self.target_lsn = Lsn.parse(catalog_conn.execute("SELECT pg_current_wal_lsn()::text").fetchone()[0])
                    log.info("catching up to %s", self.target_lsn)
            except psycopg.Error as exc:
                raise classify_pg_error(exc) from exc
            publisher.ping()
            health = self._check_slot(catalog_conn)
            try:
                check_redis_has_flushed(client, pgs.slot, health.confirmed_lsn)
                self.memory = MemoryWatch(client, rs.pause_at_memory_fraction, rs.resume_at_memory_fraction)
            except redis.RedisError as exc:
                raise TransientError(f"redis unavailable: {exc}") from exc
            self._release_stale_walsender(catalog_conn)
            stream.start(0, messages=True)  # logical messages carry backfill watermarks too
            self.state = "streaming"
            try:
                self._stream(stream, publisher, catalog_conn)
            except _ConnectionSilent:
                self._stale_pid = stream.backend_pid
                raise
        finally:
            stream.close()
            publisher.close()
            client.close()
            catalog_conn.close()

    def _drive_backfill(self, backfill: BackfillDriver, catalog_conn: psycopg.Connection) -> None:
        """Write the next snapshot chunk into the WAL if a backfill is waiting (see `cdc.bridge.backfill`)."""
        if backfill.disabled:
            return
        try:
            backfill.tick(catalog_conn)
        except psycopg.OperationalError as exc:
            raise classify_pg_error(exc) from exc
        except psycopg.errors.InsufficientPrivilege as exc:
            # snapshots and backfills must not silently stop: the operator grants, then runs again
            raise classify_pg_error(exc, role=catalog_conn.info.user, need="SELECT, UPDATE") from exc
        except psycopg.Error as exc:
            log.warning("backfill paused: %s", str(exc).strip())
            backfill.disabled = True

    def _snapshot_projector(self, entity: str, catalog_conn: psycopg.Connection) -> Projector | None:
        projector = self._snapshot_projectors.get(entity)
        if projector is None:
            mapping = next((m for m in self.mappings if m.entity == entity), None)
            if mapping is None or mapping.table is None:
                return None
            shape = table_shape(catalog_conn, *mapping.table)
            if shape is None:
                return None
            load_types(catalog_conn, self.catalog, [c.type_oid for c in shape.columns])
            projector = self._snapshot_projectors[entity] = Projector(mapping, shape, self.catalog)
        return projector

    def _watermark(self, msg, windows: Windows, backfill: BackfillDriver, catalog_conn, queue, tx) -> int:
        """Open or close a backfill window; at the high watermark publish the chunk's unchanged rows.

        Returns the transaction's next seq: the message takes one, each row another.
        """
        lsn_s, seq, xid_s, ts_s, pos_prefix = tx
        info = orjson.loads(msg.content)
        seq += 1
        chunk = info["chunk"]
        if info["kind"] == "low":
            windows.low(chunk, (info["schema"], info["table"]))
            return seq
        changed = windows.close(chunk)
        if changed is None:
            log.warning("backfill chunk %s: its low watermark was not seen; publishing it unfiltered", chunk)
            changed = set()
        projector = self._snapshot_projector(info["entity"], catalog_conn)
        if projector is None:
            log.error("backfill chunk %s: entity %s is not mapped to an existing table; skipped", chunk, info["entity"])
        else:
            names = info["columns"]
            index = {n: i for i, n in enumerate(names)}
            order = [index.get(c.name) for c in projector.shape.columns]
            batches = [self._batch(s) for s in projector.mapping.stream_keys()]
            version = projector.mapping.version
            stale = TRUNCATED in changed
            for row in info["rows"]:
                values = [None if i is None else row[i] for i in order]
                if stale or projector.key_values(values) in changed:
                    self.backfill_skipped += 1
                    continue
                out = projector.snapshot(values)
                if out is not None:
                    queue(batches[out.partition], out.fields, lsn_s, seq, xid_s, ts_s, version, pos_prefix + f"{seq:010d}")
                    self.backfill_rows[info["entity"]] += 1
                seq += 1
        if info["last"]:
            log.info("backfill of %s complete at chunk %s", info["entity"], chunk)
        backfill.seen(chunk)
        self._drive_backfill(backfill, catalog_conn)
        return seq

    def _memory_paused(self) -> bool:
        try:
            return self.memory.check()
        except redis.RedisError as exc:
            raise TransientError(f"redis unavailable: {exc}") from exc

    def _pause_while_memory_full(self, report, status_interval: float) -> None:
        """Read nothing (the server's data waits in the socket) until Redis has room again."""
        self.state = "paused"
        while not self.stopping and self._memory_paused():
            report(reply=True)  # keeps the replication connection alive
            self._sleep(min(0.5, status_interval))
        self.state = "streaming"

    def _check_slot(self, catalog_conn: psycopg.Connection) -> SlotHealth:
        try:
            return self.slot_watch.check(catalog_conn)
        except psycopg.Error as exc:
            raise classify_pg_error(exc) from exc

    def _heartbeat(self, catalog_conn: psycopg.Connection) -> bool:
        """Emit a heartbeat message; False (and stop trying) when not permitted."""
        try:
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
        client = connect_redis(self.settings.redis)
        try:
            for result in trim_mapped(client, self.mappings, policy):
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
            while time.monotonic() < deadline and catalog_conn.execute(
                "SELECT active FROM pg_replication_slots WHERE slot_name = %s", (self.settings.postgres.slot,)
            ).fetchone()[0]:
                time.sleep(0.05)  # the backend is exiting; START_REPLICATION retries anyway

    def _bind(self, relation: pg.Relation, catalog_conn: psycopg.Connection) -> list[_Target]:
        mappings = self._by_table.get((relation.namespace, relation.name))
        if not mappings:
            return []
        try:
            load_types(catalog_conn, self.catalog, [c.type_oid for c in relation.columns])
        except psycopg.Error as exc:
            raise classify_pg_error(exc) from exc
        shape = TableShape(
            schema=relation.namespace,
            name=relation.name,
            columns=tuple(ColumnShape(c.name, c.type_oid, c.is_key) for c in relation.columns),
            replica_identity=relation.replica_identity,
        )
        targets = []
        for m in mappings:
            projector = Projector(m, shape, self.catalog)
            targets.append(_Target(projector, [self._batch(s) for s in m.stream_keys()], self.read_by_entity[m.entity]))
        log.info("bound %s to %s", relation.namespace + "." + relation.name, ", ".join(m.entity for m in mappings))
        return targets

    def _stream(self, stream: ReplicationStream, publisher: Publisher, catalog_conn: psycopg.Connection) -> None:
        batch_cfg = self.settings.batch
        max_entries = batch_cfg.max_entries
        max_delay = batch_cfg.max_delay_ms / 1000.0
        status_interval = batch_cfg.status_interval_s
        receive_timeout = self.settings.postgres.receive_timeout_s
        decoder = pg.PgOutputDecoder()
        targets: dict[int, list[_Target]] = {}
        message_batches = [(m.message_prefix, m.version, self._batch(m.stream_key())) for m in self._message_mappings]
        batches = self._batches
        for b in batches.values():
            b.clear()

        pending = 0  # entries queued since the last send
        first_pending_at = 0.0
        ackable = self.durable_lsn  # end LSN of the last complete transaction seen
        in_tx = False
        lsn_s = xid_s = ts_s = pos_prefix = ""
        seq = 0
        next_status = time.monotonic()
        last_heard = next_status
        trim = self.settings.trim
        next_trim = next_status + trim.interval_s if trim.interval_s else float("inf")
        next_poll = 0.0
        monotonic = time.monotonic

        inflight = False  # a batch sent to Redis and not yet confirmed
        inflight_ack = ackable
        inflight_count = 0
        inflight_counts: dict[str, int] = {}
        inflight_sent_at = 0.0
        inflight_ts_ms = 0
        recorded = self.durable_lsn  # how far Redis is known to record that it holds the source
        pgs = self.settings.postgres
        windows = Windows()  # open backfill watermark windows
        self._snapshot_projectors = {}
        backfill = BackfillDriver(pgs.slot, self.mappings, self.settings.batch.backfill_chunk_rows)
        next_check = 0.0
        next_slot_check = monotonic() + pgs.slot_check_interval_s
        heartbeat = pgs.heartbeat_interval_s
        next_heartbeat = monotonic() + heartbeat if heartbeat else float("inf")

        def settle() -> None:
            """Wait for Redis to confirm the batch in flight; the slot may then move to it."""
            nonlocal inflight, recorded
            publisher.confirm()
            self.publish_seconds.observe(monotonic() - inflight_sent_at)
            self.commit_lag_seconds.observe(max(0.0, time.time() - inflight_ts_ms / 1000))
            for name, n in inflight_counts.items():
                self.published_by_stream[name] += n
            self.entries_published += inflight_count
            inflight = False
            recorded = max(recorded, inflight_ack)  # recorded by the same pipeline
            if inflight_ack > self.durable_lsn:
                self.durable_lsn = inflight_ack

        def flush(wait: bool) -> None:
            """Confirm the batch in flight, send the pending one; with `wait`, confirm that too.

            Redis appends one batch while the next is decoded: at most one is in flight,
            and the slot position moves only to what Redis confirmed.
            """
            nonlocal pending, inflight, inflight_ack, inflight_count, inflight_counts, inflight_sent_at
            nonlocal inflight_ts_ms, next_check
            if inflight:
                settle()
            if pending:
                inflight_counts = {b.stream: b.count for b in batches.values() if b.count}
                self.batch_sizes.observe(pending)
                publisher.send(batches.values(), flushed=ackable)
                if self.memory is not None and self.memory.ratio is not None:
                    # Redis has a memory limit: look again before the next batch, not in half a
                    # second (a fast stream would overshoot the pause mark into refused writes)
                    next_check = 0.0
                for b in batches.values():
                    b.clear()
                inflight, inflight_ack, inflight_count = True, ackable, pending
                inflight_sent_at, inflight_ts_ms = monotonic(), int(ts_s or 0)
                pending = 0
                if wait:
                    settle()
            elif ackable > self.durable_lsn:
                self.durable_lsn = ackable

        def queue(batch: StreamBatch, fields: list, lsn: str, seq: int, xid: str, ts: str, version: int, pos: str) -> None:
            """Complete an entry with its source position fields and add it to its stream's batch."""
            nonlocal pending, first_pending_at
            fields += (b"lsn", lsn, b"seq", seq, b"xid", xid, b"ts_ms", ts, b"v", version)
            batch.add(pos, fields)
            if not pending:
                first_pending_at = monotonic()
            pending += 1

        def report(reply: bool = False) -> None:
            """Tell the slot how far Redis holds the source, once Redis has recorded that itself.

            While a batch is in flight the connection is busy with its replies, so the
            record cannot be written now: report only what is already recorded.
            """
            nonlocal next_status, recorded
            if self.durable_lsn > recorded and not inflight:
                publisher.record_flushed(self.durable_lsn)
                recorded = self.durable_lsn
            acked = min(self.durable_lsn, recorded)
            stream.send_status(acked, acked, acked, reply)
            next_status = monotonic() + status_interval

        try:
            self._drive_backfill(backfill, catalog_conn)  # resume what a previous session left unfinished
            while not self.stopping:
                now = monotonic()
                if now >= next_check:  # guardrails, between messages
                    next_check = now + 0.5
                    self.last_heard = last_heard
                    if self.memory is not None and self._memory_paused():
                        # hold what is queued (a batch at most); send nothing more until Redis has room
                        if inflight:
                            settle()
                        report()
                        self._pause_while_memory_full(report, status_interval)
                        last_heard = monotonic()
                    if now >= next_slot_check:
                        next_slot_check = now + pgs.slot_check_interval_s
                        self._check_slot(catalog_conn)
                    if now >= next_heartbeat:
                        next_heartbeat = now + heartbeat
                        if now - last_heard >= heartbeat and not self._heartbeat(catalog_conn):
                            next_heartbeat = float("inf")
                if now >= next_trim:
                    self.trim_streams()
                    next_trim = monotonic() + trim.interval_s
                if pending:
                    raw = stream.read(0)
                else:
                    raw = stream.read(max(0.0, min(next_status, next_poll or next_status) - monotonic()))
                now = monotonic()
                if raw is None:
                    if pending or inflight:
                        flush(wait=True)
                        report()
                    elif now >= next_status:
                        # ask for an answer when the server has been silent: a dead peer shows up
                        report(reply=now - last_heard > status_interval)
                    if now - last_heard > receive_timeout:
                        raise _ConnectionSilent(f"no message from postgres in {receive_timeout:.0f}s; reconnecting")
                    if self.until_caught_up and not in_tx:
                        if self.durable_lsn >= self.target_lsn and (backfill.idle or backfill.disabled) \
                                and backfill.waiting_for is None and not windows.open:
                            report()
                            log.info("caught up at %s", self.durable_lsn)
                            return
                        if now >= next_poll:
                            report(reply=True)  # the answer tells how far the server has sent
                            next_poll = now + _CAUGHT_UP_POLL_S
                    continue
                last_heard = now
                if raw[0] != _W:
                    keepalive = parse_copy_data(raw)
                    if not in_tx and not pending and not inflight and not windows.open and keepalive.wal_end > ackable:
                        ackable = self.durable_lsn = Lsn(keepalive.wal_end)
                    if keepalive.reply_requested:
                        report()
                    continue
                kind = raw[_XLOG_HEADER]
                if kind == _INSERT or kind == _UPDATE or kind == _DELETE:
                    relid = _RELID(raw, _XLOG_HEADER + 1)[0]
                    self.changes_read += 1
                    tlist = targets.get(relid)
                    if tlist:
                        msg = decoder.decode(raw[_XLOG_HEADER:])
                        if windows.tables:
                            keyed = tlist[0].projector
                            if keyed.table in windows.tables:
                                for values in (msg.new if kind != _DELETE else None, msg.old if kind != _INSERT else None):
                                    if values is not None:
                                        windows.changed(keyed.table, keyed.key_values(values))
                        for t in tlist:
                            t.read[0] += 1
                            proj = t.projector
                            if kind == _INSERT:
                                out = proj.insert(msg.new)
                            elif kind == _UPDATE:
                                out = proj.update(msg.new, msg.old, msg.old_kind == "O")
                            else:
                                out = proj.delete(msg.old, msg.old_kind == "O")
                            if out is not None:
                                queue(t.batches[out.partition], out.fields, lsn_s, seq, xid_s, ts_s, t.version, pos_prefix + f"{seq:010d}")
                    seq += 1
                elif kind == _BEGIN:
                    msg = decoder.decode(raw[_XLOG_HEADER:])
                    in_tx = True
                    seq = 0
                    lsn_s = str(int(msg.final_lsn))
                    pos_prefix = f"{int(msg.final_lsn):020d}"
                    xid_s = str(msg.xid)
                    ts_s = str(pg_ts_to_unix_ms(msg.commit_ts))
                elif kind == _COMMIT:
                    msg = decoder.decode(raw[_XLOG_HEADER:])
                    in_tx = False
                    self.transactions += 1
                    if not windows.open:  # while a window is open, a replay must start before its low watermark
                        ackable = msg.end_lsn
                    if not pending and not inflight and ackable > self.durable_lsn:
                        self.durable_lsn = ackable
                elif kind == _RELATION:
                    msg = decoder.decode(raw[_XLOG_HEADER:])
                    targets[msg.relid] = self._bind(msg, catalog_conn)
                elif kind == _TRUNCATE:
                    msg = decoder.decode(raw[_XLOG_HEADER:])
                    self.changes_read += 1
                    for relid in msg.relids:
                        tlist = targets.get(relid, ())
                        if tlist:  # only mapped tables have backfill windows
                            windows.truncated(tlist[0].projector.table)
                        for t in tlist:
                            for out in t.projector.truncate():
                                queue(t.batches[out.partition], out.fields, lsn_s, seq, xid_s, ts_s, t.version, pos_prefix + f"{seq:010d}")
                    seq += 1
                elif kind == _MESSAGE:
                    msg = decoder.decode(raw[_XLOG_HEADER:])
                    if msg.prefix == WATERMARK_PREFIX:
                        seq = self._watermark(msg, windows, backfill, catalog_conn, queue, (lsn_s, seq, xid_s, ts_s, pos_prefix))
                        continue
                    if msg.prefix == REQUEST_PREFIX:  # `cdc backfill` queued one
                        seq += 1
                        self._drive_backfill(backfill, catalog_conn)
                        continue
                    if msg.transactional:
                        m_lsn, m_pos, m_xid, m_ts, m_seq = lsn_s, pos_prefix + f"{seq:010d}", xid_s, ts_s, seq
                        seq += 1
                    else:
                        m_lsn, m_pos, m_xid, m_ts, m_seq = (
                            str(int(msg.lsn)), position(msg.lsn, 0), "0", str(pg_ts_to_unix_ms(pg_now_us())), 0,
                        )
                    for prefix, version, batch in message_batches:
                        if msg.prefix.startswith(prefix):
                            queue(batch, message_entry(msg.prefix, msg.content), m_lsn, m_seq, m_xid, m_ts, version, m_pos)
                            break
                elif kind not in _IGNORED:
                    msg = decoder.decode(raw[_XLOG_HEADER:])
                    raise SourceError(f"unexpected pgoutput message {type(msg).__name__} (streaming and two-phase are not enabled)")
                if pending and (pending >= max_entries or now - first_pending_at >= max_delay):
                    flush(wait=False)
                    report()
                elif now >= next_status:
                    report()
            # stopping: finish the batch, acknowledge
            flush(wait=True)
            report()
            log.info("stopped at %s", self.durable_lsn)
        except (MappingError, pg.DecodeError) as exc:
            # Publish what came before the failure so a fixed restart resumes right there.
            try:
                flush(wait=True)
                report()
            except CdcError:
                pass
            if isinstance(exc, pg.DecodeError):
                raise SourceError(f"cannot decode a pgoutput message: {exc}") from exc
            raise
