"""The ack gate: the slot moves past a change only once the catalog vouches for what came before it.

pgoutput sends nothing of a table the publication does not cover, judged as of each
change's WAL position. A mapped table dropped and re-created (the new one is not in the
publication), renamed, moved to another schema, removed from the publication, or a
partition detached, leaves no trace in the stream: its changes are simply absent. So
the stream alone can never justify acknowledging a position.

Instead, on the bridge's other connection, every ``batch.status_interval_s`` the gate
reads the catalog (`cdc.source.coverage`): each mapped table exists with the OID it was
bound to, the publication covers it under its name, its replica identity carries updates
and deletes, and its partitions are the ones bound. If that holds, everything received
before the reading started was committed before the reading's snapshot, so any such
event committed before it would have been seen: the slot may move up to there
(`Acknowledger.verified`). If it does not hold, the bridge stops (exit 4) with the fix,
and the slot stays at the last position a passing reading vouched for, before the first
change the bridge may have missed.

The OIDs (and partitions) bound are recorded in Redis per slot (`keys.bound_tables_key`),
so a bridge started after a table was re-created while it was stopped sees it too, and a
Relation message naming a mapped table with another OID, or a bound OID under another name,
stops it unless its transaction lies before the binding's ``since`` position (history that
a rebuild at that position already covers: `cdc recover` records the tables it rebuilt).

A partition that joins empty is bound as it is (it brings no rows; rows written through the
parent after it joined were published); one that joins holding rows written before it joined
(judged by their inserting transaction against the attaching one), or one that leaves, stops the
bridge: the rows came or went without a change.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace

import psycopg
import redis

from .. import keys
from ..errors import CdcError, MappingError, PrivilegeError, SlotError
from ..mapping.judge import changed_while_running, filter_refusal
from ..mapping.model import Mapping, mapped_columns
from ..source.coverage import (Publication, TableCoverage, identity_problem, publication_problem, read_coverage,
                               read_publication, where_is)
from ..source.catalog import table_shape
from ..source.lsn import Lsn
from ..source.pubcolumns import FILTERS_IN_BRIDGE, plan, sends_less
from ..source.replication import quote_ident

__all__ = ["Bound", "TableGate", "load_bound", "record_bound", "record_current"]

log = logging.getLogger("cdc.gate")

RECOVER = "cdc recover (rebuilds the streams from the tables), then cdc run"


@dataclass(frozen=True)
class Bound:
    """A mapped table as the bridge bound it: its OID, its partitions, and from which position on."""

    oid: int
    since: Lsn
    leaves: tuple[int, ...]

    def encode(self) -> str:
        return f"{self.oid} {int(self.since)} {','.join(map(str, self.leaves))}"

    @classmethod
    def decode(cls, text: str) -> Bound:
        oid, since, leaves = (text.split(" ") + ["", ""])[:3]
        return cls(int(oid), Lsn(int(since)), tuple(int(x) for x in leaves.split(",") if x))


def _field(table: tuple[str, str]) -> str:
    return f"{table[0]}.{table[1]}"


def load_bound(client: redis.Redis, slot: str) -> dict[tuple[str, str], Bound]:
    raw = client.hgetall(keys.bound_tables_key(slot))
    bound = {}
    for field, value in raw.items():
        schema, _, name = field.decode().partition(".")
        bound[(schema, name)] = Bound.decode(value.decode())
    return bound


def record_bound(client: redis.Redis, slot: str, bound: dict[tuple[str, str], Bound]) -> None:
    if bound:
        client.hset(keys.bound_tables_key(slot), mapping={_field(t): b.encode() for t, b in bound.items()})


def record_current(conn: psycopg.Connection, client: redis.Redis, slot: str, tables: Iterable[tuple[str, str]],
                   since: Lsn) -> None:
    """Bind `tables` as they are now, from `since` on (a rebuild's position: what lies before it, it covers)."""
    coverage = read_coverage(conn, "", tables)
    record_bound(client, slot, {t: Bound(c.oid, since, c.leaves) for t, c in coverage.items() if c.oid is not None})


class TableGate:
    """Checks the mapped tables against what was bound; raises the error that stops the bridge."""

    def __init__(self, slot: str, publication: str, mappings: Sequence[Mapping]) -> None:
        self.slot = slot
        self.publication = publication
        self.tables = sorted({m.table for m in mappings if m.table is not None})
        self.columns = mapped_columns(mappings)  # what the publication must send of each
        self.filtered = [m.entity for m in mappings if m.filter]
        self.filters = [m for m in mappings if m.filter and m.table is not None]
        self.told = False  # the start's log lines on what the bridge filters itself
        self.bound: dict[tuple[str, str], Bound] = {}
        self.by_oid: dict[int, tuple[str, str]] = {}
        self.client: redis.Redis | None = None
        self.verifications = 0

    def start(self, conn: psycopg.Connection, client: redis.Redis, confirmed: Lsn) -> None:
        """A session starts with the slot at `confirmed`: bind what was never bound, check the rest."""
        self.client = client
        self.bound = load_bound(client, self.slot) if self.tables else {}
        self.bound = {t: b for t, b in self.bound.items() if t in self.tables}
        fresh = {}
        for t in self.tables:
            if t not in self.bound:
                row = conn.execute("SELECT to_regclass(%s)::oid::int8", (f"{quote_ident(t[0])}.{quote_ident(t[1])}",)).fetchone()
                if row and row[0] is not None:
                    fresh[t] = Bound(row[0], confirmed, ())
        self.bound.update(fresh)
        self._index()
        # a table bound just now takes its partitions as they are
        self.verify(conn, adopt=set(fresh))
        record_bound(client, self.slot, {t: self.bound[t] for t in fresh})

    def _index(self) -> None:
        self.by_oid = {b.oid: t for t, b in self.bound.items()}

    def verify(self, conn: psycopg.Connection, adopt: set[tuple[str, str]] = frozenset()) -> None:
        """One reading of the catalog; raises `SlotError` (exit 4) with the fix when it does not vouch."""
        self.verifications += 1
        if not self.tables:
            return
        publication = read_publication(conn, self.publication)
        coverage = read_coverage(conn, self.publication, self.tables)
        changed = {}
        for t in self.tables:
            bound, now = self.bound.get(t), coverage[t]
            self._judge(conn, t, bound, now, publication)
            problem = sends_less(now, self.columns.get(t, ()), self.publication, self.slot)
            if problem is not None:
                raise problem
            if now.partitioned:
                self._partition_identities(conn, t)
            if t in adopt:
                changed[t] = replace(bound, leaves=now.leaves)
            elif now.leaves != bound.leaves:
                changed[t] = self._partitions(conn, t, bound, now)
        if not self.told:
            self._tell(publication, coverage)
        if changed:
            self.bound.update(changed)
            if self.client is not None:
                record_bound(self.client, self.slot, {t: b for t, b in changed.items() if t not in adopt})

    def _partition_identities(self, conn: psycopg.Connection, t: tuple[str, str]) -> None:
        """A partition of a partitioned table no longer carrying a filter's column: the server describes the table
        by its parent's replica identity, so only the catalog tells (`cdc.mapping.judge`)."""
        mappings = [m for m in self.filters if m.table == t]
        shape = table_shape(conn, *t) if mappings else None
        if shape is None or not shape.partial_leaf:
            return
        for m in mappings:
            problem = filter_refusal(m, shape)
            if problem is not None:
                raise changed_while_running(problem, self.slot)

    def _tell(self, publication: Publication, coverage: dict[tuple[str, str], TableCoverage]) -> None:
        """Say once where the server cannot leave out what no mapping reads, so the bridge does it."""
        self.told = True
        for t in self.tables:
            reason = plan(coverage[t], self.columns.get(t, ()), publication).reason
            if reason is not None:
                log.info("publication %s sends every column of %s (%s): the bridge drops the unmapped ones",
                         self.publication, _field(t), reason)
        if self.filtered:
            log.info("entities %s: %s", ", ".join(self.filtered), FILTERS_IN_BRIDGE)

    def _judge(self, conn: psycopg.Connection, t: tuple[str, str], bound: Bound | None, now: TableCoverage,
               publication: Publication) -> None:
        name = _field(t)
        if now.oid is None:
            if bound is None:
                raise MappingError(f"mapped table {name} does not exist", hint="create it first, or fix the mapping's table")
            moved = where_is(conn, bound.oid)
            what = f"renamed or moved: it is now {moved}," if moved else "dropped:"
            raise SlotError(
                f"mapped table {name} (OID {bound.oid}) was {what} its changes since are not in the stream, "
                f"slot {self.slot} held before them",
                hint=f"{'rename it back or map ' + moved if moved else 're-create it or fix the mapping'}, "
                     f"then run: cdc init, then {RECOVER}")
        if bound is not None and now.oid != bound.oid:
            raise SlotError(
                f"mapped table {name} was dropped and re-created (OID {bound.oid}, now {now.oid}): its rows written "
                f"before it was published again were never decoded, slot {self.slot} held before the drop",
                hint=f"run: cdc init, then {RECOVER}")
        problem = publication_problem(now, publication, f"run: cdc init, then {RECOVER}")
        if problem is not None:
            raise SlotError(f"{problem.message}: its changes are not decoded, slot {self.slot} held before them",
                            hint=problem.hint)
        problem = identity_problem(now, publication)
        if problem is not None:
            raise problem

    def _partitions(self, conn: psycopg.Connection, t: tuple[str, str], bound: Bound, now: TableCoverage) -> Bound:
        """The partitions changed: empty newcomers are bound as they are; anything else stops the bridge."""
        name = _field(t)
        gone = [oid for oid in bound.leaves if oid not in now.leaves]
        if gone:
            names = ", ".join(where_is(conn, oid) or f"OID {oid} (dropped)" for oid in gone)
            raise SlotError(
                f"partition {names} left mapped table {name}: its rows left the table without delete changes, "
                f"slot {self.slot} held before that", hint=f"run: {RECOVER}")
        for oid in now.leaves:
            if oid in bound.leaves:
                continue
            leaf = where_is(conn, oid)
            if leaf is None:
                continue  # gone again since: the next reading finds it missing, and stops the bridge
            try:
                # `leaf` is format('%I.%I'): quoted already
                # rows written before it joined: by a transaction older than the one that attached it, or
                # by that one before the attach (rows written through the parent since were published)
                holds = conn.execute(
                    f"SELECT EXISTS (SELECT 1 FROM ONLY {leaf} l, pg_inherits i WHERE i.inhrelid = %s "
                    "AND (age(l.xmin) > age(i.xmin) OR (l.xmin = i.xmin AND l.cmin::text::int < i.cmin::text::int)))",
                    (oid,)).fetchone()[0]
            except psycopg.errors.InsufficientPrivilege as exc:
                raise PrivilegeError(
                    f"partition {leaf} joined mapped table {name} and role {conn.info.user} may not read it to see "
                    f"whether it brought rows: {str(exc).strip()}",
                    hint=f"run: GRANT SELECT ON TABLE {leaf} TO {conn.info.user}, then cdc run") from exc
            if holds:
                raise SlotError(
                    f"partition {leaf} joined mapped table {name} holding rows that no change published, "
                    f"slot {self.slot} held before that", hint=f"run: {RECOVER}")
            log.info("partition %s joined %s empty: bound", leaf, name)
        return replace(bound, leaves=now.leaves)

    def recorded_problems(self, conn: psycopg.Connection, client: redis.Redis) -> list[CdcError]:
        """What `cdc run` would refuse at start about the tables it bound before (for `cdc check`); changes
        nothing."""
        bound = {t: b for t, b in load_bound(client, self.slot).items() if t in self.tables}
        if not bound:
            return []
        publication = read_publication(conn, self.publication)
        coverage = read_coverage(conn, self.publication, bound)
        problems: list[CdcError] = []
        for t, b in bound.items():
            now = coverage[t]
            try:
                if now.oid != b.oid:
                    self._judge(conn, t, b, now, publication)
                elif now.leaves != b.leaves:
                    self._partitions(conn, t, b, now)
            except CdcError as exc:
                problems.append(exc)
        return problems

    def relation(self, relid: int, namespace: str, name: str, commit_lsn: int) -> None:
        """A Relation message: a mapped name with another OID, or a bound OID under another name, stops the
        bridge, unless its transaction lies before the binding (history a rebuild covers)."""
        t = (namespace or "pg_catalog", name)
        bound = self.bound.get(t)
        other = self.by_oid.get(relid)
        if (bound is None or bound.oid == relid) and (other is None or other == t):
            return
        if bound is not None and bound.oid != relid:
            if commit_lsn < bound.since:
                return
            raise SlotError(
                f"the stream names mapped table {_field(t)} with OID {relid}, not the OID {bound.oid} bound: it was "
                f"dropped and re-created, slot {self.slot} held before it", hint=f"run: cdc init, then {RECOVER}")
        was = self.bound[other]
        if commit_lsn < was.since:
            return
        raise SlotError(
            f"mapped table {_field(other)} (OID {relid}) was renamed or moved: the stream names it {_field(t)}, a name "
            f"no mapping reads, slot {self.slot} held before its changes under that name",
            hint=f"rename it back or map {_field(t)}, then run: cdc init, then {RECOVER}")
