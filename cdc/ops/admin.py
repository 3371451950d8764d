"""Setting up and checking the source: publication, slot, mapped tables, JSON Schema.

`init` is idempotent and reports each thing it did; `cdc check` lives in
`cdc.ops.preflight` and binds every mapping with `bind_live`, the same `Projector`
the stream uses.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Sequence
from dataclasses import replace

import psycopg
import redis

from ..keys import written_streams
from ..bridge.backfill import enqueue, ensure_table
from ..bridge.gate import PublicationRows, needed_operations, read_rows, record_rows
from ..bridge.guards import (check_source_history, clear_data_loss, diverged_error, invalidated_slot_error, slot_database_error,
                             record_data_loss, record_divergence, record_source)
from ..source.catalog import live_shape
from ..source.coverage import (PUBLISH, Publication, TableCoverage, identity_problem, operations_problem, publish_value,
                               read_coverage, read_publication)
from ..source.pubcolumns import ColumnPlan, plan
from ..source.history import Divergence, ServerHistory, read_history
from ..source.failover import create_slot, make_failover_slot
from ..source.slot_server import create_on_standby, in_recovery, standby_problems
from ..source import spare_slot
from ..config import Settings
from .. import keys
from ..errors import MappingError, SlotError, SourceError
from ..mapping.uniqueness import key_uniqueness_problem
from ..exits import as_cdc_error
from ..source.lsn import Lsn
from ..sink.claims import BridgeIdentity, claim
from ..sink.redisconn import connect_redis
from ..mapping.judge import judge
from ..mapping.model import Mapping, mapped_columns, resync_tables
from ..mapping.projector import Projector
from ..source.replication import SESSION_OPTIONS, classify_pg_error, quote_ident, quote_literal
from ..source.values import TypeCatalog, json_schema_for

__all__ = ["bind_live", "connect", "init", "judge_live", "json_schemas", "slot_connection"]

log = logging.getLogger("cdc.admin")


def connect(settings: Settings) -> psycopg.Connection:
    """The primary (postgres.dsn): the tables, the publication, and whatever the bridge writes."""
    return _connect(settings.postgres.dsn)


def _connect(dsn: str) -> psycopg.Connection:
    try:
        return psycopg.connect(dsn, autocommit=True, options=SESSION_OPTIONS, connect_timeout=10)
    except Exception as exc:
        raise classify_pg_error(exc) from exc


@contextlib.contextmanager
def slot_connection(settings: Settings, primary: psycopg.Connection) -> Iterator[psycopg.Connection]:
    """The server holding the slot: `primary` itself, or the standby of postgres.slot_dsn (closed after)."""
    if not settings.postgres.slot_dsn:
        yield primary
        return
    with _connect(settings.postgres.slot_dsn) as conn:
        yield conn


def _wal_level(conn: psycopg.Connection) -> None:
    level = conn.execute("SHOW wal_level").fetchone()[0]
    if level != "logical":
        raise SourceError(
            f"postgres wal_level is {level!r}, logical decoding needs 'logical'",
            hint="set wal_level = logical in postgresql.conf and restart PostgreSQL",
        )


def _tables(mappings: Sequence[Mapping]) -> list[tuple[str, str]]:
    return sorted({m.table for m in mappings if m.table is not None})


def _qualified(tables: Sequence[tuple[str, str]]) -> str:
    return ", ".join(f"{quote_ident(s)}.{quote_ident(t)}" for s, t in tables)


def _entry(table: tuple[str, str], columns: Sequence[str] | None) -> str:
    """One table of FOR TABLE / ADD TABLE: its name and column list (None: every column)."""
    return _qualified([table]) + ("" if columns is None else f" ({', '.join(quote_ident(c) for c in columns)})")


def _plans(coverage: dict[tuple[str, str], TableCoverage], mappings: Sequence[Mapping],
           pub: Publication) -> dict[tuple[str, str], ColumnPlan]:
    """Each mapped table's column list; refuses, before anything changes, a mapped column the table cannot send."""
    read = mapped_columns(mappings)
    plans = {}
    for t, c in coverage.items():
        absent = [col for col in read.get(t, ()) if col not in c.columns]
        if absent:
            m = next(m for m in mappings if m.table == t and absent[0] in m.columns)
            raise MappingError(f"{m.where}: entity {m.entity!r}: column {absent[0]!r} is not in table {c.qualified} "
                               f"(or is a generated column, which pgoutput never sends); nothing was changed",
                               hint="map an existing column or remove the field")
        plans[t] = plan(c, read.get(t, ()), pub)
    return plans


