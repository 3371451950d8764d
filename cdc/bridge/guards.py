"""Guardrails around the bridge: the slot's health and WAL retention, heartbeats,
Redis memory (backpressure) and Redis data loss (a record behind the slot, or a
mapped stream whose history vanished). Each check is small and I/O at the edge;
the bridge calls them on a schedule."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import psycopg
import redis

from .. import keys
from ..errors import DataLossError, PublishError, SlotError
from ..sink.streamkeys import STREAM, stream_key_error
from ..sink.trim import UnconsumedRemoved, removed_unconsumed, unconsumed_loss_error
from ..source.history import Divergence, ServerHistory, divergence
from ..source.lsn import Lsn
from ..source.slot_server import POSITION_SQL

__all__ = ["DATA_LOSS_FIELDS", "MemoryWatch", "SlotHealth", "SlotWatch", "check_redis_has_flushed", "clear_data_loss",
           "invalidated_slot_error", "missing_slot_error", "slot_database_error", "record_data_loss", "record_stream_loss",
           "check_source_history", "record_source", "record_divergence", "diverged_error", "redis_record",
           "stop_on_stream_problems", "stream_problems"]

log = logging.getLogger("cdc.guard")

LEVELS = ("ok", "warning", "critical")

#: the slot on its server; a standby's position is what it replayed (`cdc.source.slot_server`)
SLOT_QUERY = f"""
SELECT wal_status,
       pg_wal_lsn_diff({POSITION_SQL}, restart_lsn)::bigint,
       pg_wal_lsn_diff({POSITION_SQL}, confirmed_flush_lsn)::bigint,
       confirmed_flush_lsn::text,
       current_setting('max_slot_wal_keep_size')
