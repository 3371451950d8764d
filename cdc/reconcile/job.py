"""`cdc reconcile`: recompute consumer state from the canonical tables and reset it exactly.

For each spec (`cdc.reconcile.spec`):

1. hold the consumers' streams (trimming keeps every entry published from now on);
2. export a snapshot with its exact position P (`cdc.reconcile.exported_snapshot`);
3. let Spark read the source under that snapshot in parallel and aggregate it (`cdc.reconcile.truth`);
4. wait until the bridge has published everything committed before P;
5. per consumer, in its state database: compare and reset (`cdc.reconcile.reset`), and
   keep the drift report in ``cdc_reconcile_runs`` / ``cdc_drift``; a consumer whose entity's table
   was being resynced at P (`on_unaccountable: resync`) is refused instead (`_resync_refusal`);
6. release the holds.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import orjson
import psycopg
import redis

from .. import keys
from ..consume.checkpoint import Apply
from ..config import Settings
from ..errors import CdcError, ConfigError, TransientError
from ..sink.entry import parse_stream_id, reply_text
from .exported_snapshot import ExportedSnapshot, import_snapshot
from ..loader import load_callable
from ..source.lsn import Lsn
from ..mapping.model import Mapping
from ..consume.replay import read_range
from .spec import ConsumerTarget, ReconcileSpec
from ..sink.redisconn import connect_redis
from ..source.replication import classify_pg_error, quote_ident
from .reset import ResetOutcome, reset_consumer

__all__ = ["SpecResult", "preflight", "reconcile_spec"]

log = logging.getLogger("cdc.reconcile")

HOLD_TTL_MS = 24 * 3600 * 1000


@dataclass
class SpecResult:
    spec: ReconcileSpec
    position: Lsn = Lsn(0)
    snapshot: str = ""
    source_rows: int = 0
    truth_keys: int = 0
    partitions: int = 0
    read_seconds: float = 0.0
    spark_start_seconds: float = 0.0  # the Spark session's start, counted in the first spec's `seconds`
    seconds: float = 0.0
    skipped_null_keys: int = 0
    outcomes: list[ResetOutcome] = field(default_factory=list)

    @property
    def exact(self) -> bool:
        return not any(o.unrepaired for o in self.outcomes)

    def as_json(self, dry_run: bool) -> dict:
        return {
            "spec": self.spec.name,
            "position": str(self.position),
            "snapshot": self.snapshot,
            "dry_run": dry_run,
            "source_rows": self.source_rows,
            "truth_keys": self.truth_keys,
            "partitions": self.partitions,
            "read_seconds": round(self.read_seconds, 3),
            "spark_start_seconds": round(self.spark_start_seconds, 3),
            "seconds": round(self.seconds, 3),
            "source_rows_with_null_key": self.skipped_null_keys,
            "consumers": [
                {
                    "consumer": o.consumer,
                    "status": o.status,
                    "reason": o.reason,
                    "caught_up": o.caught_up,
                    "replayed": o.replayed,
                    "locked_seconds": round(o.locked_seconds, 3),
                    "streams": {p.stream: {"behind": p.behind, "checkpoint": list(p.checkpoint)} for p in o.streams},
                    **o.drift.as_json(self.spec.key_columns),
                }
                for o in self.outcomes
            ],
        }


def _hold(client: redis.Redis, streams: list[str], holder: str, holds: dict[str, str] | None = None) -> dict[str, str]:
    """Hold each stream at its last entry: trimming keeps everything published after this.

    `holds` fills as it goes, so a failure half-way still releases what was held."""
    holds = {} if holds is None else holds
    expires = int(time.time() * 1000) + HOLD_TTL_MS
    for stream in streams:
        try:
            last = reply_text(client.xinfo_stream(stream)["last-generated-id"])
        except redis.ResponseError:
            last = "0-0"  # no stream yet: every entry to come is after the snapshot
        client.hset(keys.holds_key(stream), holder, f"{last} {expires}")
        client.pexpire(keys.holds_key(stream), HOLD_TTL_MS)
        holds[stream] = last
    return holds


def _release(client: redis.Redis, holds: dict[str, str], holder: str) -> None:
    for stream in holds:
        try:
            client.hdel(keys.holds_key(stream), holder)
        except redis.RedisError as exc:  # it expires by itself
            log.warning("could not release the hold on %s: %s", stream, exc)


def _wait_for_bridge(dsn: str, slot: str, position: Lsn, timeout_s: float, say: Callable[[str], None]) -> None:
    """Until the bridge's slot has confirmed `position`: every commit before it is then in Redis."""
    deadline = time.monotonic() + timeout_s
    announced = False
    with psycopg.connect(dsn, autocommit=True, connect_timeout=10) as conn:
        while True:
            row = conn.execute(
                "SELECT confirmed_flush_lsn - '0/0'::pg_lsn FROM pg_replication_slots WHERE slot_name = %s", (slot,)
            ).fetchone()
            if row is None:
                raise ConfigError(f"the bridge's slot {slot!r} does not exist",
                                  hint="run cdc init and cdc run with the same config first")
            confirmed = Lsn(int(row[0] or 0))
            if confirmed >= position:
                return
            if time.monotonic() > deadline:
                raise TransientError(
                    f"the bridge has published up to {confirmed}, not yet up to the snapshot at {position}",
                    hint="is cdc run running? raise reconcile.wait_for_bridge_s if it is far behind",
                )
            if not announced:
                say(f"waiting for the bridge to publish up to {position} (at {confirmed})")
                announced = True
            time.sleep(0.2)  # polling the slot's confirmed position: the bridge advances it