def _set_tables(conn: psycopg.Connection, name: str, plans: dict[tuple[str, str], ColumnPlan], done: list[str]) -> None:
    """Give every mapped table its column list (and no row filter); nothing when each already has it.

    A member whose list differs is dropped and added again with its list in one transaction, so no
    change is ever decoded without it: ALTER PUBLICATION ... SET TABLE would need ownership of every
    member, and the other members (other deployments' tables) are never touched. A member published
    as its parent's partition is left for the check that follows.
    """
    stale = [(t, p) for t, p in sorted(plans.items())
             if not p.table.member or (p.table.covered and (p.table.published != p.wanted or p.table.row_filter))]
    if not stale:
        done.append(f"publication {name} already covers the mapped tables with the columns they need")
        return
    quoted = quote_ident(name)
    again = [t for t, p in stale if p.table.member]
    with conn.transaction():
        if again:
            conn.execute(f"ALTER PUBLICATION {quoted} DROP TABLE {_qualified(again)}")
        conn.execute(f"ALTER PUBLICATION {quoted} ADD TABLE {', '.join(_entry(t, p.wanted) for t, p in stale)}")
    added = len(stale) - len(again)
    done.append(f"publication {name}: set the columns of {len(stale)} mapped table(s)"
                + (f", {added} of them added" if added else ""))


def _publication(conn: psycopg.Connection, name: str, mappings: Sequence[Mapping], done: list[str]) -> None:
    """Make the publication cover every mapped table under its own name, sending the columns its mappings need;
    idempotent.

    Refuses, before changing anything, a table the publication would make refuse the application's
    UPDATE and DELETE (no usable replica identity). Partitioned tables are published as themselves
    (``publish_via_partition_root``), every partition present and future. Each mapped table gets a column
    list (`cdc.source.pubcolumns`) where the server takes one; other members keep theirs. Where it
    cannot, a table already a member is never added again (covered or not, ADD TABLE would fail).
    """
    tables = _tables(mappings)
    pub = read_publication(conn, name)
    coverage = read_coverage(conn, name, tables)
    missing = [c.qualified for c in coverage.values() if c.oid is None]
    if missing:
        raise MappingError(f"mapped table {missing[0]} does not exist", hint="create it first, or fix the mapping's table")
    would = pub if pub.exists else Publication(name, exists=True, lists=pub.lists)  # a new one publishes updates and deletes
    needed = needed_operations(mappings)
    lacking = operations_problem(pub, needed, "{alter}")
    if lacking is not None:  # as it will be once its publish option sends what the mappings publish
        would = replace(would, updates=would.updates or "u" in needed or "d" in needed,
                        publishes=would.publishes | set(needed))
    for c in coverage.values():
        problem = identity_problem(c, would)
        if problem is not None:
            raise SourceError(f"{problem.message}; nothing was changed", hint=f"{problem.hint}, then cdc init again")
    _refuse_ambiguous_keys(conn, mappings)
    plans = _plans(coverage, mappings, would)
    quoted = quote_ident(name)
    if not pub.exists:
        target = f" FOR TABLE {', '.join(_entry(t, p.wanted) for t, p in sorted(plans.items()))}" if tables else ""
        conn.execute(f"CREATE PUBLICATION {quoted}{target} WITH (publish_via_partition_root = true)")
        done.append(f"created publication {name} for {len(tables)} table(s), partitioned ones under their own name")
    else:
        if not pub.via_root:
            conn.execute(f"ALTER PUBLICATION {quoted} SET (publish_via_partition_root = true)")
            done.append(f"publication {name} now publishes partitioned tables under their own name")
        if lacking is not None:
            value = publish_value(pub, needed)
            conn.execute(f"ALTER PUBLICATION {quoted} SET (publish = {quote_literal(value)})")
            added = [PUBLISH[op] for op in PUBLISH if op in needed and op not in pub.publishes]
            done.append(f"publication {name} now publishes {', '.join(added)} (publish = '{value}'), which the "
                        "mappings publish")
        add = [t for t, c in coverage.items() if not c.covered and not c.member]
        if pub.all_tables:
            done.append(f"publication {name} already publishes all tables")
        elif pub.lists and not pub.schemas:
            _set_tables(conn, name, plans, done)
        elif add:
            conn.execute(f"ALTER PUBLICATION {quoted} ADD TABLE {_qualified(add)}")
            done.append(f"added {len(add)} table(s) to publication {name}")
        else:
            done.append(f"publication {name} already covers the mapped tables")
    for p in plans.values():
        if p.reason is not None:
            done.append(f"publication {name} sends every column of {p.table.qualified} ({p.reason}): the bridge "
                        "drops the unmapped ones")
    _published_as_asked(conn, name, tables)


