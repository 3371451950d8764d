"""Resetting a consumer's state to the truth, exactly, wherever the consumer is in its streams.

The truth is as of a position P (see `cdc.reconcile.exported_snapshot`): it contains every
transaction whose commit LSN is below P, and none at or after it. A consumer's
state must become truth(P) plus the contributions of the entries after P that it
has applied, and its checkpoints must say so. Everything happens in one
transaction in the consumer's state database, holding the consumer's checkpoint
rows (`cdc.consume.checkpoint` takes the same row locks, in the same order, for each
batch), so the consumer pauses for the length of the reset and resumes exactly
after it. Per stream, with the checkpoint at position C:

* behind (C < P): the entries the group still needs (pending or not yet
  delivered) with a position after C and an LSN below P are applied first, as the
  consumer itself would (*catch-up*), so that the state being compared is the
  state at P; the checkpoint then moves to P, so the consumer skips what the
  truth already holds and applies everything from P on.
* at or ahead (C >= P): the entries from P up to C are re-read from the stream
  and applied on top of the truth (*replay*), with the consumer's own apply
  function. A hold set before the snapshot was taken keeps them from being
  trimmed; if any entry after the hold was deleted anyway, the reset is refused
  instead of being inexact.

The result (truth plus replay) is compared with the state (after catch-up): the
difference is the drift. The comparison runs in the database (the state is set
aside in a temporary table first), and only the keys that differ come back. With drift and not a dry run, the result replaces the
state and the checkpoints move, in that one transaction; otherwise the state is
left exactly as it was. A fence per consumer (the position of the last reset)
refuses a reset from an older snapshot once a newer one has been applied.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import psycopg
import redis
from psycopg import sql

from ..consume.checkpoint import Apply, lock_checkpoints
from .drift import DriftReport, compare
from ..errors import CdcError
from ..source.lsn import lsn_text
from ..sink.entry import Entry, next_stream_id, parse_stream_id, reply_text
from .spec import ConsumerTarget, ReconcileSpec
from ..consume.replay import read_range

__all__ = ["ResetOutcome", "StreamPlan", "plan_stream", "reset_consumer"]

log = logging.getLogger("cdc.reset")

_FENCE_ENSURE = "INSERT INTO cdc_reset_fences (consumer) VALUES (%s) ON CONFLICT DO NOTHING"
_FENCE_LOCK = "SELECT position FROM cdc_reset_fences WHERE consumer = %s FOR UPDATE"
_FENCE_SET = "UPDATE cdc_reset_fences SET position = %s, applied_at = now() WHERE consumer = %s"
_SAVE = "UPDATE cdc_checkpoints SET entry_id = %s, lsn = %s, seq = %s, updated_at = now() WHERE consumer = %s AND stream = %s"

Position = tuple[int, int]

_ACTUAL = sql.Identifier("cdc_reset_actual")
_TRUTH = sql.Identifier("cdc_reset_truth")


class TruthRows(Protocol):
    """The truth per key: `cdc.reconcile.truth.Truth`, or a dict of key tuple -> values tuple."""

    def items(self) -> Iterable[tuple[tuple, tuple]]: ...


@dataclass
class StreamPlan:
    """What the reset does on one stream."""

    stream: str
    checkpoint: Position
    entry_id: str
    catch_up: list[Entry] = field(default_factory=list)
    replay: list[Entry] = field(default_factory=list)
    behind: bool = False  # the checkpoint was before the snapshot's position
    lost: str | None = None  # why the replay cannot be exact


@dataclass
class ResetOutcome:
    consumer: str
    status: str = "clean"  # clean | repaired | drift (not repaired: dry run) | stale | failed | never (consumed)
    reason: str = ""
    drift: DriftReport = field(default_factory=DriftReport)
    streams: list[StreamPlan] = field(default_factory=list)
    locked_seconds: float = 0.0  # how long the consumer's checkpoint rows were held

    @property
    def caught_up(self) -> int:
        return sum(len(p.catch_up) for p in self.streams)

    @property
    def replayed(self) -> int:
        return sum(len(p.replay) for p in self.streams)

    @property
    def unrepaired(self) -> bool:
        return self.status in ("drift", "failed")


def _group_view(client: redis.Redis, stream: str, group: str) -> tuple[tuple[int, int] | None, set[str]]:
    """(last-delivered ID, pending IDs) of `group` on `stream`; (None, ∅) when the group does not exist."""
    try:
        groups = client.xinfo_groups(stream)
    except redis.ResponseError:
        return None, set()
    for g in groups:
        if reply_text(g["name"]) != group:
            continue
        last = parse_stream_id(g["last-delivered-id"])
        pending: set[str] = set()
        start = "-"
        while g["pending"]:
            page = client.xpending_range(stream, group, min=start, max="+", count=10_000)
            if not page:
                break
            for p in page:
                pending.add(reply_text(p["message_id"]))
            start = next_stream_id(page[-1]["message_id"])
            if len(page) < 10_000:
                break
        return last, pending
    return None, set()


def _deliver_up_to(client: redis.Redis, stream: str, group: str, position: int) -> None:
    """After a reset to `position`, count every entry before it as delivered to `group` (the checkpoint makes the
    consumer skip them anyway): entries deleted from that part of the stream meanwhile are the reset's to account
    for, so the consumer's check for removed entries no longer stops it there. The group only moves forward."""
    try:  # the group's position only: its pending entries (`_group_view`) do not matter here
        groups = client.xinfo_groups(stream)
    except redis.ResponseError:
        return
    last = next((parse_stream_id(g["last-delivered-id"]) for g in groups if reply_text(g["name"]) == group), None)
    if last is None:
        return
    start = f"{last[0]}-{last[1]}"
    beyond = None
    while beyond is None:
        page = client.xrange(stream, min="(" + start, max="+", count=1000)
        for entry_id, fields in page:
            lsn, seq = fields.get(b"lsn"), fields.get(b"seq")
            if lsn is not None and seq is not None and (int(lsn), int(seq)) > (position, -1):
                beyond = parse_stream_id(entry_id)
                break
        if beyond is not None or len(page) < 1000:
            break
        start = reply_text(page[-1][0])
    if beyond is None:
        target = reply_text(client.xinfo_stream(stream)["last-generated-id"])
    else:
        ms, seq_ = beyond
        target = f"{ms}-{seq_ - 1}" if seq_ > 0 else f"{ms - 1}-18446744073709551615"
    if parse_stream_id(target) > last:
        client.xgroup_setid(stream, group, target)


