"""Reconciliation specs: what the truth is and which consumer state it must equal, from YAML.

A spec names a canonical source (a table or a SQL query), the key columns to
group by (optionally one more "overall" row over everything), the aggregates
(sum, count, min, max) and the consumers whose state holds those aggregates.
Loading is pure and reports ``file:line`` with the fix; `cdc.reconcile.job` runs it.

    name: ride-totals
    source:
      table: public.rides             # or query: SELECT ... (a subquery)
      partition_column: id            # an integer, date or timestamp column to split the read on
      partitions: 4
    truth:
      group_by: [rider_id]
      overall: {rider_id: 0}          # one more row over all source rows, under this key
      values:
        total_distance: sum(distance_m)
    consumers:
      - name: ride-totals             # the consumer's name in cdc_checkpoints (cdc consume --group)
        entity: ride
        handler: cdc.demo.rocketrides:ride_totals
        state:
          table: consumer_states
          scope: {consumer: ride-totals}
"""

from __future__ import annotations

import re
from collections.abc import Mapping as MappingABC
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import ConfigError
from ..operator_sql import check_select
from ..yamlsrc import load_yaml_file, where, yaml_files

__all__ = ["Aggregate", "ConsumerTarget", "ReconcileSpec", "load_specs", "parse_spec"]

FUNCTIONS = ("sum", "count", "min", "max")
_AGGREGATE = re.compile(r"^\s*(sum|count|min|max)\s*\(\s*(\*|[A-Za-z_][A-Za-z0-9_]*)\s*\)\s*$", re.IGNORECASE)
_IDENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_QUALIFIED = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)?$")
_HANDLER = re.compile(r"^[A-Za-z_][A-Za-z0-9_.]*:[A-Za-z_][A-Za-z0-9_]*$")


@dataclass(frozen=True)
class Aggregate:
    """One state column and the aggregate over the source that must equal it."""

    name: str  # the state column (and the truth's column)
    function: str  # sum | count | min | max
    column: str | None  # source column; None for count(*)
    #: (precision, scale) to read an unconstrained numeric column with; a value needing more scale is an error
    decimal: tuple[int, int] | None = None
    where: str = ""

    @property
    def additive(self) -> bool:
        """A missing row equals zero for sums and counts (not for min and max)."""
        return self.function in ("sum", "count")


@dataclass(frozen=True)
class ConsumerTarget:
    """A consumer whose state must equal the truth: its name, streams, apply function and state table."""

    name: str
    entity: str
    handler: str  # module:function, the apply function of cdc.consume.checkpoint.TransactionalHandler
    table: str
    scope: tuple[tuple[str, Any], ...] = ()
    group: str = ""  # the Redis consumer group (default: name)
    state_dsn: str | None = None
    where: str = ""


@dataclass(frozen=True)
class ReconcileSpec:
    name: str
    table: str | None
    query: str | None
    partition_column: str | None
    partitions: int
    fetch_size: int
    group_by: tuple[str, ...]
    overall: tuple[tuple[str, Any], ...] | None
    values: tuple[Aggregate, ...]
    consumers: tuple[ConsumerTarget, ...]
    where: str = ""
    partition_where: str = ""
    source_where: str = ""  # file:line of source.table or source.query
    group_by_where: str = ""

    @property
    def key_columns(self) -> tuple[str, ...]:
        return self.group_by if self.group_by else tuple(k for k, _ in self.overall or ())

    @property
    def source_columns(self) -> tuple[str, ...]:
        """Every source column the read needs: nothing else leaves the database."""
        cols = list(self.group_by)
        cols += [a.column for a in self.values if a.column and a.column not in cols]
        if self.partition_column and self.partition_column not in cols:
            cols.append(self.partition_column)
        return tuple(cols)


def _fail(place: str, message: str, hint: str | None = None) -> ConfigError:
    return ConfigError(f"{place}: {message}", hint=hint)


def _check_keys(raw: MappingABC, allowed: tuple[str, ...], what: str) -> None:
    for key in raw:
        if key not in allowed:
            raise _fail(where(raw, key), f"unknown key {key!r} in {what}", f"{what} accepts: {', '.join(allowed)}")


def _mapping(parent: MappingABC, key: str, what: str, required: bool = True) -> MappingABC:
    value = parent.get(key)
    if value is None and not required:
        return {}
    if not isinstance(value, dict):
        raise _fail(where(parent, key), f"{what} must be a mapping", f"add {key}: with its settings")
    return value


def _ident(parent: MappingABC, key: str, what: str) -> str:
    value = parent.get(key)
    if not isinstance(value, str) or not _IDENT.match(value):
        raise _fail(where(parent, key), f"{what} must be a column name, got {value!r}")
    return value