def _refuse(conn: psycopg.Connection, name: str, mappings: Sequence[Mapping]) -> None:
    """Before anything is created: a mapped table whose replica identity cannot carry updates and deletes
    (exit 4), then every mapping judged against its live table as cdc check and cdc run judge it (exit 3)."""
    pub = read_publication(conn, name)
    would = pub if pub.exists else Publication(name, exists=True, lists=pub.lists)
    for c in read_coverage(conn, name, _tables(mappings)).values():
        problem = identity_problem(c, would) if c.oid is not None else None
        if problem is not None:
            raise SourceError(f"{problem.message}; nothing was changed", hint=f"{problem.hint}, then cdc init again")
    judge_live(conn, mappings)


def _published_as_asked(conn: psycopg.Connection, name: str, tables: list[tuple[str, str]]) -> None:
    for c in read_coverage(conn, name, tables).values():
        if c.covered:
            continue
        if c.member:  # a member that publishes nothing under its name: a partition of a published parent
            raise SlotError(
                f"table {c.qualified} is in publication {name!r} but its changes are published as those of its "
                "partitioned parent (publish_via_partition_root)", hint="map the parent table instead of the partition")
        raise SlotError(f"table {c.qualified} is still not published by publication {name!r} (PostgreSQL never "
                        "publishes an unlogged table)", hint=f"run: ALTER TABLE {c.qualified} SET LOGGED, then cdc init again")


def init(settings: Settings, mappings: Sequence[Mapping]) -> list[str]:
    """Create the publication (for the mapped tables) and the slot; return what was done."""
    done: list[str] = []
    pgs = settings.postgres
    with connect(settings) as conn:
        try:
            _wal_level(conn)
            _refuse(conn, pgs.publication, mappings)  # what cdc check and cdc run refuse, before anything is created
            _claim(settings, mappings, read_history(pgs.slot_server))  # before anything is created: nothing another bridge holds
            before = read_rows(conn, pgs.publication, _tables(mappings))
            _publication(conn, pgs.publication, mappings, done)
            _record_rows(settings, conn, mappings, before, done)
            ensure_table(conn)
            if pgs.spare_slot_dsn:  # first: it starts no later than the slot, so it can stand in for it at once
                _spare(settings, conn, done)
            with slot_connection(settings, conn) as sconn:
                confirmed, created = _slot(settings, conn, sconn, done)
            if created:
                for m in mappings:
                    if m.snapshot == "initial":
                        backfill_id = enqueue(conn, pgs.slot, m)
                        done.append(f"initial snapshot of {m.entity} queued (backfill {backfill_id}); cdc run publishes it")
        except psycopg.Error as exc:
            raise classify_pg_error(exc, slot=pgs.slot, publication=pgs.publication, role=conn.info.user) from exc
    done.append(_register_redis(settings, Lsn.parse(confirmed), created, read_history(pgs.slot_server)))
    return done


