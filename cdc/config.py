"""Typed settings from a YAML file, each key overridable from the environment.

``CDC_<SECTION>_<KEY>`` overrides ``section.key`` (``CDC_POSTGRES_DSN``,
``CDC_REDIS_URL``, ``CDC_BATCH_MAX_ENTRIES``); top-level keys drop the section
(``CDC_MAPPINGS``). ``CDC_..._FILE`` reads the value from a file instead, so a
secret such as a DSN with a password never has to appear in a command line or
in the config file.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .errors import ConfigError
from .yamlsrc import LocatedDict, load_yaml_file, where

__all__ = [
    "BatchSettings", "HttpSettings", "PostgresSettings", "ReconcileSettings", "RedisSettings", "Settings", "TrimSettings",
]


@dataclass(frozen=True)
class PostgresSettings:
    dsn: str = "postgresql://localhost/postgres"
    slot: str = "cdc"
    publication: str = "cdc"
    #: seconds without any message from the server before the connection is deemed dead
    receive_timeout_s: float = 30.0
    #: when nothing arrives for this long, write a logical message so the slot keeps advancing (0: never)
    heartbeat_interval_s: float = 30.0
    #: seconds between checks of the slot (retained WAL, invalidation)
    slot_check_interval_s: float = 10.0
    #: retained-WAL alarm levels in bytes (0: half and four fifths of max_slot_wal_keep_size, else 1 GiB and 10 GiB)
    retained_wal_warn_bytes: int = 0
    retained_wal_critical_bytes: int = 0
    #: ask the server to stream large transactions while they run (pgoutput streaming, PostgreSQL 14+):
    #: the bridge holds their changes until the commit, spilling to its own disk instead of the server's
    streaming: bool = False


@dataclass(frozen=True)
class RedisSettings:
    url: str = "redis://localhost:6379/0"
    #: a Redis Cluster: each stream's batch goes to the node owning its hash slot
    cluster: bool = False
    #: pause reading when used memory reaches this fraction of maxmemory (0: never)
    pause_at_memory_fraction: float = 0.9
    #: resume below this fraction
    resume_at_memory_fraction: float = 0.8
    #: acknowledge the slot only once this many replicas have the batch (Redis WAIT; 0: don't wait)
    wait_replicas: int = 0
    wait_timeout_ms: int = 1000
    #: how a batch is appended atomically with its marks: "transaction" (MULTI/EXEC under WATCH)
    #: or "script" (the Lua append script, more Redis CPU per entry)
    append: str = "transaction"
    #: with a redis+sentinel:// url: the sentinels' own login (the url's user and password are the data nodes')
    sentinel_username: str = ""
    sentinel_password: str = field(default="", repr=False)


@dataclass(frozen=True)
class HttpSettings:
    #: where /metrics, /healthz and /readyz are served by `cdc run` (port 0: not served)
    host: str = "0.0.0.0"
    port: int = 9187


@dataclass(frozen=True)
class BatchSettings:
    #: most entries written to Redis in one round trip
    max_entries: int = 2000
    #: longest a change waits in the batch while more keeps arriving, in milliseconds
    max_delay_ms: int = 20
    #: seconds between standby status updates to PostgreSQL when idle
    status_interval_s: float = 1.0
    #: rows per snapshot/backfill chunk (one transaction and one WAL message each)
    backfill_chunk_rows: int = 1000
    #: memory for streamed transactions still running, in MiB; past it their changes spill to disk
    stream_buffer_mb: int = 64
    #: where streamed transactions spill, relative to the config file (empty: $TMPDIR, else /tmp)
    spill_dir: str = ""


@dataclass(frozen=True)
class TrimSettings:
    #: seconds between consumer-aware trims of every mapped stream by `cdc run` (0: never)
    interval_s: float = 60.0
    #: hard cap: keep at most this many entries per stream, even unconsumed ones (0: none)
    max_len: int = 0
    #: hard cap: drop entries older than this many seconds, even unconsumed ones (0: none)
    max_age_s: float = 0.0


@dataclass(frozen=True)
class ReconcileSettings:
    #: a folder of reconciliation specs (*.yaml), or one file; relative to the config file
    specs: str = "reconcile"
    #: where Spark runs: local[*] on this machine, or a cluster's master URL (spark://host:7077, yarn, k8s://...)
    master: str = "local[*]"
    #: the PostgreSQL JDBC driver (Debian: libpostgresql-jdbc-java)
    jdbc_jar: str = "/usr/share/java/postgresql.jar"
    driver_memory: str = "2g"
    #: on a cluster: each executor's memory (spark.executor.memory) and cores (spark.executor.cores); empty/0: Spark's own
    executor_memory: str = ""
    executor_cores: int = 0
    #: where the consumers' state and checkpoints live (empty: postgres.dsn; a spec's state.dsn wins)
    state_dsn: str = ""
    #: seconds to wait for the bridge to publish everything before the snapshot's position
    wait_for_bridge_s: float = 300.0
    #: seconds the reset waits for a consumer's checkpoint rows (a consumer mid-batch holds them)
    lock_timeout_s: float = 60.0


@dataclass(frozen=True)
class Settings:
    postgres: PostgresSettings = field(default_factory=PostgresSettings)
    redis: RedisSettings = field(default_factory=RedisSettings)
    batch: BatchSettings = field(default_factory=BatchSettings)
    trim: TrimSettings = field(default_factory=TrimSettings)
    http: HttpSettings = field(default_factory=HttpSettings)
    reconcile: ReconcileSettings = field(default_factory=ReconcileSettings)
    mappings: Path = Path("mappings")
    #: the file holding the secret that keys hmac-sha256 fields (relative to the config file; CDC_HASH_KEY_FILE)
    hash_key_file: str = ""
    #: that secret (or CDC_HASH_KEY's value); empty when none is set; never shown
    hash_key: bytes = field(default=b"", repr=False)
    source: str = "<defaults>"

    @classmethod
    def from_file(cls, path: str | Path, env: Mapping[str, str] | None = None) -> "Settings":
        path = Path(path)
        if not path.exists():
            raise ConfigError(f"config file {path} not found", hint="pass --config with the path of your cdc.yaml")
        docs = load_yaml_file(path)
        if len(docs) > 1:
            raise ConfigError(f"{path}: expected one YAML document, found {len(docs)}")
        raw = docs[0] if docs else LocatedDict()
        if not isinstance(raw, dict):
            raise ConfigError(f"{where(raw)}: the config must be a mapping of sections (postgres, redis, mappings)")
        return cls.from_dict(raw, base_dir=path.parent, env=os.environ if env is None else env, source=str(path))

    @classmethod
    def from_dict(
        cls,
        raw: Mapping[str, Any],
        *,
        base_dir: Path = Path("."),
        env: Mapping[str, str] | None = None,
        source: str = "<dict>",
    ) -> "Settings":
        env = {} if env is None else env
        sections: dict[str, Any] = {}
        known = {f.name for f in dataclasses.fields(cls)} - {"source", "hash_key"}
        for key in raw:
            if key not in known:
                raise ConfigError(
                    f"{where(raw, key)}: unknown config key {key!r}",
                    hint=f"expected one of: {', '.join(sorted(known))}",
                )
        for f in dataclasses.fields(cls):
            if f.name in ("source", "mappings", "hash_key_file", "hash_key"):
                continue
            section_cls = f.type if isinstance(f.type, type) else globals()[f.type]
            sections[f.name] = _section(section_cls, f.name, raw.get(f.name) or {}, raw, env)
        mappings = _override(env, "CDC_MAPPINGS", raw.get("mappings", "mappings"))
        mappings_path = Path(str(mappings))
        if not mappings_path.is_absolute():
            mappings_path = base_dir / mappings_path
        specs = Path(sections["reconcile"].specs)
        if not specs.is_absolute():
            sections["reconcile"] = dataclasses.replace(sections["reconcile"], specs=str(base_dir / specs))
        spill = sections["batch"].spill_dir
        if spill and not Path(spill).is_absolute():
            sections["batch"] = dataclasses.replace(sections["batch"], spill_dir=str(base_dir / spill))
        if sections["redis"].cluster and sections["redis"].url.split("://", 1)[0].lower().endswith("+sentinel"):
            raise ConfigError(f"{where(raw.get('redis') or {}, 'cluster')}: redis.cluster cannot be used with a "
                              "redis+sentinel:// url", hint="a cluster fails over by itself: give one node's redis:// url")
        key_file, key = _hash_key(raw, base_dir, env)
        return cls(**sections, mappings=mappings_path, hash_key_file=key_file, hash_key=key, source=source)


#: shortest hash key accepted, in bytes: a short secret can be found by trying keys against one known value
HASH_KEY_MIN_BYTES = 16


def _hash_key(raw: Mapping[str, Any], base_dir: Path, env: Mapping[str, str]) -> tuple[str, bytes]:
    """(the key file, the key): CDC_HASH_KEY's value, else the content of CDC_HASH_KEY_FILE or
    hash_key_file (whitespace around it removed); the key itself is never put in a message."""
    if env.get("CDC_HASH_KEY"):
        origin, key_file, text = "CDC_HASH_KEY", "", env["CDC_HASH_KEY"]
    else:
        key_file = env.get("CDC_HASH_KEY_FILE") or raw.get("hash_key_file") or ""
        if not isinstance(key_file, str):
            raise ConfigError(f"{where(raw, 'hash_key_file')}: hash_key_file must be a file name")
        if not key_file:
            return "", b""
        origin = "CDC_HASH_KEY_FILE" if env.get("CDC_HASH_KEY_FILE") else f"{where(raw, 'hash_key_file')}: hash_key_file"
        if not Path(key_file).is_absolute():
            key_file = str(base_dir / key_file)
        try:
            text = Path(key_file).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            reason = exc.strerror if isinstance(exc, OSError) else "not UTF-8 text"
            raise ConfigError(f"{origin}: cannot read the hash key file {key_file}: {reason}",
                              hint="point it at a readable file holding the key") from None
    key = text.strip().encode()
    if len(key) < HASH_KEY_MIN_BYTES:
        raise ConfigError(f"{origin}: the hash key is {len(key)} bytes, shorter than {HASH_KEY_MIN_BYTES}",
                          hint="use a random key, e.g. made with: head -c 32 /dev/urandom | base64 > hash.key")
    return key_file, key


def _override(env: Mapping[str, str], name: str, default: Any) -> Any:
    if name in env:
        return env[name]
    file_name = env.get(name + "_FILE")
    if file_name:
        try:
            return Path(file_name).read_text(encoding="utf-8").strip()
        except OSError as exc:
            raise ConfigError(f"{name}_FILE: cannot read {file_name}: {exc.strerror}") from None
    return default


def _section(section_cls: type, name: str, raw: Any, parent: Mapping, env: Mapping[str, str]) -> Any:
    if not isinstance(raw, dict):
        raise ConfigError(f"{where(parent, name)}: {name!r} must be a mapping of settings")
    fields = {f.name: f for f in dataclasses.fields(section_cls)}
    for key in raw:
        if key not in fields:
            raise ConfigError(
                f"{where(raw, key)}: unknown setting {name}.{key}",
                hint=f"{name} accepts: {', '.join(fields)}",
            )
    values: dict[str, Any] = {}
    for key, f in fields.items():
        env_name = f"CDC_{name}_{key}".upper()
        value = _override(env, env_name, raw.get(key, f.default))
        origin = env_name if env_name in env else (env_name + "_FILE" if env.get(env_name + "_FILE") else where(raw, key))
        try:
            values[key] = _coerce(value, type(f.default))
        except (TypeError, ValueError):
            raise ConfigError(
                f"{origin}: {name}.{key} must be {_KIND_NAMES[type(f.default)]}, got {value!r}"
            ) from None
        least = _AT_LEAST.get((name, key))
        if least is not None and values[key] < least:
            raise ConfigError(f"{origin}: {name}.{key} must be at least {least}, got {value!r}")
        choices = _CHOICES.get((name, key))
        if choices and values[key] not in choices:
            raise ConfigError(f"{origin}: {name}.{key} must be one of {', '.join(choices)}, got {value!r}")
        check = _CONNECTION_STRINGS.get((name, key))
        if check is not None and values[key]:
            check(values[key], f"{origin}: {name}.{key}")
    return section_cls(**values)


def check_dsn(value: str, what: str) -> None:
    """A PostgreSQL connection string libpq can parse (a URI or key=value pairs)."""
    from psycopg import conninfo

    try:
        conninfo.conninfo_to_dict(value)
    except Exception as exc:  # psycopg.ProgrammingError: libpq's own words
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else "cannot be parsed"
        raise ConfigError(f"{what} is not a valid connection string: {reason}",
                          hint="write it as postgresql://user@host:5432/dbname (password in CDC_POSTGRES_DSN_FILE)") from None


def _check_redis_url(value: str, what: str) -> None:
    """A Redis URL redis-py accepts: redis://, rediss:// or unix://, with a host and a numeric database."""
    from urllib.parse import urlsplit

    hint = "write it as redis://user:password@host:6379/0, or rediss:// for TLS, unix:///path.sock for a socket"
    if value.split("://", 1)[0].lower() in ("redis+sentinel", "rediss+sentinel"):
        from .sink.redisconn import parse_sentinel_url

        parse_sentinel_url(value, what)
        return
    try:
        url = urlsplit(value)
        url.port  # noqa: B018 (raises on a port that is not a number)
    except ValueError as exc:
        raise ConfigError(f"{what} is not a valid URL: {exc}", hint=hint) from None
    if url.scheme not in ("redis", "rediss", "unix"):
        got = f"scheme {url.scheme + '://'!r}" if url.scheme else "no scheme"
        raise ConfigError(f"{what} has {got}; Redis URLs start with redis://, rediss:// or unix://", hint=hint)
    if url.scheme != "unix" and not url.hostname:
        raise ConfigError(f"{what} names no host", hint=hint)
    db = url.path.lstrip("/") if url.scheme != "unix" else ""
    if db and not db.isdigit():
        raise ConfigError(f"{what}: database {db!r} is not a number", hint=hint)


_CONNECTION_STRINGS = {
    ("postgres", "dsn"): check_dsn,
    ("reconcile", "state_dsn"): check_dsn,
    ("redis", "url"): _check_redis_url,
}


_KIND_NAMES = {int: "an integer", float: "a number", bool: "true or false", str: "a string"}
#: settings that take one of a few words
_CHOICES = {("redis", "append"): ("transaction", "script")}
#: numeric settings with a lower bound
_AT_LEAST = {("batch", "stream_buffer_mb"): 1}


def _coerce(value: Any, kind: type) -> Any:
    if kind is bool:
        if isinstance(value, str):
            if value.lower() in ("1", "true", "yes", "on"):
                return True
            if value.lower() in ("0", "false", "no", "off"):
                return False
            raise ValueError(value)
        return bool(value)
    if kind in (int, float) and isinstance(value, bool):
        raise TypeError(value)
    if kind is int and isinstance(value, float):
        raise TypeError(value)
    return kind(value)