def plan_stream(
    client: redis.Redis, stream: str, group: str, checkpoint: Position, entry_id: str, position: int, hold: str,
) -> StreamPlan:
    """Read what one stream contributes to the reset: catch-up entries (behind) or replay entries (ahead)."""
    start_of_p: Position = (position, -1)
    behind = checkpoint < start_of_p
    plan = StreamPlan(stream, checkpoint, entry_id, behind=behind)
    try:
        info = client.xinfo_stream(stream)
    except redis.ResponseError:
        return plan  # no stream yet: nothing was published, nothing to read
    delivered, pending = (None, set())
    if behind:
        delivered, pending = _group_view(client, stream, group)
        if delivered is None:
            return plan  # no group yet: it has consumed nothing, and will read everything itself
        start = min([delivered] + [parse_stream_id(p) for p in pending])
    else:
        start = parse_stream_id(hold)
        deleted = info.get("max-deleted-entry-id")
        if deleted is not None and parse_stream_id(deleted) > start:
            plan.lost = (f"{stream}: entries after the snapshot were deleted (up to {reply_text(deleted)}), "
                         "so the entries the consumer applied after it cannot be re-read")
            return plan
    running_catch = checkpoint
    running_replay = start_of_p
    for e in read_range(client, stream, f"{start[0]}-{start[1]}", page=10_000):
        if b"replay_for" in e.fields:
            continue  # a dead letter sent back: applied once by its consumer, outside of positions
        pos = e.position
        if e.lsn < position:
            if behind and pos > running_catch and (e.id in pending or parse_stream_id(e.id) > delivered):
                plan.catch_up.append(e)
                running_catch = pos
        elif pos <= checkpoint and pos > running_replay:
            plan.replay.append(e)
            running_replay = pos
    return plan


def _table(target: ConsumerTarget) -> sql.Identifier:
    return sql.Identifier(*target.table.split("."))


def _columns(names: Iterable[str]) -> sql.Composable:
    return sql.SQL(", ").join(sql.Identifier(c) for c in names)


def _in_scope(target: ConsumerTarget) -> sql.Composable:
    """The WHERE condition selecting the consumer's rows (its scope columns' values)."""
    conditions = [sql.SQL("{} = {}").format(sql.Identifier(c), sql.Literal(v)) for c, v in target.scope]
    return sql.SQL(" AND ").join(conditions) if conditions else sql.SQL("TRUE")


#: the position of a checkpoint that never moved (cdc_checkpoints' defaults)
NEVER = (0, -1)


def _has_state(conn: psycopg.Connection, target: ConsumerTarget) -> bool:
    return conn.execute(sql.SQL("SELECT EXISTS (SELECT 1 FROM {} WHERE {})").format(
        _table(target), _in_scope(target))).fetchone()[0]


