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

The same holds for the publication's ``publish`` option: an operation it leaves out (updates
and deletes after ``SET (publish = 'insert')``, truncates without ``truncate``) that a mapping's
``ops`` publish is never decoded, and neither is a mapped partitioned table's change without
``publish_via_partition_root``. A reading that finds either stops the bridge the same way, and
records it in Redis (`GAP_FIELD`): the changes made meanwhile are in no slot, so `cdc run` refuses
until `cdc recover` rebuilt the streams, even once `cdc init` set the option back.

The OIDs (and partitions) bound are recorded in Redis per slot (`keys.bound_tables_key`),
so a bridge started after a table was re-created while it was stopped sees it too, and a
Relation message naming a mapped table with another OID, or a bound OID under another name,
stops it unless its transaction lies before the binding's ``since`` position (history that
a rebuild at that position already covers: `cdc recover` records the tables it rebuilt).

A partition that joins empty is bound as it is (it brings no rows; rows written through the
parent after it joined were published); one that joins holding rows written before it joined
(judged by their inserting transaction against the attaching one), or one that leaves, stops the
bridge: the rows came or went without a change.

A reading sees the publication only as it is at that moment: an option turned off and on again, or a
mapped table dropped from the publication and added again, between two readings (or while the bridge
is stopped) leaves it as it was, while pgoutput skipped the changes of the window. So a passing
reading records the catalog rows that decide what the publication sends of the mapped tables
(`PublicationRows`: the ``pg_publication`` row, and each table's ``pg_publication_rel`` and
``pg_publication_namespace`` rows, its partition ancestors' too, by OID and ``xmin``; `ROWS_FIELD`), and
the next reading (`cdc run` at start, the gate, `cdc check`, `cdc init` before its own changes) compares:
every change to one of them writes a new row version (a new ``xmin``, and a new OID for a member added
again; freezing keeps ``xmin`` readable), so a row changed and changed back still differs, and a gap
is recorded as above. A member dropped and added again within one transaction (what `cdc init` does to
set a column list) never left the publication: its new row was inserted after another write of that
transaction (``cmin`` above 0), and is taken as it is.

A table every mapping of which says ``on_unaccountable: resync`` is not stopped for when it is dropped,
dropped and re-created, renamed or moved, taken out of the publication, sent with fewer columns or rows than
its mappings read, or its partitions changed beyond an empty newcomer (found by a reading, by a Relation naming
it with another OID or naming its OID under another name, or by its publication rows), nor when a Relation of
it cannot be bound (a column its mappings read dropped; `TableGate.give_up`, from the session): the gate
records it in Redis (`keys.resync_key`) before the reading vouches for anything past it, writes the
``cdc.resync`` logical message on the primary (where the session decodes it, the table's streams get the
rebuild marker, op ``x``), and stops checking it; its changes are given up until a reading finds it back in
the publication as its mappings need it, binds it anew and queues an online backfill of each of its
mappings, whose last chunk clears the record (see docs/concepts/cannot-account.md).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace

import psycopg
import redis

from .. import keys
from ..errors import CdcError, MappingError, PrivilegeError, SlotError
from ..mapping.judge import changed_while_running, filter_refusal, judge
from ..mapping.model import Mapping, mapped_columns, resync_tables
from ..mapping.uniqueness import key_uniqueness_problem
from ..source.coverage import (PUBLISH, Publication, TableCoverage, identity_problem, operations_problem,
                               publication_problem, read_coverage, read_publication, where_is)
from ..source.catalog import load_types, table_shape
from ..source.lsn import Lsn
from ..source.slot_server import POSITION_SQL
from ..source.pubcolumns import FILTERS_IN_BRIDGE, plan, sends_less
from ..source.replication import quote_ident
from ..source.values import TypeCatalog
from .backfill import enqueue

__all__ = ["RESYNC_PREFIX", "Bound", "PublicationRows", "TableGate", "load_bound", "load_resync", "needed_operations",
           "read_rows", "record_bound", "record_current", "record_rows"]

log = logging.getLogger("cdc.gate")

RECOVER = "cdc recover (rebuilds the streams from the tables), then cdc run"
#: the field of `keys.bound_tables_key` recording that a reading found the publication leaving out operations
#: the mappings publish (no table's field: those hold a dot); only `cdc recover` (`record_current`) clears it
GAP_FIELD = "publish-gap"
#: the OID of the publication the bridge streamed through (one dropped and re-created has another)
PUBLICATION_FIELD = "publication-oid"
#: the catalog rows that decide what the publication sends of the mapped tables, as a passing reading found them
ROWS_FIELD = "publication-rows"
#: how a gap found in those rows starts in `GAP_FIELD`
CHANGED = "changed: "
#: the logical message marking, in the stream's order, where a `resync` table's stream gave up its changes
RESYNC_PREFIX = "cdc.resync"
#: what a resync waiting for its table says to do
RESYNC_FIX = "waiting for it to exist and be in the publication again (re-create it if dropped, then cdc init)"


def load_resync(client: redis.Redis, slot: str) -> dict[tuple[str, str], dict]:
    """The tables the bridge of `slot` is resyncing (`keys.resync_key`): table -> its record."""
    out = {}
    for field, value in client.hgetall(keys.resync_key(slot)).items():
        schema, _, name = field.decode().partition(".")
        out[(schema, name)] = json.loads(value)
    return out


def needed_operations(mappings: Iterable[Mapping]) -> dict[str, list[str]]:
    """The operations (c, u, d, t) the publication must send: op -> the entities of mapped tables whose ops hold it
    (a mapping leaving out t ignores truncates)."""
    needed: dict[str, list[str]] = {}
    for m in mappings:
        if m.table is not None:
            for op in PUBLISH:
                if op in m.ops:
                    needed.setdefault(op, []).append(m.entity)
    return needed


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
        if field in (GAP_FIELD.encode(), PUBLICATION_FIELD.encode(), ROWS_FIELD.encode()):
            continue
        schema, _, name = field.decode().partition(".")
        bound[(schema, name)] = Bound.decode(value.decode())
    return bound


def record_bound(client: redis.Redis, slot: str, bound: dict[tuple[str, str], Bound]) -> None:
    if bound:
        client.hset(keys.bound_tables_key(slot), mapping={_field(t): b.encode() for t, b in bound.items()})


# per mapped table found: the rows of pg_publication_rel (kind r, keyed by the member's OID) and
# pg_publication_namespace (kind n, keyed by the schema's OID) of the publication that cover it or a
# partition ancestor of it; and one row (no table) for the publication itself. A row is "<oid>:<xmin>";
# `again`: inserted after another write of its own transaction (cmin > 0), as when dropped and added again in it.
ROWS_QUERY = """
WITH asked(schema, name) AS (SELECT * FROM unnest(%(schemas)s::text[], %(names)s::text[])),
pub AS (SELECT oid, xmin FROM pg_publication WHERE pubname = %(pub)s),
up AS (SELECT a.schema, a.name, x.relid, xc.relnamespace
       FROM asked a JOIN pg_namespace n ON n.nspname = a.schema
       JOIN pg_class c ON c.relnamespace = n.oid AND c.relname = a.name AND c.relkind IN ('r', 'p')
       -- itself, and its partition ancestors (none for a table that is no partition)
       CROSS JOIN LATERAL (SELECT c.oid AS relid UNION SELECT relid FROM pg_partition_ancestors(c.oid)) x
       JOIN pg_class xc ON xc.oid = x.relid)
SELECT NULL, NULL, 'p', oid::text || ':' || xmin::text, false FROM pub
UNION ALL
SELECT u.schema, u.name, 'r' || r.prrelid::text, r.oid::text || ':' || r.xmin::text, r.cmin::text::int > 0
FROM up u JOIN pg_publication_rel r ON r.prrelid = u.relid AND r.prpubid = (SELECT oid FROM pub)
{schemas}
"""
# PostgreSQL 15 and later: FOR TABLES IN SCHEMA
_SCHEMA_ROWS = """UNION ALL
SELECT u.schema, u.name, 'n' || s.pnnspid::text, s.oid::text || ':' || s.xmin::text, s.cmin::text::int > 0
FROM up u JOIN pg_publication_namespace s ON s.pnnspid = u.relnamespace AND s.pnpubid = (SELECT oid FROM pub)"""


@dataclass(frozen=True)
class PublicationRows:
    """The catalog rows deciding what the publication sends of the mapped tables, by OID and xmin.

    Every change to a catalog row writes a new version of it (another xmin; a member dropped and
    added again is another row, with another OID), so a change undone is still a change.
    """

    publication: str | None  # "<oid>:<xmin>" of its pg_publication row; None: no such publication
    tables: dict[tuple[str, str], dict[str, str]]  # each mapped table found -> {"r<relid>"/"n<nspid>": "<oid>:<xmin>"}
    again: frozenset[str] = frozenset()  # rows inserted after another write of their own transaction
    #: the WAL position of the server they were read on, then (a standby holding the slot compares its own
    #: reading with them only once it replayed that far: `cdc init` records them on the primary)
    at: int | None = None

    def encode(self) -> str:
        return json.dumps({"publication": self.publication, "at": self.at,
                           "tables": {_field(t): rows for t, rows in sorted(self.tables.items())}}, sort_keys=True)

    @classmethod
    def decode(cls, text: str | bytes) -> PublicationRows:
        raw = json.loads(text)
        return cls(raw["publication"], {(f.partition(".")[0], f.partition(".")[2]): rows for f, rows in raw["tables"].items()},
                   at=raw.get("at"))

    def changed_since(self, was: PublicationRows, tables: Iterable[tuple[str, str]]) -> str | None:
        """What changed since `was` that may have let pgoutput skip changes of `tables`; None if nothing did.

        Another publication (another OID) is `TableGate._same_publication`'s to judge. Rows added only add
        what it sends. A table keeping one of its rows as it was stayed covered by it throughout; a row
        replaced by one inserted after another write of its own transaction (dropped and added again in
        one transaction, as `cdc init` sets a column list) never left it."""
        if was.publication is None or self.publication is None or \
                was.publication.split(":")[0] != self.publication.split(":")[0]:
            return None
        tables = sorted(set(tables))
        if was.publication != self.publication:
            return (f"its pg_publication row changed (ALTER PUBLICATION ... SET, OWNER TO or RENAME TO: its publish "
                    f"option or publish_via_partition_root may have been off meanwhile), which decides what it sends "
                    f"of {_names(tables)}")
        lost = []
        for t in tables:
            before, now = was.tables.get(t), self.tables.get(t, {})
            if not before or any(now.get(k) == v for k, v in before.items()):
                continue
            if all(k in now and now[k] in self.again for k in before):
                continue
            lost.append(t)
        if not lost:
            return None
        return (f"its entries for {_names(lost)} were removed or replaced (ALTER PUBLICATION ... DROP TABLE or DROP "
                "TABLES IN SCHEMA, then ADD again)")


def _names(tables: Sequence[tuple[str, str]]) -> str:
    shown = ", ".join(_field(t) for t in tables[:3])
    return f"table{'s' if len(tables) > 1 else ''} {shown}" + (f" and {len(tables) - 3} more" if len(tables) > 3 else "")


def read_rows(conn: psycopg.Connection, publication: str, tables: Iterable[tuple[str, str]]) -> PublicationRows:
    """The catalog rows deciding what `publication` sends of `tables`, in one statement (one snapshot)."""
    tables = sorted(set(tables))
    # first: the rows read next show at least what the server wrote (or a standby replayed) up to it
    at = int(conn.execute(f"SELECT ({POSITION_SQL}) - '0/0'::pg_lsn").fetchone()[0])
    query = ROWS_QUERY.format(schemas=_SCHEMA_ROWS if conn.info.server_version >= 150000 else "")
    rows = conn.execute(query, {"schemas": [s for s, _ in tables], "names": [n for _, n in tables],
                                "pub": publication}).fetchall()
    found: dict[tuple[str, str], dict[str, str]] = {}
    pub, again = None, set()
    for schema, name, key, row, inserted_again in rows:
        if schema is None:
            pub = row
            continue
        found.setdefault((schema, name), {})[key] = row
        if inserted_again:
            again.add(row)
    return PublicationRows(pub, found, frozenset(again), at)


def changed_error(publication: str, slot: str, what: str, recorded: bool) -> SlotError:
    """The publication changed where a reading cannot see it any more (`PublicationRows.changed_since`)."""
    if recorded:
        text = (f"publication {publication!r} changed while slot {slot} held changes ({what}): the changes it may "
                "have skipped meanwhile were never decoded and no replay brings them back")
    else:
        text = (f"publication {publication!r} changed since it was last read: {what}; pgoutput skips what the "
                f"publication did not send at the time, so changes made meanwhile may be in no slot, slot {slot} "
                "held before them")
    return SlotError(text, hint=f"run: {RECOVER}")


def record_rows(conn: psycopg.Connection, client: redis.Redis, slot: str, publication: str,
                tables: Iterable[tuple[str, str]], before: PublicationRows | None = None,
                resync: set[tuple[str, str]] = frozenset()) -> str | None:
    """`cdc init`: record the publication's rows for `tables` as they are now (after its own changes); but first,
    what changed since a reading recorded them, found in `before` (read before init changed anything), is
    recorded as a gap, which is returned. A `resync` table's rows that changed keep their old record instead: the
    bridge's next reading finds the change and resyncs the table."""
    tables = list(tables)
    key = keys.bound_tables_key(slot)
    raw, gap = client.hmget(key, [ROWS_FIELD, GAP_FIELD])
    found = None
    was = PublicationRows.decode(raw) if raw is not None else None
    if was is not None and before is not None and gap is None:
        found = before.changed_since(was, [t for t in tables if t not in resync])
        if found is not None:
            client.hset(key, GAP_FIELD, CHANGED + found)
    now = read_rows(conn, publication, tables)
    if was is not None and before is not None:
        for t in resync:
            if t in was.tables and before.changed_since(was, [t]) is not None:
                now.tables[t] = was.tables[t]
    client.hset(key, ROWS_FIELD, now.encode())
    return None if found is None else changed_error(publication, slot, found, True).message


def record_current(conn: psycopg.Connection, client: redis.Redis, slot: str, tables: Iterable[tuple[str, str]],
                   since: Lsn, rows: PublicationRows | None = None) -> None:
    """Bind `tables` as they are now, from `since` on (a rebuild's position: what lies before it, it covers);
    `rows`: the publication's rows for them, as of `since`."""
    tables = list(tables)
    coverage = read_coverage(conn, "", tables)
    # the rebuild holds what the publication left out before, and the next session records the publication anew
    client.hdel(keys.bound_tables_key(slot), GAP_FIELD, PUBLICATION_FIELD, ROWS_FIELD)
    if tables:  # a resync of them is superseded by the rebuild
        client.hdel(keys.resync_key(slot), *(_field(t) for t in tables))
    if rows is not None:
        client.hset(keys.bound_tables_key(slot), ROWS_FIELD, rows.encode())
    record_bound(client, slot, {t: Bound(c.oid, since, c.leaves) for t, c in coverage.items() if c.oid is not None})


def recreated_error(publication: str, slot: str, was: int | None, now: int | None) -> SlotError:
    """A publication dropped and re-created under the slot: the changes written while it did not exist were
    never published (PostgreSQL 18 skips them; 15 to 17 refuse to decode them, on every restart)."""
    oids = f" (OID {was}, now {now})" if was is not None else ""
    return SlotError(
        f"publication {publication!r} was dropped and re-created{oids} while slot {slot!r} held changes: the changes "
        "written while it did not exist were never published, and no replay brings them back",
        hint=f"drop the slot (SELECT pg_drop_replication_slot('{slot}')), then run cdc init, then cdc recover before "
             "cdc run (the streams are rebuilt from the tables' current state; the individual changes in between "
             "cannot be restored)")


class TableGate:
    """Checks the mapped tables against what was bound; raises the error that stops the bridge."""

    def __init__(self, slot: str, publication: str, mappings: Sequence[Mapping]) -> None:
        self.slot = slot
        self.publication = publication
        self.tables = sorted({m.table for m in mappings if m.table is not None})
        self.columns = mapped_columns(mappings)  # what the publication must send of each
        self.filtered = [m.entity for m in mappings if m.filter]
        self.needed = needed_operations(mappings)  # what the publication's publish option must send
        self.filters = [m for m in mappings if m.filter and m.table is not None]
        self.told = False  # the start's log lines on what the bridge filters itself
        self.bound: dict[tuple[str, str], Bound] = {}
        self.by_oid: dict[int, tuple[str, str]] = {}
        self.client: redis.Redis | None = None
        self.verifications = 0
        #: the tables every mapping of which says `on_unaccountable: resync`, and those being resynced now
        self.resync = resync_tables(mappings)
        self.resyncing: dict[tuple[str, str], dict] = {}
        #: backfills whose last chunk this process decoded (one may stand in for a resync's failed backfill)
        self.completed: set[int] = set()
        self.mappings = [m for m in mappings if m.table is not None]
        #: the primary (the resync marker and backfill are written there), and the last position the ack gate
        #: vouched for (set by the session; `confirmed` before one runs)
        self.writer: psycopg.Connection | None = None
        self.vouched: Callable[[], Lsn] | None = None
        self.confirmed = Lsn(0)

    def start(self, conn: psycopg.Connection, client: redis.Redis, confirmed: Lsn) -> None:
        """A session starts with the slot at `confirmed`: bind what was never bound, check the rest."""
        self.client = client
        self.confirmed = confirmed
        self.resyncing = {t: r for t, r in load_resync(client, self.slot).items() if t in self.resync}
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
        gap = self._gap(client)
        if gap is not None:
            raise gap
        record_bound(client, self.slot, {t: self.bound[t] for t in fresh})

    def _index(self) -> None:
        self.by_oid = {b.oid: t for t, b in self.bound.items()}

    def verify(self, conn: psycopg.Connection, adopt: set[tuple[str, str]] = frozenset()) -> None:
        """One reading of the catalog; raises `SlotError` (exit 4) with the fix when it does not vouch."""
        self.verifications += 1
        if not self.tables:
            return
        publication = read_publication(conn, self.publication)
        self._same_publication(publication)
        self._operations(publication)
        coverage = read_coverage(conn, self.publication, self.tables)
        changed = {}
        for t in self.tables:
            bound, now = self.bound.get(t), coverage[t]
            if self.waiting(t):
                self._resume(conn, t, now, publication)
                continue
            if t in self.resyncing:
                self._follow(t)
            if t in self.resync and (bound is None or t in adopt) and self._left_since_init(t, now, publication):
                what = "dropped" if now.oid is None else f"taken out of publication {self.publication!r}"
                self._break(t, f"table {_field(t)} {what} after cdc init published it, before a bridge streamed it")
                continue
            if t in self.resync and bound is not None and t not in adopt:
                cause = self._cause(conn, t, bound, now, publication)
                if cause is not None:
                    self._break(t, *cause)
                    continue
            if now.partitioned and publication.exists and not publication.via_root:
                # its changes come as those of its partitions, which no mapping reads: _judge stops the bridge
                self._record_gap("publish_via_partition_root")
            self._judge(conn, t, bound, now, publication, known=t not in adopt)
            problem = sends_less(now, self.columns.get(t, ()), self.publication, self.slot)
            if problem is not None:
                raise problem
            if now.partitioned:
                self._partition_identities(conn, t)
            if t in adopt:
                changed[t] = replace(bound, leaves=now.leaves)
            elif now.leaves != bound.leaves:
                problem = self._partition_change(conn, t, bound, now)
                if problem is not None and t in self.resync:
                    self._break(t, problem)  # bound again with its partitions as they are by the next reading
                    continue
                if problem is not None:
                    raise self._partitions_error(problem)
                changed[t] = replace(bound, leaves=now.leaves)
        self._rows(conn)
        if not self.told:
            self._tell(publication, coverage)
        if changed:
            self.bound.update(changed)
            if self.client is not None:
                record_bound(self.client, self.slot, {t: b for t, b in changed.items() if t not in adopt})

    def _operations(self, publication: Publication) -> None:
        """The publication must send every operation the mappings publish: one it leaves out is never decoded
        (pgoutput judges it as of each change's position, so no replay brings it back). Recorded in Redis, so
        that only `cdc recover` lets the bridge start again."""
        problem = operations_problem(publication, self.needed, f"run: cdc init (or {{alter}}), then {RECOVER}")
        if problem is None:
            return
        self._record_gap(", ".join(PUBLISH[op] for op in PUBLISH if op in self.needed and op not in publication.publishes))
        raise SlotError(f"{problem.message}: those changes are never decoded, slot {self.slot} held before them",
                        hint=problem.hint)

    def _same_publication(self, publication: Publication) -> None:
        """The publication is the one the bridge streamed through: one dropped and re-created (another OID) left
        a window in which no publication sent the mapped tables' changes. Recorded like a gap: only `cdc recover`
        (after the slot is dropped: PostgreSQL 15 to 17 cannot decode that window at all) clears it."""
        if self.client is None or publication.oid is None:
            return
        key = keys.bound_tables_key(self.slot)
        raw = self.client.hmget(key, [PUBLICATION_FIELD])[0]  # HMGET: what the bridge's ACL allows
        if raw is None:
            self.client.hset(key, PUBLICATION_FIELD, str(publication.oid))
        elif int(raw) != publication.oid:
            self._record_gap(f"itself while dropped and re-created (OID {int(raw)}, now {publication.oid})")
            raise recreated_error(self.publication, self.slot, int(raw), publication.oid)

    def _rows(self, conn: psycopg.Connection) -> None:
        """The publication's rows for the mapped tables against those the last passing reading recorded: one
        changed (even back) may have let pgoutput skip changes. Recorded like a gap; a passing reading records
        them (other tables' records, `cdc init`'s, stay)."""
        if self.client is None:
            return
        key = keys.bound_tables_key(self.slot)
        raw, gap = self.client.hmget(key, [ROWS_FIELD, GAP_FIELD])
        if gap is not None:  # recorded already (by cdc init beside a running bridge, say): stop on it
            found = self._gap(self.client)
            if found is not None:
                raise found
            return
        checked = [t for t in self.tables if not self.waiting(t)]
        now = read_rows(conn, self.publication, checked)
        was = PublicationRows.decode(raw) if raw is not None else None
        if was is not None and was.at is not None and now.at is not None and now.at < was.at:
            # a standby that has not replayed the rows recorded (by cdc init, on the primary) yet: what it
            # received so far came before them, and init compared the rows before its own changes
            return
        if was is not None and was.publication == now.publication:
            # a resync table whose membership changed between two readings (out of the publication and back)
            for t in [t for t in checked if t in self.resync]:
                if now.changed_since(was, [t]) is not None:
                    self._break(t, f"table {_field(t)} left publication {self.publication!r} and came back")
                    checked.remove(t)
                    now.tables.pop(t, None)
        if was is not None:
            found = now.changed_since(was, checked)
            if found is not None:
                self._record_gap(CHANGED + found)
                raise changed_error(self.publication, self.slot, found, recorded=False)
            now = replace(now, tables={**{t: r for t, r in was.tables.items() if t not in self.tables}, **now.tables})
        if was is None or (now.publication, now.tables) != (was.publication, was.tables):  # not for `at` alone
            self.client.hset(key, ROWS_FIELD, now.encode())

    # -- on_unaccountable: resync ---------------------------------------------------------------

    def _cause(self, conn: psycopg.Connection, t: tuple[str, str], bound: Bound, now: TableCoverage,
               publication: Publication) -> tuple[str, str | None] | None:
        """What a `resync` table went through that its stream cannot account for, if it is a case resynced
        (dropped, dropped and re-created, renamed or moved away, taken out of the publication, the publication
        sending fewer of its columns or rows), and the fix while it waits (None: `RESYNC_FIX`). Anything else
        stops the bridge."""
        name = _field(t)
        if now.oid is None:
            moved = where_is(conn, bound.oid)
            if moved is None:
                return f"table {name} dropped", None
            return (f"table {name} renamed or moved: it is now {moved}",
                    f"waiting for a table named {name} in the publication again (rename it back, or map {moved}: "
                    "fix the mapping, then cdc init)")
        if now.oid != bound.oid:
            return f"table {name} dropped and re-created (OID {bound.oid}, now {now.oid})", None
        if publication.exists and not now.covered and not (now.partitioned and not publication.via_root):
            return f"table {name} taken out of publication {self.publication!r}", None
        problem = sends_less(now, self.columns.get(t, ()), self.publication)
        if problem is not None:
            return problem.message, problem.hint
        return None

    def _left_since_init(self, t: tuple[str, str], now: TableCoverage, publication: Publication) -> bool:
        """A table no bridge bound yet, gone or out of the publication although `cdc init` recorded it published
        (its publication rows): dropped, or dropped and re-created, since. Its changes until then are in the
        slot, under the OID it had."""
        if self.client is None or (now.oid is not None and (not publication.exists or now.covered)):
            return False
        raw = self.client.hmget(keys.bound_tables_key(self.slot), [ROWS_FIELD])[0]
        return raw is not None and t in PublicationRows.decode(raw).tables

    def give_up(self, t: tuple[str, str], cause: str, fix: str | None = None) -> None:
        """The session found table `t`'s stream unable to go on (a description of it its mappings cannot
        bind): resync it (`t` is a `resync` table)."""
        self._break(t, cause, fix)

    def _break(self, t: tuple[str, str], cause: str, fix: str | None = None) -> None:
        """Give up table `t`'s changes knowingly: record it in Redis (before the slot may move past the change),
        then mark the place in the WAL (`RESYNC_PREFIX`); the gate no longer checks it until it is back."""
        vouched = self.vouched() if self.vouched is not None else self.confirmed
        record = {"cause": cause, "vouched": str(vouched), "state": "waiting", "marker": False, "marked_at": None,
                  "backfills": []}
        if fix is not None:
            record["fix"] = fix
        self.resyncing[t] = record
        self._save(t)
        if self.client is not None:  # its catalog rows are read anew once it is bound again
            raw = self.client.hmget(keys.bound_tables_key(self.slot), [ROWS_FIELD])[0]
            if raw is not None:
                rows = PublicationRows.decode(raw)
                if rows.tables.pop(t, None) is not None:
                    self.client.hset(keys.bound_tables_key(self.slot), ROWS_FIELD, rows.encode())
        log.warning("%s: the stream of %s gives up its changes and is resynced from the table (on_unaccountable: "
                    "resync); last position vouched for %s", cause, _field(t), vouched)
        self.emit_markers()

    def waiting(self, t: tuple[str, str]) -> bool:
        """A resyncing table not bound again yet: the gate does not check it."""
        record = self.resyncing.get(t)
        return record is not None and record["state"] == "waiting"

    def holding(self, t: tuple[str, str]) -> bool:
        """`t`'s changes are not published now: it waits to be bound again, or its marker was not decoded yet."""
        record = self.resyncing.get(t)
        return record is not None and (record["state"] == "waiting" or record["marked_at"] is None)

    def _save(self, t: tuple[str, str]) -> None:
        if self.client is not None:
            self.client.hset(keys.resync_key(self.slot), _field(t), json.dumps(self.resyncing[t], sort_keys=True))

    def emit_markers(self) -> None:
        """Write the resync marker of every table whose record says none was written yet (on the primary)."""
        if self.writer is None:
            return  # before the session starts: it writes them
        for t, record in self.resyncing.items():
            if record["marker"]:
                continue
            content = json.dumps({"slot": self.slot, "table": _field(t), "cause": record["cause"],
                                  "vouched": record["vouched"]})
            self.writer.execute("SELECT pg_logical_emit_message(true, %s, %s)", (RESYNC_PREFIX, content))
            record["marker"] = True
            self._save(t)

    def marked(self, t: tuple[str, str], at: int) -> None:
        """The session decoded `t`'s resync marker at `at`: the Relations of `t` after it are bound."""
        record = self.resyncing.get(t)
        if record is not None and (record["marked_at"] is None or record["marked_at"] < at):
            record["marked_at"] = at
            self._save(t)

    def _resume(self, conn: psycopg.Connection, t: tuple[str, str], now: TableCoverage, publication: Publication) -> None:
        """A resyncing table: once it exists and is published again, bind it anew and queue its backfill."""
        record = self.resyncing[t]
        if not record["marker"]:
            self.emit_markers()
        if record["state"] != "waiting" or now.oid is None or not now.covered or self.writer is None:
            return
        problem: CdcError | None = identity_problem(now, publication) or \
            sends_less(now, self.columns.get(t, ()), self.publication) or self._refusal(conn, t)
        if problem is not None:  # back, but not yet as its mappings need it: said in cdc status until fixed
            fix = f"back in the publication, but {problem.message}; {problem.hint}"
            if record.get("fix") != fix:
                record["fix"] = fix
                self._save(t)
                log.warning("%s cannot be resynced yet: %s", _field(t), fix)
            return
        since = Lsn(int(conn.execute(f"SELECT ({POSITION_SQL}) - '0/0'::pg_lsn").fetchone()[0]))
        self.bound[t] = Bound(now.oid, since, now.leaves)
        self._index()
        if self.client is not None:
            record_bound(self.client, self.slot, {t: self.bound[t]})
        record["backfills"] = [enqueue(self.writer, self.slot, m) for m in self.mappings if m.table == t]
        record["state"] = "backfilling"
        record["oid"] = now.oid
        self._save(t)
        log.info("%s is back (OID %d): bound from %s, backfills %s queued to resync its stream", _field(t), now.oid,
                 since, ", ".join(map(str, record["backfills"])))

    def _refusal(self, conn: psycopg.Connection, t: tuple[str, str]) -> CdcError | None:
        """What refuses a mapping of `t` on the table as it is now (the judge `cdc check` and the binding use, a
        key that may name several rows), or the bridge's role unable to read its mapped columns for the backfill
        (a re-created table has lost its grants)."""
        shape = table_shape(conn, *t)
        if shape is None:
            return None  # gone again: the next reading finds it missing
        catalog = TypeCatalog()
        load_types(conn, catalog, [c.type_oid for c in shape.columns])
        for m in self.mappings:
            if m.table == t:
                try:
                    judge(m, shape, catalog)
                except MappingError as exc:
                    return exc
                problem = key_uniqueness_problem(conn, m)  # as cdc run refuses it at start
                if problem is not None:
                    return problem
        reader = self.writer if self.writer is not None else conn  # the backfill reads on the primary
        ident, readable = reader.execute(
            "SELECT format('%%I.%%I', %s::text, %s::text), bool_and(has_column_privilege(format('%%I.%%I', %s::text, "
            "%s::text)::regclass, c, 'SELECT')) FROM unnest(%s::text[]) c",
            (*t, *t, list(self.columns.get(t, ())))).fetchone()
        if readable is False:
            role = reader.info.user
            return PrivilegeError(f"role {role} may not read table {_field(t)} for its backfill",
                                  hint=f"run: GRANT SELECT ON TABLE {ident} TO {role}")
        return None

    def backfill_done(self, backfill_id: int) -> None:
        """A backfill's last chunk: a table whose resync backfills are all done streams again."""
        self.completed.add(backfill_id)
        for t, record in list(self.resyncing.items()):
            if backfill_id in record["backfills"]:
                record["backfills"].remove(backfill_id)
                self._finish(t)

    def _finish(self, t: tuple[str, str]) -> None:
        """Save `t`'s record, or clear it once none of its backfills is left: its stream streams again."""
        if self.resyncing[t]["backfills"]:
            self._save(t)
            return
        del self.resyncing[t]
        if self.client is not None:
            self.client.hdel(keys.resync_key(self.slot), _field(t))
        log.info("%s resynced: its stream is streaming again", _field(t))

    def _follow(self, t: tuple[str, str]) -> None:
        """A resyncing table's backfills, as `cdc_backfills` has them: one that ended without its last chunk
        (failed, cancelled) leaves the resync failed, the record naming the backfill, its error and the fix, until
        a whole backfill of the same mapping queued after it (`cdc backfill --entity ...`) stands in for it."""
        record = self.resyncing[t]
        if self.writer is None or not record["backfills"]:
            return
        ended = self.writer.execute(
            "SELECT id, entity, status, error FROM cdc_backfills WHERE id = ANY(%s) "
            "AND status NOT IN ('pending', 'running', 'done') ORDER BY id", (record["backfills"],)).fetchall()
        fixes = []
        for backfill_id, entity, status, error in ended:
            newer = self.writer.execute(
                "SELECT id, status FROM cdc_backfills WHERE slot = %s AND entity = %s AND where_sql IS NULL AND id > %s "
                "AND status IN ('pending', 'running', 'done') ORDER BY id LIMIT 1", (self.slot, entity, backfill_id)).fetchone()
            if newer is not None and (newer[1] != "done" or newer[0] in self.completed):
                record["backfills"].remove(backfill_id)
                if newer[1] != "done":
                    record["backfills"].append(newer[0])
                log.info("backfill %d of %s stands in for backfill %d (%s) to resync %s", newer[0], entity, backfill_id,
                         status, _field(t))
                continue
            fixes.append(f"backfill {backfill_id} of {entity} {status}{': ' + error if error else ''}; fix its cause, "
                         f"then run: cdc backfill --entity {entity} (its last chunk ends the resync), or cdc recover")
        if fixes:
            fix = "; ".join(fixes)
            if record["state"] != "failed" or record.get("fix") != fix:
                record["state"], record["fix"] = "failed", fix
                self._save(t)
                log.error("the resync of %s did not finish: %s", _field(t), fix)
        elif len(ended):
            record["state"] = "backfilling"
            record.pop("fix", None)
            self._finish(t)

    def _record_gap(self, lacking: str) -> None:
        """Record what the publication left out, until `cdc recover`; the first finding stays (it came first)."""
        if self.client is not None and self.client.hmget(keys.bound_tables_key(self.slot), [GAP_FIELD])[0] is None:
            self.client.hset(keys.bound_tables_key(self.slot), GAP_FIELD, lacking)  # one bridge per slot writes it

    def _gap(self, client: redis.Redis) -> SlotError | None:
        """The record that a reading found the publication leaving out operations, until `cdc recover`."""
        raw = client.hmget(keys.bound_tables_key(self.slot), [GAP_FIELD])[0]
        if raw is None:
            return None
        if raw.startswith(b"itself"):
            return recreated_error(self.publication, self.slot, None, None)
        if raw.startswith(CHANGED.encode()):
            return changed_error(self.publication, self.slot, raw.decode()[len(CHANGED):], recorded=True)
        return SlotError(
            f"publication {self.publication!r} lacked {raw.decode()} while slot {self.slot} held changes (found by "
            "cdc run): the changes it left out were never decoded and no replay brings them back",
            hint=f"run: {RECOVER}")

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
               publication: Publication, known: bool = False) -> None:
        """Raise what stops the bridge about table `t`; `known`: bound by an earlier session (a reading that finds
        it out of the publication is then recorded, as only `cdc recover` brings back what it left out)."""
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
            if known:  # its changes while out are in no slot: cdc init putting it back must not be enough
                self._record_gap(f"table {name}")
            raise SlotError(f"{problem.message}: its changes are not decoded, slot {self.slot} held before them",
                            hint=problem.hint)
        problem = identity_problem(now, publication)
        if problem is not None:
            raise problem

    def _partitions(self, conn: psycopg.Connection, t: tuple[str, str], bound: Bound, now: TableCoverage) -> Bound:
        """The partitions changed: empty newcomers are bound as they are; anything else stops the bridge."""
        problem = self._partition_change(conn, t, bound, now)
        if problem is not None:
            raise self._partitions_error(problem)
        return replace(bound, leaves=now.leaves)

    def _partitions_error(self, problem: str) -> SlotError:
        """What stops the bridge for a partitions' change no change published (`_partition_change`)."""
        return SlotError(f"{problem}, slot {self.slot} held before that", hint=f"run: {RECOVER}")

    def _partition_change(self, conn: psycopg.Connection, t: tuple[str, str], bound: Bound,
                          now: TableCoverage) -> str | None:
        """What the partitions' change did that no change published (a partition gone, or one that joined holding
        rows), or None: empty newcomers are bound as they are."""
        name = _field(t)
        gone = [oid for oid in bound.leaves if oid not in now.leaves]
        if gone:
            names = ", ".join(where_is(conn, oid) or f"OID {oid} (dropped)" for oid in gone)
            return f"partition {names} left mapped table {name}: its rows left the table without delete changes"
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
                return f"partition {leaf} joined mapped table {name} holding rows that no change published"
            log.info("partition %s joined %s empty: bound", leaf, name)
        return None

    def recorded_problems(self, conn: psycopg.Connection, client: redis.Redis) -> list[CdcError]:
        """What `cdc run` would refuse at start about the tables it bound before (for `cdc check`); changes
        nothing."""
        gap = self._gap(client)
        problems: list[CdcError] = [] if gap is None else [gap]
        publication = read_publication(conn, self.publication)
        recorded = client.hmget(keys.bound_tables_key(self.slot), [PUBLICATION_FIELD])[0]
        if gap is None and recorded is not None and publication.oid is not None and int(recorded) != publication.oid:
            problems.append(recreated_error(self.publication, self.slot, int(recorded), publication.oid))
        rows = client.hmget(keys.bound_tables_key(self.slot), [ROWS_FIELD])[0]
        # a `resync` table dropped, re-created or out of the publication is the running bridge's to resync
        tables = [t for t in self.tables if t not in self.resync]
        if gap is None and rows is not None:
            found = read_rows(conn, self.publication, tables).changed_since(PublicationRows.decode(rows), tables)
            if found is not None:
                problems.append(changed_error(self.publication, self.slot, found, recorded=False))
        bound = {t: b for t, b in load_bound(client, self.slot).items() if t in tables}
        if not bound:
            return problems
        coverage = read_coverage(conn, self.publication, bound)
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

    def relation(self, relid: int, namespace: str, name: str, commit_lsn: int) -> bool:
        """A Relation message: a mapped name with another OID, or a bound OID under another name, stops the
        bridge, unless its transaction lies before the binding (history a rebuild covers). A `resync` table's
        name with another OID, or its OID under another name, starts its resync instead. True: the relation's changes are not published (a
        resyncing table's, before its resync marker: the backfill after the marker supersedes them)."""
        t = (namespace or "pg_catalog", name)
        bound = self.bound.get(t)
        record = self.resyncing.get(t)
        if record is not None and (bound is None or bound.oid != relid or record["state"] == "waiting"):
            return record["marked_at"] is None or commit_lsn < record["marked_at"]
        other = self.by_oid.get(relid)
        if (bound is None or bound.oid == relid) and (other is None or other == t):
            return False
        if bound is not None and bound.oid != relid:
            if commit_lsn < bound.since:
                return False
            if t in self.resync:
                self._break(t, f"table {_field(t)} dropped and re-created (OID {bound.oid}, now {relid})")
                return True
            raise SlotError(
                f"the stream names mapped table {_field(t)} with OID {relid}, not the OID {bound.oid} bound: it was "
                f"dropped and re-created, slot {self.slot} held before it", hint=f"run: cdc init, then {RECOVER}")
        assert other is not None
        was = self.bound[other]
        if commit_lsn < was.since:
            return False
        if other in self.resync:
            if not self.waiting(other):  # renamed or moved away: the name it had is resynced once it is back
                self._break(other, f"table {_field(other)} renamed or moved: the stream names it {_field(t)}",
                            f"waiting for a table named {_field(other)} in the publication again (rename it back, "
                            f"or map {_field(t)}: fix the mapping, then cdc init)")
            return True
        raise SlotError(
            f"mapped table {_field(other)} (OID {relid}) was renamed or moved: the stream names it {_field(t)}, a name "
            f"no mapping reads, slot {self.slot} held before its changes under that name",
            hint=f"rename it back or map {_field(t)}, then run: cdc init, then {RECOVER}")