def _slot(settings: Settings, conn: psycopg.Connection, sconn: psycopg.Connection, done: list[str]) -> tuple[str, bool]:
    """The slot on its server (`sconn`: the primary `conn`, or a standby that decodes), created if missing;
    returns (its confirmed position, whether it was created)."""
    pgs = settings.postgres
    standby = sconn is not conn and in_recovery(sconn)
    if standby:
        for what, fix in standby_problems(sconn, conn):
            raise SourceError(f"{what}; nothing was created on the standby", hint=fix)
    slot = sconn.execute(
        "SELECT plugin, confirmed_flush_lsn::text, wal_status FROM pg_replication_slots WHERE slot_name = %s",
        (pgs.slot,),
    ).fetchone()
    if slot is not None and slot[2] == "lost":
        raise invalidated_slot_error(pgs.slot)
    if slot is not None and (other := slot_database_error(sconn, pgs.slot)) is not None:
        raise other
    if slot is None:
        if standby:
            confirmed = create_on_standby(sconn, conn, pgs.slot)
            done.append(f"created logical slot {pgs.slot} (pgoutput) at {confirmed} on the standby of "
                        "postgres.slot_dsn, which decodes it")
        else:
            # what the function returns is the new slot's confirmed position
            confirmed, what = create_slot(sconn, pgs.slot, pgs.failover_slot)
            done.append(what)
        return confirmed, True
    if slot[0] != "pgoutput":
        raise SourceError(f"slot {pgs.slot} exists with plugin {slot[0]!r}, not pgoutput", hint="drop it or choose another postgres.slot")
    done.append(f"slot {pgs.slot} already exists" + (" on the standby of postgres.slot_dsn" if standby else ""))
    converted = make_failover_slot(pgs.slot_server, sconn, pgs.slot) if pgs.failover_slot and not standby else None
    if converted:
        done.append(converted)
    return slot[1], False


def _spare(settings: Settings, conn: psycopg.Connection, done: list[str]) -> None:
    """The spare copy of the slot on the server of postgres.spare_slot_dsn, created if missing."""
    pgs = settings.postgres
    if read_history(pgs.spare_slot_dsn).system_id != read_history(pgs.dsn).system_id:
        raise SourceError("postgres.spare_slot_dsn names a server of another cluster (another system identifier); "
                          "nothing was created on it", hint="name the primary or a physical standby of it")
    with _connect(pgs.spare_slot_dsn) as spare:
        if in_recovery(spare):
            for what, fix in standby_problems(spare, conn):
                raise SourceError(f"{what.replace('postgres.slot_dsn', 'postgres.spare_slot_dsn')}; nothing was created "
                                  "on it", hint=fix)
        reading = spare_slot.read(spare, pgs.slot)
        where = "the primary" if reading.on_primary else "the standby"
        if reading.exists:
            if reading.wal_status == "lost" or reading.conflicting:
                raise SlotError(f"the spare slot {pgs.slot} on {where} of postgres.spare_slot_dsn was invalidated",
                                hint=f"drop it there (SELECT pg_drop_replication_slot('{pgs.slot}')), then cdc init again")
            done.append(f"spare slot {pgs.slot} already exists on {where} of postgres.spare_slot_dsn")
            return
        at = spare_slot.create(spare, conn, pgs.slot)
        done.append(f"created the spare slot {pgs.slot} (pgoutput) at {at} on {where} of postgres.spare_slot_dsn; "
                    "cdc run keeps it behind what Redis holds")