def _set_aside(conn: psycopg.Connection, target: ConsumerTarget, key_cols: Sequence[str], value_cols: Sequence[str]) -> None:
    """Copy the consumer's state to a temporary table (dropped at commit or with the savepoint)."""
    conn.execute(sql.SQL("CREATE TEMP TABLE {} ON COMMIT DROP AS SELECT {} FROM {} WHERE {}").format(
        _ACTUAL, _columns((*key_cols, *value_cols)), _table(target), _in_scope(target)))


def _differences(conn: psycopg.Connection, target: ConsumerTarget, key_cols: Sequence[str], value_cols: Sequence[str],
                 ) -> tuple[dict, dict, int]:
    """The state now (expected) against the state set aside (actual), in the database.

    Returns only the keys that may differ (missing on a side, or a value distinct),
    as two dicts, and how many keys were compared in all: the driver holds the
    drift, not every key.
    """
    keys, n = _columns(key_cols), len(key_cols)

    def side(table: sql.Composable, where: sql.Composable) -> sql.Composable:
        return sql.SQL("SELECT {}, {}, true AS cdc_present FROM {} WHERE {}").format(keys, _columns(value_cols), table, where)

    def values_of(alias: str) -> sql.Composable:
        return sql.SQL(", ").join(sql.Identifier(alias, c) for c in value_cols)

    query = sql.SQL(
        "SELECT {keys}, a.cdc_present, {a_values}, s.cdc_present, {s_values} "
        "FROM ({actual}) a FULL JOIN ({state}) s USING ({keys}) "
        "WHERE a.cdc_present IS NULL OR s.cdc_present IS NULL OR {differs}"
    ).format(
        keys=keys, a_values=values_of("a"), s_values=values_of("s"),
        actual=side(_ACTUAL, sql.SQL("TRUE")), state=side(_table(target), _in_scope(target)),
        differs=sql.SQL(" OR ").join(
            sql.SQL("{} IS DISTINCT FROM {}").format(sql.Identifier("a", c), sql.Identifier("s", c)) for c in value_cols),
    )
    expected: dict[tuple, tuple] = {}
    actual: dict[tuple, tuple] = {}
    m = len(value_cols)
    for row in conn.execute(query):
        key = tuple(row[:n])
        if row[n]:
            actual[key] = tuple(row[n + 1:n + 1 + m])
        if row[n + 1 + m]:
            expected[key] = tuple(row[n + 2 + m:])
    union = sql.SQL("SELECT count(*) FROM (SELECT {keys} FROM {actual} UNION SELECT {keys} FROM {table} WHERE {scope}) u").format(
        keys=keys, actual=_ACTUAL, table=_table(target), scope=_in_scope(target))
    compared = int(conn.execute(union).fetchone()[0])
    return expected, actual, compared


def _stage_truth(conn: psycopg.Connection, target: ConsumerTarget, key_cols: Sequence[str], value_cols: Sequence[str],
                 truth: TruthRows) -> None:
    """Load the truth into a temporary table before anything is locked: the consumer need not wait for it."""
    cols = _columns((*key_cols, *value_cols))
    conn.execute(sql.SQL("DROP TABLE IF EXISTS {}").format(_TRUTH))
    conn.execute(sql.SQL("CREATE TEMP TABLE {} AS SELECT {} FROM {} WITH NO DATA").format(_TRUTH, cols, _table(target)))
    with conn.cursor().copy(sql.SQL("COPY {} ({}) FROM STDIN").format(_TRUTH, cols)) as copy:
        for key, values in truth.items():
            copy.write_row((*key, *values))


def _write_truth(conn: psycopg.Connection, target: ConsumerTarget, key_cols: Sequence[str], value_cols: Sequence[str]) -> None:
    """The consumer's rows become the staged truth."""
    conn.execute(sql.SQL("DELETE FROM {} WHERE {}").format(_table(target), _in_scope(target)))
    cols = _columns((*key_cols, *value_cols))
    conn.execute(sql.SQL("INSERT INTO {} ({}) SELECT {} FROM {}").format(
        _table(target),
        _columns((*(c for c, _ in target.scope), *key_cols, *value_cols)),
        sql.SQL(", ").join([*(sql.Literal(v) for _, v in target.scope), cols]),
        _TRUTH,
    ))