def _record(conn: psycopg.Connection, result: SpecResult, outcome: ResetOutcome, started: float, dry_run: bool) -> None:
    spec = result.spec
    report = outcome.drift.as_json(spec.key_columns)
    with conn.transaction():
        run_id = conn.execute(
            "INSERT INTO cdc_reconcile_runs (spec, consumer, position, snapshot, started_at, dry_run, status, reason, "
            "source_rows, truth_keys, keys_compared, keys_drifted, caught_up, replayed, report) "
            "VALUES (%s, %s, %s, %s, to_timestamp(%s), %s, %s, %s, %s, %s, %s, %s, %s, %s, %s) RETURNING id",
            (spec.name, outcome.consumer, int(result.position), result.snapshot, started, dry_run, outcome.status,
             outcome.reason, result.source_rows, result.truth_keys, outcome.drift.keys_compared,
             outcome.drift.keys_drifted, outcome.caught_up, outcome.replayed, orjson.dumps(report).decode()),
        ).fetchone()[0]
        if outcome.drift.drifted:
            with conn.cursor().copy("COPY cdc_drift (run_id, key, value, expected, actual, difference) FROM STDIN") as copy:
                for d in outcome.drift.drifted:
                    j = d.as_json(spec.key_columns)
                    copy.write_row((run_id, orjson.dumps(j["key"]).decode(), d.column, j["expected"], j["actual"],
                                    j["difference"]))


JOB_TABLES = ("cdc_checkpoints", "cdc_reset_fences", "cdc_reconcile_runs", "cdc_drift")


def _state_dsn(settings: Settings, target: ConsumerTarget) -> str:
    return target.state_dsn or settings.reconcile.state_dsn or settings.postgres.dsn


def _check_state_database(spec: ReconcileSpec, target: ConsumerTarget, state_dsn: str) -> None:
    """Fail before the long read when a consumer's state database lacks a table the reset needs,
    or its state table lacks a key, value or scope column."""
    wanted = (*JOB_TABLES, target.table)
    try:
        with psycopg.connect(state_dsn, autocommit=True, connect_timeout=10) as conn:
            found = conn.execute("SELECT t, to_regclass(t) IS NOT NULL FROM unnest(%s::text[]) AS t", (list(wanted),)).fetchall()
            missing = [t for t, present in found if not present]
            if missing:
                raise ConfigError(f"{target.where}: consumer {target.name}'s state database has no table {', '.join(missing)}",
                                  hint="run what cdc sql --file 20_consumer_state.sql prints there (and create the consumer's state table)")
            columns = _columns_of(conn, ".".join(quote_ident(part) for part in target.table.split(".")))
    except psycopg.Error as exc:
        raise classify_pg_error(exc) from None
    needed = [*spec.key_columns, *(a.name for a in spec.values), *(k for k, _ in target.scope)]
    absent = [c for c in needed if c not in columns]
    if absent:
        raise ConfigError(f"{target.where}: consumer {target.name}'s state table {target.table} has no column "
                          f"{', '.join(absent)}", hint=f"its columns: {', '.join(columns)}")