def _positive(parent: MappingABC, key: str, default: int) -> int:
    value = parent.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise _fail(where(parent, key), f"{key} must be a positive integer, got {value!r}")
    return value


def _key_values(raw: Any, place: str, what: str) -> tuple[tuple[str, Any], ...]:
    if not isinstance(raw, dict) or not raw:
        raise _fail(place, f"{what} must map column names to values", f"for example: {what}: {{rider_id: 0}}")
    for col, value in raw.items():
        if not isinstance(col, str) or not _IDENT.match(col):
            raise _fail(where(raw, col), f"{what}: {col!r} is not a column name")
        if not isinstance(value, (str, int, float)) or isinstance(value, bool):
            raise _fail(where(raw, col), f"{what}: the value of {col} must be a string or a number")
    return tuple(raw.items())


def _aggregate(name: Any, raw: Any, values: MappingABC) -> Aggregate:
    place = where(values, name)
    if not isinstance(name, str) or not _IDENT.match(name):
        raise _fail(place, f"{name!r} is not a state column name")
    decimal = None
    text = raw
    if isinstance(raw, dict):
        _check_keys(raw, ("of", "decimal"), f"value {name}")
        text = raw.get("of")
        if "decimal" in raw:
            d = raw["decimal"]
            if (not isinstance(d, list) or len(d) != 2 or not all(isinstance(x, int) and not isinstance(x, bool) for x in d)
                    or not 1 <= d[0] <= 38 or not 0 <= d[1] <= d[0]):
                raise _fail(where(raw, "decimal"), f"decimal must be [precision, scale] with 0 <= scale <= precision <= 38, got {d!r}")
            decimal = (d[0], d[1])
    m = _AGGREGATE.match(text) if isinstance(text, str) else None
    if m is None:
        raise _fail(place, f"value {name}: expected sum(column), count(*), count(column), min(column) or max(column), got {text!r}")
    function, column = m.group(1).lower(), m.group(2)
    if column == "*":
        if function != "count":
            raise _fail(place, f"value {name}: only count takes *")
        column = None
    if decimal is not None and function == "count":
        raise _fail(place, f"value {name}: decimal applies to sum, min and max, not count")
    return Aggregate(name, function, column, decimal, place)


def _consumer(raw: Any, place: str) -> ConsumerTarget:
    if not isinstance(raw, dict):
        raise _fail(place, "each consumer must be a mapping with name, entity, handler and state")
    _check_keys(raw, ("name", "group", "entity", "handler", "state"), "a consumer")
    for key in ("name", "entity", "handler"):
        if not isinstance(raw.get(key), str) or not raw[key]:
            raise _fail(where(raw, key), f"consumer needs {key}", "name: the --group it runs with; entity: its mapping; "
                        "handler: module:function")
    if not _HANDLER.match(raw["handler"]):
        raise _fail(where(raw, "handler"), f"handler must be module:function, got {raw['handler']!r}",
                    "for example: cdc.demo.rocketrides:ride_totals")
    state = _mapping(raw, "state", "state")
    _check_keys(state, ("table", "scope", "dsn"), "state")
    table = state.get("table")
    if not isinstance(table, str) or not _QUALIFIED.match(table):
        raise _fail(where(state, "table"), f"state.table must be a table name, got {table!r}")
    scope = _key_values(state["scope"], where(state, "scope"), "scope") if "scope" in state else ()
    dsn = state.get("dsn")
    if dsn is not None and not isinstance(dsn, str):
        raise _fail(where(state, "dsn"), "state.dsn must be a connection string")
    if dsn:
        from ..config import check_dsn

        check_dsn(dsn, f"{where(state, 'dsn')}: state.dsn")  # hides its password from every message from now on
    group = raw.get("group", raw["name"])
    if not isinstance(group, str) or not group:
        raise _fail(where(raw, "group"), "group must be a consumer group name")
    from ..keys import group_problem

    if (problem := group_problem(group)) is not None:
        raise _fail(where(raw, "group"), problem)
    return ConsumerTarget(raw["name"], raw["entity"], raw["handler"], table, scope, group, dsn, where(raw))