def _record_rows(settings: Settings, conn: psycopg.Connection, mappings: Sequence[Mapping], before: PublicationRows,
                 done: list[str]) -> None:
    """Record the publication's rows for the mapped tables after init's own changes, so that its repairs are not
    taken for a change by hand; one made since cdc run last read them (in `before`) is recorded as a gap
    (`cdc.bridge.gate`), which init says."""
    pgs = settings.postgres
    client = None
    try:
        client = connect_redis(settings.redis)
        found = record_rows(conn, client, pgs.slot, pgs.publication, _tables(mappings), before, resync_tables(mappings))
    except redis.RedisError as exc:  # unreachable: 75; a refused login or command: 5
        raise as_cdc_error(exc) from exc
    finally:
        if client is not None:
            client.close()
    if found is not None:
        done.append(f"{found}; cdc run refuses until cdc recover (rebuilds the streams from the tables)")


def _refuse_ambiguous_keys(conn: psycopg.Connection, mappings: Sequence[Mapping]) -> None:
    """A mapping whose key may name several rows, before anything is created."""
    for m in mappings:
        problem = key_uniqueness_problem(conn, m)
        if problem is not None:
            raise problem


def _claim(settings: Settings, mappings: Sequence[Mapping], server: ServerHistory) -> None:
    """Register the slot and claim the streams it writes on Redis (`cdc.sink.claims`), as cdc run does."""
    pgs = settings.postgres
    client = None
    try:
        client = connect_redis(settings.redis)
        claim(client, BridgeIdentity(pgs.slot, server.system_id, server.database, pgs.publication),
              written_streams(settings, mappings))
    except redis.RedisError as exc:  # unreachable: 75; a refused login or command: 5
        raise as_cdc_error(exc) from exc
    finally:
        if client is not None:
            client.close()


def _register_redis(settings: Settings, confirmed: Lsn, created: bool = False, server: ServerHistory | None = None) -> str:
    """Record in Redis that it holds the source up to the slot's position, unless it already does.

    `cdc run` compares this record with the slot to detect a Redis that lost data;
    a new (or deliberately emptied) Redis is registered here. A slot `created` now while
    Redis holds the source up to an older position has a gap nothing can fill: every
    change in between was lost to the slot. The record then stays where it is and the gap
    is recorded as a data loss, so `cdc run` refuses (exit 6) until `cdc recover` rebuilds
    the streams from the tables.

    The `server`'s history (system identifier, timeline) is recorded beside the record. Redis
    holding positions that history lacks (`check_source_history`), or a slot `created` now
    below Redis' record (the server's WAL never reached it: a promoted standby or a restored
    backup without the last transactions), is recorded as a divergence and stops (exit 6).
    """
    slot = settings.postgres.slot
    key = keys.flushed_key(slot)
    client = None
    try:
        client = connect_redis(settings.redis)
        if client.set(key, str(int(confirmed)), nx=True):
            clear_data_loss(client, slot)
            if server is not None:
                record_source(client, slot, server)
            return f"registered redis for slot {slot} at {confirmed}"
        current = Lsn(int(client.get(key)))
        if server is not None:
            below = created and confirmed < current
            # stops on a divergence (recorded), else records the history (not yet when the new slot is below)
            check_source_history(client, slot, server, record=not below,
                                 reread=lambda: read_history(settings.postgres.slot_server))
            if below:
                found = Divergence(confirmed, current, f"slot {slot!r} was created at {confirmed}, below the position "
                                   "redis holds, which this server's WAL never reached: a promoted standby or a restored "
                                   "backup lacked the last transactions")
                error = diverged_error(slot, found)
                record_divergence(client, slot, error, found)
                raise error
        if current < confirmed and created:
            message = (f"slot {slot!r} was created at {confirmed}, but redis holds the source up to {current} only: "
                       f"every change committed in ({current}, {confirmed}] was lost to the slot")
            record_data_loss(client, slot, current, confirmed, message)
            return (f"{message}; run cdc recover before cdc run (the streams then replay to the tables' current "
                    "state; the individual changes in between cannot be restored)")
        if current < confirmed:
            client.set(key, str(int(confirmed)))
            clear_data_loss(client, slot)
            return f"redis held changes up to {current} only; accepted the loss up to {confirmed}"
        return f"redis already holds slot {slot} up to {current}"
    except redis.RedisError as exc:  # unreachable: 75; a refused login or command: 5
        raise as_cdc_error(exc) from exc
    finally:
        if client is not None:
            client.close()


