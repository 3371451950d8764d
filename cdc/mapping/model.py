"""Mappings: which internal table becomes which public record, loaded from YAML.

A mapping is an allowlist: only the fields it names ever leave the database.
Everything here is pure: loading validates shape and meaning and reports
``file:line`` with the fix; `cdc.mapping.projector` applies a mapping to rows.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Mapping as MappingABC
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .. import keys
from ..errors import ConfigError, MappingError
from ..yamlsrc import load_yaml_file, where, yaml_files

__all__ = ["ON_UNACCOUNTABLE", "Condition", "FieldSpec", "Mapping", "load_mappings", "mapped_columns", "parse_mapping",
           "resync_tables"]

ALL_OPS = ("c", "u", "d", "t", "r")
CASTS = ("string", "float", "integer", "epoch_ms", "epoch_s", "date")
#: hmac-sha256: keyed with the deployment's hash key (cdc.config: CDC_HASH_KEY_FILE); sha256: unkeyed, only with
#: `unkeyed: true`, for values that are not private (a dictionary of likely values reverses it)
HASHES = ("hmac-sha256", "sha256")
KEYED_HASHES = ("hmac-sha256",)
HASH_KEY_HINT = ("set CDC_HASH_KEY_FILE (or hash_key_file: in cdc.yaml) to a file holding a secret key, e.g. made with: "
                 "head -c 32 /dev/urandom | base64 > hash.key")
FILTER_OPS = ("eq", "ne", "in", "not_in", "gt", "gte", "lt", "lte", "is_null")
REDACTED = "***"
_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_.-]*$")
_TOP_KEYS = (
    "entity", "table", "message_prefix", "key", "fields", "stream", "version",
    "ops", "before", "filter", "partitions", "snapshot", "on_unaccountable",
)
#: what the bridge does when it cannot account for a change of the mapping's table (docs/concepts/cannot-account.md):
#: stop (exit 4, slot held), or resync its stream from the table with an online backfill
ON_UNACCOUNTABLE = ("stop", "resync")


@dataclass(frozen=True)
class FieldSpec:
    """One public field: where its value comes from and how it is transformed."""

    name: str
    column: str | None = None
    const: Any = None
    cast: str | None = None
    hash: str | None = None
    salt: bytes = field(default=b"", repr=False)
    #: the secret of a keyed hash (never shown)
    key: bytes = field(default=b"", repr=False)
    redact: bool = False
    where: str = ""


@dataclass(frozen=True)
class Condition:
    """One row-filter condition on a source column; all of a mapping's must hold."""

    column: str
    op: str
    value: Any
    where: str = ""


@dataclass(frozen=True)
class Mapping:
    entity: str
    table: tuple[str, str] | None = None
    message_prefix: str | None = None
    key: tuple[str, ...] = ()
    fields: tuple[FieldSpec, ...] = ()
    stream: str = keys.DEFAULT_STREAM_TEMPLATE
    version: int = 1
    ops: frozenset[str] = frozenset(ALL_OPS)
    before: bool = True
    filter: tuple[Condition, ...] = ()
    partitions: int = 1
    partition_by: tuple[str, ...] = ()
    #: "initial": publish the table's rows (op r) when `cdc init` creates the slot; "never"
    snapshot: str = "never"
    #: "stop" (the default) or "resync": see `ON_UNACCOUNTABLE`
    on_unaccountable: str = "stop"
    where: str = ""
    field_lines: MappingABC[str, str] = field(default_factory=dict)
    #: file:line of `key:` ("" for a message mapping)
    key_where: str = ""

    @property
    def qualified_table(self) -> str:
        return f"{self.table[0]}.{self.table[1]}" if self.table else ""

    @property
    def columns(self) -> tuple[str, ...]:
        """Source columns the mapping reads (fields, then filter-only ones)."""
        seen: dict[str, None] = {}
        for spec in self.fields:
            if spec.column is not None:
                seen.setdefault(spec.column)
        for cond in self.filter:
            seen.setdefault(cond.column)
        return tuple(seen)

    def stream_key(self, partition: int = 0) -> str:
        schema, table = self.table or ("", "")
        return keys.stream_key(self.stream, entity=self.entity, schema=schema, table=table, partition=partition)

    def stream_keys(self) -> list[str]:
        return [self.stream_key(p) for p in range(self.partitions)]