def reset_consumer(
    conn: psycopg.Connection,
    client: redis.Redis,
    spec: ReconcileSpec,
    target: ConsumerTarget,
    streams: Iterable[str],
    position: int,
    holds: dict[str, str],
    truth: TruthRows,
    apply: Apply,
    *,
    dry_run: bool = False,
    lock_timeout_s: float = 60.0,
) -> ResetOutcome:
    """Compare one consumer's state with truth(position) and, unless `dry_run`, make it exact."""
    outcome = ResetOutcome(target.name)
    locked_at = None
    _stage_truth(conn, target, spec.key_columns, [a.name for a in spec.values], truth)
    try:
        with conn.transaction():
            conn.execute(f"SET LOCAL lock_timeout = '{int(lock_timeout_s * 1000)}ms'")
            conn.execute(_FENCE_ENSURE, (target.name,))
            fence = int(conn.execute(_FENCE_LOCK, (target.name,)).fetchone()[0])
            if fence >= position:
                outcome.status = "stale"
                outcome.reason = f"a reset from a newer snapshot (position {lsn_text(fence)}) was applied already"
                return outcome
            locked_at = time.monotonic()
            _reset_locked(conn, client, spec, target, sorted(streams), position, holds, apply, dry_run, outcome)
        if outcome.status == "repaired":
            for stream in sorted(streams):
                _deliver_up_to(client, stream, target.name, position)
    finally:
        if locked_at is not None:  # how long the consumer's batches had to wait
            outcome.locked_seconds = time.monotonic() - locked_at
        try:
            conn.execute(sql.SQL("DROP TABLE IF EXISTS {}").format(_TRUTH))
        except psycopg.Error:
            pass  # the connection is gone, and its temporary table with it
    return outcome


def _reset_locked(
    conn: psycopg.Connection, client: redis.Redis, spec: ReconcileSpec, target: ConsumerTarget, streams: list[str],
    position: int, holds: dict[str, str], apply: Apply, dry_run: bool,
    outcome: ResetOutcome,
) -> None:
    """Under the fence's lock: lock the checkpoints, plan every stream, then compare and repair."""
    checkpoints = lock_checkpoints(conn, target.name, streams)
    if all(mark == NEVER for _, mark, _ in checkpoints.values()) and not _has_state(conn, target):
        outcome.status = "never"
        outcome.reason = (f"never consumed: no checkpoint in cdc_checkpoints and no state in {target.table}; "
                          f"nothing compared (start it: cdc consume --group {target.group} --handler {target.handler})")
        return
    for stream in streams:
        eid, mark, _ = checkpoints[stream]
        outcome.streams.append(plan_stream(client, stream, target.group, mark, eid, position, holds.get(stream, "0-0")))
    lost = [p.lost for p in outcome.streams if p.lost]
    if lost:
        outcome.status = "failed"
        outcome.reason = "; ".join(lost) + "; run the reconciliation again"
        return
    try:
        _compare_and_repair(conn, spec, target, outcome, position, apply, dry_run)
    except (psycopg.Error, CdcError):
        raise
    except Exception as exc:  # the consumer's apply function refused an entry: report, keep the state
        outcome.status = "failed"
        outcome.reason = f"its apply function {target.handler} failed: {type(exc).__name__}: {exc}"
        return
    if not dry_run and outcome.status in ("repaired", "clean"):
        conn.execute(_FENCE_SET, (position, target.name))


def _compare_and_repair(
    conn: psycopg.Connection, spec: ReconcileSpec, target: ConsumerTarget, outcome: ResetOutcome, position: int,
    apply: Apply, dry_run: bool,
) -> None:
    """Inside a savepoint: catch up, measure, build truth + replay, compare; keep it only to repair."""
    key_cols = spec.key_columns
    value_cols = [a.name for a in spec.values]
    with conn.transaction():  # a savepoint: kept only when the state is repaired
        catch_up = [e for p in outcome.streams for e in p.catch_up]
        if catch_up:
            apply(conn, catch_up, target.name)
        _set_aside(conn, target, key_cols, value_cols)
        _write_truth(conn, target, key_cols, value_cols)
        replay = [e for p in outcome.streams for e in p.replay]
        if replay:
            apply(conn, replay, target.name)
        expected, actual, compared = _differences(conn, target, key_cols, value_cols)
        outcome.drift = compare(expected, actual, spec.values)
        outcome.drift.keys_compared = compared  # the keys left out above are identical
        if outcome.drift.clean or dry_run:
            outcome.status = "clean" if outcome.drift.clean else "drift"
            raise psycopg.Rollback()
        for p in outcome.streams:
            last = p.catch_up[-1] if p.catch_up else None
            mark = last.position if last else p.checkpoint
            if mark < (position, -1):
                conn.execute(_SAVE, (last.id if last else p.entry_id, position, -1, target.name, p.stream))
            elif last is not None:
                conn.execute(_SAVE, (last.id, last.lsn, last.seq, target.name, p.stream))
        outcome.status = "repaired"