def bind_live(conn: psycopg.Connection, mapping: Mapping, catalog: TypeCatalog) -> Projector:
    """The mapping bound to its table as the catalog describes it now (`cdc.mapping.judge` refuses what
    cdc init, cdc check and cdc run refuse)."""
    return Projector(mapping, live_shape(conn, mapping, catalog), catalog)


def judge_live(conn: psycopg.Connection, mappings: Sequence[Mapping]) -> None:
    """Every table mapping judged against its live table (`cdc.mapping.judge`): the first refusal raises."""
    catalog = TypeCatalog()
    for m in mappings:
        if m.table is not None:
            judge(m, live_shape(conn, m, catalog), catalog)


def _json_text(schema: dict) -> dict:
    """A stream field holding JSON text whose decoded value follows `schema`."""
    return {"type": "string", "contentMediaType": "application/json", "contentSchema": schema}


#: what a consumer can and cannot do with a hashed field (docs/reference/mappings.md)
_HASH_DESCRIPTIONS = {
    "hmac-sha256": "HMAC-SHA256 of the source value under the deployment's secret hash key, as hex: equal values give "
                   "equal hashes, so it can be compared and joined on (with other fields hashed under the same key); "
                   "it cannot be reversed without the key; rotating the key changes every value",
    "sha256": "SHA-256 of the source value (unkeyed), as hex: equal values give equal hashes; anyone can find the "
              "value by hashing likely values, so it is not private",
}


def _entity_schema(mapping: Mapping, projector: Projector | None, catalog: TypeCatalog) -> dict:
    key_props: dict = {}
    props: dict = {}
    columns = {c.name: c for c in projector.shape.columns} if projector else {}
    for spec in mapping.fields:
        if spec.column is None:
            value = spec.const
            kind = {bool: "boolean", int: "integer", float: "number", str: "string"}.get(type(value), "null")
            props[spec.name] = {"const": value, "type": kind}
            continue
        if spec.hash:
            schema = {"type": "string", "pattern": "^[0-9a-f]{64}$", "description": _HASH_DESCRIPTIONS[spec.hash]}
        elif spec.redact:
            schema = {"type": "string", "const": "***"}
        elif spec.cast == "string":
            schema = {"type": "string"}
        elif spec.cast == "float":
            schema = {"type": "number"}
        elif spec.cast == "integer":
            schema = {"type": "integer"}
        elif spec.cast in ("epoch_ms", "epoch_s"):
            schema = {"type": "number", "description": "exact: an integer, or decimal digits below the unit"}
        elif spec.cast == "date":
            schema = {"type": "string", "format": "date"}
        else:
            schema = json_schema_for(columns[spec.column].type_oid, catalog)
        nullable = {"anyOf": [schema, {"type": "null"}]} if spec.name not in mapping.key else schema
        props[spec.name] = nullable
        if spec.name in mapping.key:
            key_props[spec.name] = schema
    record = {"type": "object", "properties": props, "additionalProperties": False}
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "title": mapping.entity,
        "description": f"one Redis stream entry of entity {mapping.entity} (mapping version {mapping.version}); every field is a string",
        "type": "object",
        "properties": {
            "op": {"enum": sorted(mapping.ops | ({"r", "x"} if mapping.table else set()))},  # x: cdc recover
            "key": _json_text({"type": "object", "properties": key_props, "required": list(mapping.key), "additionalProperties": False}),
            "data": _json_text(record),
            "before": _json_text({"type": "object", "properties": props, "additionalProperties": False}),
            "unchanged": _json_text({"type": "array", "items": {"enum": [f.name for f in mapping.fields]}}),
            "lsn": {"type": "string", "pattern": "^[0-9]+$", "description": "commit LSN of the source transaction"},
            "seq": {"type": "string", "pattern": "^[0-9]+$", "description": "position of the change in its transaction"},
            "xid": {"type": "string", "pattern": "^[0-9]+$"},
            "ts_ms": {"type": "string", "pattern": "^[0-9]+$", "description": "commit time, Unix milliseconds"},
            "v": {"const": str(mapping.version)},
        },
        "required": ["op", "key", "lsn", "seq", "xid", "ts_ms", "v"],
    }