FROM pg_replication_slots WHERE slot_name = %s
"""


def _size(setting: str) -> int:
    """max_slot_wal_keep_size as bytes (-1: unlimited)."""
    text = setting.strip()
    if text == "-1":
        return -1
    units = {"kB": 1024, "MB": 1024**2, "GB": 1024**3, "TB": 1024**4}
    for unit, factor in units.items():
        if text.endswith(unit):
            return int(float(text[: -len(unit)]) * factor)
    return int(text) * 1024**2


@dataclass
class SlotHealth:
    wal_status: str = "unknown"
    retained_bytes: int = 0
    lag_bytes: int = 0
    confirmed_lsn: Lsn = Lsn(0)
    max_keep_bytes: int = -1
    level: str = "ok"


#: the individual changes a slot lost cannot be brought back; `cdc recover` rebuilds the streams from the tables
_NOT_RESTORED = ("the streams then replay to the tables' current state; the individual changes in between "
                 "cannot be restored")


def missing_slot_error(slot: str, held: Lsn | None | bool) -> SlotError:
    """The slot is gone. `held`: how far Redis records holding the source for it (None: no record, a new
    deployment; True: Redis could not be asked). Advice that streams on past a gap is never given."""
    if held is None:
        return SlotError(f"replication slot {slot!r} does not exist", hint="run: cdc init --config <file>")
    held_text = ("redis could not say how far it holds the source: every change committed since that position"
                 if held is True else f"redis holds the source up to {held}: every change committed since")
    return SlotError(
        f"replication slot {slot!r} does not exist, and {held_text} was lost to the slot "
        "(dropped, invalidated, or not carried over a failover)",
        hint=f"run cdc init, then cdc recover before cdc run ({_NOT_RESTORED}); "
        "cdc init alone would stream on past the gap",
    )


def slot_database_error(conn: psycopg.Connection, slot: str) -> SlotError | None:
    """The slot belongs to another database than the one `conn` (postgres.dsn) connects to: a slot decodes
    the database it was created in only (PostgreSQL refuses the other with "was not created in this
    database", for ever). None when it is this database's, or there is no such slot."""
    row = conn.execute("SELECT database, current_database() FROM pg_replication_slots "
                       "WHERE slot_name = %s AND database IS DISTINCT FROM current_database()", (slot,)).fetchone()
    if row is None or row[0] is None:
        return None
    theirs, ours = row
    return SlotError(
        f"replication slot {slot!r} belongs to database {theirs!r}, but postgres.dsn connects to database {ours!r}: "
        "a slot decodes only the database it was created in",
        hint=f"if postgres.dsn should name {theirs!r}, set it back; if the bridge moves to {ours!r} for good, drop the "
             f"old slot (SELECT pg_drop_replication_slot('{slot}'), connected to {theirs!r}), then cdc init, then cdc "
             f"recover before cdc run (the streams hold the rows of {theirs!r}; cdc recover rebuilds them from the "
             f"tables of {ours!r})")


def invalidated_slot_error(slot: str) -> SlotError:
    return SlotError(
        f"replication slot {slot!r} was invalidated (wal_status lost): the WAL it needed was removed, "
        "so changes were lost to it",
        hint=f"run SELECT pg_drop_replication_slot('{slot}'); then cdc init, then cdc recover before cdc run "
        f"({_NOT_RESTORED}); raise max_slot_wal_keep_size to avoid it",
    )


def redis_record(client: redis.Redis, slot: str) -> Lsn | None | bool:
    """How far Redis records holding the source for `slot`: None without a record, True if it cannot say."""
    try:
        raw = client.get(keys.flushed_key(slot))
    except redis.RedisError:
        return True
    return None if raw is None else Lsn(int(raw))


class SlotWatch:
    """Watches the slot: retained WAL against alarm levels, and invalidation."""

    def __init__(self, slot: str, warn_bytes: int = 0, critical_bytes: int = 0) -> None:
        self.slot = slot
        #: asks Redis how far it holds the source, for the error of a missing slot (`redis_record`)
        self.redis_held: Callable[[], Lsn | None | bool] = lambda: True
        self.warn_bytes = warn_bytes
        self.critical_bytes = critical_bytes
        self.health = SlotHealth()

    def thresholds(self, max_keep: int) -> tuple[int, int]:
        if self.warn_bytes or self.critical_bytes:
            return self.warn_bytes or self.critical_bytes, self.critical_bytes or self.warn_bytes
        if max_keep > 0:
            return max_keep // 2, max_keep * 4 // 5
        return 1024**3, 10 * 1024**3

    def check(self, conn: psycopg.Connection) -> SlotHealth:
        row = conn.execute(SLOT_QUERY, (self.slot,)).fetchone()
        if row is None:
            raise missing_slot_error(self.slot, self.redis_held())
        status, retained, lag, confirmed, keep = row
        if status == "lost":
            raise invalidated_slot_error(self.slot)
        if self.health.wal_status == "unknown":  # once: a slot never changes database
            other = slot_database_error(conn, self.slot)
            if other is not None:
                raise other
        health = SlotHealth(status, int(retained or 0), int(lag or 0), Lsn.parse(confirmed) if confirmed else Lsn(0), _size(keep))
        warn, critical = self.thresholds(health.max_keep_bytes)
        if status == "unreserved" or health.retained_bytes >= critical:
            health.level = "critical"
        elif health.retained_bytes >= warn:
            health.level = "warning"
        if health.level != self.health.level:
            report = log.error if health.level == "critical" else log.warning if health.level == "warning" else log.info
            report(
                "retained WAL alarm %s: slot %s retains %d bytes (warning at %d, critical at %d, wal_status %s)",
                health.level, self.slot, health.retained_bytes, warn, critical, status,
            )
        self.health = health
        return health

    @staticmethod
    def heartbeat(conn: psycopg.Connection) -> None:
        """Write a little WAL in this database so a quiet slot keeps advancing."""
        conn.execute("SELECT pg_logical_emit_message(false, 'cdc.heartbeat', now()::text)")


class MemoryWatch:
    """Backpressure: pause reading while Redis memory is above a fraction of maxmemory."""

    def __init__(self, client: redis.Redis, pause_at: float, resume_at: float, slot: str | None = None,
                 reserve: Callable[[], int] | None = None) -> None:
        self.client = client
        self.pause_at = pause_at
        self.resume_at = resume_at
        #: bytes Redis needs beyond its use to take the next batch; counted as used, so that the
        #: pause comes before a batch that Redis would refuse
        self.reserve = reserve
        self.paused = False
        self.ratio: float | None = None
        #: the ratio the pause rule compares: used memory plus the reserve for the next batch
        self.needed: float | None = None
        #: where the pause is recorded for `cdc status` (`keys.bridge_state_key`); None: not recorded
        self.state_key = keys.bridge_state_key(slot) if slot else None
        self._recorded: bool | None = None

    @staticmethod
    def _fullest(info: dict) -> dict:
        """INFO of one server, or of a cluster's fullest node (a dict of INFO per node)."""
        nodes = [v for v in info.values() if isinstance(v, dict)] if "used_memory" not in info else []
        if not nodes:
            return info
        return max(nodes, key=lambda i: int(i["used_memory"]) / int(i["maxmemory"]) if int(i.get("maxmemory", 0)) else 0)

    def check(self) -> bool:
        """True while reading should stay paused."""
        info = self._fullest(self.client.info("memory"))
        limit = int(info.get("maxmemory", 0))
        if not limit or not self.pause_at:
            if self.paused:
                log.info("redis has no memory limit now: resuming")
            self.ratio, self.needed, self.paused = None, None, False
            self._record()
            return False
        self.ratio = int(info["used_memory"]) / limit
        self.needed = needed = self.ratio + (self.reserve() / limit if self.reserve else 0)
        if not self.paused and needed >= self.pause_at:
            self.paused = True
            log.warning("redis memory at %.0f%% of maxmemory with room for the next batch (%.0f%% in use): "
                        "pausing reading (nothing is acknowledged or lost)", needed * 100, self.ratio * 100)
        elif self.paused and needed < self.resume_at:
            self.paused = False
            log.info("redis memory at %.0f%% of maxmemory with room for the next batch: resuming", needed * 100)
        self._record()
        return self.paused

    def _record(self) -> None:
        """Tell `cdc status` whether reading is paused, when that changes (and once per session)."""
        if self.state_key is None or self._recorded == self.paused:
            return
        fields = {"paused": int(self.paused), "memory_ratio": "" if self.needed is None else f"{self.needed:.4f}"}
        if self.paused:
            fields["paused_since_ms"] = int(time.time() * 1000)
        self.client.hset(self.state_key, mapping=fields)
        self._recorded = self.paused


DATA_LOSS_FIELDS = ("data_loss_from", "data_loss_to", "data_loss_at_ms", "data_loss", "data_loss_diverged")


def record_data_loss(client: redis.Redis, slot: str, held: Lsn | None, confirmed: Lsn, message: str) -> None:
    """Leave the loss where `cdc status` shows it, until cdc recover repairs it (or cdc init accepts it, or
    Redis holds everything again)."""
    client.hset(keys.bridge_state_key(slot), mapping={
        "data_loss_from": "" if held is None else str(held), "data_loss_to": str(confirmed),
        "data_loss_at_ms": int(time.time() * 1000), "data_loss": message,
    })


def clear_data_loss(client: redis.Redis, slot: str) -> None:
    client.hdel(keys.bridge_state_key(slot), *DATA_LOSS_FIELDS)


def record_stream_loss(client: redis.Redis, slot: str, error: DataLossError) -> None:
    """Record, for cdc status, a loss found on a stream (`cdc.sink.streamkeys`, `stream_problems`): what it
    held up to the LSN the error names is missing from it."""
    lost_to = getattr(error, "lost_to", None)
    if lost_to is not None:
        record_data_loss(client, slot, Lsn(0), lost_to, error.message)


def stop_on_stream_problems(client: redis.Redis, slot: str, streams: Mapping[str, str]) -> None:
    """Raise the first reason `stream_problems` finds, a data loss recorded for `cdc status` first."""
    problems = stream_problems(client, streams)
    if problems:
        if isinstance(problems[0], DataLossError):
            record_stream_loss(client, slot, problems[0])
        raise problems[0]


def stream_problems(client: redis.Redis, streams: Mapping[str, str]) -> list[PublishError]:
    """Why appends to these streams (stream key -> entity) would be refused: data losses first (exit 6: a
    stream gone, or replaced by another type, while its mark says it held entries), then keys of another type
    where a stream never written belongs (exit 5). The same judgement as the append's (`cdc.sink.streamkeys`)."""
    pipe = client.pipeline(transaction=False)
    for stream in streams:
        pipe.type(stream)
        pipe.get(keys.mark_key(stream))
    replies = pipe.execute(raise_on_error=False)
    infos = _stream_infos(client, [s for i, s in enumerate(streams) if replies[2 * i] in (STREAM, STREAM.encode())])
    problems: list[PublishError] = []
    for i, (stream, entity) in enumerate(streams.items()):
        key_type, mark = replies[2 * i], replies[2 * i + 1]
        if isinstance(key_type, Exception):
            raise key_type
        if isinstance(mark, redis.ResponseError) and "WRONGTYPE" in str(mark):
            name = keys.mark_key(stream)
            problems.append(PublishError(
                f"redis key {name} holds a {client.type(name).decode()}, not the high-water mark of stream {stream} "
                f"(entity {entity}); the bridge appended nothing",
                hint=f"rename that key away (redis-cli RENAME {name} <new name>), then run cdc recover, which rebuilds "
                "the stream behind a new mark (without its mark the stream would get entries it holds again)"))
            continue
        if isinstance(mark, Exception):
            raise mark
        error = stream_key_error(stream, key_type, mark, entity)
        if error is not None:
            problems.append(error)
        elif key_type.decode() == STREAM:
            problems += [_unconsumed_loss(client, gone, entity, mark)
                         for gone in removed_unconsumed(client, stream, infos.get(stream))]
    return sorted(problems, key=lambda e: not isinstance(e, DataLossError))


def _stream_infos(client: redis.Redis, streams: list[str]) -> dict[str, dict]:
    """XINFO STREAM of each of `streams`, in one round trip (a stream deleted meanwhile: left out, and read
    again where it is needed)."""
    pipe = client.pipeline(transaction=False)
    for stream in streams:
        pipe.xinfo_stream(stream)
    replies = pipe.execute(raise_on_error=False) if streams else []
    return {s: info for s, info in zip(streams, replies) if isinstance(info, dict)}


def _unconsumed_loss(client: redis.Redis, gone: UnconsumedRemoved, entity: str, mark: bytes | None) -> DataLossError:
    """A stream that lost entries a consumer group had not consumed, other than by the trim caps (exit 6)."""
    return unconsumed_loss_error(client, gone, f"stream of entity {entity}", mark)


def record_source(client: redis.Redis, slot: str, server: ServerHistory) -> None:
    """Record beside the flushed record the server history its positions belong to."""
    client.hset(keys.source_key(slot), mapping={"system_id": server.system_id, "timeline": server.timeline})


def diverged_error(slot: str, found: Divergence) -> DataLossError:
    since = "the start" if found.since is None else str(found.since)
    return DataLossError(
        f"redis holds changes of slot {slot!r} this server's history does not have: positions in ({since}, "
        f"{found.held}] name other transactions here ({found.cause}); nothing was streamed: the server's own "
        "changes there would be dropped as already written",
        hint=f"run cdc recover: it rebuilds the streams from the tables once the server's WAL passes {found.held}, "
        "then cdc run")


def record_divergence(client: redis.Redis, slot: str, error: DataLossError, found: Divergence) -> None:
    """Leave the divergence for cdc status; it holds the bridge (`check_source_history`) until cdc recover."""
    record_data_loss(client, slot, found.since, found.held, error.message)
    client.hset(keys.bridge_state_key(slot), "data_loss_diverged", 1)


def check_source_history(client: redis.Redis, slot: str, server: ServerHistory, *,
                         reread: Callable[[], ServerHistory] | None, record: bool = True,
                         decoded_here: Lsn | None = None) -> None:
    """Stop (exit 6, recorded for cdc status) when Redis holds positions the server's history lacks: another
    system, an older timeline, or a newer one that branched off below Redis' record (`cdc.source.history`);
    or when such a divergence was recorded (by cdc init) and cdc recover has not repaired it yet.

    A record without a recorded history (older deployments), or a newer timeline that branched off at or above
    Redis' record, is accepted and recorded (unless `record` is false: cdc check only reads).

    `server` was read before Redis' record, and a bridge streaming the slot meanwhile (the one `cdc check` or
    `cdc init` runs beside, or the one a restarted bridge takes over from) may have moved the record past the
    WAL position `server` saw. So a divergence is judged again on `reread()`, a reading of the server taken
    after the record: every position a bridge records is WAL the server had written before that reading.
    `reread` None: `server` was read after the record.

    `decoded_here`: the confirmed position of a slot the bridge created on this server while it was a standby
    (postgres.slot_dsn). A standby promoted under a running bridge goes on decoding its own new timeline in the
    same session, so Redis holds positions past the branch point labelled with the old timeline; when the
    slot here confirmed past the branch point, those positions were decoded here: nothing diverged.
    """
    pipe = client.pipeline(transaction=False)  # one round trip
    pipe.hgetall(keys.bridge_state_key(slot))
    pipe.get(keys.flushed_key(slot))
    pipe.hgetall(keys.source_key(slot))
    state, raw, source = pipe.execute()
    if state.get(b"data_loss_diverged"):
        raise DataLossError(state.get(b"data_loss", b"").decode(), hint="run cdc recover, then cdc run")
    if raw is None or int(raw) == 0:  # nothing held (or cdc recover at work): check_redis_has_flushed judges
        return
    held = Lsn(int(raw))
    recorded = {k.decode(): v.decode() for k, v in source.items()}
    found = _diverged(recorded, held, server)
    if found is not None and reread is not None:
        found = _diverged(recorded, held, reread())
    if (found is not None and decoded_here is not None and found.since is not None and decoded_here > found.since
            and "branched off" in found.cause):
        log.info("slot %s on this server decoded its own timeline past the branch point %s: redis' positions up to "
                 "%s are this server's", slot, found.since, held)
        found = None
    if found is not None:
        error = diverged_error(slot, found)
        record_divergence(client, slot, error, found)
        raise error
    if record and recorded != {"system_id": server.system_id, "timeline": str(server.timeline)}:
        if recorded:
            log.info("source timeline %s -> %d: it branched off at or above %s, which redis holds; nothing diverged",
                     recorded.get("timeline"), server.timeline, held)
        record_source(client, slot, server)


def _diverged(recorded: dict[str, str], held: Lsn, server: ServerHistory) -> Divergence | None:
    if "system_id" in recorded:
        return divergence(recorded["system_id"], int(recorded["timeline"]), held, server)
    return divergence(server.system_id, server.timeline, held, server)  # an older deployment: only the WAL can tell


def check_redis_has_flushed(client: redis.Redis, slot: str, confirmed: Lsn, streams: Mapping[str, str] | None = None,
                            ) -> Lsn:
    """Stop if Redis holds less than the slot was told it holds (lost writes), or when one of `streams`
    (stream key -> entity) may not be appended to (`stream_problems`); record a loss for status.

    Returns the position Redis records holding: a new session starts from it.
    """
    try:
        held = _check_flushed(client, slot, confirmed)
    except DataLossError as exc:
        raw = client.get(keys.flushed_key(slot))
        held = None if raw is None else Lsn(int(raw))
        state = client.hgetall(keys.bridge_state_key(slot))
        recorded = state.get(b"data_loss", b"").decode()
        if (recorded and state.get(b"data_loss_to") == str(confirmed).encode()
                and state.get(b"data_loss_from", b"").decode() == ("" if held is None else str(held))):
            # the same gap, recorded with its cause (cdc init on a new slot): that says more
            raise DataLossError(recorded, hint="run cdc recover (the bridge stopped), then cdc run") from None
        record_data_loss(client, slot, held, confirmed, exc.message)
        raise
    stop_on_stream_problems(client, slot, streams or {})
    clear_data_loss(client, slot)
    return held


def _check_flushed(client: redis.Redis, slot: str, confirmed: Lsn) -> Lsn:
    raw = client.get(keys.flushed_key(slot))
    if raw is None:
        raise DataLossError(
            f"redis has no record of slot {slot!r}: it may have lost its data (changes up to {confirmed} "
            "were acknowledged to postgres)",
            hint="if this Redis is new or was emptied on purpose, run cdc init to register it; "
            "otherwise restore Redis, or stop the bridge and run cdc recover to rebuild the streams",
        )
    flushed = Lsn(int(raw))
    if flushed < confirmed:
        raise DataLossError(
            f"redis lost entries: it holds changes up to {flushed}, but slot {slot!r} was acknowledged up to {confirmed}; "
            f"entries of transactions committed in ({flushed}, {confirmed}] are missing from the streams",
            hint="restore Redis from a backup holding them, or stop the bridge and run cdc recover to rebuild the streams",
        )
    return flushed