def parse_spec(raw: Any, source: str = "<spec>") -> ReconcileSpec:
    if not isinstance(raw, dict):
        raise _fail(source, "a reconciliation spec must be a mapping with name, source, truth and consumers")
    _check_keys(raw, ("name", "source", "truth", "consumers"), "a reconciliation spec")
    name = raw.get("name")
    if not isinstance(name, str) or not re.match(r"^[A-Za-z0-9_.-]+$", name or ""):
        raise _fail(where(raw, "name"), f"name must be letters, digits, . _ or -, got {name!r}")

    src, table, query, partition_column, partitions, fetch_size = _source(raw)
    truth, group_by, overall, aggregates = _truth(raw)
    consumers = _consumers(raw)
    return ReconcileSpec(
        name=name, table=table, query=query, partition_column=partition_column, partitions=partitions,
        fetch_size=fetch_size, group_by=tuple(group_by), overall=overall, values=aggregates, consumers=consumers,
        where=where(raw), partition_where=where(src, "partition_column"),
        source_where=where(src, "table" if table is not None else "query"),
        group_by_where=where(truth, "group_by") if "group_by" in truth else where(truth, "overall"),
    )


def _source(raw: dict) -> tuple:
    """The spec's source: a table or one SELECT, and how to read it in parallel."""
    src = _mapping(raw, "source", "source")
    _check_keys(src, ("table", "query", "partition_column", "partitions", "fetch_size"), "source")
    table, query = src.get("table"), src.get("query")
    if (table is None) == (query is None):
        raise _fail(where(src), "source needs exactly one of table or query")
    if table is not None and (not isinstance(table, str) or not _QUALIFIED.match(table)):
        raise _fail(where(src, "table"), f"source.table must be [schema.]table, got {table!r}")
    if query is not None and (not isinstance(query, str) or not query.strip()):
        raise _fail(where(src, "query"), "source.query must be a SELECT statement")
    if isinstance(query, str):
        query = query.strip().rstrip(";")
        # one SELECT that stays inside the subquery it is read as; what it calls is checked live (job._check_source)
        check_select(query, f"{where(src, 'query')}: source.query")
    partition_column = _ident(src, "partition_column", "partition_column") if "partition_column" in src else None
    partitions = _positive(src, "partitions", 4)
    if partitions > 1 and partition_column is None:
        raise _fail(where(src), "a parallel read needs partition_column (an integer, date or timestamp column)",
                    "add partition_column: id, or partitions: 1")
    fetch_size = _positive(src, "fetch_size", 10_000)
    return src, table, query, partition_column, partitions, fetch_size


def _truth(raw: dict) -> tuple:
    """The spec's truth: its key (group_by, overall or both) and its aggregates."""
    truth = _mapping(raw, "truth", "truth")
    _check_keys(truth, ("group_by", "overall", "values"), "truth")
    group_by = truth.get("group_by", [])
    if isinstance(group_by, str):
        group_by = [group_by]
    if not isinstance(group_by, list) or not all(isinstance(c, str) and _IDENT.match(c) for c in group_by):
        raise _fail(where(truth, "group_by"), "group_by must be a list of column names")
    overall = None
    if "overall" in truth:
        overall = _key_values(truth["overall"], where(truth, "overall"), "overall")
        if group_by and tuple(k for k, _ in overall) != tuple(group_by):
            raise _fail(where(truth, "overall"), f"overall must give a value for each group_by column, in order: {group_by}")
    if not group_by and overall is None:
        raise _fail(where(truth), "truth needs group_by, overall, or both")
    values = _mapping(truth, "values", "values")
    if not values:
        raise _fail(where(truth, "values"), "values must name at least one aggregate", "for example: total: sum(amount)")
    aggregates = tuple(_aggregate(k, v, values) for k, v in values.items())
    key_cols = tuple(group_by) or tuple(k for k, _ in overall or ())
    for a in aggregates:
        if a.name in key_cols:
            raise _fail(a.where, f"{a.name} is both a key column and a value")
    return truth, group_by, overall, aggregates


def _consumers(raw: dict) -> tuple:
    """The consumers to check, each listed once."""
    consumers_raw = raw.get("consumers")
    if not isinstance(consumers_raw, list) or not consumers_raw:
        raise _fail(where(raw, "consumers"), "consumers must list at least one consumer to check")
    consumers = tuple(_consumer(c, where(consumers_raw)) for c in consumers_raw)
    names = [c.name for c in consumers]
    if len(set(names)) != len(names):
        raise _fail(where(raw, "consumers"), "each consumer may be listed once")
    return consumers


def load_specs(path: Path) -> list[ReconcileSpec]:
    """Every spec in a folder of ``*.yaml``/``*.yml`` (or one file)."""
    files = yaml_files(path, "reconciliation specs", "set reconcile.specs in the config to a folder of *.yaml specs")
    specs = [parse_spec(doc, str(file)) for file in files for doc in load_yaml_file(file)]
    if not specs:
        raise ConfigError(f"no reconciliation specs in {path}")
    seen: set[str] = set()
    for s in specs:
        if s.name in seen:
            raise _fail(s.where, f"another spec is also named {s.name!r}")
        seen.add(s.name)
    return specs