def mapped_columns(mappings: Iterable[Mapping]) -> dict[tuple[str, str], tuple[str, ...]]:
    """Per mapped table, the source columns its mappings read (fields, key, filters), in mapping order."""
    seen: dict[tuple[str, str], dict[str, None]] = {}
    for m in mappings:
        if m.table is not None:
            seen.setdefault(m.table, {}).update(dict.fromkeys(m.columns))
    return {table: tuple(columns) for table, columns in seen.items()}


def resync_tables(mappings: Iterable[Mapping]) -> set[tuple[str, str]]:
    """The mapped tables every mapping of which says `on_unaccountable: resync` (any other stops the bridge)."""
    says: dict[tuple[str, str], bool] = {}
    for m in mappings:
        if m.table is not None:
            says[m.table] = says.get(m.table, True) and m.on_unaccountable == "resync"
    return {t for t, resync in says.items() if resync}


def _fail(place: str, message: str, hint: str | None = None) -> MappingError:
    return MappingError(f"{place}: {message}", hint=hint)


def _name_list(raw: Any, place: str, what: str) -> tuple[str, ...]:
    if isinstance(raw, str):
        raw = [raw]
    if not isinstance(raw, list) or not raw or not all(isinstance(x, str) and x for x in raw):
        raise _fail(place, f"{what} must be a list of names", f"for example: {what}: [id]")
    if len(set(raw)) != len(raw):
        raise _fail(place, f"{what} lists a name twice")
    return tuple(raw)


def _parse_table(raw: Any, place: str) -> tuple[str, str]:
    if not isinstance(raw, str) or not raw.strip():
        raise _fail(place, "table must be a table name", "for example: table: public.rides")
    parts = raw.strip().split(".")
    if len(parts) == 1:
        return ("public", parts[0])
    if len(parts) == 2 and all(parts):
        return (parts[0], parts[1])
    raise _fail(place, f"table {raw!r} is not 'schema.table' or 'table'")


def _parse_field(name: Any, raw: Any, place: str, env: MappingABC[str, str], hash_key: bytes | None) -> FieldSpec:
    if not isinstance(name, str) or not _NAME.match(name):
        raise _fail(place, f"field name {name!r} is not a valid public name", "use letters, digits, '_', '.', '-'")
    if isinstance(raw, str):
        return FieldSpec(name=name, column=raw, where=place)
    if not isinstance(raw, dict):
        raise _fail(
            place,
            f"field {name!r} must be a column name or a mapping",
            f"for example: {name}: {{column: some_column, cast: float}}",
        )
    allowed = {"column", "const", "cast", "hash", "salt_env", "unkeyed", "redact"}
    unknown = set(raw) - allowed
    if unknown:
        bad = sorted(map(str, unknown))[0]
        raise _fail(where(raw, bad), f"field {name!r}: unknown option {bad!r}", f"options are: {', '.join(sorted(allowed))}")
    if "const" in raw:
        return _const_field(name, raw, place)
    column = raw.get("column")
    if not isinstance(column, str) or not column:
        raise _fail(place, f"field {name!r}: needs a source column or a const", f"for example: {name}: {{column: {name}}}")
    cast = raw.get("cast")
    if cast is not None and cast not in CASTS:
        raise _fail(where(raw, "cast"), f"field {name!r}: unknown cast {cast!r}", f"casts are: {', '.join(CASTS)}")
    hash_name = raw.get("hash")
    if hash_name is not None and hash_name not in HASHES:
        raise _fail(where(raw, "hash"), f"field {name!r}: unknown hash {hash_name!r}", f"hashes are: {', '.join(HASHES)}")
    redact = raw.get("redact", False)
    if not isinstance(redact, bool):
        raise _fail(where(raw, "redact"), f"field {name!r}: redact must be true or false")
    if sum(x is not None and x is not False for x in (cast, hash_name, redact or None)) > 1:
        raise _fail(place, f"field {name!r}: use only one of cast, hash, redact")
    unkeyed = raw.get("unkeyed", False)
    if not isinstance(unkeyed, bool):
        raise _fail(where(raw, "unkeyed"), f"field {name!r}: unkeyed must be true or false")
    if unkeyed and hash_name != "sha256":
        raise _fail(where(raw, "unkeyed"), f"field {name!r}: unkeyed only applies with hash: sha256")
    if hash_name == "sha256" and not unkeyed:
        raise _fail(
            where(raw, "hash"),
            f"field {name!r}: hash sha256 is unkeyed, so anyone can reverse it by hashing likely values",
            "use hash: hmac-sha256 (keyed with the secret in CDC_HASH_KEY_FILE), or add unkeyed: true "
            "if the values are not private",
        )
    key, salt = _hash_secrets(name, raw, hash_name, env, hash_key)
    return FieldSpec(name=name, column=column, cast=cast, hash=hash_name, salt=salt, key=key, redact=redact, where=place)