def _columns_of(conn: psycopg.Connection, relation_sql: str) -> list[str]:
    """The column names of a table or subquery, read without reading a row."""
    return [d.name for d in conn.execute(f"SELECT * FROM {relation_sql} LIMIT 0").description]


def _check_source(settings: Settings, spec: ReconcileSpec) -> None:
    """Fail before Spark starts when the source table, query or a column the spec names is not in the
    live database, naming the spec's line."""
    from .truth import source_from  # pure SQL text: no pyspark

    try:
        with psycopg.connect(settings.postgres.dsn, autocommit=True, connect_timeout=10) as conn:
            if spec.table is not None and conn.execute("SELECT to_regclass(%s)", (spec.table,)).fetchone()[0] is None:
                raise ConfigError(f"{spec.source_where}: source.table {spec.table} does not exist in the source database",
                                  hint="fix source.table (schema.table), or create the table")
            if spec.query is not None:
                _refuse_volatile_calls(conn, spec)
            try:
                with conn.transaction():
                    conn.execute("SET TRANSACTION READ ONLY")
                    columns = _columns_of(conn, source_from(spec))
            except psycopg.errors.ReadOnlySqlTransaction as exc:
                raise ConfigError(f"{spec.source_where}: source.query: {str(exc).splitlines()[0]}",
                                  hint="the query must only read: SELECT ... FROM ...") from None
            except psycopg.errors.InsufficientPrivilege as exc:
                raise ConfigError(f"{spec.source_where}: {str(exc).splitlines()[0]}",
                                  hint="grant SELECT on the source to the reconciliation's role") from None
            except (psycopg.errors.SyntaxError, psycopg.errors.UndefinedColumn, psycopg.errors.UndefinedTable,
                    psycopg.errors.UndefinedFunction) as exc:
                raise ConfigError(f"{spec.source_where}: source.query: {str(exc).splitlines()[0]}",
                                  hint="the query must run on its own: SELECT ... FROM ...") from None
    except psycopg.OperationalError as exc:
        raise classify_pg_error(exc) from None
    named = [(c, spec.group_by_where) for c in spec.group_by]
    named += [(a.column, a.where) for a in spec.values if a.column]
    if spec.partition_column:
        named.append((spec.partition_column, spec.partition_where))
    for column, place in named:
        if column not in columns:
            raise ConfigError(f"{place}: the source ({spec.table or 'source.query'}) has no column {column!r}",
                              hint=f"its columns: {', '.join(columns)}")


def _refuse_volatile_calls(conn: psycopg.Connection, spec: ReconcileSpec) -> None:
    """A source.query may call no volatile function or operator: those are the ones that can have side
    effects (write WAL, change sequences or settings, sleep), which a READ ONLY transaction does not stop."""
    from ..operator_sql import check_select, volatile_calls

    volatile = volatile_calls(conn, check_select(spec.query, f"{spec.source_where}: source.query"))
    if volatile:
        raise ConfigError(f"{spec.source_where}: source.query calls {', '.join(volatile)}, which may change the database "
                          "(a volatile function)",
                          hint="read with plain SELECT expressions and immutable or stable functions (count, sum, lower, ...)")


#: per consumer: its target, its entity's streams, its apply function and its entity's table ("schema.table")
Targets = list[tuple[ConsumerTarget, list[str], Apply, str]]


def preflight(settings: Settings, mappings: Sequence[Mapping], spec: ReconcileSpec) -> Targets:
    """Check what can be checked before the long read: the source table or query and every column
    the spec names, against the live database; each consumer's mapping, apply function and state
    database. Returns, per consumer, its streams and apply function (what `reconcile_spec` runs)."""
    by_entity = {m.entity: m for m in mappings}
    _check_source(settings, spec)
    targets = []
    for target in spec.consumers:
        if target.entity not in by_entity:
            raise ConfigError(f"{target.where}: no mapping for entity {target.entity!r}",
                              hint=f"entities: {', '.join(sorted(by_entity))}")
        mapping = by_entity[target.entity]
        targets.append((target, mapping.stream_keys(), load_callable(target.handler), mapping.qualified_table))
        _check_state_database(spec, target, _state_dsn(settings, target))
    return targets