def json_schemas(settings: Settings, mappings: Sequence[Mapping]) -> dict[str, dict]:
    """A JSON Schema per entity, with column types read from the live schema."""
    catalog = TypeCatalog()
    result = {}
    with connect(settings) as conn:
        try:
            for m in mappings:
                if m.table is None:
                    result[m.entity] = {
                        "$schema": "https://json-schema.org/draft/2020-12/schema",
                        "title": m.entity,
                        "type": "object",
                        "properties": {
                            "op": {"const": "m"},
                            "data": {"type": "object", "properties": {"prefix": {"type": "string"}, "content": {}}},
                        },
                    }
                    continue
                result[m.entity] = _entity_schema(m, bind_live(conn, m, catalog), catalog)
        except psycopg.Error as exc:
            raise classify_pg_error(exc) from exc
    if settings.transactions.stream:
        result[keys.TRANSACTIONS_OWNER] = end_record_schema(settings.transactions.stream)
    return result


def end_record_schema(stream: str) -> dict:
    """The JSON Schema of an entry of the transactions stream: an END record, or the marker of cdc recover."""
    digits = {"type": "string", "pattern": "^[0-9]+$"}
    counts = {"type": "object", "additionalProperties": {"type": "integer", "minimum": 1}}
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "title": "transaction END record",
        "description": f"one entry of the transactions stream {stream}: the end of a source transaction that produced "
                       "entries (op e), or the marker of cdc recover (op x); every field is a string",
        "type": "object",
        "properties": {
            "op": {"enum": ["e", "x"]},
            "key": _json_text({"type": "object", "additionalProperties": False}),
            "data": _json_text({"type": "object", "properties": {
                "count": {"type": "integer", "minimum": 1, "description": "the transaction's entries, in all streams"},
                "streams": {**counts, "description": "its entries per stream key (partition streams separately)"},
                "transactions": {"type": "array", "minItems": 1, "items": {
                    "type": "array", "prefixItems": [{"type": "integer"}] * 3, "minItems": 3, "maxItems": 3,
                    "description": "[xid, commit LSN, ts_ms]"},
                    "description": "format 2 (v 2): the transactions it covers, in commit order (count and streams "
                                   "are theirs together)"},
            }, "description": "of op e; op x carries the marker of cdc recover"}),
            "lsn": {**digits, "description": "commit LSN of the source transaction (as its entries; format 2: the "
                                             "last one's)"},
            "seq": {**digits, "description": "one past the largest seq of the transaction's entries"},
            "xid": {**digits, "description": "transaction id (as its entries)"},
            "ts_ms": {**digits, "description": "commit time, Unix milliseconds (as its entries)"},
            "v": {"enum": ["1", "2"], "description": "the END record's format version: 2 covers several transactions "
                                                    "(transactions.max_per_end)"},
        },
        "required": ["op", "key", "lsn", "seq", "xid", "ts_ms", "v"],
    }