def _const_field(name: str, raw: dict, place: str) -> FieldSpec:
    """A field holding one plain value, the same in every entry."""
    if len(raw) != 1:
        raise _fail(place, f"field {name!r}: a const field takes no other option")
    if isinstance(raw["const"], (dict, list)):
        raise _fail(place, f"field {name!r}: const must be a plain value")
    const = raw["const"]
    if not isinstance(const, (str, int, float, bool)) and const is not None:
        const = str(const)
    return FieldSpec(name=name, const=const, where=place)


def _hash_secrets(name: str, raw: dict, hash_name: str | None, env: MappingABC[str, str],
                  hash_key: bytes | None) -> tuple[bytes, bytes]:
    """A hashed field's (key, salt): the hash key for a keyed hash, the salt_env value for sha256."""
    key = b""
    if hash_name in KEYED_HASHES:
        if not hash_key:
            raise ConfigError(f"{where(raw, 'hash')}: field {name!r} is hashed with {hash_name}, and no hash key is set",
                              hint=HASH_KEY_HINT)
        key = hash_key
    salt = b""
    if "salt_env" in raw:
        if hash_name != "sha256":
            raise _fail(where(raw, "salt_env"), f"field {name!r}: salt_env only applies with hash: sha256",
                        "hmac-sha256 takes its key from CDC_HASH_KEY_FILE" if hash_name else None)
        var = raw["salt_env"]
        if not isinstance(var, str) or var not in env:
            raise _fail(
                where(raw, "salt_env"),
                f"field {name!r}: environment variable {var!r} (the hash salt) is not set",
                f"export {var}=... before starting",
            )
        salt = env[var].encode()
    return key, salt


def _parse_filter(raw: Any, place: str) -> tuple[Condition, ...]:
    if not isinstance(raw, dict) or not raw:
        raise _fail(place, "filter must map source columns to conditions", "for example: filter: {status: {ne: test}}")
    conditions = []
    for column, cond in raw.items():
        cplace = where(raw, column)
        if not isinstance(column, str):
            raise _fail(cplace, f"filter column {column!r} must be a name")
        bare = not isinstance(cond, dict)
        if bare:
            cond = {"eq": cond}
        if not cond:
            raise _fail(cplace, f"filter on {column!r} has no condition")
        for op, value in cond.items():
            if op not in FILTER_OPS:
                raise _fail(where(cond, op), f"unknown filter operator {op!r}", f"operators are: {', '.join(FILTER_OPS)}")
            if op in ("in", "not_in") and not isinstance(value, list):
                raise _fail(where(cond, op), f"filter {op} on {column!r} needs a list", f"for example: {{{op}: [a, b]}}")
            if op == "is_null" and not isinstance(value, bool):
                raise _fail(where(cond, op), f"filter is_null on {column!r} needs true or false")
            if op not in ("in", "not_in", "is_null") and isinstance(value, (list, dict)):
                raise _fail(where(cond, op), f"filter {op} on {column!r} needs a plain value")
            conditions.append(Condition(column=column, op=op, value=value, where=cplace if bare else where(cond, op)))
    return tuple(conditions)


def _message_mapping(raw: dict, entity: str, stream: str | None, version: int) -> Mapping:
    """A mapping of logical decoding messages (one with message_prefix)."""
    prefix = raw["message_prefix"]
    if not isinstance(prefix, str) or not prefix:
        raise _fail(where(raw, "message_prefix"), "message_prefix must be a non-empty string")
    extra = set(raw) - {"entity", "message_prefix", "stream", "version"}
    if extra:
        bad = sorted(extra)[0]
        raise _fail(where(raw, bad), f"{bad!r} does not apply to a message mapping (one with message_prefix)")
    return _own_streams(raw, Mapping(
        entity=entity, message_prefix=prefix, stream=stream or keys.DEFAULT_STREAM_TEMPLATE,
        version=version, ops=frozenset({"m"}), before=False, where=where(raw),
    ))


