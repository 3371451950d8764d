"""How the reconciliation reads its source: JDBC connection, column types, partition ranges, the query.

Plain SQL and values, no Spark: `cdc.reconcile.truth` hands these to Spark's
JDBC reader.
"""

from __future__ import annotations

import os
from datetime import date, datetime, timezone
from typing import Any
from urllib.parse import quote as url_quote

import psycopg
from psycopg.conninfo import conninfo_to_dict

from ..errors import ConfigError
from ..source.replication import quote_ident
from .spec import ReconcileSpec

__all__ = ["NUMERIC_OID", "SNAPSHOT_COLUMN", "describe_source", "jdbc_url", "partition_bounds", "source_from",
           "source_query", "split"]

NUMERIC_OID = 1700
SNAPSHOT_COLUMN = "__cdc_snapshot"


def jdbc_url(dsn: str) -> tuple[str, dict[str, str]]:
    """A JDBC URL and connection properties for a libpq connection string or URI."""
    params = conninfo_to_dict(dsn)
    host = params.pop("host", None) or "localhost"
    if host.startswith("/"):
        raise ConfigError("the JDBC driver cannot use a Unix socket: give postgres.dsn a TCP host",
                          hint="for example host=localhost port=5432")
    port = params.pop("port", None) or "5432"
    dbname = params.pop("dbname", None) or params.get("user") or os.environ.get("USER", "postgres")
    props = {"driver": "org.postgresql.Driver", "ApplicationName": "cdc-reconcile"}
    for libpq, jdbc in (("user", "user"), ("password", "password"), ("sslmode", "sslmode"),
                        ("sslrootcert", "sslrootcert"), ("sslcert", "sslcert"), ("sslkey", "sslkey"),
                        ("connect_timeout", "connectTimeout")):
        if params.get(libpq):
            props[jdbc] = str(params[libpq])
    if "password" not in props and os.environ.get("PGPASSWORD"):
        props["password"] = os.environ["PGPASSWORD"]
    return f"jdbc:postgresql://{host}:{port}/{url_quote(dbname)}", props


def source_from(spec: ReconcileSpec) -> str:
    if spec.table:
        return ".".join(quote_ident(part) for part in spec.table.split("."))
    return f"({spec.query}) AS cdc_query"


def describe_source(conn: psycopg.Connection, spec: ReconcileSpec) -> dict[str, tuple[int, int | None, int | None]]:
    """(type oid, precision, scale) of each source column the spec reads; errors name the spec's line."""
    cols = ", ".join(quote_ident(c) for c in spec.source_columns)
    try:
        cur = conn.execute(f"SELECT {cols} FROM {source_from(spec)} LIMIT 0")
    except psycopg.errors.UndefinedColumn as exc:
        raise ConfigError(f"{spec.where}: {str(exc).splitlines()[0]}", hint="fix the column names in the spec") from None
    except psycopg.errors.UndefinedTable as exc:
        raise ConfigError(f"{spec.where}: {str(exc).splitlines()[0]}", hint="fix source.table or source.query") from None
    except psycopg.errors.InsufficientPrivilege as exc:
        raise ConfigError(f"{spec.where}: {str(exc).splitlines()[0]}",
                          hint="grant SELECT on the source to the reconciliation's role") from None
    except psycopg.errors.SyntaxError as exc:
        raise ConfigError(f"{spec.where}: source.query: {str(exc).splitlines()[0]}") from None
    return {d.name: (d.type_code, d.precision, d.scale) for d in cur.description}


def partition_bounds(conn: psycopg.Connection, spec: ReconcileSpec) -> tuple[Any, Any] | None:
    """(min, max) of the partition column, read in `conn`'s transaction (the imported snapshot)."""
    if not spec.partition_column:
        return None
    col = quote_ident(spec.partition_column)
    return conn.execute(f"SELECT min({col}), max({col}) FROM {source_from(spec)}").fetchone()


def split(spec: ReconcileSpec, low: Any, high: Any) -> tuple[int, str, str]:
    """How many ranges the read is split into, and Spark's bounds as text.

    The bounds only set the stride: Spark's first range also takes everything
    below (and NULL), its last everything above, so every row is read exactly
    once whatever the bounds. An integer, date or timestamp column can split a read.
    """
    if isinstance(low, int) and not isinstance(low, bool):
        return max(1, min(spec.partitions, high - low + 1)), str(low), str(high)
    if isinstance(low, datetime):  # before date: a datetime is a date
        if low.tzinfo is not None:  # Spark reads these in its session time zone: UTC
            low, high = (v.astimezone(timezone.utc).replace(tzinfo=None) for v in (low, high))
        return (1 if low == high else spec.partitions), low.isoformat(" "), high.isoformat(" ")
    if isinstance(low, date):
        return max(1, min(spec.partitions, (high - low).days + 1)), low.isoformat(), high.isoformat()
    raise ConfigError(f"{spec.partition_where}: partition_column {spec.partition_column} must be an integer, date or timestamp column",
                      hint="split on such a column, or read with partitions: 1")


def source_query(spec: ReconcileSpec, types: dict[str, tuple[int, int | None, int | None]]) -> str:
    """The subquery each Spark partition runs (Spark adds the partition's range condition)."""
    select: list[str] = [quote_ident(c) for c in spec.group_by]
    done = set(spec.group_by)
    for a in spec.values:
        if a.column is None or a.column in done:
            continue
        done.add(a.column)
        oid, precision, _ = types[a.column]
        if oid == NUMERIC_OID and a.function != "count" and (precision is None or precision > 38):
            if a.decimal is None:
                raise ConfigError(
                    f"{a.where}: {a.column} is numeric without a precision Spark can hold exactly",
                    hint="declare it: {of: " + f"{a.function}({a.column})" + ", decimal: [38, 6]} with a scale at least "
                         "as large as the data needs (a value that would be rounded fails the job)",
                )
        if a.decimal is not None:
            cast = f"{quote_ident(a.column)}::numeric({a.decimal[0]},{a.decimal[1]})"
            select.append(f"{cast} AS {quote_ident(a.column)}")
            select.append(f"({quote_ident(a.column)} IS DISTINCT FROM {cast}) AS {quote_ident('__cdc_rounded_' + a.column)}")
        else:
            select.append(quote_ident(a.column))
    if spec.partition_column and spec.partition_column not in done:
        select.append(quote_ident(spec.partition_column))
    select.append(f"(SELECT pg_current_snapshot()::text) AS {SNAPSHOT_COLUMN}")
    return f"(SELECT {', '.join(select)} FROM {source_from(spec)}) AS cdc_source"