def reconcile_spec(
    settings: Settings,
    spec: ReconcileSpec,
    targets: Targets,
    spark,
    *,
    dry_run: bool = False,
    say: Callable[[str], None] = lambda line: None,
    progress: Callable[[int, int], None] | None = None,
) -> SpecResult:
    """Run one spec end to end, for the consumers `preflight` checked; the result says, per
    consumer, what was found and done."""
    started_wall, started = time.time(), time.monotonic()
    result = SpecResult(spec)
    all_streams = sorted({s for _, streams, _, _ in targets for s in streams})
    dsn = settings.postgres.dsn
    client = connect_redis(settings.redis)
    holder = f"reconcile:{spec.name}:{uuid.uuid4().hex[:8]}"
    holds: dict[str, str] = {}
    try:
        resyncing = _resyncing(client, settings.postgres.slot)  # before the snapshot
        _hold(client, all_streams, holder, holds)
        truth = _read_truth(dsn, spec, spark, result, say, progress)
        with truth:  # its rows spill to a temporary file: remove it when done
            result.source_rows, result.truth_keys = truth.source_rows, len(truth)
            result.partitions, result.skipped_null_keys = truth.partitions, truth.skipped_null_keys
            rate = result.source_rows / result.read_seconds if result.read_seconds else 0
            say(f"{spec.name}: read {result.source_rows} rows in {truth.partitions} partition(s) in "
                f"{result.read_seconds:.1f}s ({rate:,.0f} rows/s): {len(truth)} keys")
            if truth.skipped_null_keys:
                say(f"{spec.name}: {truth.skipped_null_keys} source rows have a null key and belong to no state row")
            _wait_for_bridge(settings.postgres.slot_dsn or dsn, settings.postgres.slot, result.position,
                             settings.reconcile.wait_for_bridge_s, say)  # where the slot lives
            resyncing.update(_resyncing(client, settings.postgres.slot))  # after it
            for target, streams, apply, table in targets:
                refused = _resync_refusal(client, table, streams, holds, int(result.position), resyncing)
                outcome = _reset_target(settings, client, spec, target, streams, apply, holds, truth, result,
                                        started_wall, dry_run, refused)
                result.outcomes.append(outcome)
                say(f"{spec.name}: consumer {target.name}: {describe(outcome)}")
    except redis.ConnectionError as exc:
        raise TransientError(f"redis unavailable: {exc}") from None
    except redis.RedisError as exc:
        raise CdcError(f"redis refused: {exc}", hint="the reconciliation's redis user needs xinfo, xrange, xpending, hset, hdel") from None
    finally:
        try:
            _release(client, holds, holder)
        finally:
            client.close()
    result.seconds = time.monotonic() - started
    return result


def _read_truth(dsn: str, spec: ReconcileSpec, spark, result: SpecResult, say: Callable[[str], None],
                progress: Callable[[int, int], None] | None):
    """Export a snapshot, read the spec's source in it with Spark: the truth (its position in `result`)."""
    from .truth import compute_truth, describe_source, partition_bounds

    with ExportedSnapshot(dsn) as snap:
        result.position, result.snapshot = snap.position, snap.name
        say(f"{spec.name}: snapshot {snap.name} at position {snap.position}")
        try:
            with psycopg.connect(dsn, autocommit=True, connect_timeout=10) as ref:
                reference = import_snapshot(ref, snap.name)
                types = describe_source(ref, spec)
                bounds = partition_bounds(ref, spec)
                ref.execute("COMMIT")
        except psycopg.Error as exc:
            raise classify_pg_error(exc) from None
        t0 = time.monotonic()
        truth = compute_truth(spark, spec, dsn, snap.name, reference, bounds, types, progress)
        result.read_seconds = time.monotonic() - t0
    return truth