def _parse_key(raw: dict, fields: tuple[FieldSpec, ...]) -> tuple[str, ...]:
    by_name = {f.name: f for f in fields}
    key = _name_list(raw["key"], where(raw, "key"), "key")
    for name in key:
        spec = by_name.get(name)
        if spec is None:
            raise _fail(where(raw, "key"), f"key field {name!r} is not one of the mapping's fields", f"add it under fields: {name}: <column>")
        if spec.column is None or spec.hash or spec.redact:
            raise _fail(where(raw, "key"), f"key field {name!r} must come from a column, unhashed and unredacted")
    return key


def _parse_ops(raw: Any, place: str) -> frozenset[str]:
    ops_list = _name_list(raw, place, "ops")
    bad = [op for op in ops_list if op not in ALL_OPS]
    if bad:
        raise _fail(place, f"unknown operation {bad[0]!r}", "operations are c (insert), u (update), d (delete), t (truncate), r (snapshot read)")
    return frozenset(ops_list)


def _parse_partitions(praw: Any, pplace: str, key: tuple[str, ...]) -> tuple[int, tuple[str, ...]]:
    """(count, the key fields the partition is computed from)."""
    if not isinstance(praw, dict) or not isinstance(praw.get("count"), int) or isinstance(praw.get("count"), bool) or praw["count"] < 1:
        raise _fail(pplace, "partitions needs a positive count", "for example: partitions: {count: 4, by: [rider]}")
    unknown = set(praw) - {"count", "by"}
    if unknown:
        raise _fail(pplace, f"unknown partitions option {sorted(map(str, unknown))[0]!r}", "options are count and by")
    partition_by = _name_list(praw.get("by", list(key)), pplace, "partitions.by")
    for name in partition_by:
        if name not in key:
            raise _fail(pplace, f"partitions.by field {name!r} is not a key field", "partition by key fields so deletes land in the same stream")
    return praw["count"], partition_by


def parse_mapping(raw: Any, env: MappingABC[str, str] | None = None, hash_key: bytes | None = None) -> Mapping:
    """Validate one mapping document (as loaded by `cdc.yamlsrc`) into a `Mapping`; `hash_key` keys
    hmac-sha256 fields (`Settings.hash_key`)."""
    env = os.environ if env is None else env
    place = where(raw)
    if not isinstance(raw, dict):
        raise _fail(place, "a mapping must be a YAML mapping with entity, table, key and fields")
    for key in raw:
        if key not in _TOP_KEYS:
            raise _fail(where(raw, key), f"unknown mapping key {key!r}", f"mapping keys are: {', '.join(_TOP_KEYS)}")
    entity = raw.get("entity")
    if not isinstance(entity, str) or not _NAME.match(entity):
        raise _fail(place, "entity must be a public name", "for example: entity: ride")

    version = raw.get("version", 1)
    if not isinstance(version, int) or isinstance(version, bool) or version < 1:
        raise _fail(where(raw, "version"), "version must be a positive integer")
    stream = raw.get("stream")
    if stream is not None and (not isinstance(stream, str) or not stream):
        raise _fail(where(raw, "stream"), "stream must be a key template", "for example: stream: 'cdc:{entity}'")

    if "message_prefix" in raw:
        return _message_mapping(raw, entity, stream, version)

    for required in ("table", "key", "fields"):
        if required not in raw:
            raise _fail(place, f"mapping {entity!r} has no {required!r}", "see docs/reference/mappings.md")
    table = _parse_table(raw["table"], where(raw, "table"))
    fields_raw = raw["fields"]
    if not isinstance(fields_raw, dict) or not fields_raw:
        raise _fail(where(raw, "fields"), "fields must map public names to source columns", "for example: fields: {id: id}")
    fields = tuple(_parse_field(name, spec, where(fields_raw, name), env, hash_key) for name, spec in fields_raw.items())
    key = _parse_key(raw, fields)
    ops = _parse_ops(raw["ops"], where(raw, "ops")) if "ops" in raw else frozenset(ALL_OPS)
    snapshot = raw.get("snapshot", "never")
    if snapshot not in ("initial", "never"):
        raise _fail(where(raw, "snapshot"), f"snapshot must be initial or never, not {snapshot!r}")
    on_unaccountable = raw.get("on_unaccountable", "stop")
    if on_unaccountable not in ON_UNACCOUNTABLE:
        raise _fail(where(raw, "on_unaccountable"), f"on_unaccountable must be stop or resync, not {on_unaccountable!r}",
                    "stop: the bridge stops, slot held (the default); resync: its stream is rebuilt from the table")
    if on_unaccountable == "resync" and "r" not in ops:
        raise _fail(where(raw, "on_unaccountable"), "on_unaccountable: resync needs op r in ops (the backfill that "
                    "resyncs the stream publishes its rows as r)", "add r to ops, or leave on_unaccountable out")
    before = raw.get("before", True)
    if not isinstance(before, bool):
        raise _fail(where(raw, "before"), "before must be true or false")
    conditions = _parse_filter(raw["filter"], where(raw, "filter")) if "filter" in raw else ()

    partitions, partition_by = _parse_partitions(raw["partitions"], where(raw, "partitions"), key) if "partitions" in raw else (1, ())
    if stream is None:
        stream = keys.PARTITIONED_STREAM_TEMPLATE if partitions > 1 else keys.DEFAULT_STREAM_TEMPLATE
    elif partitions > 1 and "{partition}" not in stream:
        raise _fail(where(raw, "stream"), "a partitioned mapping's stream template must contain {partition}")
    return _own_streams(raw, Mapping(
        entity=entity, table=table, key=key, fields=fields, stream=stream, version=version, ops=ops,
        before=before, filter=conditions, partitions=partitions, partition_by=partition_by, snapshot=snapshot,
        on_unaccountable=on_unaccountable, where=place,
        field_lines={f.name: f.where for f in fields}, key_where=where(raw, "key"),
    ))


