"""Setting up and checking the source: publication, slot, mapped tables, JSON Schema.

`init` is idempotent and reports each thing it did; `cdc check` lives in
`cdc.ops.preflight` and binds every mapping with `bind_live`, the same `Projector`
the stream uses.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import psycopg
import redis

from ..bridge.backfill import enqueue, ensure_table
from ..bridge.guards import clear_data_loss
from ..source.catalog import load_types, table_shape
from ..source.failover import create_slot, make_failover_slot
from ..config import Settings
from .. import keys
from ..errors import MappingError, SourceError
from ..exits import as_cdc_error
from ..source.lsn import Lsn
from ..sink.redisconn import connect_redis
from ..mapping.model import Mapping
from ..mapping.projector import Projector
from ..source.replication import SESSION_OPTIONS, classify_pg_error, quote_ident
from ..source.values import TypeCatalog, json_schema_for

__all__ = ["bind_live", "connect", "init", "json_schemas"]

log = logging.getLogger("cdc.admin")


def connect(settings: Settings) -> psycopg.Connection:
    try:
        return psycopg.connect(settings.postgres.dsn, autocommit=True, options=SESSION_OPTIONS, connect_timeout=10)
    except Exception as exc:
        raise classify_pg_error(exc) from exc


def _wal_level(conn: psycopg.Connection) -> None:
    level = conn.execute("SHOW wal_level").fetchone()[0]
    if level != "logical":
        raise SourceError(
            f"postgres wal_level is {level!r}, logical decoding needs 'logical'",
            hint="set wal_level = logical in postgresql.conf and restart PostgreSQL",
        )


def _tables(mappings: Sequence[Mapping]) -> list[tuple[str, str]]:
    return sorted({m.table for m in mappings if m.table is not None})


def init(settings: Settings, mappings: Sequence[Mapping]) -> list[str]:
    """Create the publication (for the mapped tables) and the slot; return what was done."""
    done: list[str] = []
    pgs = settings.postgres
    with connect(settings) as conn:
        try:
            _wal_level(conn)
            tables = _tables(mappings)
            missing = [f"{s}.{t}" for s, t in tables if table_shape(conn, s, t) is None]
            if missing:
                raise MappingError(f"mapped table {missing[0]} does not exist", hint="create it first, or fix the mapping's table")
            published = {
                (r[0], r[1])
                for r in conn.execute("SELECT schemaname, tablename FROM pg_publication_tables WHERE pubname = %s", (pgs.publication,))
            }
            exists = conn.execute("SELECT puballtables FROM pg_publication WHERE pubname = %s", (pgs.publication,)).fetchone()
            names = ", ".join(f"{quote_ident(s)}.{quote_ident(t)}" for s, t in tables)
            if exists is None:
                if tables:
                    conn.execute(f"CREATE PUBLICATION {quote_ident(pgs.publication)} FOR TABLE {names}")
                else:
                    conn.execute(f"CREATE PUBLICATION {quote_ident(pgs.publication)}")
                done.append(f"created publication {pgs.publication} for {len(tables)} table(s)")
            elif not exists[0]:
                add = [(s, t) for s, t in tables if (s, t) not in published]
                if add:
                    conn.execute(
                        f"ALTER PUBLICATION {quote_ident(pgs.publication)} ADD TABLE "
                        + ", ".join(f"{quote_ident(s)}.{quote_ident(t)}" for s, t in add)
                    )
                    done.append(f"added {len(add)} table(s) to publication {pgs.publication}")
                else:
                    done.append(f"publication {pgs.publication} already covers the mapped tables")
            else:
                done.append(f"publication {pgs.publication} already publishes all tables")
            ensure_table(conn)
            slot = conn.execute(
                "SELECT plugin, confirmed_flush_lsn::text FROM pg_replication_slots WHERE slot_name = %s", (pgs.slot,)
            ).fetchone()
            if slot is None:
                # what the function returns is the new slot's confirmed position
                confirmed, created = create_slot(conn, pgs.slot, pgs.failover_slot)
                done.append(created)
                for m in mappings:
                    if m.snapshot == "initial":
                        backfill_id = enqueue(conn, pgs.slot, m)
                        done.append(f"initial snapshot of {m.entity} queued (backfill {backfill_id}); cdc run publishes it")
            elif slot[0] != "pgoutput":
                raise SourceError(f"slot {pgs.slot} exists with plugin {slot[0]!r}, not pgoutput", hint="drop it or choose another postgres.slot")
            else:
                done.append(f"slot {pgs.slot} already exists")
                confirmed = slot[1]
                converted = make_failover_slot(pgs.dsn, conn, pgs.slot) if pgs.failover_slot else None
                if converted:
                    done.append(converted)
        except psycopg.Error as exc:
            raise classify_pg_error(exc, slot=pgs.slot, publication=pgs.publication, role=conn.info.user) from exc
    done.append(_register_redis(settings, Lsn.parse(confirmed)))
    return done


def _register_redis(settings: Settings, confirmed: Lsn) -> str:
    """Record in Redis that it holds the source up to the slot's position, unless it already does.

    `cdc run` compares this record with the slot to detect a Redis that lost data;
    a new (or deliberately emptied) Redis is registered here.
    """
    key = keys.flushed_key(settings.postgres.slot)
    client = None
    try:
        client = connect_redis(settings.redis)
        if client.set(key, str(int(confirmed)), nx=True):
            clear_data_loss(client, settings.postgres.slot)
            return f"registered redis for slot {settings.postgres.slot} at {confirmed}"
        current = Lsn(int(client.get(key)))
        if current < confirmed:
            client.set(key, str(int(confirmed)))
            clear_data_loss(client, settings.postgres.slot)
            return f"redis held changes up to {current} only; accepted the loss up to {confirmed}"
        return f"redis already holds slot {settings.postgres.slot} up to {current}"
    except redis.RedisError as exc:  # unreachable: 75; a refused login or command: 5
        raise as_cdc_error(exc) from exc
    finally:
        if client is not None:
            client.close()


def bind_live(conn: psycopg.Connection, mapping: Mapping, catalog: TypeCatalog) -> Projector:
    schema, name = mapping.table
    shape = table_shape(conn, schema, name)
    if shape is None:
        raise MappingError(f"{mapping.where}: entity {mapping.entity!r}: table {schema}.{name} does not exist", hint="create it or fix table:")
    load_types(conn, catalog, [c.type_oid for c in shape.columns])
    return Projector(mapping, shape, catalog)


def _json_text(schema: dict) -> dict:
    """A stream field holding JSON text whose decoded value follows `schema`."""
    return {"type": "string", "contentMediaType": "application/json", "contentSchema": schema}


#: what a consumer can and cannot do with a hashed field (README "Mappings")
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
            schema = {"type": ["number", "string"]}
        elif spec.cast in ("integer", "epoch_ms", "epoch_s"):
            schema = {"type": ["integer", "string"]}
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
    return result