def _resyncing(client: redis.Redis, slot: str) -> dict[str, str]:
    """The tables the bridge of `slot` is resyncing now (`on_unaccountable: resync`): "schema.table" -> cause."""
    out = {}
    for table, record in client.hgetall(keys.resync_key(slot)).items():
        try:
            cause = str(json.loads(record).get("cause", ""))
        except (ValueError, AttributeError):
            cause = ""
        out[reply_text(table)] = cause
    return out


def _resync_refusal(client: redis.Redis, table: str, streams: Sequence[str], holds: dict[str, str], position: int,
                    resyncing: dict[str, str]) -> str:
    """Why no reset of a consumer of `table` from the snapshot at `position` can be exact, or "": its table was
    resyncing when the snapshot was taken (in the bridge's record before or after it, or a resync marker in its
    streams after the hold and before the snapshot). The snapshot then holds rows the stream brings only later,
    with the online backfill's `r` rows after the position: truth plus what the consumer applies after it would
    count them twice."""
    cause = resyncing.get(table)
    if cause is None:
        for stream in streams:
            hold = holds.get(stream, "0-0")
            start = "-" if parse_stream_id(hold) == (0, 0) else "(" + hold
            for e in read_range(client, stream, start, on_foreign=lambda error: None):
                if e.lsn >= position:
                    break
                if e.op == "x" and isinstance(e.data, dict) and e.data.get("resync") is True:
                    cause = str(e.data.get("cause", ""))
            if cause is not None:
                break
    if cause is None:
        return ""
    return (f"table {table} was being resynced at the snapshot ({cause or 'on_unaccountable: resync'}): its stream "
            "is rebuilt by an online backfill after the snapshot's position, so no reset from this snapshot is exact; "
            "nothing changed; run the reconciliation again once cdc status shows it streaming")


def _reset_target(settings: Settings, client, spec: ReconcileSpec, target, streams, apply, holds: dict[str, str],
                  truth, result: SpecResult, started_wall: float, dry_run: bool, refused: str = "") -> ResetOutcome:
    """Compare one consumer's state with the truth and reset it (unless `dry_run`); the run recorded. `refused`:
    why no reset can be exact, recorded as the outcome with nothing compared or changed."""
    try:
        with psycopg.connect(_state_dsn(settings, target), autocommit=True, connect_timeout=10) as conn:
            if refused:
                outcome = ResetOutcome(target.name, status="failed", reason=refused)
                _record(conn, result, outcome, started_wall, dry_run)
                return outcome
            outcome = reset_consumer(
                conn, client, spec, target, streams, int(result.position), holds, truth, apply,
                dry_run=dry_run, lock_timeout_s=settings.reconcile.lock_timeout_s,
            )
            _record(conn, result, outcome, started_wall, dry_run)
            return outcome
    except psycopg.errors.UndefinedTable as exc:
        raise ConfigError(f"{target.where}: {str(exc).splitlines()[0]}",
                          hint="create the consumer's tables (cdc sql --file 20_consumer_state.sql) in its state database") from None
    except psycopg.errors.LockNotAvailable:
        raise TransientError(f"consumer {target.name}: its checkpoint rows stayed locked for "
                             f"{settings.reconcile.lock_timeout_s:.0f}s", hint="run the reconciliation again") from None
    except psycopg.Error as exc:
        raise classify_pg_error(exc) from None


def describe(outcome: ResetOutcome) -> str:
    behind = sum(1 for p in outcome.streams if p.behind)
    where = f"{behind} of {len(outcome.streams)} stream(s) behind the snapshot"
    moved = (f"{outcome.caught_up} entries caught up, {outcome.replayed} replayed, "
             f"consumer paused {outcome.locked_seconds:.2f}s while its checkpoints were locked")
    drift = outcome.drift
    found = "no drift" if drift.clean else f"{drift.keys_drifted} of {drift.keys_compared} keys drifted"
    verdict = {
        "clean": "exact",
        "repaired": "repaired",
        "drift": "NOT repaired (dry run)",
        "stale": f"skipped: {outcome.reason}",
        "failed": f"NOT repaired: {outcome.reason}",
        "never": outcome.reason,
    }[outcome.status]
    if outcome.status == "never" or (outcome.status == "failed" and not outcome.streams):  # nothing compared
        return verdict
    return f"{found} ({where}; {moved}): {verdict}"