def _own_streams(raw: dict, mapping: Mapping) -> Mapping:
    """`mapping`, once none of its streams is named like a key the bridge or its consumers keep for themselves
    (the dead letters, the bridge's records, a stream's mark, holds, leases, failure counts)."""
    for stream in mapping.stream_keys():
        reason = keys.reserved_name(stream)
        if reason is not None:
            raise _fail(where(raw, "stream") if "stream" in raw else mapping.where,
                        f"stream {stream!r} of entity {mapping.entity!r} is a reserved name: {reason}",
                        "give the mapping a stream of its own, such as stream: 'cdc:{entity}' (without a hash tag), "
                        "or 'cdc:{{entity}}' for a hash tag")
    return mapping


def _documents(path: Path) -> Iterable[Any]:
    for doc in load_yaml_file(path, MappingError):
        if isinstance(doc, list):
            yield from doc
        else:
            yield doc


def load_mappings(path: Path, env: MappingABC[str, str] | None = None, hash_key: bytes | None = None) -> list[Mapping]:
    """Every mapping in a folder of ``*.yaml``/``*.yml`` (or one file); validated together."""
    files = yaml_files(path, "mappings", "set mappings: to a folder of *.yaml files")
    mappings = [parse_mapping(doc, env, hash_key) for file in files for doc in _documents(file)]
    if not mappings:
        raise ConfigError(f"no mappings found in {path}", hint="add a *.yaml file with entity, table, key and fields")
    seen_entities: dict[str, Mapping] = {}
    seen_streams: dict[str, Mapping] = {}
    seen_prefixes: dict[str, Mapping] = {}
    for m in mappings:
        if m.entity in seen_entities:
            raise MappingError(f"{m.where}: entity {m.entity!r} is already defined at {seen_entities[m.entity].where}")
        seen_entities[m.entity] = m
        for stream in m.stream_keys():
            if stream in seen_streams:
                raise MappingError(
                    f"{m.where}: stream {stream!r} is already written by entity {seen_streams[stream].entity!r}",
                    hint="give each mapping its own stream",
                )
            seen_streams[stream] = m
        if m.message_prefix is not None:
            for prefix, other in seen_prefixes.items():
                if m.message_prefix.startswith(prefix) or prefix.startswith(m.message_prefix):
                    raise MappingError(f"{m.where}: message_prefix {m.message_prefix!r} overlaps {prefix!r} of {other.entity!r}")
            seen_prefixes[m.message_prefix] = m
    return mappings
